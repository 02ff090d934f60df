"""Everything the server runs on, wired once: model, KV storage, engine, scheduler."""

from __future__ import annotations

import os
import time

import mlx.core as mx
import structlog
from mlx.utils import tree_flatten

from mlxserve.v1 import generation_pb2 as pb
from service.config import ConfigError, ServerConfig
from service.engine import paged_attention
from service.engine.engine import Engine, EngineSequence, StepRow
from service.engine.kv_dense import DenseKVStorage
from service.engine.kv_paged import PagedKVStorage
from service.engine.sampler import SamplingParams
from service.kv.budget import parse_budget
from service.models import activations
from service.models.loader import LoadedModel, load_model
from service.scheduler.request import SequenceStatus
from service.scheduler.scheduler import Scheduler, SchedulerConfig
from service.telemetry.telemetry import Telemetry

log = structlog.get_logger(__name__)
PAGED_BLOCK_SIZE = 16
MIRROR_MAX_BYTES = 1 << 30  # past this (big batch x long rows), decode steps gather instead
DETERMINISTIC_CHUNK = 2048

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
        self.kv_budget_unlimited = True

    def load(self) -> None:
        cfg = self.config
        started = time.monotonic()
        lm = load_model(cfg.model, cfg.dtype, cfg.load_format)
        self.loaded = lm
        self.slot_context = cfg.slot_context(lm.max_context)
        fast_mlp_layers = self._install_activations(lm)
        storage = self._make_storage(lm)
        self.engine = Engine(
            lm.model,
            storage,
            lm.num_layers,
            batched=not cfg.no_batch,
            shape_buckets=cfg.shape_buckets == "on"
            or (cfg.shape_buckets == "auto" and mx.cuda.is_available()),
            direct_decode=self._direct_decode(lm, storage),
            fault_injector=fault_injector_from_env(),
        )
        self._enable_mirror(storage)
        self._enable_in_place_decode(storage)
        self.scheduler = Scheduler(
            self.engine,
            SchedulerConfig(
                max_batch_size=cfg.batch_size,
                max_queue_depth=cfg.max_queue_depth,
                slot_context=self.slot_context,
                # Deterministic mode: the prefill plan must not depend on what else runs, so the
                # chunk size is fixed and every prompt is prefilled alone.
                prefill_chunk_size=(
                    cfg.prefill_chunk_size
                    if cfg.prefill_chunk_size is not None or not cfg.deterministic
                    else DETERMINISTIC_CHUNK
                ),
                max_batch_prefill=1 if cfg.no_batch or cfg.deterministic else self._batch_prefill(),
                max_batch_prefill_tokens=cfg.max_batch_prefill_tokens,
                prefill_grant_interval=cfg.prefill_grant_interval,
                enable_preemption=cfg.enable_preemption,
                preemption_policy=cfg.preemption_policy,
                kv_admission_watermark=cfg.kv_admission_watermark,
            ),
            decode=lm.tokenizer.decode,
            ends_mid_character=lm.tokenizer.ends_mid_character,
            # Random weights emit EOS at random: dummy models always generate to max_tokens.
            eos_token_ids=frozenset()
            if lm.model_id.startswith("dummy:")
            else lm.tokenizer.eos_token_ids,
            observer=self.telemetry.observer,
        )
        warm_up_seconds = self._warm_up()
        self.scheduler.start()
        log.info(
            "model loaded",
            model=lm.model_id,
            architecture=lm.architecture,
            dtype=str(lm.dtype),
            layers=lm.num_layers,
            decode_path=self.engine.decode_path,
            shape_buckets=self.engine.shape_buckets,
            decode_attention=self.decode_attention,
            overlap_steps=self.engine.overlap_steps,
            compiled_decode=self.engine.decode_graph is not None,
            fast_swiglu_layers=fast_mlp_layers,
            storage_backend=storage.name,
            max_batch_size=cfg.batch_size,
            slot_context=self.slot_context,
            warm_up_seconds=warm_up_seconds,
            seconds=round(time.monotonic() - started, 2),
        )
        self.serving = True

    def _warm_up(self) -> float:
        """With shape buckets or direct decode attention (CUDA by default), run the first
        prefill buckets (16 … 128 tokens) and a decode step on a throwaway sequence before
        serving: the attention plans and the decode kernel are compiled on first use (~0.6 s
        per bucket on an H200), which the first requests would otherwise wait for."""
        engine = self.engine
        if not (engine.shape_buckets or engine.direct_decode):
            return 0.0
        started = time.monotonic()
        for width in (16, 32, 64, 128):
            seq = engine.add_sequence("warm-up", SamplingParams(), [0], cache_prefix=False)
            try:
                engine.prefill([StepRow(seq, [0] * width)])
                engine.step([StepRow(seq)])
            finally:
                engine.release(seq)
        return round(time.monotonic() - started, 2)

    def _install_activations(self, lm: LoadedModel) -> int:
        """--activations: auto uses our fast SwiGLU on the CPU, where MLX's exp is slow (a
        GPU's is not); returns how many layers run it (float32 llama-family layers only)."""
        choice = self.config.activations
        if choice == "mlx" or (choice == "auto" and mx.default_device() != mx.cpu):
            return 0
        return activations.install(lm.model)

    def _batch_prefill(self) -> int:
        """--max-batch-prefill, default by device: a GPU prefills 16 short prompts in about
        the time of one, a CPU's prefill cost grows with every prompt added."""
        if self.config.max_batch_prefill is not None:
            return self.config.max_batch_prefill
        return 16 if mx.cuda.is_available() else 4

    def _direct_decode(self, lm: LoadedModel, storage: object) -> bool:
        """--decode-attention: auto reads the paged pool directly where the CUDA kernel runs
        (elsewhere the MLX-ops reference would be slower than gathering)."""
        choice = self.config.decode_attention
        if choice in ("gather", "mirror") or (
            choice == "auto" and not paged_attention.kernel_available()
        ):
            return False
        usable = (
            isinstance(storage, PagedKVStorage)
            and paged_attention.kernel_supports(lm.head_dim)
            and paged_attention.install(lm.model)
        )
        if choice == "direct" and not usable:
            raise ConfigError(
                "--decode-attention direct needs the paged backend, a llama-family model and a "
                f"head dim that is a multiple of 32 (got {lm.architecture}, {lm.head_dim})"
            )
        return usable

    def _enable_mirror(self, storage: object) -> None:
        """--decode-attention mirror (auto without the CUDA kernel): decode steps attend over a
        contiguous copy of the batch's K/V (service.engine.kv_mirror) instead of gathering it
        from the pool every step (CPU harness, C = 8 / 16: +8-14% tok/s)."""
        choice = self.config.decode_attention
        if choice not in ("auto", "mirror") or self.engine.direct_decode:
            return
        if not isinstance(storage, PagedKVStorage):
            if choice == "mirror":
                raise ConfigError("--decode-attention mirror needs the paged backend")
            return
        storage.enable_mirror(MIRROR_MAX_BYTES)

    def _enable_in_place_decode(self, storage: object) -> None:
        """Where decode steps read the pool with the CUDA kernel, they can also write it in
        place (paged_attention.store_decode_kv); MLX's functional writes would copy a layer's
        pool whenever something else still references it. That makes two things safe:
        --overlap-steps auto queues step N+1 before step N is read, as mlx-lm's generate loop
        does, and --compile-decode auto replays decode steps from compiled graphs."""
        cfg = self.config
        wanted = cfg.overlap_steps != "off" or cfg.compile_decode != "off"
        if not (wanted and self.engine.direct_decode and paged_attention.kernel_available()):
            return
        assert isinstance(storage, PagedKVStorage)
        storage.write_in_place = True
        self.engine.overlap_steps = cfg.overlap_steps != "off"
        if cfg.compile_decode != "off":
            self.engine.compile_decode_steps()

    @property
    def decode_attention(self) -> str:
        """The decode attention the engine runs: direct, mirror or gather."""
        if self.engine.direct_decode:
            return "direct"
        return "mirror" if getattr(self.engine.storage, "mirror", None) is not None else "gather"

    def _make_storage(self, lm: LoadedModel) -> DenseKVStorage | PagedKVStorage:
        """`auto` is paged: the batch view serves every mlx-lm attention model through it."""
        cfg = self.config
        if cfg.decode_storage_backend == "dense":
            return DenseKVStorage(lm.num_layers, lm.kv_heads, lm.head_dim, lm.dtype)
        bytes_per_block = PAGED_BLOCK_SIZE * 2 * lm.num_layers * lm.kv_heads * lm.head_dim
        bytes_per_block *= lm.dtype.size
        weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
        budget = parse_budget(cfg.kv_cache_budget, weights)
        # Unlimited (or huge auto) budgets are capped at what the slots could ever use twice
        # over (the rest is prefix cache); the arrays themselves grow only as blocks are used.
        slot_blocks = -(-self.slot_context // PAGED_BLOCK_SIZE)
        most = 2 * cfg.batch_size * slot_blocks
        blocks = most if budget is None else min(most, budget // bytes_per_block)
        self.kv_budget_unlimited = budget is None
        if blocks < 1:
            raise ConfigError(f"--kv-cache-budget {cfg.kv_cache_budget} holds no KV block")
        log.info(
            "KV cache budget",
            budget=cfg.kv_cache_budget,
            budget_bytes=blocks * bytes_per_block,
            blocks=blocks,
            block_size=PAGED_BLOCK_SIZE,
            tokens=blocks * PAGED_BLOCK_SIZE,
        )
        return PagedKVStorage(
            lm.num_layers,
            lm.kv_heads,
            lm.head_dim,
            lm.dtype,
            num_blocks=blocks,
            block_size=PAGED_BLOCK_SIZE,
            enable_prefix_caching=not cfg.no_prompt_cache,
        )

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> str | None:
        """Why a request can never fit the KV budget, or None."""
        capacity = self.engine.capacity_tokens()
        if capacity is not None and prompt_tokens + max_tokens > capacity:
            return (
                f"the KV cache budget holds {capacity} tokens; this request needs up to "
                f"{prompt_tokens + max_tokens} (prompt {prompt_tokens} + max_tokens {max_tokens})"
            )
        return None

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
        if isinstance(storage, PagedKVStorage):
            stats = storage.stats()
            response.block_size = stats.block_size
            response.total_blocks = stats.num_total_blocks
            response.active_blocks = stats.num_active_blocks
            response.free_blocks = stats.num_free_blocks
            response.cached_blocks = stats.num_cached_blocks
            # Allocated: holding data, in use or kept as an evictable cached prefix.
            response.allocated_blocks = stats.num_active_blocks + sum(
                1
                for b in storage.manager.pool.free_block_ids()
                if storage.manager.pool.block(b).block_hash is not None
            )
            response.used_bytes = storage.used_bytes
            response.budget_bytes = 0 if self.kv_budget_unlimited else storage.budget_bytes
            response.prefix_lookups = stats.prefix_lookups
            response.prefix_hits = stats.prefix_hits
            response.prefix_hit_tokens = stats.prefix_hit_tokens
            response.evictions = stats.evictions
        else:
            used = sum(s.engine_seq.num_cached for s in running if s.engine_seq is not None)
            response.used_bytes = used * storage.bytes_per_token
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
