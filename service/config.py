"""Server configuration: command-line flags, each with an MLXSERVE_* environment variable."""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

MIN_SLOT_CONTEXT = 512


class ConfigError(ValueError):
    pass


@dataclass
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    model: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"
    parallel: int = 4
    max_batch_size: int | None = None
    max_queue_depth: int = 32
    prefill_chunk_size: int | None = None
    max_prefill_stall_ms: float | None = None  # None: 4 median decode steps; 0: off
    prefill_grant_interval: int = 16
    max_batch_prefill: int | None = None  # None: 16 with CUDA, 4 elsewhere
    max_batch_prefill_tokens: int | None = None
    enable_preemption: bool = False
    preemption_policy: str = "longest-first"
    no_batch: bool = False
    decode_storage_backend: str = "auto"
    kv_cache_budget: str = "auto"
    kv_admission_watermark: float = 0.01
    ctx_size: int | None = None
    no_prompt_cache: bool = False
    default_max_tokens: int = 512
    deterministic: bool = False
    log_level: str = "info"
    log_format: str = "auto"
    metrics_port: int | None = None
    max_request_bytes: int = 4 << 20  # gRPC's own default receive limit
    drain_timeout: float = 30.0
    api_workers: int = 1
    tensor_parallel: int = 1
    draft_kind: str = "none"
    prompt_lookup_max_batch: int = 2
    num_draft_tokens: int = 4
    prompt_lookup_min_ngram: int = 2
    prompt_lookup_max_ngram: int = 4
    distributed_backend: str = "auto"
    max_connection_age: float = 0.0  # seconds; 0: unlimited
    max_connection_age_grace: float = 300.0
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None
    auth_token_file: str | None = None
    reflection_requires_auth: bool = False
    allow_special_tokens_in_content: bool = False

    def resolved_backend(self) -> str:
        """MLX distributed backend of the tensor-parallel ranks: NCCL between GPUs, the ring
        (local processes over TCP) elsewhere. Decided without importing MLX (the launcher
        does not): a visible NVIDIA GPU means CUDA."""
        if self.distributed_backend != "auto":
            return self.distributed_backend
        return "nccl" if visible_gpus() else "ring"

    @property
    def batch_size(self) -> int:
        if self.no_batch:
            return 1
        return self.max_batch_size or self.parallel

    def slot_context(self, model_max_context: int) -> int:
        """Tokens one sequence may hold: --ctx-size shared by the slots, else the model's limit."""
        if self.ctx_size is None:
            return model_max_context
        per_slot = self.ctx_size // self.batch_size
        if per_slot < MIN_SLOT_CONTEXT:
            raise ConfigError(
                f"--ctx-size {self.ctx_size} gives each of the {self.batch_size} slots "
                f"{per_slot} tokens; a slot needs at least {MIN_SLOT_CONTEXT}"
            )
        return min(per_slot, model_max_context)

    def validate(self) -> None:
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"--port {self.port} is not a TCP port")
        if self.parallel < 1 or (self.max_batch_size is not None and self.max_batch_size < 1):
            raise ConfigError("--parallel and --max-batch-size must be at least 1")
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
        if self.decode_storage_backend not in ("auto", "dense", "paged"):
            raise ConfigError("--decode-storage-backend must be auto, dense or paged")
        if not 0.0 <= self.kv_admission_watermark <= 0.5:
            raise ConfigError("--kv-admission-watermark must be within [0, 0.5]")
        if self.ctx_size is not None and self.ctx_size <= 0:
            raise ConfigError("--ctx-size must be positive")
        if self.ctx_size is not None:
            self.slot_context(self.ctx_size)  # refuses slots under 512 tokens before loading
        if self.default_max_tokens < 1:
            raise ConfigError("--default-max-tokens must be at least 1")
        if self.drain_timeout < 0:
            raise ConfigError("--drain-timeout must be >= 0")
        if self.draft_kind not in ("none", "prompt-lookup"):
            raise ConfigError("--draft-kind must be none or prompt-lookup")
        if self.num_draft_tokens < 1 or self.prompt_lookup_max_batch < 1:
            raise ConfigError("--num-draft-tokens and --prompt-lookup-max-batch must be >= 1")
        if not 1 <= self.prompt_lookup_min_ngram <= self.prompt_lookup_max_ngram:
            raise ConfigError(
                "--prompt-lookup-min-ngram must be >= 1 and <= --prompt-lookup-max-ngram"
            )
        if self.tensor_parallel < 1:
            raise ConfigError("--tensor-parallel must be at least 1")
        if self.distributed_backend not in ("auto", "ring", "nccl"):
            raise ConfigError("--distributed-backend must be auto, ring or nccl")
        if self.api_workers < 1:
            raise ConfigError("--api-workers must be at least 1")
        if self.max_request_bytes < 1:
            raise ConfigError("--max-request-bytes must be at least 1")
        if not 0 <= self.max_connection_age < 1e9:
            raise ConfigError("--max-connection-age must be >= 0 seconds (0: unlimited)")
        if not 0 <= self.max_connection_age_grace < 1e9:
            raise ConfigError("--max-connection-age-grace must be >= 0 seconds")
        self._validate_security()

    def _validate_security(self) -> None:
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


def _env(name: str, default: object) -> object:
    return os.environ.get(f"MLXSERVE_{name.upper()}", default)


def _env_flag(name: str) -> bool:
    return os.environ.get(f"MLXSERVE_{name.upper()}", "").lower() in ("1", "true", "yes", "on")


def _optional_int(value: str | None) -> int | None:
    return None if value in (None, "") else int(value)


def _stall_ms(value: str | None) -> float | None:
    """--max-prefill-stall-ms: 'auto' (or unset) is None, else milliseconds."""
    if value is None or value.strip().lower() in ("", "auto"):
        return None
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not auto or a number") from None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    a = parser.add_argument
    a("--host", default=_env("host", d.host), help="address to bind (MLXSERVE_HOST)")
    a("--port", type=int, default=int(_env("port", d.port)), help="gRPC port (MLXSERVE_PORT)")
    a(
        "--model",
        default=_env("model", None),
        help="mlx-lm / Hugging Face model directory; default: the embedded SmolLM2-135M-Instruct",
    )
    a(
        "--dtype",
        default=_env("dtype", d.dtype),
        help="float parameters and KV cache: auto (float32 on the CPU, where MLX's half-precision "
        "matmuls are slow; bfloat16 on a GPU) | float32 | bfloat16 | float16",
    )
    a(
        "--load-format",
        default=_env("load_format", d.load_format),
        help="auto, or dummy:PRESET for random weights of a preset's shape",
    )
    a(
        "--parallel",
        "-np",
        type=int,
        default=int(_env("parallel", d.parallel)),
        help="sequence slots (MLXSERVE_PARALLEL)",
    )
    a(
        "--max-batch-size",
        type=int,
        default=_optional_int(_env("max_batch_size", None)),
        help="rows per decode step (default: --parallel)",
    )
    a(
        "--max-queue-depth",
        type=int,
        default=int(_env("max_queue_depth", d.max_queue_depth)),
        help="waiting requests before RESOURCE_EXHAUSTED",
    )
    a(
        "--prefill-chunk-size",
        "-b",
        type=int,
        default=_optional_int(_env("prefill_chunk", None) or _env("prefill_chunk_size", None)),
        help="tokens of every prefill chunk (default adaptive: 2048 while nothing decodes, "
        "sized by --max-prefill-stall-ms while rows decode); 0 = no chunking",
    )
    a(
        "--max-prefill-stall-ms",
        type=_stall_ms,
        default=_env("max_prefill_stall_ms", None),  # a string default goes through `type`
        help="while rows decode, size each prefill chunk by its measured cost so that their "
        "inter-token gap stays within this many ms (default auto: 4x the running median decode "
        "step); 0 = token-count chunks (512 while decoding); not with --prefill-chunk-size",
    )
    a(
        "--prefill-grant-interval",
        type=int,
        default=int(_env("prefill_grant_interval", d.prefill_grant_interval)),
        help="decode ticks a parked prefill chunk yields before it is guaranteed a turn",
    )
    a(
        "--max-batch-prefill",
        type=int,
        default=_optional_int(_env("max_batch_prefill", None)),
        help="waiting requests prefilled together (default 16 with CUDA, 4 elsewhere)",
    )
    a(
        "--max-batch-prefill-tokens",
        type=int,
        default=_optional_int(_env("max_batch_prefill_tokens", None)),
        help="token cap of one batched prefill (default 2*max_batch_prefill*min(chunk,512))",
    )
    a("--enable-preemption", action="store_true", default=_env_flag("enable_preemption"))
    a(
        "--preemption-policy",
        default=_env("preemption_policy", d.preemption_policy),
        help="longest-first | lowest-priority",
    )
    a(
        "--no-batch",
        action="store_true",
        default=_env_flag("no_batch"),
        help="serve with a sequential worker (one request at a time)",
    )
    a(
        "--decode-storage-backend",
        default=_env("decode_storage_backend", d.decode_storage_backend),
        help="auto (paged for families verified against mlx-lm, else dense) | dense | paged",
    )
    a(
        "--kv-cache-budget",
        default=_env("kv_cache_budget", d.kv_cache_budget),
        help="auto | BYTES | none",
    )
    a(
        "--kv-admission-watermark",
        type=float,
        default=float(_env("kv_admission_watermark", d.kv_admission_watermark)),
    )
    a(
        "--ctx-size",
        "-c",
        type=int,
        default=_optional_int(_env("ctx_size", None)),
        help="total context shared by the slots (each gets ctx_size // max_batch_size)",
    )
    a("--no-prompt-cache", action="store_true", default=_env_flag("no_prompt_cache"))
    a(
        "--default-max-tokens",
        type=int,
        default=int(_env("default_max_tokens", d.default_max_tokens)),
        help="max_tokens of a request that sets none",
    )
    a(
        "--deterministic",
        action="store_true",
        default=_env_flag("deterministic"),
        help="reproducible greedy decoding (also MLXSERVE_DETERMINISTIC=1)",
    )
    a(
        "--max-request-bytes",
        type=int,
        default=int(_env("max_request_bytes", d.max_request_bytes)),
        help="largest request message accepted; larger ones get RESOURCE_EXHAUSTED from gRPC "
        "(default 4 MiB, gRPC's own default)",
    )
    a(
        "--max-connection-age",
        type=float,
        default=float(_env("max_connection_age", d.max_connection_age)),
        help="seconds before a connection is sent GOAWAY, so clients reconnect and load "
        "balancers can rebalance (0 = unlimited)",
    )
    a(
        "--max-connection-age-grace",
        type=float,
        default=float(_env("max_connection_age_grace", d.max_connection_age_grace)),
        help="seconds the calls in flight on an aged connection get to finish",
    )
    a(
        "--tls-cert",
        default=_env("tls_cert", None) or None,
        help="PEM certificate chain: serve TLS (with --tls-key)",
    )
    a("--tls-key", default=_env("tls_key", None) or None, help="PEM private key of --tls-cert")
    a(
        "--tls-client-ca",
        default=_env("tls_client_ca", None) or None,
        help="PEM CA certificate(s): mutual TLS, clients must present a certificate they signed",
    )
    a(
        "--auth-token-file",
        default=_env("auth_token_file", None) or None,
        help="bearer tokens, one per line (blank lines and # comments ignored): calls without "
        "`authorization: Bearer <token>` get UNAUTHENTICATED; health stays open",
    )
    a(
        "--reflection-requires-auth",
        action="store_true",
        default=_env_flag("reflection_requires_auth"),
        help="server reflection needs a token too (default: open, like health)",
    )
    a(
        "--allow-special-tokens-in-content",
        action="store_true",
        default=_env_flag("allow_special_tokens_in_content"),
        help="parse special tokens typed into chat content as control tokens (default: they "
        "are plain text, so a user cannot forge turns)",
    )
    a("--log-level", default=_env("log_level", d.log_level))
    a("--log-format", default=_env("log_format", d.log_format), help="auto | json | console")
    a(
        "--drain-timeout",
        type=float,
        default=float(_env("drain_timeout", d.drain_timeout)),
        help="seconds a stop signal lets running requests finish (new ones get UNAVAILABLE); "
        "what still runs then ends as cancelled; a second signal stops at once",
    )
    a(
        "--draft-kind",
        default=_env("draft_kind", d.draft_kind),
        help="speculative decoding: none | prompt-lookup (drafts from the row's own prompt and "
        "output, verified in one forward while few rows decode)",
    )
    a(
        "--prompt-lookup-max-batch",
        type=int,
        default=int(_env("prompt_lookup_max_batch", d.prompt_lookup_max_batch)),
        help="rows decoding at most for drafts to be verified",
    )
    a(
        "--num-draft-tokens",
        type=int,
        default=int(_env("num_draft_tokens", d.num_draft_tokens)),
        help="tokens drafted per row and step",
    )
    a(
        "--prompt-lookup-min-ngram",
        type=int,
        default=int(_env("prompt_lookup_min_ngram", d.prompt_lookup_min_ngram)),
    )
    a(
        "--prompt-lookup-max-ngram",
        type=int,
        default=int(_env("prompt_lookup_max_ngram", d.prompt_lookup_max_ngram)),
        help="n-gram sizes matched against the row's earlier tokens (longest first)",
    )
    a(
        "--tensor-parallel",
        type=int,
        default=int(_env("tensor_parallel", d.tensor_parallel)),
        help="engine-core ranks of one mx.distributed group: the model's heads are split over "
        "them (a model too large for one device, or lower latency)",
    )
    a(
        "--distributed-backend",
        default=_env("distributed_backend", d.distributed_backend),
        help="auto (nccl between GPUs, else ring: local processes over TCP) | ring | nccl",
    )
    a(
        "--api-workers",
        type=int,
        default=int(_env("api_workers", d.api_workers)),
        help="gRPC front-end processes sharing the port (SO_REUSEPORT); one engine core serves "
        "them all",
    )
    a(
        "--metrics-port",
        type=int,
        default=_optional_int(_env("metrics_port", None)),
        help="serve Prometheus metrics on this port (/metrics)",
    )


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    fields = ServerConfig.__dataclass_fields__
    config = ServerConfig(**{k: v for k, v in vars(args).items() if k in fields})
    config.validate()
    return config
