"""`python -m client bench`: options and orchestration (workload -> targets -> report)."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from client.bench import report
from client.bench.grpc_target import GrpcTarget
from client.bench.metrics import LevelResult
from client.bench.server import ServerProcess
from client.bench.workload import Workload
from client.client import GenerationClient

PEERS = ("mlx-lm-batch",)


def _concurrency_list(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected e.g. 1,4,8,16: {err}") from err
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Workload()
    parser.add_argument(
        "--concurrency",
        type=_concurrency_list,
        default=defaults.concurrency,
        help="comma-separated levels (default 1,4,8,16)",
    )
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument(
        "--rounds", type=int, default=defaults.rounds, help="rounds of C requests per level"
    )
    parser.add_argument(
        "--no-prompt-cache",
        action="store_true",
        help="send cache_prompt=false (default: the server's setting)",
    )
    parser.add_argument(
        "--spawn-server",
        action="store_true",
        help="start `python -m service` on a free port for the run instead of using --target",
    )
    parser.add_argument(
        "--server-args",
        default="",
        help="extra arguments for the spawned server, one shell-quoted string; without "
        "--parallel the server gets --parallel <largest C>",
    )
    parser.add_argument(
        "--model", help="model directory for the spawned server and the peer (default: embedded)"
    )
    parser.add_argument(
        "--peer",
        action="append",
        choices=PEERS,
        default=[],
        help="also measure a peer on the same workload, after our sweep",
    )
    parser.add_argument("--out", type=Path, help="JSON path (default bench/out/bench-TIME.json)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
    parser.add_argument("--ready-timeout", type=float, default=180.0)
    parser.add_argument("--request-timeout", type=float, default=600.0)


def _progress_printer() -> Callable[[str], None]:
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[bench +{time.monotonic() - started:6.1f}s] {line}", file=sys.stderr, flush=True)

    return progress


def _server_args(args: argparse.Namespace, workload: Workload) -> list[str]:
    extra = shlex.split(args.server_args)
    # The server's default batch (--parallel 4) would cap every level above 4.
    if not any(a in ("--parallel", "-np") or a.startswith("--parallel=") for a in extra):
        extra += ["--parallel", str(max(workload.concurrency))]
    if args.model and "--model" not in extra:
        extra += ["--model", args.model]
    return extra


def _server_snapshot(target: str) -> dict[str, Any]:
    """Model info and cache stats as JSON-ready dicts (empty where an RPC fails)."""
    snapshot: dict[str, Any] = {}
    with GenerationClient(target) as client:
        for key, call in (("model_info", client.model_info), ("cache_stats", client.cache_stats)):
            try:
                snapshot[key] = json_format.MessageToDict(
                    call(timeout=10), preserving_proto_field_name=True
                )
            except grpc.RpcError as err:
                snapshot[key] = {"error": f"{err.code().name}: {err.details()}"}
    return snapshot


def _run_peer(name: str, workload: Workload, progress: Callable[[str], None], model: str | None):
    if name == "mlx-lm-batch":
        from client.bench.peer_mlx_lm_batch import run_peer

        return run_peer(workload, progress, model=model)
    raise ValueError(f"unknown peer {name!r}")


def run_bench(args: argparse.Namespace) -> int:
    progress = _progress_printer()
    workload = Workload(
        concurrency=args.concurrency,
        max_tokens=args.max_tokens,
        rounds=args.rounds,
        cache_prompt=False if args.no_prompt_cache else None,
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out_path: Path = args.out or Path("bench/out") / f"bench-{stamp}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    meta: dict[str, Any] = {
        "timestamp": stamp,
        "workload": workload.to_dict(),
        "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
        "grpc_version": grpc.__version__,
    }

    server: ServerProcess | None = None
    target = args.target
    try:
        if args.spawn_server:
            server = ServerProcess(
                _server_args(args, workload),
                log_path=out_path.with_suffix(".server.log"),
                ready_timeout=args.ready_timeout,
            )
            progress(f"starting server: {shlex.join(server.command)} (log {server.log_path})")
            server.start()
            target = server.target
            meta["server_command"] = server.command
        meta["target"] = target
        progress(f"server SERVING at {target}; sweep C={list(workload.concurrency)}")
        meta["server_before"] = _server_snapshot(target)
        ours = GrpcTarget(target, request_timeout=args.request_timeout).run(workload, progress)
        meta["server_after"] = _server_snapshot(target)
    finally:
        if server is not None:
            progress("stopping server")
            server.stop()

    peers: dict[str, list[LevelResult]] = {}
    for name in dict.fromkeys(args.peer):
        if server is None:
            progress(f"note: {target} stays up (idle) while {name} runs")
        peers[name] = _run_peer(name, workload, progress, args.model)

    print(report.format_table(report.comparison_rows(ours, peers), list(peers)))
    verdict = report.scaling_verdict(ours)
    if verdict:
        print(verdict)
    report.write_json(out_path, meta, ours, peers)
    print(f"wrote {out_path}")
    if not args.no_plot:
        plot_path = out_path.with_suffix(".png")
        if report.write_plot(plot_path, ours, peers):
            print(f"wrote {plot_path}")
    return 0
