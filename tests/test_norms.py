"""service.core.models.norms: the CPU's RMSNorm as compiled chains, mx.fast.rms_norm's numbers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from bench.decode_primitives import primitives
from service.core.models import norms
from service.core.models.norms import CompiledRMSNorm
from tests.helpers.tiny import LAYERS, tiny_llama


@pytest.fixture(autouse=True)
def on_cpu():
    """The compiled norms are the CPU's (the engine config's compiled_norms): they are held to
    MLX's CPU fallback, on the CPU's stream also where a GPU is the default device."""
    with mx.stream(mx.cpu):
        yield


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(
    "shape", [(1, 1, 64), (5, 1, 64), (3, 7, 576), (2, 9, 4, 128), (80, 1, 64), (256, 1, 576)]
)
@pytest.mark.parametrize("eps", [1e-5, 1e-6])
def test_normalizes_as_mx_fast_rms_norm_bit_for_bit(dtype, shape, eps):
    mx.random.seed(3)
    x = (mx.random.normal(shape) * 4).astype(dtype)
    plain = nn.RMSNorm(shape[-1], eps=eps)
    plain.weight = mx.random.normal(shape[-1:]).astype(dtype)
    eps_array = mx.array(eps, mx.float32)
    for path in (norms.rms_norm, norms.rms_norm_wide):
        out = path(x, plain.weight, eps_array)
        assert mx.array_equal(out, plain(x)).item()
        assert out.dtype == plain(x).dtype
    assert mx.array_equal(CompiledRMSNorm(plain)(x), plain(x)).item()


def test_a_weight_of_another_dtype_promotes_as_the_fallback_does():
    x = mx.random.normal((2, 3, 32)).astype(mx.bfloat16)
    plain = nn.RMSNorm(32)
    plain.weight = mx.random.normal((32,))  # float32
    out = CompiledRMSNorm(plain)(x)
    assert out.dtype == mx.float32
    assert mx.array_equal(out, plain(x)).item()


def test_a_small_input_takes_the_compiled_chain_and_a_large_one_the_wide_path():
    """The chain is the square, the sum, the width (shapeless: from the input) and one fused
    kernel; past COMPILED_MAX_ELEMENTS the rows' scales alike, then two vectorized multiplies."""
    plain = nn.RMSNorm(64)
    small = mx.random.normal((norms.COMPILED_MAX_ELEMENTS // 64, 1, 64))
    large = mx.random.normal((norms.COMPILED_MAX_ELEMENTS // 64 + 1, 1, 64))
    mx.eval(small, large, plain.parameters())
    compiled = CompiledRMSNorm(plain)
    fallback = sum(primitives(plain(large)).values())  # MLX's CPU fallback, op by op
    assert fallback > 8
    assert sum(primitives(compiled(small)).values()) == 4
    wide = primitives(compiled(large))
    assert wide["Multiply"] == 2 and sum(wide.values()) < fallback
    assert mx.array_equal(compiled(large), plain(large)).item()


def test_install_swaps_every_rms_norm_and_keeps_the_weights():
    model = tiny_llama()
    before = dict(tree_flatten(model.parameters()))
    tokens = mx.array([[5, 9, 2, 7]])
    expected = model(tokens)
    # Two per layer and the final norm.
    assert norms.install(model) == 2 * LAYERS + 1
    assert not any(type(m) is nn.RMSNorm for m in model.modules())
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)
    assert mx.array_equal(model(tokens), expected).item()
