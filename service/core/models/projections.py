"""Sibling projections that read one input, run as one matmul.

mlx-lm's attention blocks call q_proj, k_proj and v_proj with one input array, and its MLPs
gate_proj and up_proj. On CUDA a matmul costs MLX more host work than any other primitive of a
decode step (`bench/host_cost.py` measures it), so `fuse` gives each such group of plain
`nn.Linear` or `nn.QuantizedLinear` layers one weight, their rows concatenated: the first member
called computes `x @ W.T` once and splits it, and its siblings take their parts when called with
the same input. Two matmuls an attention block and one an MLP fewer.

The members keep their names, classes (a subclass) and shapes, so adapters, parameter counts and
GetModelInfo see the model unchanged; their weights become views of the group's rows, so fusing
adds no memory. A member called in another way than its siblings (another input, or a sibling
never called) computes alone, as before fusing: `SharedInput` says when a group gives up.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx import nn

from service.core.models import quantized

# mlx-lm's attention blocks call q, k and v, and its MLPs gate and up, with one input array.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass
class _Held:
    """Outputs computed for members still to be called, and what they were computed for."""

    x: mx.array  # held: while it is, no other array can take its identity
    key: tuple[Any, ...]
    outs: dict[int, mx.array]  # member index -> its output


class _HeldPerThread(threading.local):
    """Each thread's forwards hold their own outputs."""

    def __init__(self) -> None:
        self.held: _Held | None = None


class SharedInput:
    """What members that read one input share: the outputs one computation made for the members
    not called yet.

    The first member called computes every member's output, returns its own and `hold`s the
    others'. A member `take`s its held output only when called with the very same input array,
    under the same key (what else the outputs depend on); every other call computes anew. Two
    calls in a row off that pattern (a member called with another input, or a new computation
    while a member has not taken its output) show the model does not call its members that way,
    and turn the group off for good (`enabled`): a family that passes the members other inputs,
    or skips one, pays a wasted computation or two, never wrong numbers. One alone, as a forward
    cut short by an error leaves, does not.

    A traced (`mx.compile`) forward runs this logic at trace time: what it decides is in the
    graph."""

    def __init__(self) -> None:
        self.enabled = True
        self._misses = 0  # calls off the pattern since the last computation fully taken
        self._local = _HeldPerThread()

    def disable(self) -> None:
        self.enabled = False
        self._local.held = None

    def take(self, index: int, x: mx.array, key: tuple[Any, ...] = ()) -> mx.array | None:
        """Member `index`'s output held for input x under `key`; None: the member computes (for
        the group while `enabled`, alone otherwise)."""
        held = self._local.held
        if held is None:
            return None
        out = held.outs.pop(index, None)
        if not held.outs:
            self._local.held = None
        if out is not None and held.x is x and held.key == key:
            if not held.outs:
                self._misses = 0
            return out
        # Not the pattern: another input than its siblings', or a sibling never called.
        self._local.held = None
        self._misses += 1
        if self._misses > 1:
            self.disable()
        return None

    def pending(self) -> bool:
        """Whether outputs are held for members not called yet (on this thread)."""
        return self._local.held is not None

    def hold(self, x: mx.array, key: tuple[Any, ...], outs: dict[int, mx.array]) -> None:
        """Keep the outputs computed for input x under `key` for the members they belong to."""
        self._local.held = _Held(x, key, outs) if outs else None


def _matmul_t(x: mx.array, w: mx.array) -> mx.array:
    return x @ w.T


class _Fused(SharedInput):
    """One weight (and bias, and quantization scales and biases) for sibling projections, their
    rows concatenated in member order."""

    def __init__(self, members: list[nn.Linear]) -> None:
        super().__init__()
        first = members[0]
        # A plain weight's product (service.core.models.decode_gemm's kernel on CUDA).
        self.matmul: Callable[[mx.array, mx.array], mx.array] = _matmul_t
        self.quantized = isinstance(first, nn.QuantizedLinear)
        sizes = [m.weight.shape[0] for m in members]
        self.splits = list(itertools.accumulate(sizes))[:-1]
        self.params = {
            key: mx.concatenate([m[key] for m in members])
            for key in ("weight", "bias", "scales", "biases")
            if key in first
        }
        if self.quantized:
            self.group_size, self.bits, self.mode = first.group_size, first.bits, first.mode
        mx.eval(self.params)
        bounds = [0, *self.splits, sum(sizes)]
        for member, start, stop in zip(members, bounds, bounds[1:]):
            for key, whole in self.params.items():
                member[key] = whole[start:stop]  # a view: the member's own array is freed
        mx.eval([m.parameters() for m in members])

    def __call__(self, x: mx.array) -> list[mx.array]:
        """Every member's output for x, as each would compute it alone."""
        return mx.split(self.product(x), self.splits, axis=-1)

    def product(self, x: mx.array) -> mx.array:
        """Every member's output for x, side by side: [..., sum of the members' sizes]."""
        p = self.params
        if self.quantized:
            y = quantized.folded_product(
                x,
                p["weight"],
                scales=p["scales"],
                biases=p.get("biases"),
                group_size=self.group_size,
                bits=self.bits,
                mode=self.mode,
            )
            if "bias" in p:
                y = y + p["bias"]
        elif "bias" in p:
            y = mx.addmm(p["bias"], x, p["weight"].T)
        else:
            y = self.matmul(x, p["weight"])
        return y


class _Member:
    """A projection whose output comes from its group's one matmul (`_Fused`)."""

    _fused: _Fused
    _fused_index: int

    def __call__(self, x: mx.array) -> mx.array:
        group, index = self._fused, self._fused_index
        if group.enabled:
            out = group.take(index, x)
            if out is not None:
                return out
        if not group.enabled:
            return super().__call__(x)  # type: ignore[misc]
        outs = group(x)
        group.hold(x, (), {i: out for i, out in enumerate(outs) if i != index})
        return outs[index]


def whole_group(layers: list[nn.Module]) -> _Fused | None:
    """The group whose members are exactly `layers`, in member order, when it still computes
    for them as one (enabled, nothing held); None otherwise (a layer not fused, or wrapped)."""
    members = [m for m in layers if isinstance(m, _Member)]
    if not members or len(members) < len(layers):
        return None
    group = members[0]._fused
    if (
        any(m._fused is not group for m in members)
        or [m._fused_index for m in members] != list(range(len(group.splits) + 1))
        or not group.enabled
        or group.pending()
    ):
        return None
    return group


def columns(layers: list[nn.Module], x: mx.array) -> list[tuple[mx.array, int]]:
    """Each layer's output for x as (y, start): the layer's output is y's columns from `start`.

    Where the layers are members of one fused group that holds nothing for them, y is the
    group's whole product, computed once and not split: a consumer that reads rows (the LoRA
    kernel) then reads the members' columns in place instead of a copy of each slice. The
    group's other members get their parts held, as when one of them computes. Otherwise each
    layer's own output, from column 0."""
    members = [m for m in layers if isinstance(m, _Member)]
    group = members[0]._fused if members else None
    if (
        group is None
        or len(members) < len(layers)
        or any(m._fused is not group for m in members)
        or not group.enabled
        or group.pending()
    ):
        return [(m(x), 0) for m in layers]
    whole = group.product(x)
    own = {m._fused_index for m in members}
    if len(own) <= len(group.splits):  # members left out: their parts, held
        parts = mx.split(whole, group.splits, axis=-1)
        group.hold(x, (), {i: part for i, part in enumerate(parts) if i not in own})
    starts = [0, *group.splits]
    return [(whole, starts[m._fused_index]) for m in members]


class FusedLinear(_Member, nn.Linear):
    pass


class FusedQuantizedLinear(_Member, quantized.FoldedQuantizedLinear):
    pass


def _signature(module: nn.Module) -> tuple[Any, ...] | None:
    """What members of one group must share; None: not a layer `fuse` takes."""
    if type(module) is nn.Linear:
        quantization: tuple[Any, ...] = ()
    elif type(module) is nn.QuantizedLinear:
        quantization = (module.group_size, module.bits, module.mode, "biases" in module)
    else:
        return None  # sharded, adapted or otherwise wrapped layers keep their own forward
    weight = module.weight
    return (type(module), weight.shape[1], weight.dtype, "bias" in module, *quantization)


def groups(model: nn.Module) -> list[_Fused]:
    """The model's fused groups, each once, in module order."""
    found: dict[int, _Fused] = {}
    for _, module in model.named_modules():
        if isinstance(module, _Member):
            found.setdefault(id(module._fused), module._fused)
    return list(found.values())


def fuse(model: nn.Module) -> int:
    """Give each block's sibling projections that read one input (`SHARED_INPUT`) one weight;
    returns the number of groups made. Members of a group are of one class, input size, dtype
    and quantization: where siblings differ (a mixed-precision quantization that keeps v_proj at
    more bits), those that agree form the group, and the others compute alone."""
    modules = dict(model.named_modules())
    parents = sorted({name.rpartition(".")[0] for name in modules})
    groups = 0
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for names in SHARED_INPUT:
            kinds: dict[tuple[Any, ...], list[nn.Module]] = {}
            for name in names:
                module = modules.get(prefix + name)
                signature = None if module is None else _signature(module)
                if signature is not None:
                    kinds.setdefault(signature, []).append(module)
            for members in kinds.values():
                if len(members) < 2:
                    continue
                group = _Fused(members)
                cls = FusedQuantizedLinear if group.quantized else FusedLinear
                for index, member in enumerate(members):
                    # The same module, now calling through its group: its name and arrays stay.
                    member.__class__ = cls
                    member._fused, member._fused_index = group, index
                groups += 1
    return groups
