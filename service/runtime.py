"""Everything the server runs on, wired once: model, KV storage, engine, scheduler."""

from __future__ import annotations

import os
import time

import mlx.core as mx
import structlog

from mlxserve.v1 import generation_pb2 as pb
from service.config import ServerConfig
from service.engine.engine import Engine, EngineSequence
from service.engine.kv_dense import DenseKVStorage
from service.models.loader import LoadedModel, load_model
from service.scheduler.request import SequenceStatus
from service.scheduler.scheduler import Scheduler, SchedulerConfig
from service.telemetry.telemetry import Telemetry

log = structlog.get_logger(__name__)

_SLOT_STATE = {
    SequenceStatus.PREFILLING: pb.SLOT_STATE_PREFILLING,
    SequenceStatus.DECODING: pb.SLOT_STATE_DECODING,
}


def fault_injector_from_env() -> object | None:
    """Test hook: MLXSERVE_INJECT_FAULT=marker makes every evaluation of a request whose id
    contains the marker fail at the evaluation boundary, as a device error would."""
    marker = os.environ.get("MLXSERVE_INJECT_FAULT")
    if not marker:
        return None

    def inject(seq: EngineSequence) -> bool:
        return marker in seq.seq_id

    return inject


class Runtime:
    def __init__(self, config: ServerConfig, telemetry: Telemetry | None = None) -> None:
        self.config = config
        self.telemetry = telemetry or Telemetry()  # default: all off
        self.serving = False
        self.draining = False
        self.loaded: LoadedModel | None = None
        self.scheduler: Scheduler | None = None
        self.slot_context = 0

    def load(self) -> None:
        cfg = self.config
        started = time.monotonic()
        lm = load_model(cfg.model, cfg.dtype, cfg.load_format)
        self.loaded = lm
        self.slot_context = cfg.slot_context(lm.max_context)
        storage = DenseKVStorage(lm.num_layers, lm.kv_heads, lm.head_dim, lm.dtype)
        self.engine = Engine(
            lm.model,
            storage,
            lm.num_layers,
            batched=not cfg.no_batch,
            fault_injector=fault_injector_from_env(),
        )
        self.scheduler = Scheduler(
            self.engine,
            SchedulerConfig(
                max_batch_size=cfg.batch_size,
                max_queue_depth=cfg.max_queue_depth,
                slot_context=self.slot_context,
                prefill_chunk_size=cfg.prefill_chunk_size,
                max_batch_prefill=1 if cfg.no_batch else cfg.max_batch_prefill,
                max_batch_prefill_tokens=cfg.max_batch_prefill_tokens,
                prefill_grant_interval=cfg.prefill_grant_interval,
                enable_preemption=cfg.enable_preemption,
                preemption_policy=cfg.preemption_policy,
            ),
            decode=lm.tokenizer.decode,
            ends_mid_character=lm.tokenizer.ends_mid_character,
            # Random weights emit EOS at random: dummy models always generate to max_tokens.
            eos_token_ids=frozenset()
            if lm.model_id.startswith("dummy:")
            else lm.tokenizer.eos_token_ids,
            observer=self.telemetry.observer,
        )
        self.scheduler.start()
        log.info(
            "model loaded",
            model=lm.model_id,
            architecture=lm.architecture,
            dtype=str(lm.dtype),
            layers=lm.num_layers,
            decode_path=self.engine.decode_path,
            storage_backend=storage.name,
            max_batch_size=cfg.batch_size,
            slot_context=self.slot_context,
            seconds=round(time.monotonic() - started, 2),
        )
        self.serving = True

    def load_in_thread(self) -> None:
        """`load` for a worker thread: MLX wants the thread's streams released when done."""
        try:
            self.load()
        finally:
            mx.clear_streams()

    @property
    def tokenizer(self):
        assert self.loaded is not None
        return self.loaded.tokenizer

    def unavailable_reason(self) -> str:
        return "server is draining" if self.draining else "model is loading"

    def metrics_rejected(self, reason: str) -> None:
        """A request refused before queueing (queue_full, invalid_argument, ...)."""
        self.telemetry.rejected(reason)

    def cache_stats(self) -> pb.CacheStatsResponse:
        sched = self.scheduler
        response = pb.CacheStatsResponse(
            slot_context_tokens=self.slot_context, max_batch_size=self.config.batch_size
        )
        if sched is None:
            return response
        storage = self.engine.storage
        response.storage_backend = storage.name
        response.reserved_bytes = storage.reserved_bytes
        running = sched.snapshot()
        used_tokens = sum(s.engine_seq.num_cached for s in running if s.engine_seq is not None)
        response.used_bytes = used_tokens * storage.bytes_per_token
        response.active_sequences = len(running)
        response.queued_requests = sched.queue_depth
        response.total_completed = sched.stats.total_completed
        response.preemptions = sched.stats.preemptions
        for seq in running:
            if seq.status not in _SLOT_STATE:
                continue
            response.slots.append(
                pb.SlotInfo(
                    request_id=seq.request_id,
                    state=_SLOT_STATE[seq.status],
                    generated_tokens=seq.num_generated,
                    context_tokens=seq.engine_seq.num_cached if seq.engine_seq else 0,
                    priority=seq.request.priority,
                )
            )
        return response

    def model_info(self) -> pb.GetModelInfoResponse:
        lm = self.loaded
        if lm is None:
            return pb.GetModelInfoResponse()
        return pb.GetModelInfoResponse(
            model_id=lm.model_id,
            architecture=lm.architecture,
            vocab_size=lm.vocab_size,
            num_layers=lm.num_layers,
            dtype=str(lm.dtype).removeprefix("mlx.core."),
            eos_token_ids=sorted(lm.tokenizer.eos_token_ids),
            decode_path=self.engine.decode_path,
            slot_context_tokens=self.slot_context,
            max_batch_size=self.config.batch_size,
            storage_backend=self.engine.storage.name,
        )

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.stop()
