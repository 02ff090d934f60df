"""The embedded GGUF's weights as our loader serves them equal the `gguf` package's own
dequantization of the same file, bit for bit in float32, on every quantized tensor."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from mlx.utils import tree_flatten

from service.core.models.gguf import LAYER_NAMES, TOP_NAMES, load_gguf_llama
from service.core.models.loader import embedded_gguf_path

pytestmark = [pytest.mark.slow, pytest.mark.model]

FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16)


def _parameter_name(gguf_name: str) -> tuple[str, str]:
    """(parameter name, GGUF tensor kind) of a GGUF tensor name."""
    base = gguf_name.removesuffix(".weight")
    if base.startswith("blk."):
        _, layer, kind = base.split(".", 2)
        return f"model.layers.{layer}.{LAYER_NAMES[kind]}.weight", kind
    return f"{TOP_NAMES[base]}.weight", base


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of each head's Q/K rows: its converter wrote each head's
    rows as reshape(2, half, cols).swapaxes(0, 1) of the Hugging Face layout."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _field(reader: GGUFReader, key: str) -> int:
    return int(reader.fields[key].contents())


@pytest.fixture(scope="module")
def reader() -> GGUFReader:
    return GGUFReader(embedded_gguf_path())


@pytest.fixture(scope="module")
def served_weights() -> dict[str, np.ndarray]:
    model, _ = load_gguf_llama(embedded_gguf_path(), mx.float32)
    return {name: np.array(value) for name, value in tree_flatten(model.parameters())}


def test_dequantized_weights_equal_the_gguf_package_bit_for_bit(reader, served_weights) -> None:
    heads = _field(reader, "llama.attention.head_count")
    kv_heads = _field(reader, "llama.attention.head_count_kv")
    quantized = [t for t in reader.tensors if t.tensor_type not in FLOAT_TYPES]
    assert len(quantized) == 211  # Q4_1 and Q8_0 tensors of SmolLM2-135M-Instruct
    mismatched = []
    for tensor in quantized:
        name, kind = _parameter_name(tensor.name)
        expected = dequantize(tensor.data, tensor.tensor_type)
        assert expected.dtype == np.float32
        if kind in ("attn_q", "attn_k"):
            expected = _unpermute(expected, heads if kind == "attn_q" else kv_heads)
        got = served_weights[name]
        assert got.dtype == np.float32 and got.shape == expected.shape, name
        if not np.array_equal(got, expected):
            mismatched.append((name, float(np.max(np.abs(got - expected)))))
    assert not mismatched, f"{len(mismatched)} of {len(quantized)} differ, e.g. {mismatched[:3]}"


def test_float_tensors_load_unchanged(reader, served_weights) -> None:
    floats = [t for t in reader.tensors if t.tensor_type in FLOAT_TYPES]
    assert floats
    for tensor in floats:
        name, _ = _parameter_name(tensor.name)
        expected = np.asarray(tensor.data, dtype=np.float32).reshape(served_weights[name].shape)
        np.testing.assert_array_equal(served_weights[name], expected, err_msg=name)
