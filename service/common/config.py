"""Server configuration: command-line flags in groups, each flag with an MLXSERVE_* variable.

`ServerConfig` holds one dataclass per group. Each process receives only its part: the engine
core gets `CoreConfig` (model, scheduling, KV cache, logging), the gRPC front ends get
`FrontendProcessConfig` (transport and security, front end, observability). `--help` lists the
flags by group.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

MIN_SLOT_CONTEXT = 512


class ConfigError(ValueError):
    pass


@dataclass
class TransportConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    max_request_bytes: int = 4 << 20  # gRPC's own default receive limit
    max_connection_age: float = 0.0  # seconds; 0: unlimited
    max_connection_age_grace: float = 300.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    reflection_requires_auth: bool = False

    def validate(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.max_request_bytes < 1:
            raise ConfigError("--max-request-bytes must be at least 1")
        if not 0 <= self.max_connection_age < 1e9:
            raise ConfigError("--max-connection-age must be >= 0 seconds (0: unlimited)")
        if not 0 <= self.max_connection_age_grace < 1e9:
            raise ConfigError("--max-connection-age-grace must be >= 0 seconds")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
        if self.reflection_requires_auth and not self.auth_token_file:
            raise ConfigError("--reflection-requires-auth needs --auth-token-file")
        for flag, path in (
            ("--tls-cert", self.tls_cert),
            ("--tls-key", self.tls_key),
            ("--tls-client-ca", self.tls_client_ca),
            ("--auth-token-file", self.auth_token_file),
        ):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: no such file")


GPU_PREFILL_TOKENS = 16384  # token cap of one prefill pass on a GPU by default
CPU_PREFILL_ROWS = 4  # prompts per prefill pass on a CPU by default
WORKER_CORES = 4  # CPU cores per gRPC front end by default (--api-workers auto)
MAX_AUTO_WORKERS = 4


def auto_api_workers(cpus: int | None = None) -> int:
    """Front ends by default: one per WORKER_CORES cores, at least one and at most
    MAX_AUTO_WORKERS (each runs one event loop on one core; the engine core takes another)."""
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return max(1, min(MAX_AUTO_WORKERS, cpus // WORKER_CORES))


def _api_workers(value: str) -> int:
    """--api-workers: a count, or auto (by CPU count)."""
    if value.strip().lower() == "auto":
        return auto_api_workers()
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or a number") from None


@dataclass
class FrontendConfig:
    api_workers: int = 1
    default_max_tokens: int = 512
    allow_special_tokens_in_content: bool = False
    drain_timeout: float = 30.0

    def validate(self) -> None:
        if self.api_workers < 1:
            raise ConfigError("--api-workers must be at least 1")
        if self.default_max_tokens < 1:
            raise ConfigError("--default-max-tokens must be at least 1")
        if self.drain_timeout < 0:
            raise ConfigError("--drain-timeout must be >= 0")


@dataclass
class SchedulingConfig:
    max_batch_size: int = 4  # rows per decode step (--max-batch-size, alias --parallel)
    max_queue_depth: int = 32
    prefill_chunk_size: int | None = None
    max_prefill_stall_ms: float | None = None  # None: a few median decode steps; 0: off
    prefill_grant_interval: int = 16
    max_batch_prefill: int | None = None  # None: by device
    max_batch_prefill_tokens: int | None = None
    enable_preemption: bool = False
    preemption_policy: str = "longest-first"
    no_batch: bool = False
    deterministic: bool = False
    draft_kind: str = "none"
    num_draft_tokens: int = 4
    prompt_lookup_max_batch: int = 2
    prompt_lookup_min_ngram: int = 2
    prompt_lookup_max_ngram: int = 4

    @property
    def batch_size(self) -> int:
        return 1 if self.no_batch else self.max_batch_size

    def prefill_limits(self, gpu: bool) -> tuple[int, int | None]:
        """Rows and tokens of one prefill pass, where the flags leave them unset. A GPU
        prefills many short prompts in about the time of one, so a pass admits the whole batch
        as far as GPU_PREFILL_TOKENS goes: a burst starts decoding at once. (The runner pads a pass
        to a power of two of rows, whose shapes the runtime builds before serving.) A CPU's prefill
        cost grows with every prompt: CPU_PREFILL_ROWS, and the scheduler's derived token cap."""
        rows = self.max_batch_prefill
        if rows is None:
            rows = self.batch_size if gpu else CPU_PREFILL_ROWS
        tokens = self.max_batch_prefill_tokens
        if tokens is None and gpu:
            tokens = GPU_PREFILL_TOKENS
        return rows, tokens

    def validate(self) -> None:
        if self.max_batch_size < 1:
            raise ConfigError("--max-batch-size must be at least 1")
        if self.max_queue_depth < 0:
            raise ConfigError("--max-queue-depth must be >= 0")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 0:
            raise ConfigError("--prefill-chunk-size must be >= 0")
        stall = self.max_prefill_stall_ms
        if stall is not None and not (math.isfinite(stall) and stall >= 0):
            raise ConfigError(
                f"--max-prefill-stall-ms {stall} must be auto or milliseconds >= 0 (0 = off)"
            )
        if stall and self.prefill_chunk_size is not None:
            raise ConfigError(
                "--max-prefill-stall-ms sizes adaptive chunks and --prefill-chunk-size fixes "
                "every chunk: give one of them"
            )
        if stall and self.deterministic:
            raise ConfigError(
                "--max-prefill-stall-ms makes chunk sizes depend on load, which --deterministic "
                "forbids: give one of them"
            )
        if self.preemption_policy not in ("longest-first", "lowest-priority"):
            raise ConfigError("--preemption-policy must be longest-first or lowest-priority")
        if self.draft_kind not in ("none", "prompt-lookup"):
            raise ConfigError("--draft-kind must be none or prompt-lookup")
        if self.num_draft_tokens < 1 or self.prompt_lookup_max_batch < 1:
            raise ConfigError("--num-draft-tokens and --prompt-lookup-max-batch must be >= 1")
        if not 1 <= self.prompt_lookup_min_ngram <= self.prompt_lookup_max_ngram:
            raise ConfigError(
                "--prompt-lookup-min-ngram must be >= 1 and <= --prompt-lookup-max-ngram"
            )


@dataclass
class KVCacheConfig:
    decode_storage_backend: str = "auto"
    kv_cache_budget: str = "auto"
    kv_admission_watermark: float = 0.01
    ctx_size: int | None = None
    no_prompt_cache: bool = False

    def slot_context(self, batch_size: int, model_max_context: int) -> int:
        """Tokens one sequence may hold: --ctx-size shared by the slots, else the model's limit."""
        if self.ctx_size is None:
            return model_max_context
        per_slot = self.ctx_size // batch_size
        if per_slot < MIN_SLOT_CONTEXT:
            raise ConfigError(
                f"--ctx-size {self.ctx_size} gives each of the {batch_size} slots "
                f"{per_slot} tokens; a slot needs at least {MIN_SLOT_CONTEXT}"
            )
        return min(per_slot, model_max_context)

    def validate(self, batch_size: int) -> None:
        if self.decode_storage_backend not in ("auto", "dense", "paged"):
            raise ConfigError("--decode-storage-backend must be auto, dense or paged")
        if not 0.0 <= self.kv_admission_watermark <= 0.5:
            raise ConfigError("--kv-admission-watermark must be within [0, 0.5]")
        if self.ctx_size is not None and self.ctx_size <= 0:
            raise ConfigError("--ctx-size must be positive")
        if self.ctx_size is not None:
            self.slot_context(batch_size, self.ctx_size)  # slots under 512 tokens: refused now


@dataclass
class ModelConfig:
    path: str | None = None  # --model
    dtype: str = "auto"
    load_format: str = "auto"
    tensor_parallel: int = 1
    distributed_backend: str = "auto"
    # --adapter NAME=PATH, repeated: mlx-lm LoRA adapters served with the model.
    adapters: tuple[tuple[str, str], ...] = ()

    def resolved_backend(self) -> str:
        """MLX distributed backend of the tensor-parallel ranks: NCCL between GPUs, the ring
        (local processes over TCP) elsewhere. Decided without importing MLX (the launcher
        does not): a visible NVIDIA GPU means CUDA."""
        if self.distributed_backend != "auto":
            return self.distributed_backend
        return "nccl" if visible_gpus() else "ring"

    def validate(self) -> None:
        if self.tensor_parallel < 1:
            raise ConfigError("--tensor-parallel must be at least 1")
        if self.distributed_backend not in ("auto", "ring", "nccl"):
            raise ConfigError("--distributed-backend must be auto, ring or nccl")
        seen: set[str] = set()
        for name, path in self.adapters:
            if name in seen:
                raise ConfigError(f"--adapter {name}: the name is given twice")
            seen.add(name)
            if not os.path.isdir(path):
                raise ConfigError(f"--adapter {name}={path}: no such directory")


@dataclass
class StructuredOutputConfig:
    """response_format: both the front ends (which refuse a bad format before it is queued)
    and the engine core (which compiles it again, cached, before admitting it) compile."""

    max_grammar_compile_ms: float = 2000.0
    grammar_cache_size: int = 256

    def validate(self) -> None:
        if not (math.isfinite(self.max_grammar_compile_ms) and self.max_grammar_compile_ms > 0):
            raise ConfigError("--max-grammar-compile-ms must be a positive number of ms")
        if self.grammar_cache_size < 1:
            raise ConfigError("--grammar-cache-size must be at least 1")


LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "json", "console")


@dataclass
class ObservabilityConfig:
    log_level: str = "info"
    log_format: str = "auto"
    metrics_port: int | None = None

    def validate(self) -> None:
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"--log-level {self.log_level!r}: use {' | '.join(LOG_LEVELS)}")
        if self.log_format.lower() not in LOG_FORMATS:
            raise ConfigError(f"--log-format {self.log_format!r}: use {' | '.join(LOG_FORMATS)}")


@dataclass
class CoreConfig:
    """What the engine-core process is given."""

    model: ModelConfig = field(default_factory=ModelConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    def slot_context(self, model_max_context: int) -> int:
        return self.kv.slot_context(self.scheduling.batch_size, model_max_context)


@dataclass
class FrontendProcessConfig:
    """What a gRPC front-end process is given."""

    transport: TransportConfig = field(default_factory=TransportConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)


@dataclass
class ServerConfig:
    transport: TransportConfig = field(default_factory=TransportConfig)
    frontend: FrontendConfig = field(default_factory=FrontendConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    kv: KVCacheConfig = field(default_factory=KVCacheConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputConfig = field(default_factory=StructuredOutputConfig)

    @property
    def core(self) -> CoreConfig:
        return CoreConfig(self.model, self.scheduling, self.kv, self.observability, self.structured)

    @property
    def frontend_process(self) -> FrontendProcessConfig:
        return FrontendProcessConfig(
            self.transport, self.frontend, self.observability, self.structured
        )

    def validate(self) -> None:
        self.transport.validate()
        self.frontend.validate()
        self.scheduling.validate()
        self.kv.validate(self.scheduling.batch_size)
        self.model.validate()
        self.structured.validate()
        self.observability.validate()


def visible_gpus() -> int:
    """NVIDIA GPUs this process may use (CUDA_VISIBLE_DEVICES, else nvidia-smi's list)."""
    import shutil
    import subprocess

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        listing = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in listing.splitlines() if line.startswith("GPU "))


# -- flags -------------------------------------------------------------------------------


def _stall_ms(value: str | None) -> float | None:
    """--max-prefill-stall-ms: 'auto' (or unset) is None, else milliseconds."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or a number") from None


def _optional_int(value: str | None) -> int | None:
    return None if value in (None, "") else int(value)


ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def adapter_spec(value: str) -> tuple[str, str]:
    """--adapter NAME=PATH. Names are kept to what metric labels and logs carry as they are."""
    name, sep, path = value.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"{value!r} is not NAME=PATH")
    if not ADAPTER_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(
            f"adapter name {name!r}: use letters, digits, '.', '_' and '-' (at most 64, "
            "starting with a letter or digit)"
        )
    return name, path


def _env_flag(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Flag:
    """One flag: its group field, its names, how a value parses, its help. The default is the
    group dataclass's, unless MLXSERVE_<ENV> is set."""

    field: str
    help: str = ""
    names: tuple[str, ...] = ()  # default: --field-with-dashes
    parse: Callable[[str], Any] | None = None  # None: the field's type (str, int, float)
    switch: bool = False  # store_true
    env: tuple[str, ...] = ()  # default: MLXSERVE_FIELD
    default: str | None = None  # the flag's default, parsed (None: the dataclass's)
    # Given any number of times; the variable holds comma-separated values. Flags on the
    # command line replace the variable's values.
    repeated: bool = False


GROUPS: tuple[tuple[str, type, tuple[Flag, ...]], ...] = (
    (
        "transport and security",
        TransportConfig,
        (
            Flag("host", "address to bind"),
            Flag("port", "gRPC port"),
            Flag(
                "max_request_bytes",
                "largest request message accepted; larger ones get RESOURCE_EXHAUSTED from gRPC "
                "(default: gRPC's own, 4 MiB)",
            ),
            Flag(
                "max_connection_age",
                "seconds before a connection is sent GOAWAY, so clients reconnect and load "
                "balancers can rebalance (0 = unlimited)",
            ),
            Flag(
                "max_connection_age_grace",
                "seconds the calls in flight on an aged connection get to finish",
            ),
            Flag("tls_cert", "PEM certificate chain: serve TLS (with --tls-key)"),
            Flag("tls_key", "PEM private key of --tls-cert"),
            Flag(
                "tls_client_ca",
                "PEM CA certificate(s): mutual TLS, clients must present a certificate they signed",
            ),
            Flag(
                "auth_token_file",
                "bearer tokens, one per line (blank lines and # comments ignored): calls without "
                "`authorization: Bearer <token>` get UNAUTHENTICATED; health stays open",
            ),
            Flag(
                "reflection_requires_auth",
                "server reflection needs a token too (default: open, like health)",
                switch=True,
            ),
        ),
    ),
    (
        "front end",
        FrontendConfig,
        (
            Flag(
                "api_workers",
                "gRPC front-end processes sharing the port (SO_REUSEPORT); one engine core "
                "serves them all; auto (the default): one per 4 CPU cores, at most 4",
                parse=_api_workers,
                default="auto",
            ),
            Flag("default_max_tokens", "max_tokens of a request that sets none"),
            Flag(
                "allow_special_tokens_in_content",
                "parse special tokens typed into chat content as control tokens (default: they "
                "are plain text, so a user cannot forge turns)",
                switch=True,
            ),
            Flag(
                "drain_timeout",
                "seconds a stop signal lets running requests finish (new ones get UNAVAILABLE); "
                "what still runs then ends as cancelled; a second signal stops at once",
            ),
        ),
    ),
    (
        "scheduler",
        SchedulingConfig,
        (
            Flag(
                "max_batch_size",
                "sequence slots: rows decoded together in one step (--parallel is the same "
                "setting; MLXSERVE_PARALLEL too)",
                names=("--max-batch-size", "--parallel", "-np"),
                env=("MAX_BATCH_SIZE", "PARALLEL"),
            ),
            Flag("max_queue_depth", "waiting requests before RESOURCE_EXHAUSTED"),
            Flag(
                "prefill_chunk_size",
                "tokens of every prefill chunk (default adaptive: 2048 while nothing decodes, "
                "sized by --max-prefill-stall-ms while rows decode); 0 = no chunking",
                names=("--prefill-chunk-size", "-b"),
                parse=_optional_int,
                env=("PREFILL_CHUNK_SIZE", "PREFILL_CHUNK"),
            ),
            Flag(
                "max_prefill_stall_ms",
                "while rows decode, size each prefill chunk by its measured cost so that their "
                "inter-token gap stays within this many ms (default auto: a few running median "
                "decode steps), unless more prompts prefill than rows decode; 0 = token-count "
                "chunks (512 while decoding); not with --prefill-chunk-size",
                parse=_stall_ms,
            ),
            Flag(
                "prefill_grant_interval",
                "decode ticks a parked prefill chunk yields before it is guaranteed a turn",
            ),
            Flag(
                "max_batch_prefill",
                "waiting requests prefilled together (default by device: the whole batch on a GPU, "
                "each pass padded to a power of two of rows; 4 elsewhere)",
                parse=_optional_int,
            ),
            Flag(
                "max_batch_prefill_tokens",
                "token cap of one batched prefill (default 16384 on a GPU, elsewhere "
                "2*max_batch_prefill*min(chunk,512); 0 = none)",
                parse=_optional_int,
            ),
            Flag(
                "enable_preemption",
                "a higher-priority arrival may evict a running row",
                switch=True,
            ),
            Flag("preemption_policy", "longest-first | lowest-priority"),
            Flag("no_batch", "serve with a sequential worker (one request at a time)", switch=True),
            Flag(
                "deterministic",
                "reproducible greedy decoding: the prefill plan does not depend on load",
                switch=True,
            ),
            Flag(
                "draft_kind",
                "speculative decoding: none | prompt-lookup (drafts from the row's own prompt and "
                "output, verified in one forward while few rows decode)",
            ),
            Flag("num_draft_tokens", "tokens drafted per row and step"),
            Flag("prompt_lookup_max_batch", "rows decoding at most for drafts to be verified"),
            Flag("prompt_lookup_min_ngram", "shortest n-gram matched against the row's tokens"),
            Flag("prompt_lookup_max_ngram", "longest n-gram matched (tried first)"),
        ),
    ),
    (
        "KV cache",
        KVCacheConfig,
        (
            Flag(
                "decode_storage_backend",
                "auto (paged for families verified against mlx-lm, else dense) | dense | paged",
            ),
            Flag("kv_cache_budget", "auto | BYTES | none"),
            Flag(
                "kv_admission_watermark",
                "fraction of the pool kept free for running rows when admitting (0-0.5)",
            ),
            Flag(
                "ctx_size",
                "total context shared by the slots (each gets ctx_size // max_batch_size)",
                names=("--ctx-size", "-c"),
                parse=_optional_int,
            ),
            Flag("no_prompt_cache", "no cross-request prompt-prefix cache", switch=True),
        ),
    ),
    (
        "model",
        ModelConfig,
        (
            Flag(
                "path",
                "mlx-lm / Hugging Face model directory; default: the embedded "
                "SmolLM2-135M-Instruct",
                names=("--model",),
                env=("MODEL",),
            ),
            Flag(
                "dtype",
                "float parameters and KV cache: auto (float32 on the CPU, where MLX's "
                "half-precision matmuls are slow; bfloat16 on a GPU) | float32 | bfloat16 | "
                "float16",
            ),
            Flag("load_format", "auto, or dummy:PRESET for random weights of a preset's shape"),
            Flag(
                "tensor_parallel",
                "engine-core ranks of one mx.distributed group: the model's heads are split over "
                "them (a model too large for one device, or lower latency)",
            ),
            Flag(
                "distributed_backend",
                "auto (nccl between GPUs, else ring: local processes over TCP) | ring | nccl",
            ),
            Flag(
                "adapters",
                "NAME=PATH: serve the mlx-lm LoRA/DoRA adapter directory PATH (what `mlx_lm "
                "lora` writes) as NAME; requests choose it with `adapter: NAME`; repeat for more",
                names=("--adapter",),
                parse=adapter_spec,
                env=("ADAPTER",),
                repeated=True,
            ),
        ),
    ),
    (
        "structured output",
        StructuredOutputConfig,
        (
            Flag(
                "max_grammar_compile_ms",
                "longest a request's response_format may take to compile (JSON Schema, regex, "
                "grammar, choice); a format that takes longer is refused with "
                "INVALID_ARGUMENT, and the refusal cached like any compiled format",
            ),
            Flag(
                "grammar_cache_size",
                "compiled response formats kept per process (least recently used dropped "
                "first); each is bounded by the grammar engine's own limits",
            ),
        ),
    ),
    (
        "observability",
        ObservabilityConfig,
        (
            Flag("log_level", " | ".join(LOG_LEVELS)),
            Flag("log_format", "auto (JSON unless stdout is a terminal) | json | console"),
            Flag(
                "metrics_port",
                "serve Prometheus metrics on this port (/metrics)",
                parse=_optional_int,
            ),
        ),
    ),
)
GROUP_ATTRS = {
    TransportConfig: "transport",
    FrontendConfig: "frontend",
    SchedulingConfig: "scheduling",
    KVCacheConfig: "kv",
    ModelConfig: "model",
    StructuredOutputConfig: "structured",
    ObservabilityConfig: "observability",
}


def _dest(group: type, flag: Flag) -> str:
    return f"{GROUP_ATTRS[group]}.{flag.field}"


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    for title, group, flags in GROUPS:
        section = parser.add_argument_group(title)
        defaults = group()
        types = {f.name: f.type for f in fields(group)}
        for flag in flags:
            _add_flag(section, group, flag, getattr(defaults, flag.field), types[flag.field])


def _add_flag(section: Any, group: type, flag: Flag, default: Any, annotation: Any) -> None:
    names = flag.names or ("--" + flag.field.replace("_", "-"),)
    env_names = [f"MLXSERVE_{e}" for e in (flag.env or (flag.field.upper(),))]
    env_value = next((os.environ[e] for e in env_names if os.environ.get(e)), None)
    help_text = f"{flag.help} ({', '.join(env_names)})" if flag.help else f"({env_names[0]})"
    kwargs: dict[str, Any] = {"dest": _dest(group, flag), "help": help_text}
    if flag.switch:
        kwargs.update(action="store_true", default=_env_flag(env_value or ""))
    elif flag.repeated:
        parse = flag.parse or _scalar_type(annotation)
        values = [v for v in (env_value or "").split(",") if v.strip()]
        try:
            from_env = tuple(parse(v) for v in values)
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{env_names[0]}: {exc}") from None
        kwargs.update(
            type=parse,
            default=from_env or default,
            metavar=names[0].lstrip("-").upper(),
            action=_Repeated,
        )
    else:
        parse = flag.parse or _scalar_type(annotation)
        if env_value is None and flag.default is not None:
            env_value = flag.default
        default = parse(env_value) if env_value is not None else default
        kwargs.update(type=parse, default=default, metavar=names[0].lstrip("-").upper())
    if len(names) > 1 and not flag.switch:
        kwargs["action"] = _OneSetting
    section.add_argument(*names, **kwargs)


class _Repeated(argparse.Action):
    """Collects every value of a repeated flag; the first one on the command line replaces
    what the environment gave."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        given = getattr(namespace, "_repeated", set())
        current = () if self.dest not in given else getattr(namespace, self.dest)
        given.add(self.dest)
        namespace._repeated = given
        setattr(namespace, self.dest, (*current, values))


class _OneSetting(argparse.Action):
    """A flag with several names (--max-batch-size, --parallel) is one setting: given twice
    with different values, the command is refused rather than the last one silently winning."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        seen = getattr(namespace, "_given", {})
        earlier = seen.get(self.dest)
        if earlier is not None and earlier[1] != values:
            parser.error(
                f"{earlier[0]} {earlier[1]} and {option} {values} set the same value: give one"
            )
        seen[self.dest] = (option, values)
        namespace._given = seen
        setattr(namespace, self.dest, values)


def _scalar_type(annotation: Any) -> Callable[[str], Any]:
    text = str(annotation)
    if text.startswith("int"):
        return int
    if text.startswith("float"):
        return float
    return str


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    values = vars(args)  # dests are "group.field"
    parts: dict[str, Any] = {}
    for _, group, flags in GROUPS:
        attr = GROUP_ATTRS[group]
        parts[attr] = group(**{f.field: values[_dest(group, f)] for f in flags})
    config = ServerConfig(**parts)
    config.validate()
    return config
