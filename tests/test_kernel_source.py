"""service.core.engine.kernel_source: what MLX is handed of a kernel's source. That the served
kernels still compile from their compacted sources is shown by the nvcc tests of each kernel's
module (tests/helpers/cuda_source.py records what `cuda_kernel` passes to MLX)."""

from __future__ import annotations

import re

import pytest

from service.core.engine import paged_attention, sampler
from service.core.engine.kernel_source import compact, cuda_kernel
from service.core.models import decode_gemm, lora_kernel, residual_norm, rope


def test_compact_drops_comments_and_indentation_and_keeps_lines():
    source = (
        "// a header comment\n"
        "#include <mma.h>\n"
        "\n"
        "template <int N>  // trailing\n"
        "__device__ int f(int x) {\n"
        "    /* a block\n"
        "       over lines */ return x * N;   \n"
        "}\n"
    )
    assert compact(source) == (
        "#include <mma.h>\ntemplate <int N>\n__device__ int f(int x) {\nreturn x * N;\n}\n"
    )


def test_compact_keeps_literals_that_look_like_comments():
    source = 'asm volatile("mov.u32 %0, 1; // not a comment\\n" : "=r"(x));  // one\n'
    source += "char c = '/'; char d = '\\''; /* two */ int e = 1;\n"
    assert compact(source) == (
        'asm volatile("mov.u32 %0, 1; // not a comment\\n" : "=r"(x));\n'
        "char c = '/'; char d = '\\'';   int e = 1;\n"  # a comment becomes a space
    )


def _sources() -> list[str]:
    """Every served kernel's source and header, as its module holds them."""
    return [
        lora_kernel.kernel_header(residual_norm._FOLD_HEADER),
        lora_kernel._fused_source(3),
        lora_kernel._SHRINK,
        lora_kernel._EXPAND_ADD,
        lora_kernel._LOADS_HEADER + lora_kernel._TILE_HEADER,
        lora_kernel._SHRINK_ROWS,
        lora_kernel._EXPAND_ADD_ROWS,
        residual_norm._SOURCE,
        residual_norm._FOLD_SOURCE,
        paged_attention._ROPE_HEADER,
        paged_attention._SOURCE,
        paged_attention._STORE_SOURCE,
        sampler._MASKED_ARGMAX_HEADER,
        sampler._MASKED_ARGMAX,
        decode_gemm._HEADER,
        decode_gemm._SOURCE,
        rope._INV_FREQS_SOURCE,
    ]


def test_compact_code_only_changes_whitespace():
    # Every kernel's source, comments gone: the code tokens are the same, in the same order.
    strip = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
    for source in _sources():
        assert compact(source).split() == strip.sub(" ", source).split()
    fold = lora_kernel.kernel_header(residual_norm._FOLD_HEADER)
    assert len(compact(fold)) < 0.8 * len(fold)


@pytest.mark.parametrize("source", ["int a;  // a comment \\\nint b;\n", 'auto s = R"(// x)";\n'])
def test_compact_refuses_what_it_would_get_wrong(source):
    with pytest.raises(ValueError, match="does not handle"):
        compact(source)


@pytest.mark.parametrize("header", ["", "// only a comment\n"])
def test_cuda_kernel_hands_mlx_the_compacted_source(monkeypatch, header):
    seen = {}

    def kernel(**kwargs):
        seen.update(kwargs)
        return "kernel"

    monkeypatch.setattr("mlx.core.fast.cuda_kernel", kernel)
    made = cuda_kernel(
        name="k",
        input_names=("x",),
        output_names=("out",),
        source="  out[0] = x[0];  // copy\n",
        header=header,
    )
    assert made == "kernel"
    assert seen == {
        "name": "k",
        "input_names": ["x"],
        "output_names": ["out"],
        "source": "out[0] = x[0];\n",
        "header": "",
        "ensure_row_contiguous": True,
    }
