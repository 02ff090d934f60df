"""Custom CUDA kernels as MLX gets them: their sources without comments or indentation.

MLX's CUDA backend hashes a custom kernel's whole source, its header included, at every launch
to find the compiled module (mlx/backend/cuda/custom_kernel.cpp), and the decode step launches
custom kernels hundreds of times: every byte of a source is host time at every step. The sources
in this package keep their comments for the reader; `cuda_kernel` hands MLX the code alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import mlx.core as mx

# String and character literals first, so that a `//` inside one is not taken for a comment.
_TOKEN = re.compile(r"""("(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|//[^\n]*|/\*.*?\*/""", re.DOTALL)
# What a line-by-line pass would get wrong: line continuations and raw string literals.
_UNSAFE = re.compile(r'\\\n|\bR"')


def compact(source: str) -> str:
    """`source` without its comments, indentation, trailing blanks or empty lines. Lines stay
    lines: preprocessor directives need their own. A line continuation (a comment's would join
    the next line to it, a macro's would lose its comment-only lines) or a raw string literal
    is refused: the kernels here have none, and this is not a C++ lexer."""
    unsafe = _UNSAFE.search(source)
    if unsafe:
        raise ValueError(f"compact: the source has {unsafe.group()!r}, which it does not handle")
    code = _TOKEN.sub(lambda m: m.group(1) or " ", source)
    lines = (line.strip() for line in code.splitlines())
    return "".join(f"{line}\n" for line in lines if line)


def cuda_kernel(
    *,
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
) -> Any:
    """`mx.fast.cuda_kernel` of the compacted source and header."""
    return mx.fast.cuda_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=compact(source),
        header=compact(header),
        ensure_row_contiguous=ensure_row_contiguous,
    )
