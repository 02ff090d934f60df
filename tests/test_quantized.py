"""service/core/models/quantized.py: quantized layers given the folded product compute what
MLX's own classes compute, for every leading shape, with the product seeing one 2-D input; the
swap keeps names and arrays, and leaves subclasses (fused members) alone. Whole families through
the engine: tests/test_engine_families.py (test_folded_quantized_rows_give_mlx_lm_alone)."""

from __future__ import annotations

from collections.abc import Iterator

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear
from mlx.utils import tree_flatten

from service.core.models import projections, quantized
from tests.helpers.quantized import quantized_product_inputs


@pytest.fixture
def product_inputs() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the inputs every `mx.quantized_matmul` call sees while the test runs."""
    with quantized_product_inputs() as seen:
        yield seen


def quantized_linear(bias: bool, bits: int = 4) -> nn.QuantizedLinear:
    mx.random.seed(3)
    layer = nn.QuantizedLinear.from_linear(nn.Linear(64, 48, bias=bias), group_size=32, bits=bits)
    if bias:
        layer.bias = mx.random.normal((48,))
    mx.eval(layer.parameters())
    return layer


SHAPES = [(5, 64), (5, 1, 64), (3, 4, 64), (2, 3, 1, 64)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_a_folded_linear_gives_mlx_numbers_through_one_2d_product(shape, bias, product_inputs):
    layer = quantized_linear(bias)
    x = mx.random.normal(shape)
    want = layer(x)
    assert quantized.fold_rows(layer) == 1
    assert type(layer) is quantized.FoldedQuantizedLinear
    product_inputs.clear()
    got = layer(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape[:-1]))
    assert product_inputs == [(rows, 64)]


@pytest.mark.parametrize("bits", [4, 8])
def test_many_rows_take_the_dequantized_weight_with_mlx_numbers(bits, product_inputs):
    """From DEQUANTIZE_ROWS rows (a prefill pass) the product is a dense one on the weight
    dequantized for the call: no quantized matmul, the same numbers to float rounding."""
    layer = quantized_linear(True, bits)
    x = mx.random.normal((2, quantized.DEQUANTIZE_ROWS // 2, 64))
    want = layer(x)
    quantized.fold_rows(layer)
    product_inputs.clear()
    got = layer(x)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert product_inputs == []
    # One row fewer stays on the quantized kernel.
    layer(x.reshape(-1, 64)[1:])
    assert product_inputs == [(quantized.DEQUANTIZE_ROWS - 1, 64)]


def test_a_tied_quantized_head_folds(product_inputs):
    mx.random.seed(4)
    embedding = nn.QuantizedEmbedding.from_embedding(nn.Embedding(96, 64), group_size=32, bits=4)
    hidden = mx.random.normal((6, 1, 64))
    want = embedding.as_linear(hidden)
    tokens = mx.array([[1], [5], [9]])
    looked_up = embedding(tokens)
    assert quantized.fold_rows(embedding) == 1
    product_inputs.clear()
    got = embedding.as_linear(hidden)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert product_inputs == [(6, 64)]
    assert mx.array_equal(embedding(tokens), looked_up)  # the lookup is not a product


@pytest.mark.parametrize("sharded", [QuantizedAllToShardedLinear, QuantizedShardedToAllLinear])
def test_sharded_quantized_layers_fold(sharded, product_inputs):
    """On a group of one (this process), each sharded class computes the whole layer."""
    layer = sharded.from_quantized_linear(quantized_linear(bias=True), group=mx.distributed.init())
    x = mx.random.normal((4, 1, 64))
    want = layer(x)
    assert quantized.fold_rows(layer) == 1
    assert type(layer).__bases__ == (sharded,)
    product_inputs.clear()
    got = layer(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert product_inputs == [(4, 64)]
    # A prefill-sized input takes the shard's dequantized weight.
    wide = mx.random.normal((quantized.DEQUANTIZE_ROWS, 64))
    want = sharded.__call__(layer, wide)
    product_inputs.clear()
    np.testing.assert_allclose(np.array(layer(wide)), np.array(want), rtol=1e-4, atol=1e-4)
    assert product_inputs == []


class Block(nn.Module):
    """An attention block's projections and an MLP's, named as mlx-lm names them."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(64, 64)
        self.k_proj = nn.Linear(64, 32)
        self.v_proj = nn.Linear(64, 32)
        self.o_proj = nn.Linear(64, 64)
        self.embed = nn.Embedding(96, 64)
        self.norm = nn.RMSNorm(64)

    def __call__(self, x: mx.array) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.embed.as_linear(self.norm(self.o_proj(q + mx.concatenate([k, v], -1))))


def quantized_block(seed: int) -> Block:
    mx.random.seed(seed)
    model = Block()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_fold_rows_swaps_mlx_classes_only_and_keeps_the_arrays(product_inputs):
    """After fusing (as the runtime orders them): the fused members keep their class and fold in
    their group's product; the rest become folded classes; nothing else changes."""
    model = quantized_block(5)
    x = mx.random.normal((7, 1, 64))
    want = model(x)
    assert projections.fuse(model) == 1
    before = {k: id(v) for k, v in tree_flatten(model.parameters())}
    assert quantized.fold_rows(model) == 2  # o_proj and the embedding
    assert {k: id(v) for k, v in tree_flatten(model.parameters())} == before
    assert type(model.q_proj) is projections.FusedQuantizedLinear
    assert type(model.o_proj) is quantized.FoldedQuantizedLinear
    assert type(model.embed) is quantized.FoldedQuantizedEmbedding
    product_inputs.clear()
    got = model(x)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert product_inputs and {len(s) for s in product_inputs} == {2}
    assert quantized.fold_rows(model) == 0  # folded already


def test_float_layers_are_left_alone():
    model = Block()
    assert quantized.fold_rows(model) == 0
    assert type(model.o_proj) is nn.Linear


def test_dequantize_gives_float_layers_with_the_same_numbers():
    model = quantized_block(6)
    x = mx.random.normal((5, 1, 64))
    want = model(x)
    packed = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    extra = quantized.dequantized_extra_bytes(model)
    assert quantized.dequantize(model) == 5  # four projections and the embedding
    assert type(model.o_proj) is nn.Linear and type(model.embed) is nn.Embedding
    assert model.o_proj.weight.dtype == mx.float32
    assert sum(v.nbytes for _, v in tree_flatten(model.parameters())) == packed + extra
    np.testing.assert_allclose(np.array(model(x)), np.array(want), rtol=1e-4, atol=1e-4)
    assert quantized.dequantized_extra_bytes(model) == 0
    assert quantized.dequantize(model) == 0
