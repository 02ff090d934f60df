"""Tensor parallel: N engine-core ranks of one `mx.distributed` group serve one model.

Every rank loads the model and shards it with mlx-lm's `model.shard(group)` (attention heads,
K/V heads and MLP columns split N ways; embedding and LM head replicated, so every rank computes
the same logits and samples the same tokens: no logits are gathered to one rank). Each rank
keeps its own paged pool of its K/V heads.

Rank 0 runs the scheduler, and with it the one KV cache manager: it alone decides block ids.
Its runner is a `ReplicatedRunner`: each step's plan (service.core.scheduler.plan: rows joining
and leaving, changed block tables, the block update, the forwards) is sent to the other ranks
before it runs on rank 0, and so is each dispatch, sampling under token masks (structured
output: rank 0 keeps the grammars and fills the masks) and read of it; the followers (`follow`)
replay them on their own runners, so every rank's pool of its K/V heads holds each sequence in
the same blocks and the step graphs and collectives match rank 0's. Commands go over ZeroMQ
(one socket per follower); the model's own collectives synchronize the forwards.

LoRA adapters are loaded on every rank into the same slots (at start, and at run time by a
command rank 0 sends before it loads), each rank holding its shard of every layer's update
(service.core.models.lora); rows name their adapter's slot in the plan.

Under tensor parallel an engine failure is fatal (the ranks could no longer be kept in step):
the core exits and the front ends end every open request with UNAVAILABLE.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import zmq

from service.core.scheduler.plan import RowMasks, StepPlan, StepResult

if TYPE_CHECKING:  # MLX is imported only once the launcher has set the group's environment
    from service.core.engine.config import EngineConfig
    from service.core.engine.runner import ModelRunner
    from service.core.engine.storage import KVStorage
    from service.core.models.lora import AdapterSet
    from service.protocol import AdapterDescription

log = structlog.get_logger(__name__)


class TensorParallelError(RuntimeError):
    """The model cannot be served at this tensor-parallel size (the message says why)."""


# -- the commands ------------------------------------------------------------------------------


class Submit(msgspec.Struct, tag=True):
    plan: StepPlan
    dispatch: bool


class Dispatch(msgspec.Struct, tag=True):
    step: int


class Sample(msgspec.Struct, tag=True):
    step: int
    masks: RowMasks


class Collect(msgspec.Struct, tag=True):
    step: int


class LoadAdapter(msgspec.Struct, tag=True):
    name: str
    path: str
    slot: int


class Stop(msgspec.Struct, tag=True):
    pass


Command = Submit | Dispatch | Sample | Collect | LoadAdapter | Stop
_decoder = msgspec.msgpack.Decoder(Command)
_encoder = msgspec.msgpack.Encoder()


def follower_address(run_dir: Path, rank: int) -> str:
    return f"ipc://{run_dir / f'rank-{rank}.sock'}"


# -- the group -------------------------------------------------------------------------------


def init_group(backend: str) -> Any:
    """This process's `mx.distributed` group (the launcher set MLX_RANK and the backend's
    variables before MLX was imported)."""
    import mlx.core as mx

    return mx.distributed.init(backend=backend, strict=True)


def check_shardable(model: Any, family_ok: bool, heads: int, kv_heads: int, size: int) -> None:
    """Refuse, with the reason, a model this tensor-parallel size cannot split."""
    if not family_ok:
        raise TensorParallelError(
            f"the {type(model).__module__.rsplit('.', 1)[-1]} family has no tensor-parallel"
            " sharding in mlx-lm"
        )
    if heads % size or kv_heads % size:
        raise TensorParallelError(
            f"{heads} attention heads and {kv_heads} K/V heads do not split {size} ways"
        )


def agree(value: int, group: Any) -> int:
    """Rank 0's value on every rank (one small collective): e.g. the pool size, which rank 0
    derives from its free memory."""
    import mlx.core as mx

    mine = value if group.rank() == 0 else 0
    total = mx.distributed.all_sum(mx.array([mine], dtype=mx.int64), group=group)
    return int(total.item())


# -- rank 0 ------------------------------------------------------------------------------------


class ReplicatedRunner:
    """Rank 0's runner: the local ModelRunner, with every plan, dispatch and read sent to the
    followers first (service.core.loop.Runner, what the loop calls)."""

    def __init__(self, runner: ModelRunner, run_dir: Path, size: int) -> None:
        self._runner = runner
        self._context = zmq.Context()
        self._sockets = []
        for rank in range(1, size):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(follower_address(run_dir, rank))
            self._sockets.append(socket)

    # What the runtime reads (the same on every rank).
    @property
    def config(self) -> EngineConfig:
        return self._runner.config

    @property
    def storage(self) -> KVStorage:
        return self._runner.storage

    @property
    def decode_path(self) -> str:
        return self._runner.decode_path

    @property
    def adapters(self) -> AdapterSet | None:
        return self._runner.adapters

    def _send(self, command: Any) -> None:
        data = _encoder.encode(command)
        for socket in self._sockets:
            socket.send(data)

    def submit(self, plan: StepPlan, dispatch: bool = True) -> Any:
        for join in plan.joins:
            params = join.params
            if not params.greedy and params.seed is None and not join.resume:
                # Every rank must draw the same tokens: give the row one seed for all of them.
                join.params = replace(params, seed=random.getrandbits(63))
        self._send(Submit(plan, dispatch))
        return self._runner.submit(plan, dispatch)

    def dispatch(self, pending: Any) -> Any:
        self._send(Dispatch(pending.plan.step))
        return self._runner.dispatch(pending)

    def take_prefill(self, pending: Any) -> StepResult:
        """The prefill forwards' results: read at submit on every rank; no command."""
        return self._runner.take_prefill(pending)

    def sample(self, pending: Any, masks: RowMasks) -> Any:
        self._send(Sample(pending.plan.step, masks))
        return self._runner.sample(pending, masks)

    def stage_masks(self, pending: Any, masks: RowMasks) -> None:
        """Local only: the masks still go to every rank with `sample`."""
        self._runner.stage_masks(pending, masks)

    def collect(self, pending: Any) -> StepResult:
        self._send(Collect(pending.plan.step))
        return self._runner.collect(pending)  # a failure raises (no containment here)

    def read_beside(self, pending: Any) -> StepResult | None:
        """Never: every read is a command the other ranks follow, sent from the loop thread
        (the runtime does not read beside a dispatch under tensor parallel)."""
        return None

    def load_adapter(self, name: str, path: str, slot: int) -> AdapterDescription:
        """Every rank loads it into the same slot, its shard of each layer's update."""
        self._send(LoadAdapter(name, path, slot))
        return self._runner.load_adapter(name, path, slot)

    def close(self) -> None:
        self._send(Stop())
        for socket in self._sockets:
            socket.close(linger=1000)
        self._context.term()


# -- the other ranks -------------------------------------------------------------------------


def follow(runner: Any, run_dir: Path, rank: int) -> None:
    """Replay rank 0's plans on this rank's runner until told to stop."""
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.bind(follower_address(run_dir, rank))
    pending: dict[int, Any] = {}
    parent = os.getppid()
    try:
        while True:
            if not socket.poll(1000):
                if os.getppid() != parent:
                    return  # the server is gone
                continue
            command = _decoder.decode(socket.recv())
            if isinstance(command, Stop):
                return
            if isinstance(command, Submit):
                pending[command.plan.step] = runner.submit(command.plan, command.dispatch)
            elif isinstance(command, Dispatch):
                runner.dispatch(pending[command.step])
            elif isinstance(command, Sample):
                runner.sample(pending[command.step], command.masks)
            elif isinstance(command, Collect):
                result = runner.collect(pending.pop(command.step))
                if result.errors:
                    raise RuntimeError(f"rank {rank}: a step failed: {result.errors}")
            elif isinstance(command, LoadAdapter):
                from service.common.model_source import ModelLoadError

                try:
                    runner.load_adapter(command.name, command.path, command.slot)
                except ModelLoadError as exc:
                    # Rank 0 read the same files and refused them too: nothing to follow.
                    log.warning("adapter refused", rank=rank, error=str(exc))
    finally:
        socket.close(linger=0)
        context.term()
