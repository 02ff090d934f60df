"""service/core/models/projections.py: sibling projections as one matmul give each member what it
computes alone, keep their names, shapes and memory, and give up (computing alone again) on a
model that does not call them with one input. Whole families through the engine:
tests/test_engine_families.py (test_fused_projections_give_mlx_lm_alone)."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx import nn

from bench.decode_primitives import primitives
from service.core.models import projections


class Block(nn.Module):
    """An attention block's and an MLP's projections, named as mlx-lm names them."""

    def __init__(self, dims: int = 64, bias: bool = False) -> None:
        super().__init__()
        self.q_proj = nn.Linear(dims, dims, bias=bias)
        self.k_proj = nn.Linear(dims, dims // 2, bias=bias)
        self.v_proj = nn.Linear(dims, dims // 2, bias=bias)
        self.gate_proj = nn.Linear(dims, 96, bias=bias)
        self.up_proj = nn.Linear(dims, 96, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        attn = q + mx.concatenate([k, v], axis=-1)
        return nn.silu(self.gate_proj(attn)) * self.up_proj(attn)


class Model(nn.Module):
    def __init__(self, layers: int = 2, bias: bool = False) -> None:
        super().__init__()
        self.layers = [Block(bias=bias) for _ in range(layers)]

    def __call__(self, x: mx.array) -> mx.array:
        return [layer(x) for layer in self.layers][-1]


def built(bias: bool = False, bits: int = 0) -> Model:
    mx.random.seed(0)
    model = Model(bias=bias)
    if bits:
        nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def names_and_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    from mlx.utils import tree_flatten

    return {k: v.shape for k, v in tree_flatten(model.parameters())}


@pytest.mark.parametrize(
    "bias,bits", [(False, 0), (True, 0), (False, 4), (True, 8)], ids=["plain", "bias", "q4", "q8b"]
)
def test_members_give_what_they_compute_alone(bias: bool, bits: int) -> None:
    model = built(bias, bits)
    x = mx.random.normal((3, 5, 64))
    want = model(x)
    shapes = names_and_shapes(model)
    assert projections.fuse(model) == 4  # q/k/v and gate/up, in each of two layers
    assert names_and_shapes(model) == shapes
    kind = projections.FusedQuantizedLinear if bits else projections.FusedLinear
    assert isinstance(model.layers[0].k_proj, kind)
    assert mx.allclose(model(x), want, atol=1e-5)
    # Each member called alone, out of the pattern, still gives its own output.
    alone = built(bias, bits).layers[1]
    for name in ("k_proj", "q_proj", "up_proj"):
        assert mx.allclose(model.layers[1][name](x), alone[name](x), atol=1e-5), name
    assert all(g.enabled for g in projections.groups(model))


def test_one_matmul_per_group() -> None:
    """The members' outputs come from one product of the concatenated weight: two a layer
    instead of five in the test block, traced as the compiled decode step traces it."""
    model = built()
    x = mx.random.normal((2, 64))
    want = model(x)
    assert primitives(want)["Matmul"] == 5  # the last layer's graph
    projections.fuse(model)
    got = model(x)
    assert primitives(got)["Matmul"] == 2
    assert mx.allclose(got, want, atol=1e-5)
    assert mx.allclose(mx.compile(model)(x), want, atol=1e-5)


def test_columns_give_members_their_part_of_one_product() -> None:
    """`columns`: members of one group get the group's whole product, unsplit, and where their
    outputs start in it; a member left out takes its held part; layers of no group, or members
    of a group that holds outputs already, get their own outputs."""
    model = built()
    block = model.layers[0]
    x = mx.random.normal((3, 64))
    want = {name: block[name](x) for name in ("q_proj", "k_proj", "v_proj", "up_proj")}
    plain = built().layers[0]
    ((_, start),) = projections.columns([plain.q_proj], x)
    assert start == 0
    projections.fuse(model)
    (q, q_at), (v, v_at) = projections.columns([block.q_proj, block.v_proj], x)
    assert q is v and q.shape == (3, 128) and (q_at, v_at) == (0, 96)
    assert mx.allclose(q[:, :64], want["q_proj"], atol=1e-5)
    assert mx.allclose(v[:, 96:], want["v_proj"], atol=1e-5)
    assert mx.allclose(block.k_proj(x), want["k_proj"], atol=1e-5)  # held for it
    # A group holding outputs (gate computed first) gives up's own, held, output.
    block.gate_proj(x)
    ((up, at),) = projections.columns([block.up_proj], x)
    assert at == 0 and up.shape == (3, 96) and mx.allclose(up, want["up_proj"], atol=1e-5)
    # Members of two groups: each its own output.
    got = projections.columns([block.q_proj, block.up_proj], x)
    assert [y.shape for y, _ in got] == [(3, 64), (3, 96)]
    block.k_proj(x), block.v_proj(x)  # take what q's call held
    assert all(g.enabled for g in projections.groups(model))


def test_weights_are_views_of_the_group() -> None:
    """Fusing adds no memory: the members' arrays become the group's rows."""
    model = built()
    mx.eval(model.parameters())
    mx.clear_cache()
    before = mx.get_active_memory()
    projections.fuse(model)
    mx.clear_cache()
    after = mx.get_active_memory()
    assert after <= before + 4096
    group = model.layers[0].q_proj._fused
    assert mx.array_equal(
        group.params["weight"],
        mx.concatenate([model.layers[0][n].weight for n in ("q_proj", "k_proj", "v_proj")]),
    )


class Skipping(nn.Module):
    """A block that calls k with another input and never calls v."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(16, 16)
        self.k_proj = nn.Linear(16, 16)
        self.v_proj = nn.Linear(16, 16)

    def __call__(self, x: mx.array) -> mx.array:
        return self.q_proj(x) + self.k_proj(x * 2)


def test_a_model_off_the_pattern_turns_its_group_off() -> None:
    mx.random.seed(1)
    model = Skipping()
    x = mx.random.normal((2, 16))
    want = model(x)
    projections.fuse(model)
    (group,) = projections.groups(model)
    assert mx.allclose(model(x), want, atol=1e-5)  # k computes anew: one miss, still on
    assert group.enabled
    assert mx.allclose(model(x), want, atol=1e-5)  # the second miss in a row turns it off
    assert not group.enabled
    assert mx.allclose(model(x), want, atol=1e-5)


def test_a_forward_cut_short_leaves_the_group_on() -> None:
    """q called, then an error before k and v: the next forward misses once, then holds again."""
    model = built()
    x = mx.random.normal((2, 64))
    want = model(x)
    projections.fuse(model)
    model.layers[0].q_proj(x)  # the forward that stopped there
    assert mx.allclose(model(x), want, atol=1e-5)
    assert mx.allclose(model(x), want, atol=1e-5)
    assert all(g.enabled for g in projections.groups(model))


def test_siblings_of_different_kinds_stay_apart() -> None:
    """Members share class, input size, dtype, bias and quantization: of siblings that differ,
    those that agree form the group (v_proj kept at 8 bits, as mixed-precision recipes do)."""
    model = built()
    x = mx.random.normal((2, 64))
    model.layers[0].v_proj = nn.Linear(64, 32, bias=True)  # the only one with a bias
    nn.quantize(model.layers[1], group_size=32, bits=4, class_predicate=lambda p, _: p != "v_proj")
    nn.quantize(model.layers[1], group_size=32, bits=8, class_predicate=lambda p, m: p == "v_proj")
    mx.eval(model.parameters())
    want = [layer(x) for layer in model.layers]
    # layer 0: q+k and gate+up; layer 1: q+k (4-bit) and gate+up (4-bit)
    assert projections.fuse(model) == 4
    assert type(model.layers[0].v_proj) is nn.Linear
    assert type(model.layers[1].v_proj) is nn.QuantizedLinear
    assert model.layers[1].q_proj._fused is model.layers[1].k_proj._fused
    for layer, expect in zip(model.layers, want):
        assert mx.allclose(layer(x), expect, atol=1e-5)
    assert all(g.enabled for g in projections.groups(model))

    mixed = built()
    nn.quantize(mixed.layers[0], group_size=32, bits=4, class_predicate=lambda p, _: p == "up_proj")
    assert projections.fuse(mixed) == 3  # layer 0's MLP: one float, one 4-bit
    assert type(mixed.layers[0].gate_proj) is nn.Linear


def test_threads_hold_their_own_outputs() -> None:
    """Forwards built on two threads at once each take their own siblings' outputs."""
    model = built()
    inputs = [mx.random.normal((2, 64)) for _ in range(2)]
    want = [model(x) for x in inputs]
    mx.eval(want)
    projections.fuse(model)
    barrier = threading.Barrier(2)
    got: list[np.ndarray | None] = [None, None]

    def run(i: int) -> None:
        layer = model.layers[0]
        barrier.wait()
        q = layer.q_proj(inputs[i])
        barrier.wait()  # both threads hold outputs now
        k, v = layer.k_proj(inputs[i]), layer.v_proj(inputs[i])
        got[i] = np.array(q + mx.concatenate([k, v], axis=-1))  # evaluated on this thread

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    layer = built().layers[0]
    for i, x in enumerate(inputs):
        expect = layer.q_proj(x) + mx.concatenate([layer.k_proj(x), layer.v_proj(x)], axis=-1)
        assert np.allclose(got[i], np.array(expect), atol=1e-5)
    assert all(g.enabled for g in projections.groups(model))
