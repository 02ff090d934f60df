"""RoPE variants of service.core.models.rope: the CPU's angles shared by a forward's layers."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import llama
from mlx_lm.models.rope_utils import Llama3RoPE

from service.core.models import rope
from service.core.models.rope import SharedAngleRoPE
from tests.helpers import cuda_source
from tests.helpers.tiny import LAYERS, tiny_llama


@pytest.fixture
def on_cpu():
    """SharedAngleRoPE is the CPU's (the engine config's shared_rope_angles): it is held to MLX's
    CPU fallback, on the CPU's stream also where a GPU is the default device."""
    with mx.stream(mx.cpu):
        yield


@pytest.mark.usefixtures("on_cpu")
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("dims,head_dim", [(64, 64), (32, 64)])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_shared_angles_rotate_as_mx_fast_rope_bit_for_bit(dtype, dims, head_dim, tokens, scale):
    plain = nn.RoPE(dims, base=100000.0, scale=scale)
    shared = SharedAngleRoPE(plain)
    mx.random.seed(2)
    offsets = mx.array([0, 3, 17, 250, 4095])
    for heads in (9, 3, 9):  # q and k of a layer, then the next layer's q: angles reused
        x = mx.random.normal((5, heads, tokens, head_dim)).astype(dtype)
        assert mx.array_equal(shared(x, offsets), plain(x, offsets)).item()
        assert mx.array_equal(shared(x, 11), plain(x, 11)).item()


@pytest.mark.usefixtures("on_cpu")
def test_a_forward_makes_its_angles_once(monkeypatch: pytest.MonkeyPatch):
    """Every layer of a forward rotates at the same offsets: its angles are made once for all
    of them; a new offsets array (the next forward) makes them anew."""
    calls = []
    real = rope._angles_in

    def counted(dtype):
        angles = real(dtype)
        return lambda *args: calls.append(1) or angles(*args)

    monkeypatch.setattr(rope, "_angles_in", counted)
    layers = [SharedAngleRoPE(nn.RoPE(16, base=10000.0)) for _ in range(4)]
    x = mx.ones((2, 4, 1, 16))
    for step in range(3):
        offsets = mx.array([step, step + 5])
        for layer in layers:
            layer(x, offsets)
            layer(x[:, :2], offsets)
        assert len(calls) == step + 1


@pytest.mark.usefixtures("on_cpu")
def test_a_rotation_is_a_few_primitives():
    """The angles and the rotation are compiled chains: a layer's q rotation after the first
    is its two halves' slices, a fused kernel per half and the concatenation (the fallback's
    products are a dozen primitives)."""
    from bench.decode_primitives import primitives

    shared = SharedAngleRoPE(nn.RoPE(64, base=10000.0))
    x = mx.random.normal((8, 4, 1, 64))
    mx.eval(x)
    offsets = mx.array(list(range(8)))
    mx.eval(shared(x, offsets))  # the forward's angles, evaluated
    assert sum(primitives(shared(x, offsets)).values()) == 5


def test_only_plain_non_traditional_ropes_are_wrapped():
    model = tiny_llama()
    assert rope.share_angles(model) == LAYERS
    assert all(isinstance(layer.self_attn.rope, SharedAngleRoPE) for layer in model.layers)
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    scaled = llama.Model(llama.ModelArgs(**{**vars(model.args), "rope_scaling": llama3}))
    assert rope.share_angles(scaled) == 0  # llama3's RoPE rotates by its own frequencies


@pytest.mark.parametrize(
    "module",
    [
        nn.RoPE(64, traditional=False, base=10000.0, scale=1.0),
        nn.RoPE(32, traditional=True, base=500000.0, scale=0.5),
        Llama3RoPE(
            64,
            max_position_embeddings=8192,
            base=500000.0,
            scaling_config={"factor": 8.0, "original_max_position_embeddings": 8192},
        ),
    ],
    ids=["plain", "traditional-partial", "llama3"],
)
def test_a_rotation_is_the_modules_own(module: nn.Module) -> None:
    """`rotation_of` describes the module as MLX's kernel computes it: the pairs, then the
    angle (scale * p) * inv_freqs[i], matches the module's rotation of a token at p."""
    rotation = rope.rotation_of(module)
    assert rotation is not None and rotation.module is module
    head = 64
    x = mx.random.normal((3, 2, 1, head), key=mx.random.key(1))
    positions = [0, 7, 300]
    want = module(x, offset=mx.array(positions))
    dims, half = rotation.dims, rotation.dims // 2
    theta = (rotation.scale * mx.array(positions, mx.float32))[:, None] * rotation.inv_freqs
    cos, sin = mx.cos(theta)[:, None, None, :], mx.sin(theta)[:, None, None, :]
    if rotation.traditional:
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        pairs = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
        rotated = pairs.reshape(*x.shape[:-1], dims)
    else:
        x1, x2 = x[..., :half], x[..., half:dims]
        rotated = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    got = mx.concatenate([rotated, x[..., dims:]], axis=-1)
    assert mx.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert rope.rotation_of(nn.Linear(4, 4)) is None


def test_a_direct_steps_rotation_is_deferred_and_taken_once() -> None:
    """In a direct step (its offsets array marks the calls) the wrapper returns its input for
    the kernels to rotate; any other call rotates; a rotation nobody took is an error."""
    inner = nn.RoPE(16)
    wrapped = rope.DeferredRoPE(inner, rope.rotation_of(inner))
    q = mx.random.normal((2, 4, 1, 16))
    offset = mx.array([3, 9])
    rope.begin_step(offset)
    assert wrapped(q, offset) is q
    other = mx.array([3, 9])  # equal values, but not the step's array: rotated now
    assert mx.array_equal(wrapped(q, other), inner(q, other))
    prefill = mx.random.normal((2, 4, 5, 16))  # several tokens a row: rotated now
    assert mx.array_equal(wrapped(prefill, offset), inner(prefill, offset))
    rotation = rope.take(q)
    assert rotation is not None and rotation.module is inner
    assert rope.take(q) is None  # taken once
    rope.settle()
    assert wrapped(q, offset) is q
    with pytest.raises(RuntimeError, match="not applied"):
        rope.settle()
    rope.begin_step(None)
    assert mx.array_equal(wrapped(q, offset), inner(q, offset))
    rope.settle()


def test_defer_wraps_the_fixed_frequency_ropes_of_a_model() -> None:
    model = tiny_llama()
    assert rope.defer(model) == LAYERS
    assert all(isinstance(layer.self_attn.rope, rope.DeferredRoPE) for layer in model.layers)


def test_a_plain_ropes_frequencies_off_cuda_are_mlxs_expression_on_the_host():
    half, base = 32, 10000.0
    d = np.arange(half, dtype=np.float32) / np.float32(half)
    want = np.exp2(-d * np.float32(math.log2(base))).astype(np.float32)
    if not mx.cuda.is_available():
        assert np.array_equal(np.array(rope.plain_inv_freqs(half, base)), want)
    # On CUDA the device's exp2 may round some of them another way, by an ulp or two.
    got = np.array(rope.plain_inv_freqs(half, base))
    assert np.allclose(got, want, rtol=4 * 2.0**-23, atol=0)


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_frequency_kernel_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's inverse frequencies (what CUDA machines use) for a few widths: no error,
    no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rope, "_inv_freqs_kernel", rope._inv_freqs_kernel.__wrapped__)
    for half in (4, 32, 64):
        rope.plain_inv_freqs(half, 500000.0)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == 3, compiled.log
    assert compiled.spills == 0, compiled.log
