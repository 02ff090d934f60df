"""`python -m client bench`: options and orchestration (workload -> plan -> runs -> report).

One run measures our server (spawned, or at --target), then each --peer in turn on the identical
plan, one at a time so they never share the machine. Peers (mlx-lm on the same weights) need MLX
and the server's model loader, so they are not part of this package: they are the mapping of
name -> `PeerRun` that a caller passes to `run_bench`. In a repository checkout they are
bench/peers/, found here when importable (`checkout_peers`); `python -m bench.compare` is the
checkout's own entry point for them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc
from google.protobuf import json_format

from client.bench import report
from client.bench.grpc_target import GrpcTarget, count_tokens_via_rpc
from client.bench.metrics import LevelResult
from client.bench.server import CHECKOUT_ROOT, ServerProcess
from client.bench.workload import ARRIVALS, LengthDist, Plan, Workload, build_plan
from client.cli import connection_kwargs
from client.client import GenerationClient

Progress = Callable[[str], None]
# A peer: (plan, progress, the parsed options, the stem of its log paths) -> (its levels, notes
# for the JSON's meta).
PeerRun = Callable[
    [Plan, Progress, argparse.Namespace, Path], tuple[list[LevelResult], dict[str, Any]]
]

# The repository's peers (bench/peers/): a module with `PEERS` (name -> PeerRun) and
# `add_arguments(group)` for their options.
PEERS_MODULE = "bench.peers"
PEERS_HINT = (
    "peers run mlx-lm on the server's weights and live in the mlxserve repository, not in the "
    "client: in a checkout (`make install`), run `python -m bench.compare --spawn-server "
    "--peer NAME ...` from its root"
)


def checkout_peers() -> ModuleType | None:
    """The peers module of a repository checkout, or None where it is not importable."""
    try:
        module = importlib.import_module(PEERS_MODULE)
    except ModuleNotFoundError as err:
        if err.name in ("bench", PEERS_MODULE):
            return None
        raise
    return module if isinstance(getattr(module, "PEERS", None), Mapping) else None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,4,8,16: {err}") from err
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected e.g. 0.5,1,2: {err}") from err
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError("rates must be positive")
    return values


def _length(text: str) -> str:
    try:
        return str(LengthDist.parse(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def add_bench_arguments(parser: argparse.ArgumentParser, peers: ModuleType | None = None) -> None:
    """The harness's options; with `peers` (see PEERS_MODULE), --peer's choices and their own."""
    d = Workload()
    load = parser.add_argument_group("load pattern")
    load.add_argument(
        "--arrival",
        choices=ARRIVALS,
        default=d.arrival,
        help="burst: rounds of C requests at once (default); closed: C workers "
        "back to back; poisson: open loop at --rate",
    )
    load.add_argument(
        "--concurrency",
        type=_int_list,
        default=d.concurrency,
        help="comma-separated levels C (default 1,4,8,16)",
    )
    load.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="burst: rounds of C requests per level; closed: C*rounds requests",
    )
    load.add_argument(
        "--min-requests",
        type=int,
        default=d.min_requests,
        help="burst/closed: more rounds where C*rounds is fewer requests than this (default 0)",
    )
    load.add_argument(
        "--rate",
        type=_float_list,
        default=d.rates,
        help="poisson: offered load(s) in requests/s, comma-separated",
    )
    load.add_argument("--duration", type=float, help="poisson: seconds of arrivals per rate")
    load.add_argument("--num-requests", type=int, help="poisson: requests per rate")
    load.add_argument(
        "--max-tokens",
        type=_length,
        default=d.max_tokens,
        help="completion length: N, fixed:N or uniform:A-B (default fixed:64)",
    )
    load.add_argument(
        "--prompt-len",
        type=_length,
        help="prompt tokens (rendered chat): fixed:N or uniform:A-B; questions "
        "padded with filler text (default: the questions as they are)",
    )
    load.add_argument(
        "--warmup",
        type=int,
        default=d.warmup,
        help="untimed requests, one at a time, before the first level (default 1)",
    )
    load.add_argument(
        "--warmup-rounds",
        type=int,
        default=d.warmup_rounds,
        help="untimed rounds of each level's shape before it (default 0)",
    )
    load.add_argument("--seed", type=int, default=d.seed, help="plan seed (lengths, arrivals)")
    load.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="send cache_prompt=false (default: the server's setting)",
    )

    srv = parser.add_argument_group("servers and peers")
    srv.add_argument(
        "--spawn-server",
        action="store_true",
        help="start `python -m service` on a free port instead of using --target",
    )
    srv.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the spawned server, one shell-quoted string; "
        "without --parallel it gets --parallel <largest C>, without --max-queue-depth "
        "max(32, largest C)",
    )
    srv.add_argument(
        "--model",
        help="model directory for our server and the peers (default: the embedded SmolLM2)",
    )
    srv.add_argument(
        "--load-format",
        default="auto",
        help="auto, or dummy:PRESET (random weights of a preset's shape)",
    )
    srv.add_argument("--dtype", default="auto", help="auto|float32|bfloat16 (server and peers)")
    if peers is None:
        # Accepted, so that run_bench can say where peers are instead of argparse's "unrecognized".
        srv.add_argument(
            "--peer",
            action="append",
            default=[],
            metavar="NAME",
            help="also measure a peer on the same plan (needs the repository checkout's "
            "bench/peers/)",
        )
    else:
        srv.add_argument(
            "--peer",
            action="append",
            choices=sorted(peers.PEERS),
            default=[],
            help="also measure a peer on the same plan, after ours (repeatable)",
        )
        peers.add_arguments(srv)

    out = parser.add_argument_group("report")
    out.add_argument("--out", type=Path, help="JSON path (default bench/out/bench-TIME.json)")
    out.add_argument("--log-dir", type=Path, help="server logs (default: beside --out)")
    out.add_argument("--title", default="", help="plot title")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    out.add_argument(
        "--deadline",
        type=float,
        help="Unix time after which no further peer is started (they are noted as skipped)",
    )
    out.add_argument("--ready-timeout", type=float, default=300.0)
    out.add_argument("--request-timeout", type=float, default=600.0)
    out.add_argument(
        "--channels",
        type=int,
        default=8,
        help="gRPC channels (each its own connection) the requests are spread over, as several "
        "callers would open them: one connection reaches one of the server's front ends",
    )
    out.add_argument(
        "--client-processes",
        type=int,
        default=1,
        help="client processes sending our server's requests (the channels are divided among "
        "them): one process's grpc.aio caps the tokens/s it can receive",
    )


def default_out_path() -> Path:
    return Path("bench/out") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"


def _progress_printer() -> Progress:
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[bench +{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    return progress


def _server_args(args: argparse.Namespace, workload: Workload) -> list[str]:
    extra = shlex.split(args.server_args)
    # The server's default batch (--parallel 4) would cap every level above 4.
    if not any(a in ("--parallel", "-np") or a.startswith("--parallel=") for a in extra):
        extra += ["--parallel", str(max(workload.concurrency))]
    # A burst of C requests must not overflow the waiting queue before the batch takes them
    # (mlx_lm.server has no queue limit): the queue is made at least as deep as the largest C.
    if not any(a == "--max-queue-depth" or a.startswith("--max-queue-depth=") for a in extra):
        extra += ["--max-queue-depth", str(max(32, *workload.concurrency))]
    if args.model and "--model" not in extra:
        extra += ["--model", args.model]
    if args.load_format != "auto" and "--load-format" not in extra:
        extra += ["--load-format", args.load_format]
    if args.dtype != "auto" and "--dtype" not in extra:
        extra += ["--dtype", args.dtype]
    return extra


def _server_snapshot(target: str, connection: dict[str, Any]) -> dict[str, Any]:
    """Model info and cache stats as JSON-ready dicts (empty where an RPC fails)."""
    snapshot: dict[str, Any] = {}
    with GenerationClient(target, **connection) as client:
        for key, call in (("model_info", client.model_info), ("cache_stats", client.cache_stats)):
            try:
                snapshot[key] = json_format.MessageToDict(
                    call(timeout=10), preserving_proto_field_name=True
                )
            except grpc.RpcError as err:
                snapshot[key] = {"error": f"{err.code().name}: {err.details()}"}
    return snapshot


def git_state(root: Path | None = CHECKOUT_ROOT) -> dict[str, Any]:
    """The commit of the checkout at `root` (default: this one, the server's code when it is
    spawned from here); {} outside one, and for a tree copied out of git into another checkout
    (whose commit is not the tree's)."""
    if root is None:
        return {}

    def git(*argv: str) -> str:
        done = subprocess.run(
            ["git", *argv],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != root.resolve():
            return {}
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain"))}
    except (OSError, subprocess.SubprocessError):
        return {}


def _plan_summary(plan: Plan) -> dict[str, Any]:
    prompt_tokens = [s.prompt_tokens for lv in plan.levels for s in lv.requests if s.prompt_tokens]
    max_tokens = [s.max_tokens for lv in plan.levels for s in lv.requests]
    return {
        "levels": [
            {"level": lv.label, "requests": len(lv.requests), "warmup_batches": len(lv.warmup)}
            for lv in plan.levels
        ],
        "prompt_tokens": {
            "min": min(prompt_tokens),
            "max": max(prompt_tokens),
            "mean": sum(prompt_tokens) / len(prompt_tokens),
        }
        if prompt_tokens
        else None,
        "max_tokens": {"min": min(max_tokens), "max": max(max_tokens)} if max_tokens else None,
    }


def _exit_on_sigterm() -> None:
    """SIGTERM (e.g. from `timeout`) unwinds like an exception, so spawned servers are stopped."""

    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def run_bench(args: argparse.Namespace, peers: Mapping[str, PeerRun] | None = None) -> int:
    """One harness run from add_bench_arguments' options; `peers` are what --peer may name."""
    unknown = [name for name in args.peer if name not in (peers or {})]
    if unknown:
        raise ValueError(f"--peer {', '.join(unknown)}: {PEERS_HINT}")
    _exit_on_sigterm()
    progress = _progress_printer()
    workload = Workload(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        prompt_len=args.prompt_len,
        rounds=args.rounds,
        min_requests=args.min_requests,
        arrival=args.arrival,
        rates=args.rate,
        duration=args.duration,
        num_requests=args.num_requests,
        warmup=args.warmup,
        warmup_rounds=args.warmup_rounds,
        seed=args.seed,
        cache_prompt=False if args.no_prompt_cache else None,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path: Path = args.out or default_out_path()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_dir: Path = args.log_dir or out_path.parent
    log_dir.mkdir(parents=True, exist_ok=True)
    log_stem = log_dir / out_path.stem
    meta: dict[str, Any] = {
        "timestamp": stamp,
        "argv": sys.argv,
        "workload": workload.to_dict(),
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        "grpc_version": grpc.__version__,
        "git": git_state(),
        "load_format": args.load_format,
        "dtype": args.dtype,
    }

    server: ServerProcess | None = None
    target = args.target
    connection = connection_kwargs(args)  # TLS and token, for a --target that needs them
    try:
        if args.spawn_server:
            server = ServerProcess(
                _server_args(args, workload),
                log_path=Path(f"{log_stem}.server.log"),
                ready_timeout=args.ready_timeout,
            )
            progress(f"starting server: {shlex.join(server.command)} (log {server.log_path})")
            server.start()
            target = server.target
            meta["server_command"] = server.command
        else:
            with GenerationClient(target, **connection) as client:
                client.wait_ready(args.ready_timeout)  # SERVING: the model is loaded
        meta["target"] = target
        meta["server_before"] = _server_snapshot(target, connection)
        plan = build_plan(workload, count_tokens_via_rpc(target, **connection))
        meta["plan"] = _plan_summary(plan)
        progress(f"server SERVING at {target}; plan {meta['plan']}")
        ours = GrpcTarget(
            target,
            request_timeout=args.request_timeout,
            channels=args.channels,
            processes=args.client_processes,
            **connection,
        ).run(plan, progress)
        meta["server_after"] = _server_snapshot(target, connection)
    finally:
        if server is not None:
            progress("stopping server")
            server.stop()

    peer_levels: dict[str, list[LevelResult]] = {}
    meta["peers"] = {}
    # Written after each stage, so a run cut short (a device time limit) keeps what it measured.
    report.write_json(out_path, meta, ours, peer_levels)
    for name in dict.fromkeys(args.peer):
        if args.deadline is not None and time.time() > args.deadline:
            progress(f"{name}: skipped (past --deadline)")
            meta["peers"][name] = {"skipped": "past --deadline"}
            continue
        if server is None:
            progress(f"note: {target} stays up (idle) while {name} runs")
        assert peers is not None  # checked above
        try:
            peer_levels[name], meta["peers"][name] = peers[name](plan, progress, args, log_stem)
        except Exception as err:  # a failed peer must not lose our results
            progress(f"{name} FAILED: {type(err).__name__}: {err}")
            meta["peers"][name] = {"error": f"{type(err).__name__}: {err}"}
        report.write_json(out_path, meta, ours, peer_levels)

    print(report.format_table(report.comparison_rows(ours, peer_levels), list(peer_levels)))
    for name, levels in peer_levels.items():
        if any(level.requests for level in levels):
            print(report.format_target_table(name, levels))
    meta["host"]["loadavg_end"] = os.getloadavg()
    report.write_json(out_path, meta, ours, peer_levels)
    print(f"wrote {out_path}")
    if not args.no_plot:
        plot_path = out_path.with_suffix(".png")
        title = args.title or _default_title(args, workload)
        if report.write_plot(plot_path, ours, peer_levels, title):
            print(f"wrote {plot_path}")
    return 0


def _default_title(args: argparse.Namespace, workload: Workload) -> str:
    model = args.model or (args.load_format if args.load_format != "auto" else "embedded SmolLM2")
    return (
        f"{model}, dtype {args.dtype}, {workload.arrival} arrivals, "
        f"max_tokens {workload.max_tokens}, {platform.node()}"
    )
