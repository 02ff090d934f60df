"""service.core.models.residual_norm: a layer's residual add and the RMSNorm after it as one
kernel. On the CPU, the swapped layers' chaining (each layer's closing sum computed with the next
layer's norm) against mlx-lm's model; on a CUDA host, the kernel against MLX's two ops; with
nvcc, the kernel's source as MLX wraps it."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import qwen3

from service.core.models import residual_norm
from tests.helpers import cuda_source
from tests.helpers.tiny import LAYERS, tiny_llama

cuda_only = pytest.mark.skipif(not residual_norm.available(), reason="needs MLX's CUDA backend")


def _tiny_qwen3() -> nn.Module:
    mx.random.seed(3)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("make", [tiny_llama, _tiny_qwen3], ids=["llama", "qwen3"])
def test_fused_layers_give_the_models_own_outputs(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's adds go through add_rms_norm (the first layer's input norm excepted:
    2 * layers - 1 calls a forward) and the logits are the model's own: bit for bit on the CPU
    (MLX's operations), to float32 roundings on CUDA (the kernel sums the squares in another
    order than MLX's RMSNorm)."""
    model = make()
    tokens = mx.array([[5, 9, 2, 7, 1], [3, 3, 8, 0, 4]])
    want = model(tokens)
    layers = len(model.layers)
    assert residual_norm.install(model) == layers
    calls = []
    fused = residual_norm.add_rms_norm

    def counted(*args):
        calls.append(args[0].shape)
        return fused(*args)

    monkeypatch.setattr(residual_norm, "add_rms_norm", counted)
    got = model(tokens)
    assert len(calls) == 2 * layers - 1
    if mx.cuda.is_available():
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    else:
        assert mx.array_equal(got, want)
    first = model.layers[0]
    assert type(first).__name__ == "FusedTransformerBlock"
    assert isinstance(first, type(make().layers[0]))  # names, weights and class kept


def test_a_kept_sum_goes_with_its_array() -> None:
    """What a layer keeps for the next one lives as long as the sum it returned, no longer."""
    model = tiny_llama()
    residual_norm.install(model)
    kept = residual_norm._PER_THREAD.sum
    x = mx.random.normal((1, 3, 64))
    out = model.layers[0](x)
    parts = kept.parts_of(out)
    assert parts is not None and mx.array_equal(parts[0] + parts[1], out)
    assert kept.parts_of(x) is None
    del out, parts
    gc.collect()
    assert kept.held is None
    mx.eval(model(mx.array([[1, 2, 3]])))  # a whole forward: its last sum is gone with it
    gc.collect()
    assert kept.held is None


def test_only_plain_llama_family_layers_are_swapped() -> None:
    model = tiny_llama()
    model.layers[0].post_attention_layernorm = nn.LayerNorm(64)  # not the fused pattern
    assert residual_norm.install(model) == LAYERS - 1
    assert type(model.layers[0]).__name__ == "TransformerBlock"
    assert residual_norm.install(nn.Sequential(nn.Linear(4, 4))) == 0


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("width", [64, 576, 4096])
def test_the_kernel_is_mlxs_add_and_rms_norm(dtype: mx.Dtype, width: int) -> None:
    mx.random.seed(width)
    x = mx.random.normal((3, 5, width)).astype(dtype)
    r = mx.random.normal((3, 5, width)).astype(dtype)
    weight = (1.0 + 0.1 * mx.random.normal((width,))).astype(dtype)
    assert residual_norm.supported(x, r, weight)
    h, y = residual_norm.add_rms_norm(x, r, weight, 1e-5)
    want_h = x + r
    want_y = mx.fast.rms_norm(want_h, weight, 1e-5)
    assert mx.array_equal(h, want_h)
    # The sum of squares in another order can move the inner rounding T(x * n) by an ulp, which
    # the outer w * (.) rounding can make two: at most two roundings of y apart.
    ulp = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-22}[dtype]
    diff = mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32))
    assert (diff <= 2 * ulp * mx.abs(want_y.astype(mx.float32)) + 1e-6).all().item()


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_source_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel as MLX wraps it, for three dtypes and SmolLM2's, the 8B's and a tiny width:
    no error, no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(residual_norm, "available", lambda: True)
    monkeypatch.setattr(residual_norm, "_kernel", residual_norm._kernel.__wrapped__)
    cases = [(mx.bfloat16, 576), (mx.float16, 4096), (mx.float32, 64)]
    for dtype, width in cases:
        x = mx.zeros((2, 1, width), dtype)
        residual_norm.add_rms_norm(x, x, mx.ones((width,), dtype), 1e-5)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == len(cases), compiled.log
    assert compiled.spills == 0, compiled.log
