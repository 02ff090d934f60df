"""RoPE variants of service.core.models.rope: the CPU's angles shared by a forward's layers."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama

from service.core.models import rope
from service.core.models.rope import SharedAngleRoPE
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
