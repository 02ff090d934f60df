"""Many mlx-lm LoRA and DoRA adapters on one base model, applied per row of one batched forward.

`mlx_lm lora` writes an adapter as a directory: `adapter_config.json` (fine_tune_type, num_layers,
lora_parameters: rank, scale, keys) and `adapters.safetensors` (per converted module `lora_a`
[in, r], `lora_b` [r, out] and, for DoRA, the magnitude `m` [out]). Each module any loaded adapter
targets is wrapped once by `MultiLoRALinear`, which keeps its base layer as the child `linear`
and the adapters' weights stacked by *adapter slot* (slot 0, `NO_ADAPTER`, is all zeros). The
engine publishes each row's slot for the forward it builds (`row_adapters`); the base projection
then runs once for all rows and each row adds its own adapter's update, gathered per row with
`mx.gather_mm`; on CUDA (`EngineConfig.lora_kernel`) with custom kernels instead: in a decode
step `lora_kernel.fused_add`, one kernel for the projections that read the same input
(`_Group`); in a pass of several tokens a row `lora_kernel.rows_add`, whose tiles of a row's
tokens share each read of the adapter's A and B.
With no adapter row in the forward the wrapper is the base layer alone.

What mlx-lm computes (`mlx_lm/tuner/lora.py`, `dora.py`), reproduced op for op:
  LoRA:  linear(x) + (scale * ((x @ lora_a) @ lora_b)).astype(x.dtype)
  DoRA:  (m / ||W + (scale * lora_b.T) @ lora_a.T||_row).astype(x.dtype) * (x @ W.T + the
         same update), plus the bias; W dequantized for a quantized base.
The scale multiplies the product (not folded into B) and the products run in
promote(x.dtype, lora_a.dtype), so a LoRA row is bit-identical to mlx-lm's forward on a float or
quantized base. The DoRA factor depends on weights only: it is computed once per adapter with
mlx-lm's expression. DoRA over a bias or a quantized base reuses the shared base product, where
mlx-lm computes its own: equal to float tolerance.

Targets follow mlx-lm's `linear_to_lora_layers`: the config's keys (default: every Linear,
QuantizedLinear, SwitchLinear and Embedding inside a layer) in the last `num_layers` layers (-1
and 0 mean all), plus model-level modules whose full name is a key (`lm_head`). Everything else
is refused with the reason (`AdapterError`): full fine-tunes, LoRA on embeddings or MoE experts,
tensors the config does not target, targets without their tensors, shapes that do not fit.

Under tensor parallel each adapter is sharded like its base layer: an all-to-sharded layer keeps
the columns of `lora_b` (and of `m`) of its output shard, a sharded-to-all layer the rows of
`lora_a` of its input shard, with the rank-sized product summed over the group before `lora_b`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.nn.layers.distributed import (
    AllToShardedLinear,
    QuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear,
    ShardedToAllLinear,
)
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from service.common.model_source import ModelLoadError
from service.core.engine.device_memory import resident
from service.core.models import lora_kernel, projections, residual_norm
from service.core.models.projections import SHARED_INPUT, SharedInput
from service.protocol import AdapterDescription

NO_ADAPTER = 0  # the reserved slot: zero weights, scale 0, DoRA factor 1

# Layers an adapter may target, by how their weight is split over a tensor-parallel group.
_QUANTIZED = (nn.QuantizedLinear, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)
_OUTPUT_SHARDED = (AllToShardedLinear, QuantizedAllToShardedLinear)
_INPUT_SHARDED = (ShardedToAllLinear, QuantizedShardedToAllLinear)
_LINEAR = (nn.Linear, *_QUANTIZED, *_OUTPUT_SHARDED, *_INPUT_SHARDED)
# What mlx-lm's trainer converts when the config names no keys.
_TRAINABLE = (
    nn.Linear,
    nn.QuantizedLinear,
    SwitchLinear,
    QuantizedSwitchLinear,
    nn.Embedding,
    nn.QuantizedEmbedding,
)


class AdapterError(ModelLoadError):
    """An adapter that cannot be served on this model; the message says why, in one line."""


class RowAdapters:
    """The adapter slot of each row of one forward (int32 [B], or [M] for a 2-D input such as
    the LM head's rows), with the per-row scales gathered once for all layers."""

    def __init__(self, slots: mx.array) -> None:
        self.slots = slots
        self._scales: dict[tuple[int, int, mx.Dtype], mx.array] = {}
        self._tokens: dict[tuple[int, int], tuple[mx.array | None, mx.array]] = {}
        self._token_scales: dict[tuple[int, int, int], mx.array] = {}
        # Zeros for the CUDA kernels' launches in this forward, one fill for them all.
        self.counts = lora_kernel.Counts()

    def scales(self, table: _Scales, dtype: mx.Dtype) -> mx.array:
        key = (id(table), table.version, dtype)
        rows = self._scales.get(key)
        if rows is None:
            rows = self._scales[key] = table.array(dtype)[self.slots]
        return rows

    def per_token(
        self, local: mx.array | None, length: int, table: _Scales
    ) -> tuple[mx.array, mx.array]:
        """Each token's local slot (int32) and scale (float32), [B * length], for the CUDA
        kernels; `local`: a stack's global -> local slot map (None: the identity). Made once per
        forward for each map: stacks holding the same adapters share one (`_Maps`)."""
        key = (id(local), length)
        held = self._tokens.get(key)
        if held is None or held[0] is not local:  # the map is kept, so its id is not reused
            idx = self.slots if local is None else local[self.slots]
            if idx.dtype != mx.int32:
                idx = idx.astype(mx.int32)
            if length > 1:
                idx = mx.repeat(idx, length)
            held = self._tokens[key] = (local, idx)
        skey = (id(table), table.version, length)
        scale = self._token_scales.get(skey)
        if scale is None:
            scale = self.scales(table, mx.float32).reshape(-1)
            if length > 1:
                scale = mx.repeat(scale, length)
            self._token_scales[skey] = scale
        return held[1], scale


# The rows of the forward being built, or None: no row of it uses an adapter. The engine sets it
# around each forward; a compiled graph sets it inside its traced function, from an input.
row_adapters: ContextVar[RowAdapters | None] = ContextVar("row_adapters", default=None)


@contextmanager
def use_adapters(rows: RowAdapters | None) -> Iterator[None]:
    token = row_adapters.set(rows)
    try:
        yield
    finally:
        row_adapters.reset(token)


# -- reading an adapter --------------------------------------------------------------------------


@dataclass
class ModuleWeights:
    lora_a: mx.array  # [in, r]
    lora_b: mx.array  # [r, out]
    m: mx.array | None = None  # DoRA magnitude [out]


@dataclass
class Adapter:
    """An adapter read and checked against the served model."""

    name: str
    path: str
    fine_tune_type: str  # "lora" | "dora"
    rank: int
    scale: float
    keys: list[str]  # what the config targets (per-layer or model-level module names)
    modules: dict[str, ModuleWeights] = field(default_factory=dict)  # full name -> weights

    @property
    def nbytes(self) -> int:
        return sum(
            w.lora_a.nbytes + w.lora_b.nbytes + (w.m.nbytes if w.m is not None else 0)
            for w in self.modules.values()
        )

    @property
    def dora(self) -> bool:
        return self.fine_tune_type == "dora"

    def describe(self, layers: Sequence[str]) -> AdapterDescription:
        """`layers`: the full names of the model's layers (prefixes of the modules)."""
        adapted = {
            layer for layer in layers if any(m.startswith(layer + ".") for m in self.modules)
        }
        return AdapterDescription(
            name=self.name,
            path=self.path,
            fine_tune_type=self.fine_tune_type,
            rank=self.rank,
            scale=self.scale,
            target_modules=sorted(self.keys),
            num_layers=len(adapted),
            memory_bytes=self.nbytes,
        )


def _base(module: nn.Module) -> nn.Module:
    return module.linear if isinstance(module, MultiLoRALinear) else module


def _named_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """`named_modules`, with an installed wrapper seen as the layer it wraps."""
    out: list[tuple[str, nn.Module]] = []
    inside: list[str] = []
    for name, module in root.named_modules():
        if any(name.startswith(prefix) for prefix in inside):
            continue
        if isinstance(module, MultiLoRALinear):
            inside.append(name + ".")
        out.append((name, _base(module)))
    return out


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(input_dims, output_dims) of a linear layer as mlx-lm's LoRALinear sizes its adapter: the
    whole layer's, also when this process holds one tensor-parallel shard of it."""
    out_dims, in_dims = module.weight.shape
    if isinstance(module, _QUANTIZED):
        in_dims = in_dims * 32 // module.bits
    if isinstance(module, _OUTPUT_SHARDED):
        out_dims *= module.group.size()
    elif isinstance(module, _INPUT_SHARDED):
        in_dims *= module.group.size()
    return in_dims, out_dims


def default_keys(model: nn.Module) -> set[str]:
    """mlx-lm's keys when the config names none: every trainable module inside a layer."""
    keys: set[str] = set()
    for layer in model.layers:
        keys.update(
            k for k, m in _named_modules(layer) if k and isinstance(m, (*_TRAINABLE, *_LINEAR))
        )
    return keys


def layer_names(model: nn.Module) -> list[str]:
    full = {id(m): n for n, m in model.named_modules()}
    return [full[id(layer)] for layer in model.layers]


def target_modules(
    model: nn.Module, num_layers: int, keys: Sequence[str] | None
) -> dict[str, nn.Module]:
    """What `linear_to_lora_layers(model, num_layers, {keys})` would convert: full name ->
    module (an installed wrapper seen as its base layer)."""
    keyset = default_keys(model) if keys is None else set(keys)
    names = layer_names(model)
    targets: dict[str, nn.Module] = {}
    for prefix, layer in list(zip(names, model.layers))[-max(num_layers, 0) :]:
        for k, m in _named_modules(layer):
            if k in keyset:
                targets[f"{prefix}.{k}"] = m
    for k, m in _named_modules(model):
        if k in keyset:
            targets[k] = m
    return targets


def refusal(module: nn.Module) -> str | None:
    """Why an adapter cannot be applied to this module (None: it can)."""
    kind = type(module).__name__
    if isinstance(module, (SwitchLinear, QuantizedSwitchLinear)):
        return (
            f"LoRA on MoE experts ({kind}) is not supported: a row would need its experts' "
            "indices and its adapter's combined"
        )
    if isinstance(module, (nn.Embedding, nn.QuantizedEmbedding)):
        return (
            f"LoRA on embeddings ({kind}) is not supported: a token-indexed update (and, with tied "
            "embeddings, the LM head's too)"
        )
    if not isinstance(module, _LINEAR):
        return f"a {kind}, not a linear layer (nn.Linear or nn.QuantizedLinear)"
    return None


def _config(where: str, path: Path) -> dict:
    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{where}: unreadable adapter_config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{where}: adapter_config.json is not a JSON object")
    return config


def load_adapter(name: str, path: str | Path, model: nn.Module) -> Adapter:
    """Read an mlx-lm adapter directory and check it against the served model."""
    path = Path(path)
    where = f"adapter {name!r} ({path})"
    for file in ("adapter_config.json", "adapters.safetensors"):
        if not (path / file).is_file():
            raise AdapterError(f"{where}: {file} not found")
    config = _config(where, path)
    kind = config.get("fine_tune_type", "lora")  # mlx-lm's default when absent
    if kind == "full":
        raise AdapterError(
            f"{where}: fine_tune_type 'full' is a full fine-tune (it replaces the base weights, "
            "no low-rank update): serve it as a model of its own"
        )
    if kind not in ("lora", "dora"):
        raise AdapterError(f"{where}: unknown fine_tune_type {kind!r} (lora or dora)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{where}: adapter_config.json has no lora_parameters")
    for key in ("rank", "scale"):
        if key not in params:
            raise AdapterError(f"{where}: lora_parameters has no {key!r} (mlx-lm requires it)")
    if "num_layers" not in config:
        raise AdapterError(f"{where}: adapter_config.json has no num_layers")
    rank, scale, num_layers = int(params["rank"]), float(params["scale"]), int(config["num_layers"])
    keys = params.get("keys")

    targets = target_modules(model, num_layers, keys)
    if not targets:
        raise AdapterError(f"{where}: its keys {keys} match no module of the served model")
    for module_name, module in targets.items():
        why = refusal(module)
        if why is not None:
            raise AdapterError(f"{where}: {module_name} is {why}")

    try:
        weights = mx.load(str(path / "adapters.safetensors"))
    except (OSError, ValueError, RuntimeError) as exc:
        raise AdapterError(f"{where}: unreadable adapters.safetensors: {exc}") from exc
    leaves = ("lora_a", "lora_b", "m") if kind == "dora" else ("lora_a", "lora_b")
    # Tensors of modules the model lacks say most about a mismatch: they come first.
    unknown: list[str] = []
    errors: list[str] = []
    present = dict(_named_modules(model))
    for key in sorted(weights):
        module_name, _, leaf = key.rpartition(".")
        if module_name not in present:
            unknown.append(f"{key}: the served model has no module {module_name}")
        elif module_name not in targets or leaf not in leaves:
            errors.append(f"{key}: not a {kind} parameter of a module the config targets")
    modules: dict[str, ModuleWeights] = {}
    for module_name, module in targets.items():
        in_dims, out_dims = linear_dims(module)
        expected = {"lora_a": (in_dims, rank), "lora_b": (rank, out_dims), "m": (out_dims,)}
        got: dict[str, mx.array] = {}
        for leaf in leaves:
            w = weights.get(f"{module_name}.{leaf}")
            if w is None:
                errors.append(f"{module_name}.{leaf}: missing (the config targets {module_name})")
            elif tuple(w.shape) != expected[leaf]:
                errors.append(
                    f"{module_name}.{leaf}: adapter shape {tuple(w.shape)} does not match "
                    f"{expected[leaf]} (module {in_dims}->{out_dims}, rank {rank})"
                )
            elif not mx.issubdtype(w.dtype, mx.floating):
                errors.append(f"{module_name}.{leaf}: dtype {w.dtype} is not floating point")
            else:
                got[leaf] = w
        if len(got) == len(leaves):
            modules[module_name] = ModuleWeights(got["lora_a"], got["lora_b"], got.get("m"))
    if unknown or errors:
        errors = unknown + sorted(set(errors))
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        raise AdapterError(f"{where} does not fit the served model: {'; '.join(errors[:3])}{more}")
    return Adapter(
        name=name,
        path=str(path),
        fine_tune_type=kind,
        rank=rank,
        scale=scale,
        keys=sorted(default_keys(model)) if keys is None else list(keys),
        modules=modules,
    )


# -- the wrapper ---------------------------------------------------------------------------------


_PROMOTED: dict[tuple[mx.Dtype, mx.Dtype], mx.Dtype] = {}


def _promote(a: mx.Dtype, b: mx.Dtype) -> mx.Dtype:
    """The dtype MLX's binary ops (and matmul) give for operands of dtypes a and b."""
    if a == b:
        return a
    key = (a, b)
    if key not in _PROMOTED:
        _PROMOTED[key] = (mx.zeros((1,), dtype=a) * mx.zeros((1,), dtype=b)).dtype
    return _PROMOTED[key]


def _dequantized(linear: nn.Module) -> mx.array:
    if isinstance(linear, _QUANTIZED):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear.weight


class _Scales:
    """The LoRA scale of each slot, shared by the wrappers of one AdapterSet."""

    def __init__(self) -> None:
        self.values: list[float] = [0.0]
        self.version = 0
        self._arrays: dict[mx.Dtype, mx.array] = {}

    def set(self, slot: int, scale: float) -> None:
        self.values += [0.0] * (slot + 1 - len(self.values))
        self.values[slot] = scale
        self.version += 1
        self._arrays.clear()

    def array(self, dtype: mx.Dtype) -> mx.array:
        table = self._arrays.get(dtype)
        if table is None:
            values = resident(np.array(self.values, np.float32), dtype)
            table = self._arrays[dtype] = values[:, None, None]
        return table


class _Maps:
    """Global -> local slot maps, one array per distinct map, shared by the wrappers of one
    AdapterSet: the kernels' per-token slots are then gathered once per forward for each
    (`RowAdapters.per_token`), not once per layer."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, ...], mx.array] = {}

    def get(self, table: Sequence[int]) -> mx.array:
        key = tuple(table)
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = resident(np.array(key, dtype=np.int32))
        return held

    def retain(self, live: Iterable[mx.array | None]) -> None:
        """Forget the maps no stack uses any more."""
        keep = {id(m) for m in live if m is not None}
        self._held = {k: m for k, m in self._held.items() if id(m) in keep}


@dataclass
class _Stack:
    """One layer's adapters, stacked and zero-padded to the largest rank among them: A [S, in,
    r], B [S, r, out]. Local slot 0 is zeros; `local` maps every global slot to its local one
    (0 for adapters that do not target this layer)."""

    a: mx.array
    b: mx.array
    members: dict[int, int] = field(default_factory=dict)  # global slot -> local slot
    ranks: dict[int, int] = field(default_factory=dict)  # local slot -> its adapter's rank
    local: mx.array | None = None  # int32 [global slots]; None: the identity
    # With several ranks stacked: (rank, global -> local map of that rank's slots only).
    by_rank: list[tuple[int, mx.array]] = field(default_factory=list)
    a_t: mx.array | None = None  # A as [S, r, in], for the CUDA kernels (wrappers' `kernel`)

    @property
    def rank(self) -> int:
        return self.a.shape[2]

    def local_of(self, slots: mx.array) -> mx.array:
        """The rows' local slots in this stack."""
        return slots if self.local is None else self.local[slots]

    def nbytes(self) -> int:
        maps = [self.local, self.a_t, *(t for _, t in self.by_rank)]
        return self.a.nbytes + self.b.nbytes + sum(m.nbytes for m in maps if m is not None)


@dataclass
class _Dora:
    """Per global slot, the DoRA factor [S, out] (1 for other slots) and whether it is DoRA."""

    factor: mx.array
    is_dora: mx.array  # bool [S]
    slots: set[int] = field(default_factory=set)


class MultiLoRALinear(nn.Module):
    """A linear layer plus the updates of every adapter that targets it, chosen per row.

    A one-token row (decode; the LM head's rows) is multiplied with the whole padded stack: the
    padding adds exact zeros. A multi-token forward with adapters of several ranks in the stack
    multiplies each rank's slots at their own width, so that every row's products have exactly
    its adapter's shapes (BLAS may round a wider product differently)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear
        self.input_dims, self.output_dims = linear_dims(linear)
        self._group = (
            linear.group if isinstance(linear, (*_OUTPUT_SHARDED, *_INPUT_SHARDED)) else None
        )
        self._reduce = isinstance(linear, _INPUT_SHARDED)  # the update's input is a shard too
        # Held in plain objects, off the module's parameter tree: `parameters()` shows the base
        # layer alone (as `<name>.linear.*`).
        self._scales = _Scales()  # replaced by the AdapterSet's shared table
        self._stack: _Stack | None = None
        self._dora: _Dora | None = None
        self._num_slots = 1
        self._maps = _Maps()  # replaced by the AdapterSet's shared one
        self.kernel = False  # set by the AdapterSet (EngineConfig.lora_kernel)
        # The projections that read this one's input, when it has such siblings (_Group).
        self._shared: _Group | None = None
        self._shared_index = 0

    # -- shards
    def _shard(self, w: ModuleWeights) -> ModuleWeights:
        """This process's part of an adapter's weights under tensor parallel."""
        if self._group is None:
            return w
        n, r = self._group.size(), self._group.rank()
        if self._reduce:
            size = self.input_dims // n
            return ModuleWeights(w.lora_a[r * size : (r + 1) * size], w.lora_b, w.m)
        size = self.output_dims // n
        m = None if w.m is None else w.m[r * size : (r + 1) * size]
        return ModuleWeights(w.lora_a, w.lora_b[:, r * size : (r + 1) * size], m)

    def _dora_factor(self, w: ModuleWeights, scale: float) -> mx.array:
        """mlx-lm's DoRA magnitude over the adapted weight's row norms (from weights alone)."""
        assert w.m is not None
        weight = _dequantized(self.linear)
        adapted = weight + (scale * w.lora_b.T) @ w.lora_a.T
        if self._reduce and self._group is not None:
            # Each process holds some columns of every row: the squared norms add up.
            squares = mx.distributed.all_sum(mx.sum(adapted * adapted, axis=1), group=self._group)
            return w.m / mx.sqrt(squares)
        return w.m / mx.linalg.norm(adapted, axis=1)

    # -- slots
    def resize(self, num_slots: int) -> None:
        """Make every global slot below num_slots addressable."""
        if num_slots <= self._num_slots:
            return
        grow = num_slots - self._num_slots
        self._num_slots = num_slots
        dora = self._dora
        if dora is not None:
            ones = mx.ones((grow, dora.factor.shape[1]), dtype=dora.factor.dtype)
            dora.factor = mx.concatenate([dora.factor, ones])
            dora.is_dora = mx.concatenate([dora.is_dora, mx.zeros((grow,), dtype=mx.bool_)])
        self._reindex()

    def set_slot(self, slot: int, w: ModuleWeights, scale: float, dora: bool) -> None:
        self.resize(slot + 1)
        w = self._shard(w)
        in_local, rank = w.lora_a.shape
        out_local = w.lora_b.shape[1]
        stack = self._stack
        dtype = w.lora_a.dtype if stack is None else _promote(stack.a.dtype, w.lora_a.dtype)
        if stack is None:
            stack = self._stack = _Stack(
                mx.zeros((1, in_local, rank), dtype=dtype),
                mx.zeros((1, rank, out_local), dtype=dtype),
            )
        if rank > stack.rank or dtype != stack.a.dtype:  # re-pad to the new largest rank
            r = max(rank, stack.rank)
            a = mx.zeros((stack.a.shape[0], in_local, r), dtype=dtype)
            b = mx.zeros((stack.a.shape[0], r, out_local), dtype=dtype)
            a[:, :, : stack.rank] = stack.a.astype(dtype)
            b[:, : stack.rank, :] = stack.b.astype(dtype)
            stack.a, stack.b = a, b
        used = set(stack.members.values())
        local = next((i for i in range(1, stack.a.shape[0]) if i not in used), stack.a.shape[0])
        if local == stack.a.shape[0]:
            stack.a = mx.concatenate([stack.a, mx.zeros((1, *stack.a.shape[1:]), dtype=dtype)])
            stack.b = mx.concatenate([stack.b, mx.zeros((1, *stack.b.shape[1:]), dtype=dtype)])
        a = mx.zeros(stack.a.shape[1:], dtype=dtype)
        a[:, :rank] = w.lora_a.astype(dtype)
        b = mx.zeros(stack.b.shape[1:], dtype=dtype)
        b[:rank] = w.lora_b.astype(dtype)
        stack.a[local] = a
        stack.b[local] = b
        stack.members[slot] = local
        stack.ranks[local] = rank
        if dora:
            factor = self._dora_factor(w, scale)
            if self._dora is None:
                self._dora = _Dora(
                    mx.ones((self._num_slots, factor.shape[0]), dtype=factor.dtype),
                    mx.zeros((self._num_slots,), dtype=mx.bool_),
                )
            held = self._dora
            held.factor = held.factor.astype(_promote(held.factor.dtype, factor.dtype))
            held.factor[slot] = factor.astype(held.factor.dtype)
            held.is_dora[slot] = True
            held.slots.add(slot)
        self._reindex()

    def clear_slot(self, slot: int) -> None:
        stack = self._stack
        if stack is not None and slot in stack.members:
            local = stack.members.pop(slot)
            stack.a[local] = mx.zeros(stack.a.shape[1:], dtype=stack.a.dtype)
            stack.b[local] = mx.zeros(stack.b.shape[1:], dtype=stack.b.dtype)
            stack.ranks.pop(local, None)
            if not stack.members:
                self._stack = None
        held = self._dora
        if held is not None and slot in held.slots:
            held.slots.discard(slot)
            held.factor[slot] = mx.ones(held.factor.shape[1:], dtype=held.factor.dtype)
            held.is_dora[slot] = False
            if not held.slots:
                self._dora = None
        self._reindex()

    def _reindex(self) -> None:
        stack = self._stack
        arrays: list[mx.array] = []
        if stack is not None:
            table = [stack.members.get(s, 0) for s in range(self._num_slots)]
            # The global -> local gather is skipped when it is the identity.
            identity = stack.a.shape[0] == self._num_slots and table == list(range(self._num_slots))
            stack.local = None if identity else self._maps.get(table)
            stack.by_rank = []
            distinct = sorted(set(stack.ranks.values()))
            if len(distinct) > 1:
                for r in distinct:
                    only = [loc if stack.ranks.get(loc) == r else 0 for loc in table]
                    stack.by_rank.append((r, mx.array(only, dtype=mx.int32)))
            stack.a_t = mx.contiguous(stack.a.swapaxes(1, 2)) if self.kernel else None
            arrays += [stack.a, stack.b, *(t for _, t in stack.by_rank)]
            if stack.a_t is not None:
                arrays.append(stack.a_t)
            if stack.local is not None:
                arrays.append(stack.local)
        if self._dora is not None:
            arrays += [self._dora.factor, self._dora.is_dora]
        if self._shared is not None:
            self._shared.version += 1
        mx.eval(arrays)

    @property
    def active(self) -> bool:
        return self._stack is not None

    def nbytes(self) -> int:
        held = self._dora
        extra = 0 if held is None else held.factor.nbytes + held.is_dora.nbytes
        return (self._stack.nbytes() if self._stack is not None else 0) + extra

    # -- forward
    def _update(
        self, x: mx.array, rows: RowAdapters, a: mx.array, b: mx.array, local: mx.array
    ) -> mx.array:
        """scale * ((x @ A) @ B) of each row [B, N, out], in promote(x, A)'s dtype."""
        dtype = _promote(x.dtype, a.dtype)
        z = mx.gather_mm(x if x.dtype == dtype else x.astype(dtype), a, rhs_indices=local)
        if self._reduce and self._group is not None:
            z = mx.distributed.all_sum(z, group=self._group)
        z = mx.gather_mm(z, b, rhs_indices=local)
        return rows.scales(self._scales, z.dtype) * z

    def fusable(self) -> bool:
        """The update comes from `lora_kernel.fused_add`: the kernel path, no DoRA adapter, and
        no sum over a tensor-parallel group between the two products."""
        stack = self._stack
        return (
            self.kernel
            and stack is not None
            and stack.a_t is not None
            and self._dora is None
            and not self._reduce
        )

    def part(
        self, x: mx.array, y: mx.array, start: int, rows: RowAdapters
    ) -> tuple[lora_kernel.Part, mx.array]:
        """This layer's share of a `fused_add` call for input x [..., in] and base output y (or
        the wider y whose columns from `start` it is: `projections.columns`), with the tokens'
        scales [tokens]."""
        stack = self._stack
        assert stack is not None and stack.a_t is not None
        length = math.prod(x.shape[1:-1])  # tokens per row: 1 for the LM head's [rows, H]
        idx, scale = rows.per_token(stack.local, length, self._scales)
        return lora_kernel.Part(y, stack.a_t, stack.b, idx, start), scale

    def _kernel_update(
        self, x: mx.array, y: mx.array, rows: RowAdapters, stack: _Stack
    ) -> mx.array:
        """A sharded-to-all layer's update on CUDA: `shrink`, z summed over the tensor-parallel
        group, `expand_add`."""
        assert stack.a_t is not None
        batch, length, width = x.shape
        idx, scale = rows.per_token(stack.local, length, self._scales)
        z = lora_kernel.shrink(x.reshape(batch * length, width), stack.a_t, idx)
        if self._reduce and self._group is not None:
            z = mx.distributed.all_sum(z, group=self._group)
        flat = y.reshape(batch * length, -1)
        return lora_kernel.expand_add(flat, z, stack.b, idx, scale).reshape(y.shape)

    def __call__(self, x: mx.array) -> mx.array:
        rows = row_adapters.get()
        stack = self._stack
        if rows is None or stack is None:
            return self.linear(x)
        if self.fusable():
            # Several tokens a row (prefill, verification): this layer's row kernels, whose
            # tiles of a row's tokens share each read of A and B (`lora_kernel.rows_add`).
            # One token a row: one kernel, this layer's alone or its siblings' too (_Group).
            several = x.ndim == 3 and x.shape[1] > 1
            out = None if several or self._shared is None else self._shared(self, x, rows)
            if out is None:
                ((y, start),) = projections.columns([self.linear], x)
                part, scale = self.part(x, y, start, rows)
                if several:
                    (out,) = lora_kernel.rows_add(x, [part], scale, x.shape[1])
                else:
                    (out,) = lora_kernel.fused_add(x, [part], scale, rows.counts)
                    # A residual add of out next (o_proj's, down_proj's) makes the update in
                    # its own kernel instead, and this one is never run.
                    residual_norm.defer(out, lora_kernel.Deferred(x, part, scale, rows.counts))
            return out
        y = self.linear(x)
        # The LM head sees [rows, H]: one token per row.
        x3 = x[:, None, :] if x.ndim == 2 else x
        slots = rows.slots
        if self.kernel and self._dora is None:
            return self._kernel_update(x3, y, rows, stack)
        if stack.by_rank and x3.shape[1] > 1:
            # B's rank slice is copied: MLX's CUDA gather_mm (0.32) reads a 3-D operand whose
            # last two axes are row-contiguous with its implicit batch stride (r * out), not the
            # slice's (R * out), so a slot's rows came from other slots' (zero padding: the
            # update was lost). A's slice is copied by gather_mm itself; the copy changes no
            # number (each slot's matrix keeps its layout).
            parts = [
                (stack.a[:, :, :r], mx.contiguous(stack.b[:, :r, :]), table[slots])
                for r, table in stack.by_rank
            ]
        else:
            local = stack.local_of(slots)
            parts = [(stack.a, stack.b, local)]
        out, delta = y, None
        for a, b, local in parts:  # a row is in one part at most: the others add exact zeros
            d = self._update(x3, rows, a, b, local)
            if d.dtype != x.dtype:
                d = d.astype(x.dtype)
            if x.ndim == 2:
                d = d.reshape(y.shape)
            out = out + d
            delta = d if delta is None else delta + d
        return self._finish(x, y, slots, out, delta)

    def _finish(
        self, x: mx.array, y: mx.array, slots: mx.array, out: mx.array, delta: mx.array | None
    ) -> mx.array:
        """The rows' outputs (`out` = base + update), DoRA rows rescaled."""
        held = self._dora
        if held is None:
            return out
        factor = held.factor[slots].astype(x.dtype)
        factor = factor if x.ndim == 2 else factor[:, None, :]
        if "bias" not in self.linear:
            return factor * out  # factor 1 for LoRA rows and slot 0: exact
        # DoRA scales the product without the bias and adds it after: for DoRA rows only.
        bias = self.linear.bias
        assert delta is not None
        dora_out = factor * ((y - bias) + delta) + bias
        is_dora = held.is_dora[slots]
        return mx.where(is_dora[:, None] if x.ndim == 2 else is_dora[:, None, None], dora_out, out)


# -- projections that read one input -------------------------------------------------------------


class _Group(SharedInput):
    """Wrapped projections of one block that read the same input (`SHARED_INPUT`): their updates
    come from one `fused_add` kernel instead of one each.

    The first member called with adapter rows runs every ready member's base layer and one
    kernel for them all, returns its own output and holds the others' (`SharedInput`: taken only
    with the very same input, under the same rows and stacks; otherwise computed anew, and two
    misses in a row turn the group off). The numbers are the same either way: a member's blocks
    of the kernel do the same work whatever else the kernel holds."""

    def __init__(self, members: list[MultiLoRALinear]) -> None:
        super().__init__()
        self.members = members
        self.version = 0  # bumped when a member's stacks change (MultiLoRALinear._reindex)

    def __call__(self, member: MultiLoRALinear, x: mx.array, rows: RowAdapters) -> mx.array | None:
        """`member`'s output (base plus update) for x; None: the member computes it alone."""
        if not self.enabled:
            return None
        key = (rows, self.version)
        out = self.take(member._shared_index, x, key)
        if out is not None or not self.enabled:
            return out
        ready = [
            m
            for m in self.members
            if m.fusable()
            and m._scales is member._scales
            and m._stack is not None
            and m._stack.a.shape[1] == x.shape[-1]
        ]
        if len(ready) < 2 or not any(m is member for m in ready):
            return None
        # The base products: of fused projections (q/k/v, gate/up), one matmul whose columns
        # the kernel reads in place.
        bases = projections.columns([m.linear for m in ready], x)
        shares = [m.part(x, y, start, rows) for m, (y, start) in zip(ready, bases)]
        parts = [part for part, _ in shares]
        outs = lora_kernel.fused_add(x, parts, shares[0][1], rows.counts)
        own = None
        siblings: dict[int, mx.array] = {}
        for m, out in zip(ready, outs):
            if m is member:
                own = out
            else:
                siblings[m._shared_index] = out
        self.hold(x, key, siblings)
        return own


# -- the set --------------------------------------------------------------------------------------


class AdapterSet:
    """The adapters served on one model, by slot (slot 0 is `NO_ADAPTER`)."""

    def __init__(self, model: nn.Module, kernel: bool = False) -> None:
        """`kernel`: the wrappers add the rows' updates with the CUDA kernels
        (EngineConfig.lora_kernel; elsewhere their MLX-op reference, for tests)."""
        self.model = model
        self.kernel = kernel
        self._slots: dict[str, int] = {}
        # What GetModelInfo says of each; the weights themselves live in the stacks only.
        self._described: dict[str, AdapterDescription] = {}
        self._wrappers: dict[str, MultiLoRALinear] = {}
        self._num_slots = 1
        self._scales = _Scales()
        self._maps = _Maps()
        self._layers = layer_names(model)

    def _wrapper(self, full_name: str) -> MultiLoRALinear:
        wrapper = self._wrappers.get(full_name)
        if wrapper is None:
            module = dict(self.model.named_modules())[full_name]
            wrapper = MultiLoRALinear(module)
            wrapper._scales = self._scales
            wrapper._maps = self._maps
            wrapper.kernel = self.kernel
            wrapper.resize(self._num_slots)
            self.model.update_modules(tree_unflatten([(full_name, wrapper)]))
            self._wrappers[full_name] = wrapper
            self._regroup(full_name)
        return wrapper

    def _regroup(self, full_name: str) -> None:
        """Group the new wrapper with its wrapped siblings that read the same input."""
        parent, _, leaf = full_name.rpartition(".")
        prefix = f"{parent}." if parent else ""
        for names in SHARED_INPUT:
            if leaf not in names:
                continue
            members = [self._wrappers[prefix + n] for n in names if prefix + n in self._wrappers]
            group = _Group(members) if len(members) > 1 else None
            for index, member in enumerate(members):
                member._shared, member._shared_index = group, index

    def _prune_maps(self) -> None:
        self._maps.retain(w._stack.local for w in self._wrappers.values() if w._stack is not None)

    def add(self, adapter: Adapter, slot: int | None = None) -> int:
        """Install a checked adapter in `slot` (default: the lowest free one); returns it."""
        if adapter.name in self._slots:
            raise AdapterError(f"adapter {adapter.name!r} is already loaded")
        taken = set(self._slots.values())
        if slot is None:
            slot = next(s for s in range(1, len(taken) + 2) if s not in taken)
        if slot == NO_ADAPTER or slot in taken:
            raise ValueError(f"adapter slot {slot} is not free")
        self._num_slots = max(self._num_slots, slot + 1)
        self._scales.set(slot, adapter.scale)
        for full_name, weights in adapter.modules.items():
            self._wrapper(full_name).set_slot(slot, weights, adapter.scale, adapter.dora)
        for wrapper in self._wrappers.values():  # every wrapper can index every slot
            wrapper.resize(self._num_slots)
        self._prune_maps()
        self._slots[adapter.name] = slot
        self._described[adapter.name] = adapter.describe(self._layers)
        return slot

    def remove(self, name: str) -> int:
        """Take an adapter out; returns the slot it held (free again)."""
        slot = self._slots.pop(name)
        self._described.pop(name)
        self._scales.set(slot, 0.0)
        for wrapper in self._wrappers.values():
            wrapper.clear_slot(slot)
        self._prune_maps()
        return slot

    def name_of(self, slot: int) -> str | None:
        return next((n for n, s in self._slots.items() if s == slot), None)

    def slot(self, name: str) -> int:
        return self._slots[name]

    def rows(self, slots: np.ndarray) -> RowAdapters | None:
        """The `row_adapters` value for rows with these slots (None: no row has an adapter)."""
        if not slots.any():
            return None
        return RowAdapters(mx.array(slots.astype(np.int32)))

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def describe(self, name: str) -> AdapterDescription:
        return self._described[name]

    def descriptions(self) -> list[AdapterDescription]:
        return [self.describe(n) for n in sorted(self._slots, key=self._slots.__getitem__)]

    def memory_bytes(self) -> int:
        """What the stacks hold: every adapter, slot 0's zeros, rank padding, slot maps, DoRA
        factors."""
        return sum(w.nbytes() for w in self._wrappers.values())

    @property
    def wrappers(self) -> dict[str, MultiLoRALinear]:
        return dict(self._wrappers)

    def uninstall(self) -> None:
        """Put the base layers back."""
        if self._wrappers:
            self.model.update_modules(
                tree_unflatten([(n, w.linear) for n, w in self._wrappers.items()])
            )
        self._wrappers.clear()
        self._slots.clear()
        self._described.clear()
        self._num_slots = 1
