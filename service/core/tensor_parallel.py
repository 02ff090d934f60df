"""Tensor parallel: N engine-core ranks of one `mx.distributed` group serve one model.

Every rank loads the model and shards it with mlx-lm's `model.shard(group)` (attention heads,
K/V heads and MLP columns split N ways; embedding and LM head replicated, so every rank computes
the same logits and samples the same tokens: no logits are gathered to one rank). Each rank
keeps its own paged pool of its K/V heads.

Rank 0 runs the scheduler, and with it the one KV cache manager: it alone decides block ids.
Its engine is a `ReplicatedEngine`: every call that changes engine state (sequences added,
released, a step submitted, dispatched, read) is sent to the other ranks, in order, before it
runs on rank 0, with the step's block tables and block update (growth, copies); the followers
(`follow`) replay the same calls on their own engines, so every rank's pool of its K/V heads
holds each sequence in the same blocks and the step graphs and collectives match rank 0's.
Commands go over ZeroMQ (one socket per follower); the model's own collectives synchronize the
forwards.

Under tensor parallel an engine failure is fatal (the ranks could no longer be kept in step):
the core exits and the front ends end every open request with UNAVAILABLE.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import zmq

from service.core.kv.block_pool import BlockUpdate
from service.protocol import SamplingParams

if TYPE_CHECKING:  # MLX is imported only once the launcher has set the group's environment
    from service.core.engine.config import EngineConfig
    from service.core.engine.engine import Engine
    from service.core.engine.storage import KVStorage

log = structlog.get_logger(__name__)


class TensorParallelError(RuntimeError):
    """The model cannot be served at this tensor-parallel size (the message says why)."""


# -- the commands ------------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    seq_id: str
    params: SamplingParams
    prompt: list[int]
    want_logprobs: bool
    top_logprobs: int
    num_cached: int  # positions adopted from the prefix cache
    resume: bool  # re-admitted after a preemption: keeps its sampler state


class Update(msgspec.Struct):
    """A BlockUpdate (service.core.kv.block_pool) on the wire."""

    capacity: int
    copies: list[tuple[int, int]]


class Release(msgspec.Struct, tag=True):
    seq_id: str
    final: bool  # False: preempted, it comes back (with its sampler state)


class Submit(msgspec.Struct, tag=True):
    step: int
    # (seq_id, tokens or None, sample, block table)
    rows: list[tuple[str, list[int] | None, bool, list[int]]]
    dispatch: bool
    update: Update | None


class Dispatch(msgspec.Struct, tag=True):
    step: int


class Finish(msgspec.Struct, tag=True):
    step: int


class Verify(msgspec.Struct, tag=True):
    # (seq_id, last token, drafted tokens, block table)
    rows: list[tuple[str, int, list[int], list[int]]]
    update: Update | None


class Stop(msgspec.Struct, tag=True):
    pass


Command = Add | Release | Submit | Dispatch | Finish | Verify | Stop
_decoder = msgspec.msgpack.Decoder(Command)
_encoder = msgspec.msgpack.Encoder()


def _wire(update: BlockUpdate | None) -> Update | None:
    return None if update is None else Update(update.capacity, list(update.copies))


def _unwire(update: Update | None) -> BlockUpdate | None:
    if update is None:
        return None
    return BlockUpdate(update.capacity, tuple((src, dst) for src, dst in update.copies))


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


class ReplicatedEngine:
    """Rank 0's engine: the local Engine, with every state-changing call sent to the
    followers first (service.core.engine.engine.ForwardEngine, what the scheduler calls)."""

    def __init__(self, engine: Engine, run_dir: Path, size: int) -> None:
        self._engine = engine
        self._context = zmq.Context()
        self._sockets = []
        for rank in range(1, size):
            socket = self._context.socket(zmq.PUSH)
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(follower_address(run_dir, rank))
            self._sockets.append(socket)
        self._steps: dict[int, int] = {}  # id(PendingStep) -> step number
        self._step = 0

    # What the scheduler and the runtime read (the same on every rank).
    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def storage(self) -> KVStorage:
        return self._engine.storage

    @property
    def batched(self) -> bool:
        return self._engine.batched

    @property
    def decode_path(self) -> str:
        return self._engine.decode_path

    def _send(self, command: Any) -> None:
        data = _encoder.encode(command)
        for socket in self._sockets:
            socket.send(data)

    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        want_logprobs: bool = False,
        top_logprobs: int = 0,
        sampler: Any = None,
        num_cached: int = 0,
    ) -> Any:
        if sampler is None and not params.greedy and params.seed is None:
            # Every rank must draw the same tokens: give the row one seed for all of them.
            params = replace(params, seed=random.getrandbits(63))
        self._send(
            Add(
                seq_id,
                params,
                list(prompt_token_ids),
                want_logprobs,
                top_logprobs,
                num_cached,
                sampler is not None,
            )
        )
        return self._engine.add_sequence(
            seq_id,
            params,
            prompt_token_ids,
            want_logprobs=want_logprobs,
            top_logprobs=top_logprobs,
            sampler=sampler,
            num_cached=num_cached,
        )

    def release(self, seq: Any, final: bool = True) -> None:
        self._send(Release(seq.seq_id, final))
        self._engine.release(seq, final)

    def submit(
        self, rows: list[Any], dispatch: bool = True, update: BlockUpdate | None = None
    ) -> Any:
        self._step += 1
        self._send(
            Submit(
                self._step,
                [
                    (
                        r.seq.seq_id,
                        None if r.tokens is None else list(r.tokens),
                        r.sample,
                        list(r.block_ids),
                    )
                    for r in rows
                ],
                dispatch,
                _wire(update),
            )
        )
        pending = self._engine.submit(rows, dispatch, update)
        self._steps[id(pending)] = self._step
        return pending

    def dispatch(self, pending: Any) -> Any:
        self._send(Dispatch(self._steps[id(pending)]))
        return self._engine.dispatch(pending)

    def finish_rows(self, pending: Any) -> list[Any]:
        self._send(Finish(self._steps.pop(id(pending))))
        return self._engine.finish_rows(pending)  # a failure raises (engine without containment)

    def verify(self, rows: list[Any], update: BlockUpdate | None = None) -> list[Any]:
        self._send(
            Verify(
                [(r.seq.seq_id, r.last_token, list(r.draft), list(r.block_ids)) for r in rows],
                _wire(update),
            )
        )
        return self._engine.verify(rows, update)

    def prefill(self, rows: list[Any], update: BlockUpdate | None = None) -> list[Any]:
        return self.finish_rows(self.submit(rows, update=update))

    def step(self, rows: list[Any], update: BlockUpdate | None = None) -> list[Any]:
        return self.finish_rows(self.submit(rows, update=update))

    def close(self) -> None:
        self._send(Stop())
        for socket in self._sockets:
            socket.close(linger=1000)
        self._context.term()


# -- the other ranks -------------------------------------------------------------------------


def follow(engine: Any, run_dir: Path, rank: int) -> None:
    """Replay rank 0's engine calls on this rank's engine until told to stop."""
    from service.core.engine.engine import DraftRow, StepRow

    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    socket.bind(follower_address(run_dir, rank))
    seqs: dict[str, Any] = {}
    samplers: dict[str, Any] = {}  # kept across a preemption, as rank 0's scheduler keeps its
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
            if isinstance(command, Add):
                seq = engine.add_sequence(
                    command.seq_id,
                    command.params,
                    command.prompt,
                    want_logprobs=command.want_logprobs,
                    top_logprobs=command.top_logprobs,
                    sampler=samplers.get(command.seq_id) if command.resume else None,
                    num_cached=command.num_cached,
                )
                seqs[command.seq_id] = seq
                samplers[command.seq_id] = seq.sampler
            elif isinstance(command, Release):
                engine.release(seqs[command.seq_id], command.final)
                if command.final:
                    del seqs[command.seq_id]
                    samplers.pop(command.seq_id, None)
            elif isinstance(command, Submit):
                rows = [
                    StepRow(seqs[s], tokens, sample, blocks)
                    for s, tokens, sample, blocks in command.rows
                ]
                pending[command.step] = engine.submit(
                    rows, command.dispatch, _unwire(command.update)
                )
            elif isinstance(command, Dispatch):
                engine.dispatch(pending[command.step])
            elif isinstance(command, Verify):
                engine.verify(
                    [
                        DraftRow(seqs[s], last, draft, blocks)
                        for s, last, draft, blocks in command.rows
                    ],
                    _unwire(command.update),
                )
            elif isinstance(command, Finish):
                for result in engine.finish_rows(pending.pop(command.step)):
                    if result.error is not None:
                        raise RuntimeError(f"rank {rank}: a step failed: {result.error}")
    finally:
        socket.close(linger=0)
        context.term()
