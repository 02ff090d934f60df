"""The engine core's contents, wired once: model, engine config, KV storage and manager, model
runner, scheduler and the loop that drives them.

Lives in the engine-core process (service.core.server), or in-process for `python -m service
generate`. The loop thread is the only one that touches the scheduler and the runner; other
threads talk to it through the loop's inbox, and read only what does not change once loaded
(the model's description)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import structlog
from mlx.utils import tree_flatten

from service.common import grammar
from service.common.config import GPU_PREFILL_TOKENS, ConfigError, CoreConfig
from service.common.os_thread import ENGINE_THREAD, name_this_thread
from service.common.tokenizer import Tokenizer
from service.core import warm_up
from service.core.engine import paged_attention
from service.core.engine.config import EngineConfig, resolve
from service.core.engine.memory import release_freed_memory
from service.core.engine.runner import FaultInjector, ModelRunner, Row
from service.core.engine.sampler import apply_token_masks
from service.core.engine.storage import PoolShape, bytes_per_block, make_storage
from service.core.kv.block_pool import KVCacheManager, KVCacheStats, KVManager, UnpagedKV
from service.core.kv.budget import available_memory_bytes, parse_budget
from service.core.loop import CoreLoop, slot_views
from service.core.models import (
    activations,
    decode_gemm,
    lora,
    norms,
    projections,
    quantized,
    residual_norm,
    rope,
)
from service.core.models.families import Family, family
from service.core.models.layout import CacheLayout, UnsupportedModelError, probe_layout
from service.core.models.loader import LoadedModel, ModelLoadError, load_model, model_arg
from service.core.scheduler.adapters import AdapterTable
from service.core.scheduler.constraints import Constraints
from service.core.scheduler.request import Request
from service.core.scheduler.scheduler import Scheduler, SchedulerConfig, SpeculationConfig
from service.core.tensor_parallel import (
    ReplicatedRunner,
    TensorParallelError,
    agree,
    check_shardable,
    init_group,
)
from service.protocol import (
    FORMAT_KINDS,
    AdapterDescription,
    CacheCounters,
    GrammarCounters,
    ModelInfo,
    Quantization,
    Speculation,
    StepCounters,
    StructuredOutputInfo,
)

log = structlog.get_logger(__name__)
PAGED_BLOCK_SIZE = 16
SPECULATION_MAX_CONTEXT = 4608  # whole context at most for a verification round (paged)
DETERMINISTIC_CHUNK = 2048


def fault_injector_from_env() -> FaultInjector | None:
    """Test hook: MLXSERVE_INJECT_FAULT is a comma-separated list of markers. A request whose id
    contains a marker fails at the evaluation boundary, as a device error would; with the
    prefix `build:`, it fails while its forward is built, as a model-code error would."""
    spec = os.environ.get("MLXSERVE_INJECT_FAULT")
    if not spec:
        return None
    markers = [m.strip() for m in spec.split(",") if m.strip()]
    build = [m.removeprefix("build:") for m in markers if m.startswith("build:")]
    evaluate = [m for m in markers if not m.startswith("build:")]

    def inject(row: Row, stage: str) -> bool:
        return any(m in row.seq_id for m in (build if stage == "build" else evaluate))

    return inject


@dataclass
class _Snapshot:
    """What the loop publishes after each turn for stats queries."""

    running: list[Request] = field(default_factory=list)
    context: Callable[[Request], int] = lambda seq: 0
    queued: int = 0
    completed: int = 0
    failed: int = 0
    preemptions: int = 0
    kv: KVCacheStats | None = None
    free_cached: int = 0


class Runtime:
    def __init__(self, config: CoreConfig, run_dir: Path | None = None) -> None:
        """run_dir: where the ranks' sockets live (tensor parallel)."""
        self.config = config
        self.run_dir = run_dir or Path(".")
        # Tensor parallel: this process's rank of the mx.distributed group (service.launcher
        # set the backend's environment before MLX was imported).
        model = config.model
        self.group = init_group(model.resolved_backend()) if model.tensor_parallel > 1 else None
        self.rank = self.group.rank() if self.group is not None else 0
        self.serving = False
        self.loaded: LoadedModel | None = None
        self.layout: CacheLayout | None = None
        self.engine_config: EngineConfig | None = None
        self.runner: ModelRunner | ReplicatedRunner | None = None
        self.scheduler: Scheduler | None = None
        self.loop: CoreLoop | None = None
        self.slot_context = 0
        self.batch_size = config.scheduling.batch_size  # 1 for a model that cannot batch
        self.kv_budget_unlimited = True
        # Told (from the loop thread) when the engine turns unhealthy or healthy again, and
        # when a request's final output has been delivered.
        self.on_engine_health: Callable[[bool], object] | None = None
        self.on_request_finished: Callable[[Request], None] | None = None
        # Told (from the loop thread) of a request refused because its adapter is no longer
        # served, and when the served adapters changed.
        self.on_request_rejected: Callable[[Request, str], None] | None = None
        self.on_adapters_changed: Callable[[list[AdapterDescription]], None] | None = None
        # Told (from the loop thread) of the model's tokenizer as soon as it is loaded, before
        # the weights where the loader can: the front ends load it meanwhile.
        self.on_tokenizer: Callable[[Tokenizer], object] | None = None
        # The adapters requests may use, as GetModelInfo lists them: replaced as a whole on the
        # loop thread, read from others.
        self.served_adapters: list[AdapterDescription] = []
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        # The scheduler's KV manager; the same object typed as the paged pool's, or None.
        self.kv: KVManager = UnpagedKV()
        self.block_manager: KVCacheManager | None = None
        self.bytes_per_block = 0
        self._snapshot = _Snapshot()
        # Structured output: response formats compiled before admission (None: the model's
        # tokenizer cannot drive the grammar engine).
        self.grammar: grammar.GrammarCache | None = None

    # -- start-up --------------------------------------------------------------------
    def start(self) -> None:
        """Load and serve on one thread: MLX binds arrays and compiled graphs to the streams of
        the thread that makes them, so the thread that loads the model (and evaluates what
        mlx-lm creates lazily) is the one that runs every forward."""
        self._thread = threading.Thread(target=self._main, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    @property
    def engine_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def load_error(self) -> BaseException | None:
        """What loading raised, once the loop thread has ended; else None."""
        if self._load_error is not None and self._thread is not None:
            self._thread.join()
        return self._load_error

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until the model is loaded; raises what loading raised (once the loop thread
        has ended: MLX aborts a process that exits while a thread still holds its streams)."""
        self._ready.wait(timeout)
        if self._load_error is not None:
            if self._thread is not None:
                self._thread.join()
            raise self._load_error

    def _main(self) -> None:
        try:
            self.load()
        except BaseException as exc:
            self._load_error = exc
            mx.clear_streams()
            self._ready.set()
            return
        # Named for the OS only now: a thread takes its creator's OS name, and MLX's stream
        # threads, made while loading, should keep the process's.
        name_this_thread(ENGINE_THREAD)
        self._ready.set()
        assert self.loop is not None
        try:
            self.loop.run()
        finally:
            # MLX wants each thread that used it to release its streams before exiting
            # (otherwise the process can abort at exit).
            mx.clear_streams()

    def load(self) -> None:
        """Load the model and build storage, runner, scheduler and loop on the calling thread
        (which then serves: `start` does both on the loop thread)."""
        started = time.monotonic()
        lm = self._load_model()
        fam = family(lm.family)
        engine_config = self._engine_config(lm, fam)
        if engine_config.dequantize_weights:
            self._dequantize(lm)  # first: the float layers then take the swaps below
        fast_mlp_layers = activations.install(lm.model) if engine_config.fast_swiglu else 0
        if engine_config.shared_rope_angles:
            rope.share_angles(lm.model, lm.dtype)
        compiled_norms = norms.install(lm.model) if engine_config.compiled_norms else 0
        if engine_config.rope_in_kernels:
            rope.defer(lm.model)
        fused_groups = projections.fuse(lm.model) if engine_config.fused_projections else 0
        if fused_groups:
            release_freed_memory()  # the members' own weights, now views of their groups'
        if engine_config.decode_gemm:
            decode_gemm.install(lm.model)  # after fusing: a group's one product takes it
        if engine_config.fused_add_norm:
            residual_norm.install(lm.model)
        if engine_config.fold_quantized_rows:
            quantized.fold_rows(lm.model)  # after fusing: the fused members fold in their group
        # After the MLPs' swap (it recognizes the projections as plain nn.Linear) and the fusing
        # (adapters wrap the fused members, whose base products their group computes once).
        adapters = self._load_adapters(lm, engine_config.lora_kernel)
        self.runner = self._build_runner(lm, fam, engine_config, adapters)
        if self.group is not None and self.rank > 0:
            # A follower: no scheduler; it replays rank 0's plans (tensor_parallel).
            self.serving = True
            return
        if self.group is not None:
            assert isinstance(self.runner, ModelRunner)
            self.runner = ReplicatedRunner(self.runner, self.run_dir, self.group.size())
        self.grammar = self._grammar_cache(lm)
        self.scheduler = self._build_scheduler(engine_config, adapters)
        self.served_adapters = adapters.descriptions()
        self.loop = CoreLoop(
            self.scheduler,
            self.runner,
            overlap_steps=engine_config.overlap_steps,
            # Tensor parallel: every read is one the other ranks follow, on this thread.
            update_beside_dispatch=engine_config.update_beside_dispatch and self.group is None,
            on_turn=self._publish,
            on_finished=self.on_request_finished,
            # Tensor parallel: the other ranks cannot follow a step rank 0 gave up on.
            fatal_errors=self.group is not None,
            on_rejected=self._request_rejected,
            on_adapters_changed=self._adapters_changed,
        )
        warm_up_seconds = self._warm_up(engine_config)
        if self.grammar is not None:
            # The token-mask kernel is compiled on first use (on the CPU, by the system's C++
            # compiler): now, not on the first constrained request.
            logits = mx.zeros((1, self.loaded.vocab_size), lm.dtype)
            mx.eval(apply_token_masks(logits, np.full((1, 1), -1, np.int32)))
        self._publish(self.scheduler)  # stats before the first turn: the pool as built
        self._log_loaded(
            lm,
            fam,
            engine_config,
            {
                "fast_swiglu_layers": fast_mlp_layers,
                "compiled_norms": compiled_norms,
                "fused_projection_groups": fused_groups,
            },
            warm_up_seconds,
            started,
        )
        self.serving = True

    def _load_model(self) -> LoadedModel:
        cfg = self.config
        lm = load_model(cfg.model.path, cfg.model.dtype, cfg.model.load_format, self.on_tokenizer)
        if self.group is not None:
            self._shard(lm)
        try:
            layout = probe_layout(lm.model)
        except UnsupportedModelError as exc:
            raise ModelLoadError(
                f"{lm.model_id} ({lm.architecture}) cannot be served: {exc}"
            ) from exc
        self.loaded, self.layout = lm, layout
        self.slot_context = cfg.slot_context(lm.max_context)
        if layout.native and self.group is not None:
            raise ModelLoadError(
                f"{lm.model_id}: tensor parallel needs caches the engine can view"
                f" ({layout.native_reason})"
            )
        if layout.native:
            # Served as mlx-lm runs it alone, one sequence at a time.
            self.batch_size = 1
            log.warning(
                f"Model {lm.model_id} does not support batched decode; clamping max_batch_size"
                f" from {cfg.scheduling.batch_size} to 1",
                reason=layout.native_reason,
            )
        return lm

    def _load_adapters(self, lm: LoadedModel, kernel: bool) -> lora.AdapterSet:
        """--adapter: every adapter read and checked against the model before any is
        installed (AdapterError, a ModelLoadError: the server refuses to start, saying why)."""
        adapters = lora.AdapterSet(lm.model, kernel=kernel)
        specs = self.config.model.adapters
        for adapter in [lora.load_adapter(name, path, lm.model) for name, path in specs]:
            adapters.add(adapter)
        if specs:
            release_freed_memory()  # the files' tensors, copied into the stacks
            log.info(
                "adapters loaded",
                adapters=[
                    {"name": d.name, "rank": d.rank, "memory_bytes": d.memory_bytes}
                    for d in adapters.descriptions()
                ],
                stack_bytes=adapters.memory_bytes(),
            )
        return adapters

    def _request_rejected(self, seq: Request, message: str) -> None:
        if self.on_request_rejected is not None:
            self.on_request_rejected(seq, message)

    def _adapters_changed(self) -> None:
        """On the loop thread, after a load or the start of an unload."""
        runner, scheduler = self.runner, self.scheduler
        assert runner is not None and scheduler is not None and runner.adapters is not None
        self.served_adapters = [runner.adapters.describe(n) for n in scheduler.adapters.served]
        if self.on_adapters_changed is not None:
            self.on_adapters_changed(self.served_adapters)

    def _dequantize(self, lm: LoadedModel) -> None:
        """Dequantize the model's quantized layers if their float weights take at most half the
        free memory; otherwise keep them, and say what that costs."""
        extra = quantized.dequantized_extra_bytes(lm.model)
        if extra <= 0:
            return
        available = available_memory_bytes()
        if extra > available // 2:
            log.warning(
                "quantized weights kept: dequantized they would take more than half the free"
                " memory, and MLX's CPU quantized matmul computes one row at a time",
                extra_bytes=extra,
                available_bytes=available,
            )
            return
        layers = quantized.dequantize(lm.model)
        lm.quantization = replace(lm.quantization, dequantized=True)
        release_freed_memory()  # the packed weights
        log.info("quantized weights dequantized for the CPU", layers=layers, extra_bytes=extra)

    def _engine_config(self, lm: LoadedModel, fam: Family) -> EngineConfig:
        cfg = self.config
        assert self.layout is not None
        backend = cfg.kv.decode_storage_backend
        if backend == "auto":
            backend = "paged" if fam.verified else "dense"
        self.engine_config = resolve(
            fam,
            self.layout,
            paged=backend == "paged",
            batched=not cfg.scheduling.no_batch and fam.verified,
            head_dim_supported=paged_attention.kernel_supports(self.layout.head_dim),
            float32=lm.dtype == mx.float32,
            grouped_heads=lm.num_heads > self.layout.kv_heads,
            compilable=not rope.reads_offsets_on_host(lm.model),
        )
        return self.engine_config

    def _build_runner(
        self,
        lm: LoadedModel,
        fam: Family,
        engine_config: EngineConfig,
        adapters: lora.AdapterSet | None = None,
    ) -> ModelRunner:
        layout = self.layout
        assert layout is not None
        pool = self._pool_shape(lm, layout) if engine_config.paged else None
        storage = make_storage(engine_config, lm.model, layout, pool)
        if pool is not None:
            self.block_manager = KVCacheManager(
                pool.num_blocks,
                pool.block_size,
                # A recurrent state cannot be rebuilt from shared K/V blocks.
                enable_prefix_caching=not self.config.kv.no_prompt_cache and not layout.stateful,
                capacity=min(pool.num_blocks, pool.initial_blocks),
            )
            self.kv = self.block_manager
        max_blocks = -(-(self.slot_context + 64) // PAGED_BLOCK_SIZE) if pool is not None else 0
        return ModelRunner(
            lm.model,
            storage,
            layout,
            engine_config,
            max_rows=self.batch_size,
            max_blocks_per_row=max_blocks,
            split_head=fam.split_head,
            fault_injector=fault_injector_from_env(),
            contain_failures=self.group is None,
            adapters=adapters,
        )

    def _grammar_cache(self, lm: LoadedModel) -> grammar.GrammarCache | None:
        """The compile cache of response formats. EOS: the tokenizer's (a dummy model's are
        ignored by the scheduler, but a grammar still needs them to end)."""
        cache = grammar.cache_for(
            lm.tokenizer, lm.vocab_size, self.config.structured, lexers=grammar.mask_threads()
        )
        if cache is None:
            log.warning("structured output is off: the tokenizer cannot drive the grammar engine")
        return cache

    def _build_scheduler(
        self, engine_config: EngineConfig, adapters: lora.AdapterSet | None = None
    ) -> Scheduler:
        cfg = self.config.scheduling
        assert self.layout is not None and self.loaded is not None
        deterministic = cfg.deterministic
        gpu = mx.cuda.is_available()
        prefill_rows, prefill_tokens = cfg.prefill_limits(gpu)
        table = AdapterTable()
        for name in adapters.names if adapters is not None else []:
            table.add(name, adapters.slot(name))
        return Scheduler(
            SchedulerConfig(
                max_batch_size=self.batch_size,
                max_queue_depth=cfg.max_queue_depth,
                slot_context=self.slot_context,
                # Deterministic mode: the prefill plan must not depend on what else runs, so the
                # chunk size is fixed and every prompt is prefilled alone.
                prefill_chunk_size=(
                    cfg.prefill_chunk_size
                    if cfg.prefill_chunk_size is not None or not deterministic
                    else DETERMINISTIC_CHUNK
                ),
                max_prefill_stall_ms=cfg.max_prefill_stall_ms,
                max_batch_prefill=1
                if cfg.no_batch or deterministic or engine_config.single_row_prefill
                else prefill_rows,
                max_batch_prefill_tokens=prefill_tokens,
                prefill_grant_interval=cfg.prefill_grant_interval,
                enable_preemption=cfg.enable_preemption,
                preemption_policy=cfg.preemption_policy,
                kv_admission_watermark=self.config.kv.kv_admission_watermark,
                speculation=self._speculation(self.layout, engine_config.paged),
                last_token_alone=engine_config.native_caches,
            ),
            self.eos_token_ids,
            kv=self.kv,
            batched=engine_config.batched,
            on_health=self._engine_health,
            constraints=Constraints(
                self.batch_size, self.loaded.vocab_size, self.loaded.tokenizer.eos_token_ids
            )
            if self.grammar is not None
            else None,
            adapters=table,
        )

    def _log_loaded(
        self,
        lm: LoadedModel,
        fam: Family,
        engine_config: EngineConfig,
        swapped: dict[str, int],
        warm_up_seconds: float,
        started: float,
    ) -> None:
        assert self.layout is not None and self.runner is not None
        self._log_decode_path(lm, fam.verified)
        log.info(
            "model loaded",
            model=lm.model_id,
            architecture=lm.architecture,
            family=lm.family,
            dtype=str(lm.dtype),
            quantization=lm.quantization.describe(),
            layers=self.layout.describe(),
            decode_path=engine_config.decode_path,
            storage_backend=self.runner.storage.name,
            decode_attention=engine_config.decode_attention,
            overlap_steps=engine_config.overlap_steps,
            update_beside_dispatch=engine_config.update_beside_dispatch,
            compiled_decode=engine_config.compile_decode,
            shape_buckets=engine_config.shape_buckets,
            **swapped,
            max_batch_size=self.batch_size,
            slot_context=self.slot_context,
            warm_up_seconds=warm_up_seconds,
            seconds=round(time.monotonic() - started, 2),
        )

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """What ends a generation. Random weights emit EOS at random: dummy models always
        generate to max_tokens."""
        lm = self.loaded
        if lm is None or lm.model_id.startswith("dummy:"):
            return frozenset()
        return lm.tokenizer.eos_token_ids

    def _engine_health(self, healthy: bool) -> None:
        if self.on_engine_health is not None:
            self.on_engine_health(healthy)

    def _speculation(self, layout: CacheLayout, paged: bool) -> SpeculationConfig | None:
        """--draft-kind prompt-lookup, where drafts can be rolled back (attention caches)."""
        cfg = self.config.scheduling
        if cfg.draft_kind == "none":
            return None
        if layout.stateful or layout.native:
            log.warning(
                "speculative decoding is off for this model: a recurrent state or native cache"
                " cannot roll back rejected drafts"
            )
            return None
        return SpeculationConfig(
            num_draft_tokens=cfg.num_draft_tokens,
            max_batch=cfg.prompt_lookup_max_batch,
            min_ngram=cfg.prompt_lookup_min_ngram,
            max_ngram=cfg.prompt_lookup_max_ngram,
            # Paged storage gathers a row's whole context for a verification forward.
            max_context=SPECULATION_MAX_CONTEXT if paged else None,
        )

    def _shard(self, lm: LoadedModel) -> None:
        """Split the model's heads and MLP over the group (mlx-lm's `model.shard`)."""
        assert self.group is not None
        fam = family(lm.family)
        kv_heads = model_arg(lm.model.args, "num_key_value_heads") or lm.num_heads
        try:
            check_shardable(
                lm.model, fam.tensor_parallel, lm.num_heads, kv_heads, self.group.size()
            )
        except TensorParallelError as exc:
            raise ModelLoadError(
                f"{lm.model_id} cannot be served at --tensor-parallel {self.group.size()}: {exc}"
            ) from exc
        lm.model.shard(self.group)
        mx.eval(lm.model.parameters())
        log.info(
            "model sharded",
            rank=self.rank,
            tensor_parallel=self.group.size(),
            heads_per_rank=lm.num_heads // self.group.size(),
            kv_heads_per_rank=kv_heads // self.group.size(),
        )

    def _log_decode_path(self, lm: LoadedModel, verified: bool) -> None:
        """The start-up line that says how this model's decode steps run."""
        if self.config.scheduling.no_batch:
            log.info(f"Model {lm.model_id} decode path: sequential worker (--no-batch)")
        elif self.layout is not None and self.layout.native:
            return  # the clamping line said it
        elif verified:
            log.info(f"Model {lm.model_id} decode path: native batched forward")
        else:
            log.warning(
                f"Model {lm.model_id} decode path: per-row fallback (aggregate decode throughput"
                " will not scale with --parallel)",
                family=lm.family,
                reason="family not verified against mlx-lm's batched output",
            )

    @property
    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence could ever hold (the paged pool); None: no budget."""
        manager = self.block_manager
        return manager.capacity_tokens if manager is not None else None

    def _warm_up(self, config: EngineConfig) -> float:
        """With shape buckets or direct decode attention (CUDA), build what the first requests
        would otherwise wait for (service.core.warm_up): the first prefill buckets, the decode
        steps and, where the runner pads passes to a power of two of rows (paged storage),
        each pass shape within the cap."""
        runner, kv, scheduler = self.runner, self.kv, self.scheduler
        assert runner is not None and scheduler is not None
        if not (config.shape_buckets or config.decode_attention == "direct"):
            return 0.0
        started = time.monotonic()
        graph = isinstance(runner, ModelRunner) and runner.decode_graph is not None
        warm_up.warm_single_row(runner, kv, self.batch_size, graph)
        sched = scheduler.config
        if config.shape_buckets and config.paged and sched.max_batch_prefill > 1:
            rows = min(sched.max_batch_prefill, self.batch_size)
            shapes = warm_up.pass_shapes(rows, sched.max_batch_prefill_tokens or GPU_PREFILL_TOKENS)
            warm_up.warm_prefill_passes(runner, kv, shapes)
        return round(time.monotonic() - started, 2)

    def _pool_shape(self, lm: LoadedModel, layout: CacheLayout) -> PoolShape:
        """The paged pool's size: --kv-cache-budget, capped at what the slots could ever use
        twice over (the rest is prefix cache); the arrays themselves grow only as blocks are
        used."""
        cfg = self.config
        per_block = bytes_per_block(layout, PAGED_BLOCK_SIZE)
        weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
        budget = parse_budget(cfg.kv.kv_cache_budget, weights)
        slot_blocks = -(-self.slot_context // PAGED_BLOCK_SIZE)
        most = 2 * self.batch_size * slot_blocks
        blocks = most if budget is None else min(most, budget // per_block)
        if self.group is not None:
            # Every rank's pool must be the same size: rank 0's (it decides from its memory).
            blocks = agree(blocks, self.group)
        self.kv_budget_unlimited = budget is None
        if blocks < 1:
            raise ConfigError(f"--kv-cache-budget {cfg.kv.kv_cache_budget} holds no KV block")
        log.info(
            "KV cache budget",
            budget=cfg.kv.kv_cache_budget,
            budget_bytes=blocks * per_block,
            blocks=blocks,
            block_size=PAGED_BLOCK_SIZE,
            tokens=blocks * PAGED_BLOCK_SIZE,
        )
        self.bytes_per_block = per_block
        return PoolShape(blocks, PAGED_BLOCK_SIZE)

    # -- what the front ends are told ---------------------------------------------------
    def _publish(self, sched: Scheduler) -> None:
        """After each turn, on the loop thread: what a stats query reads (scalars and the list
        of running requests; no per-row work here)."""
        manager = self.block_manager
        self._snapshot = _Snapshot(
            running=list(sched.running),
            context=sched.context_tokens,
            queued=self.loop.queue_depth if self.loop is not None else 0,
            completed=sched.stats.total_completed,
            failed=sched.stats.total_failed,
            preemptions=sched.stats.preemptions,
            kv=manager.stats() if manager is not None else None,
            free_cached=manager.pool.num_free_cached_blocks if manager is not None else 0,
        )

    def counters(self) -> CacheCounters:
        """The cache and batch state after the last turn (any thread: a stats query is answered
        at once, however long the turn under way takes)."""
        assert self.runner is not None
        snap = self._snapshot
        storage = self.runner.storage
        out = CacheCounters(
            storage_backend=storage.name,
            reserved_bytes=storage.reserved_bytes,
            slot_context_tokens=self.slot_context,
            max_batch_size=self.batch_size,
            active_sequences=len(snap.running),
            queued_requests=snap.queued,
            total_completed=snap.completed,
            total_failed=snap.failed,
            preemptions=snap.preemptions,
            slots=slot_views(snap.running, snap.context),
            grammar=self.grammar_counters(),
        )
        if self.loop is not None:
            steps = self.loop.steps  # whole ints, read under the GIL: a copy, never torn
            out.steps = StepCounters(steps.overlapped, steps.serial)
        if snap.kv is not None:
            stats = snap.kv
            budget_bytes = stats.num_total_blocks * self.bytes_per_block
            out.block_size = stats.block_size
            out.total_blocks = stats.num_total_blocks
            out.active_blocks = stats.num_active_blocks
            out.free_blocks = stats.num_free_blocks
            out.cached_blocks = stats.num_cached_blocks
            # Allocated: holding data, in use or kept as an evictable cached prefix.
            out.allocated_blocks = stats.num_active_blocks + snap.free_cached
            out.used_bytes = stats.num_active_blocks * self.bytes_per_block
            out.budget_bytes = 0 if self.kv_budget_unlimited else budget_bytes
            out.capacity_bytes = budget_bytes
            out.prefix_lookups = stats.prefix_lookups
            out.prefix_hits = stats.prefix_hits
            out.prefix_hit_tokens = stats.prefix_hit_tokens
            out.evictions = stats.evictions
        elif self.runner.config.native_caches:
            out.used_bytes = storage.reserved_bytes
        else:
            used = sum(snap.context(s) for s in snap.running)
            out.used_bytes = used * storage.bytes_per_token
            out.capacity_bytes = self.batch_size * self.slot_context * storage.bytes_per_token
        return out

    def grammar_counters(self) -> GrammarCounters:
        """Cumulative counts, read as they are from any thread (whole ints and short lists
        copied under the GIL: a scrape may miss the turn under way, never see a torn value)."""
        out = GrammarCounters()
        if self.grammar is not None:
            stats = self.grammar.stats
            out.compiles, out.cache_hits = stats.misses, stats.hits
            out.refusals, out.compile_seconds = stats.refusals, stats.compile_seconds
        constraints = self.scheduler.constraints if self.scheduler is not None else None
        if constraints is not None:
            masks = constraints.stats
            out.mask_steps, out.mask_rows, out.mask_seconds = masks.steps, masks.rows, masks.seconds
            out.mask_step_buckets = list(masks.step_buckets)
            out.mask_row_buckets = list(masks.row_buckets)
        return out

    def structured_output_info(self) -> StructuredOutputInfo:
        if self.grammar is None:
            return StructuredOutputInfo()
        return StructuredOutputInfo(
            grammar.ENGINE,
            grammar.ENGINE_VERSION,
            list(FORMAT_KINDS),
            grammar.GRAMMAR_SYNTAX,
            round(self.grammar.max_compile_ms),
        )

    def model_info(self) -> ModelInfo:
        lm = self.loaded
        if lm is None or self.runner is None:
            return ModelInfo()
        return ModelInfo(
            model_id=lm.model_id,
            architecture=lm.architecture,
            vocab_size=lm.vocab_size,
            num_layers=lm.num_layers,
            dtype=str(lm.dtype).removeprefix("mlx.core."),
            eos_token_ids=sorted(lm.tokenizer.eos_token_ids),
            decode_path="sequential worker"
            if self.config.scheduling.no_batch
            else self.runner.decode_path,
            slot_context_tokens=self.slot_context,
            max_batch_size=self.batch_size,
            storage_backend=self.runner.storage.name,
            family=lm.family,
            quantization=Quantization(
                lm.quantization.mode,
                lm.quantization.bits,
                lm.quantization.group_size,
                lm.quantization.overrides,
                lm.quantization.dequantized,
            ),
            cache_layers=self.layout.describe() if self.layout is not None else "",
            tensor_parallel=self.group.size() if self.group is not None else 1,
            speculation=self._speculation_info(),
            structured_output=self.structured_output_info(),
            adapters=list(self.served_adapters),
        )

    def _speculation_info(self) -> Speculation:
        spec = self.scheduler.config.speculation if self.scheduler is not None else None
        if spec is None:
            return Speculation()
        return Speculation(
            self.config.scheduling.draft_kind,
            spec.num_draft_tokens,
            spec.max_batch,
            spec.min_ngram,
            spec.max_ngram,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.loop is not None:
            self.loop.stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if isinstance(self.runner, ReplicatedRunner):
            self.runner.close()  # the followers stop too
        if self.grammar is not None:
            self.grammar.close()
