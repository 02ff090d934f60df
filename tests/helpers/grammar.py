"""The grammar engine on the embedded model's tokenizer, and force-feeding documents through
the matcher path as the engine core runs it (mask first, then accept)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np

from service.common.grammar import Compiled, GrammarCache, allocate_bitmask, make_tokenizer
from service.common.tokenizer import Tokenizer, tokenizer_from_gguf
from service.protocol import ResponseFormat
from tests.helpers.paths import REPO_ROOT

VOCAB = 49152  # SmolLM2's logits width
EOS = 2
CORPUS = REPO_ROOT / "tests" / "data" / "structured_output"


@functools.cache
def embedded_tokenizer() -> Tokenizer:
    from service.core.models.gguf import read_gguf_metadata
    from service.core.models.loader import embedded_gguf_path

    return tokenizer_from_gguf(read_gguf_metadata(embedded_gguf_path()))


def engine_cache(**kwargs: Any) -> GrammarCache:
    """A grammar cache over the embedded model's tokenizer (built on its first compile)."""
    tok = embedded_tokenizer()

    def source() -> Any:
        text = tok.tokenizer_json()
        assert text is not None
        return make_tokenizer(text, sorted(tok.eos_token_ids), VOCAB)

    kwargs.setdefault("max_compile_ms", 10_000)
    return GrammarCache(source, **kwargs)


def allowed(row: np.ndarray, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def feed(compiled: Compiled, ids: list[int]) -> tuple[bool, str]:
    """Force-feed tokens as the engine core would sample them: before each, the mask must allow
    it and the matcher accept it; at the end EOS must be allowed (the document is complete)."""
    m = compiled.matcher()
    row = allocate_bitmask(1, VOCAB)[0]
    for i, t in enumerate(ids):
        m.fill_mask(row)
        if not allowed(row, t):
            return False, f"token {i} not in the mask"
        if not m.accept(t):
            return False, f"token {i} refused: {m.error}"
    m.fill_mask(row)
    if not (allowed(row, EOS) and m.is_accepting()):
        return False, "EOS not allowed at the end"
    return True, ""


def schema_format(schema: Any) -> ResponseFormat:
    return ResponseFormat("json_schema", json.dumps(schema))


def dump(data: Any) -> str:
    """An instance as the default JSON options write it (json.dumps' separators)."""
    return json.dumps(data, ensure_ascii=False)


def corpus(name: str) -> list[dict[str, Any]]:
    return json.loads((CORPUS / name).read_text())


def corpus_path(name: str) -> Path:
    return CORPUS / name
