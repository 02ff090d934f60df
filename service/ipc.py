"""What the gRPC front ends and the engine core say to each other, over ZeroMQ, in msgpack.

Sockets (ipc:// paths in the server's run directory):
- The core binds a ROUTER (`core.sock`); each front end connects a DEALER to it and sends its
  requests, aborts and queries there; the core answers on the same socket (ready, rejections,
  stats, health).
- Each front end binds a PULL (`frontend-N.sock`); the core's engine thread connects a PUSH to
  it and sends one `Outputs` message per engine step: every row of that front end that
  produced something (new tokens and logprobs, lifecycle events, the final summary), never one
  message per token.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from service.scheduler.request import GenerationRequest, StepOutput

# -- front end -> core -------------------------------------------------------------------------


class Hello(msgspec.Struct, tag=True):
    frontend: str
    outputs: str  # the front end's PULL address


class Add(msgspec.Struct, tag=True):
    rid: str  # unique per front end and request: never the caller's request_id
    request: GenerationRequest
    trace: tuple[str, str] | None = None  # (trace_id, span_id): the core's log lines carry them


class Abort(msgspec.Struct, tag=True):
    rid: str


class StatsQuery(msgspec.Struct, tag=True):
    qid: int


ToCore = Hello | Add | Abort | StatsQuery

# -- core -> front end (ROUTER replies) ----------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    model_info: bytes  # a serialized GetModelInfoResponse
    tokenizer_dir: str  # the model's tokenizer, saved for the front ends to load
    eos_token_ids: list[int]
    slot_context: int
    capacity_tokens: int | None  # the most tokens one sequence could ever hold (None: no cap)
    pid: int = 0  # the core's process id (its process metrics)


class LoadFailed(msgspec.Struct, tag=True):
    message: str


class Rejected(msgspec.Struct, tag=True):
    rid: str
    message: str  # the waiting queue is full: RESOURCE_EXHAUSTED


class StatsReply(msgspec.Struct, tag=True):
    qid: int
    stats: bytes  # a serialized CacheStatsResponse


class Health(msgspec.Struct, tag=True):
    healthy: bool  # several engine steps in a row failed (False), or one succeeded again


FromCore = Ready | LoadFailed | Rejected | StatsReply | Health

# -- core -> front end (one message per engine step) -------------------------------------------


class Outputs(msgspec.Struct, tag=True):
    items: list[StepOutput]  # every request of the front end that produced something


_to_core = msgspec.msgpack.Decoder(ToCore)
_from_core = msgspec.msgpack.Decoder(FromCore)
_outputs = msgspec.msgpack.Decoder(Outputs)
_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct) -> bytes:
    return _encoder.encode(message)


def decode_to_core(data: bytes) -> ToCore:
    return _to_core.decode(data)


def decode_from_core(data: bytes) -> FromCore:
    return _from_core.decode(data)


def decode_outputs(data: bytes) -> Outputs:
    return _outputs.decode(data)


def core_address(run_dir: Path) -> str:
    return f"ipc://{run_dir / 'core.sock'}"


def frontend_address(run_dir: Path, index: int) -> str:
    return f"ipc://{run_dir / f'frontend-{index}.sock'}"
