"""Serving overhead on the CPU: what the serving stack costs per generated token, measured where
the model costs next to nothing (not a test).

Starts our server on `dummy:tiny-vocab` (one narrow layer, a 512-token vocabulary: see
service/core/models/presets.py) with --max-batch-size C and --max-queue-depth C, and drives it
closed-loop at C concurrent requests (default 256): token-id prompts (random ids below the
vocabulary, a fresh prompt per request, so no prompt prefix is shared), ignore_eos, a fixed
completion length, over several gRPC channels (each its own connection) from one or more client
processes using grpc.aio, streaming (StreamGenerate) or --unary (Generate). After --warmup
seconds of load it measures --rounds consecutive windows of --window seconds, and per window:

- generated tokens/s received through gRPC (streamed tokens by arrival; unary requests' tokens
  when they complete);
- CPU microseconds per generated token (user + system, all threads, from /proc/PID/stat) of the
  engine core (the launcher's child that maps libmlx), of the front ends (the launcher, which is
  front end 0, and its other children) and of the client processes, with the cores each used;
  the core's split by thread (/proc/PID/task): its engine threads (named by the server), MLX's
  stream threads and OpenBLAS's, and its transport (main thread, ZeroMQ's);
- with --metrics (the server then keeps its Prometheus metrics, which costs the front ends CPU),
  the engine core's steps per second and the share of them planned only after the step before
  was read (`mlxserve_core_steps_total{pipeline="serial"}`: admissions, prefills, ...);
- the other load on the machine: its busy CPU time (/proc/stat) less ours, in cores, and the
  1-minute load average before the window.

It prints a table per window plus the median and range, and writes JSON (--out) with the git
commit, the server command, the per-process figures and every window.

    PYTHONPATH=. .venv/bin/python -m bench.serving_overhead [--api-workers 2] [--channels 8]
        [--unary] [--client-procs 2] [--rounds 3] [--out FILE.json]

The server runs with one OpenBLAS thread (--blas-threads): this model's matmuls gain nothing
from a second, and OpenBLAS's idle worker would spin on a core between them, billed to the core
as if it were serving work. (The server preloads OpenBLAS for MLX by itself; this process
imports neither MLX nor the server.)
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import multiprocessing as mp
import os
import platform
import random
import shlex
import statistics
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from client.bench.cli import git_state
from client.bench.server import ServerProcess, free_port
from client.client import GenerationClient, build_request, to_stream_request
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.os_thread import ENGINE_THREAD, UPDATE_THREAD

ROOT = Path(__file__).resolve().parents[1]

PRESET = "tiny-vocab"
VOCAB = 512  # the preset's vocabulary: prompt ids must stay below it
FIRST_PLAIN_ID = 17  # the embedded tokenizer's special tokens come first
CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- /proc ------------------------------------------------------------------------------------


def parse_stat(text: str) -> tuple[int, int]:
    """(ppid, utime + stime in clock ticks) from a /proc/PID/stat line. The command name, in
    parentheses, may itself hold spaces and parentheses: the fields after the last ')' count."""
    fields = text.rsplit(")", 1)[1].split()
    return int(fields[1]), int(fields[11]) + int(fields[12])


def cpu_ticks(pid: int) -> int | None:
    """The process's CPU time so far (all threads), or None once it is gone."""
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]
    except (OSError, IndexError, ValueError):
        return None


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if parse_stat(stat.read_text())[0] == pid:
                out.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return sorted(out)


# The engine core's threads by what they do: the engine's (the loop's, and the one that reads a
# step beside the next one's dispatch: service.common.os_thread names them), MLX's stream
# threads and OpenBLAS's (they keep the process's name), and the transport (the main thread's
# ZeroMQ sockets, ZeroMQ's own I/O threads).
THREAD_ROLES = ("engine", "mlx", "transport")


def thread_role(pid: int, tid: int, name: str) -> str:
    if name in (ENGINE_THREAD, UPDATE_THREAD):
        return "engine"
    if tid == pid or name.startswith("ZMQbg"):
        return "transport"
    return "mlx"


def thread_ticks(pid: int) -> dict[str, int]:
    """The process's CPU time so far by thread role (THREAD_ROLES), in clock ticks."""
    out = dict.fromkeys(THREAD_ROLES, 0)
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
            name = text[text.index("(") + 1 : text.rindex(")")]
            out[thread_role(pid, int(stat.parent.name), name)] += parse_stat(text)[1]
        except (OSError, IndexError, ValueError):
            continue
    return out


def _maps_mlx(pid: int) -> bool:
    try:
        return "libmlx" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def server_processes(launcher: int) -> dict[str, list[int]]:
    """The server's processes by role: the launcher is front end 0; of its children, those that
    map MLX are the engine core (one per tensor-parallel rank), multiprocessing's resource
    tracker is `other`, and the rest are front ends."""
    roles: dict[str, list[int]] = {"core": [], "frontend": [launcher], "other": []}
    for pid in children(launcher):
        if _maps_mlx(pid):
            roles["core"].append(pid)
        elif "resource_tracker" in _cmdline(pid):
            roles["other"].append(pid)
        else:
            roles["frontend"].append(pid)
    return roles


def parse_machine_ticks(text: str) -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs from /proc/stat's first line (guest time is
    already inside user time, so it is not added again)."""
    name, *values = text.splitlines()[0].split()
    assert name == "cpu", name
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in values[:8])
    busy = user + nice + system + irq + softirq + steal
    return busy, busy + idle + iowait


def machine_ticks() -> tuple[int, int]:
    return parse_machine_ticks(Path("/proc/stat").read_text())


# -- the load generator (client processes) ----------------------------------------------------


@dataclass
class ClientPlan:
    target: str
    workers: int
    channels: int
    prompt_len: int
    max_tokens: int
    unary: bool
    temperature: float
    seed: int
    request_timeout: float


@dataclass
class ClientResult:
    tokens: list[int] = field(default_factory=list)  # per window
    messages: list[int] = field(default_factory=list)
    completed: list[int] = field(default_factory=list)
    errors: list[int] = field(default_factory=list)
    cpu_ticks: list[int] = field(default_factory=list)  # at each boundary
    error_samples: list[str] = field(default_factory=list)


async def _client_main(plan: ClientPlan, conn: Connection) -> None:
    loop = asyncio.get_running_loop()
    options = [
        # Each channel its own connection: channels with equal arguments share subchannels.
        ("grpc.use_local_subchannel_pool", 1),
        ("grpc.max_receive_message_length", 64 << 20),
    ]
    channels = [
        grpc.aio.insecure_channel(plan.target, options=options) for _ in range(plan.channels)
    ]
    stubs = [pb_grpc.GenerationServiceStub(channel) for channel in channels]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), timeout=60)
    boundaries: list[float] = []
    windows = 0
    result = ClientResult()

    def window_of(now: float) -> int:
        """The window index of a time, or -1 outside every window."""
        k = bisect.bisect_right(boundaries, now) - 1
        return k if 0 <= k < windows else -1

    def new_request(rng: random.Random) -> pb.GenerateRequest:
        return build_request(
            token_ids=[rng.randrange(FIRST_PLAIN_ID, VOCAB) for _ in range(plan.prompt_len)],
            max_tokens=plan.max_tokens,
            temperature=plan.temperature,
            ignore_eos=True,
        )

    async def worker(index: int) -> None:
        stub = stubs[index % len(stubs)]
        rng = random.Random(plan.seed * 1_000_003 + index)
        while True:
            request = new_request(rng)
            try:
                if plan.unary:
                    response = await stub.Generate(request, timeout=plan.request_timeout)
                    k = window_of(time.monotonic())
                    if k >= 0:
                        result.tokens[k] += len(response.token_ids)
                        result.messages[k] += 1
                        result.completed[k] += 1
                    continue
                call = stub.StreamGenerate(to_stream_request(request), timeout=plan.request_timeout)
                async for message in call:
                    k = window_of(time.monotonic())
                    if k >= 0:
                        result.tokens[k] += len(message.token_ids)
                        result.messages[k] += 1
                k = window_of(time.monotonic())
                if k >= 0:
                    result.completed[k] += 1
            except grpc.RpcError as err:
                k = window_of(time.monotonic())
                if k >= 0:
                    result.errors[k] += 1
                if len(result.error_samples) < 5:
                    result.error_samples.append(f"{err.code().name}: {err.details()}")
                await asyncio.sleep(0.05)

    tasks = [asyncio.create_task(worker(i)) for i in range(plan.workers)]
    conn.send(("started", time.monotonic()))
    boundaries = await loop.run_in_executor(None, conn.recv)
    windows = len(boundaries) - 1
    for name in ("tokens", "messages", "completed", "errors"):
        setattr(result, name, [0] * windows)
    for boundary in boundaries:
        await asyncio.sleep(max(0.0, boundary - time.monotonic()))
        result.cpu_ticks.append(cpu_ticks(os.getpid()) or 0)
    # The load goes on until the server's last sample is taken.
    await loop.run_in_executor(None, conn.recv)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close(grace=None)
    conn.send(("done", result))


def client_process(plan: ClientPlan, conn: Connection) -> None:
    """A client process's entry point (multiprocessing, spawn)."""
    asyncio.run(_client_main(plan, conn))


# -- orchestration ----------------------------------------------------------------------------


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def server_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--load-format",
        f"dummy:{PRESET}",
        "--max-batch-size",
        str(args.concurrency),
        "--max-queue-depth",
        str(args.concurrency),
        "--api-workers",
        str(args.api_workers),
        *shlex.split(args.server_args),
    ]


def _steps(metrics_url: str) -> dict[str, float]:
    """The engine core's steps so far, by pipeline (`mlxserve_core_steps_total`)."""
    with urllib.request.urlopen(metrics_url, timeout=5) as reply:
        text = reply.read().decode()
    return {
        sample.labels["pipeline"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "mlxserve_core_steps"
        for sample in family.samples
    }


def _sample(roles: dict[str, list[int]], target: str, metrics_url: str | None) -> dict[str, Any]:
    """The server's CPU ticks per process, the machine's, the batch state and the engine
    core's steps, now."""
    busy, total = machine_ticks()
    sample: dict[str, Any] = {
        "time": time.monotonic(),
        "loadavg_1m": os.getloadavg()[0],
        "machine_busy": busy,
        "machine_total": total,
        "ticks": {str(pid): cpu_ticks(pid) for pids in roles.values() for pid in pids},
        "core_threads": {str(pid): thread_ticks(pid) for pid in roles["core"]},
    }
    try:
        with GenerationClient(target) as client:
            stats = client.cache_stats(timeout=5)
        sample["active_sequences"] = stats.active_sequences
        sample["queued_requests"] = stats.queued_requests
    except grpc.RpcError as err:
        sample["stats_error"] = f"{err.code().name}: {err.details()}"
    if metrics_url is not None:
        try:
            sample["steps"] = _steps(metrics_url)
        except OSError as err:
            sample["steps_error"] = str(err)
    return sample


def _window(
    k: int,
    start: dict[str, Any],
    end: dict[str, Any],
    roles: dict[str, list[int]],
    clients: list[ClientResult],
) -> dict[str, Any]:
    seconds = end["time"] - start["time"]
    tokens = sum(c.tokens[k] for c in clients)

    def role_seconds(pids: list[int]) -> float:
        used = 0
        for pid in pids:
            a, b = start["ticks"].get(str(pid)), end["ticks"].get(str(pid))
            if a is not None and b is not None:
                used += b - a
        return used / CLK_TCK

    core = role_seconds(roles["core"])
    frontend = role_seconds(roles["frontend"])
    other = role_seconds(roles["other"])
    client = sum(c.cpu_ticks[k + 1] - c.cpu_ticks[k] for c in clients) / CLK_TCK
    machine_busy = (end["machine_busy"] - start["machine_busy"]) / CLK_TCK

    def per_token(cpu: float) -> float | None:
        return 1e6 * cpu / tokens if tokens else None

    steps: dict[str, float] = {}  # by pipeline; empty without --metrics (or a failed scrape)
    if "steps" in start and "steps" in end:
        steps = {
            k: end["steps"].get(k, 0) - start["steps"].get(k, 0) for k in ("overlapped", "serial")
        }
    total_steps = sum(steps.values())

    def thread_seconds(role: str) -> float:
        used = 0
        for pid in roles["core"]:
            a, b = start["core_threads"].get(str(pid)), end["core_threads"].get(str(pid))
            if a is not None and b is not None:
                used += max(0, b[role] - a[role])  # a thread that ended took its ticks along
        return used / CLK_TCK

    by_thread = {
        f"core_{role}_us_per_token": per_token(thread_seconds(role)) for role in THREAD_ROLES
    }

    return {
        "window": k + 1,
        "seconds": seconds,
        "loadavg_1m_before": start["loadavg_1m"],
        "tokens": tokens,
        "tokens_per_second": tokens / seconds,
        "messages": sum(c.messages[k] for c in clients),
        "completed": sum(c.completed[k] for c in clients),
        "errors": sum(c.errors[k] for c in clients),
        "core_cpu_seconds": core,
        "frontend_cpu_seconds": frontend,
        "client_cpu_seconds": client,
        "core_us_per_token": per_token(core),
        # The core's by thread role (THREAD_ROLES): engine, MLX's streams, transport.
        **by_thread,
        "frontend_us_per_token": per_token(frontend),
        "client_us_per_token": per_token(client),
        "core_cores": core / seconds,
        "frontend_cores": frontend / seconds,
        "client_cores": client / seconds,
        "frontend_cores_by_pid": {
            str(pid): ((end["ticks"][str(pid)] or 0) - (start["ticks"][str(pid)] or 0))
            / CLK_TCK
            / seconds
            for pid in roles["frontend"]
        },
        # Everything else the machine ran meanwhile (other users, our own stray processes).
        "others_cores": max(0.0, machine_busy - core - frontend - other - client) / seconds,
        # The engine's steps, and the share of them planned only after the one before was read.
        "steps_per_second": total_steps / seconds if steps else None,
        "serial_step_share": steps["serial"] / total_steps if total_steps else None,
        "active_sequences_after": end.get("active_sequences"),
        "queued_requests_after": end.get("queued_requests"),
    }


SUMMARY_KEYS = (
    "tokens_per_second",
    "core_us_per_token",
    "core_engine_us_per_token",
    "core_mlx_us_per_token",
    "core_transport_us_per_token",
    "frontend_us_per_token",
    "client_us_per_token",
    "core_cores",
    "frontend_cores",
    "client_cores",
    "others_cores",
    "loadavg_1m_before",
    "steps_per_second",
    "serial_step_share",
)


def summarize(windows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out = {}
    for key in SUMMARY_KEYS:
        values = [w[key] for w in windows if w.get(key) is not None]
        if values:
            out[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    return out


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def format_table(windows: list[dict[str, Any]], summary: dict[str, dict[str, float]]) -> str:
    header = [
        "window",
        "load1",
        "others",
        "tok/s",
        "core us/tok",
        "engine",
        "mlx",
        "fe us/tok",
        "client us/tok",
        "core",
        "fe",
        "client",
        "msgs/tok",
        "steps/s",
        "serial",
        "errors",
    ]

    def cells(w: dict[str, Any]) -> list[str]:
        return [
            str(w["window"]),
            f"{w['loadavg_1m_before']:.2f}",
            f"{w['others_cores']:.2f}",
            f"{w['tokens_per_second']:.0f}",
            f"{w['core_us_per_token']:.1f}",
            _fmt(w.get("core_engine_us_per_token"), ".1f"),
            _fmt(w.get("core_mlx_us_per_token"), ".1f"),
            f"{w['frontend_us_per_token']:.1f}",
            f"{w['client_us_per_token']:.1f}",
            f"{w['core_cores']:.2f}",
            f"{w['frontend_cores']:.2f}",
            f"{w['client_cores']:.2f}",
            f"{w['messages'] / w['tokens']:.2f}" if w["tokens"] else "-",
            _fmt(w["steps_per_second"], ".0f"),
            _fmt(w["serial_step_share"], ".2f"),
            str(w["errors"]),
        ]

    def summary_cells(stat: str) -> list[str]:
        def value(key: str, fmt: str) -> str:
            if key not in summary:
                return "-"
            if stat == "range":
                low, high = summary[key]["min"], summary[key]["max"]
                return f"{low:{fmt}}-{high:{fmt}}"
            return f"{summary[key]['median']:{fmt}}"

        return [
            stat,
            value("loadavg_1m_before", ".2f"),
            value("others_cores", ".2f"),
            value("tokens_per_second", ".0f"),
            value("core_us_per_token", ".1f"),
            value("core_engine_us_per_token", ".1f"),
            value("core_mlx_us_per_token", ".1f"),
            value("frontend_us_per_token", ".1f"),
            value("client_us_per_token", ".1f"),
            value("core_cores", ".2f"),
            value("frontend_cores", ".2f"),
            value("client_cores", ".2f"),
            "",
            value("steps_per_second", ".0f"),
            value("serial_step_share", ".2f"),
            "",
        ]

    rows = [cells(w) for w in windows] + [summary_cells("median"), summary_cells("range")]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in [header, *rows]]
    lines.append(
        "(us/tok: CPU microseconds per generated token; engine / mlx: the core's on its engine "
        "threads / on MLX's stream threads (the rest is its transport); "
        "core/fe/client/others: cores in use; "
        "load1: 1-minute load average before the window; serial: the share of the engine's "
        "steps planned after the step before was read)"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_path = args.out.with_suffix(".server.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "meta": {
            "timestamp": stamp,
            "argv": sys.argv,
            "git": git_state(),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "grpc_version": grpc.__version__,
            "workload": {
                "preset": PRESET,
                "concurrency": args.concurrency,
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "rpc": "Generate" if args.unary else "StreamGenerate",
                "channels": args.channels,
                "client_processes": args.client_procs,
                "temperature": args.temperature,
                "warmup_seconds": args.warmup,
                "window_seconds": args.window,
                "blas_threads": args.blas_threads or None,
            },
        }
    }
    flags, metrics_url = server_flags(args), None
    if args.metrics:
        port = free_port()
        flags += ["--metrics-port", str(port)]
        metrics_url = f"http://127.0.0.1:{port}/metrics"
    server = ServerProcess(flags, log_path=log_path, ready_timeout=300.0)
    if args.blas_threads:
        server.env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    print(f"starting: {shlex.join(server.command)} (log {log_path})", file=sys.stderr)
    server.start()
    ctx = mp.get_context("spawn")
    procs: list[mp.process.BaseProcess] = []
    pipes: list[Connection] = []
    try:
        roles = server_processes(server._proc.pid)  # type: ignore[union-attr]
        if len(roles["core"]) != 1 or len(roles["frontend"]) != args.api_workers:
            raise RuntimeError(f"unexpected server processes: {roles}")
        with GenerationClient(server.target) as client:
            info = client.model_info(timeout=10)
        document["meta"]["server_command"] = server.command
        document["meta"]["processes"] = roles
        document["meta"]["model"] = {
            "model_id": info.model_id,
            "vocab_size": info.vocab_size,
            "num_layers": info.num_layers,
            "dtype": info.dtype,
            "decode_path": info.decode_path,
            "storage_backend": info.storage_backend,
            "max_batch_size": info.max_batch_size,
        }
        channels = _split(args.channels, args.client_procs)
        for index, workers in enumerate(_split(args.concurrency, args.client_procs)):
            plan = ClientPlan(
                target=server.target,
                workers=workers,
                channels=max(1, channels[index]),
                prompt_len=args.prompt_len,
                max_tokens=args.max_tokens,
                unary=args.unary,
                temperature=args.temperature,
                seed=args.seed + index,
                request_timeout=args.request_timeout,
            )
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=client_process, args=(plan, theirs), daemon=True)
            proc.start()
            procs.append(proc)
            pipes.append(ours)
        started = [_recv(pipe, 120, "started")[1] for pipe in pipes]
        first = max(started) + args.warmup
        boundaries = [first + k * args.window for k in range(args.rounds + 1)]
        for pipe in pipes:
            pipe.send(boundaries)
        print(
            f"load running (C={args.concurrency}, {args.channels} channels, "
            f"{args.client_procs} client process(es)); warm-up {args.warmup:g}s, then "
            f"{args.rounds} x {args.window:g}s",
            file=sys.stderr,
        )
        samples = []
        for boundary in boundaries:
            time.sleep(max(0.0, boundary - time.monotonic()))
            samples.append(_sample(roles, server.target, metrics_url))
        for pipe in pipes:
            pipe.send("stop")
        results: list[ClientResult] = [_recv(pipe, 60, "done")[1] for pipe in pipes]
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        print("stopping server", file=sys.stderr)
        server.stop()
    windows = [_window(k, samples[k], samples[k + 1], roles, results) for k in range(args.rounds)]
    document["windows"] = windows
    document["summary"] = summarize(windows)
    document["client_error_samples"] = [s for r in results for s in r.error_samples]
    return document


def _recv(pipe: Connection, timeout: float, kind: str) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError(f"no {kind!r} from a client process within {timeout:g}s")
    message = pipe.recv()
    if message[0] != kind:
        raise RuntimeError(f"expected {kind!r} from a client process, got {message[0]!r}")
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/serving_overhead.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    a = parser.add_argument
    a("--concurrency", type=int, default=256, help="requests in flight (closed loop) = batch size")
    a("--prompt-len", type=int, default=32, help="prompt tokens (random ids below the vocabulary)")
    a("--max-tokens", type=int, default=128, help="generated tokens per request (EOS ignored)")
    a("--temperature", type=float, default=0.0, help="0: greedy")
    a("--channels", type=int, default=8, help="gRPC channels (connections), over the clients")
    a("--client-procs", type=int, default=1, help="client processes sharing the load")
    a("--unary", action="store_true", help="Generate instead of StreamGenerate")
    a("--api-workers", type=int, default=1, help="the server's front-end processes")
    a("--server-args", default="", help="more server flags, one shell-quoted string")
    a(
        "--blas-threads",
        type=int,
        default=1,
        help="the server's OPENBLAS_NUM_THREADS (0: OpenBLAS's default, a thread per core). "
        "One by default: this model's matmuls are too small to split, and OpenBLAS's idle "
        "workers spin on a core between them",
    )
    a(
        "--metrics",
        action="store_true",
        help="serve Prometheus metrics (--metrics-port) and report the engine's steps per "
        "window; the metrics cost the front ends CPU",
    )
    a("--warmup", type=float, default=10.0, help="seconds of load before the first window")
    a("--window", type=float, default=20.0, help="seconds per measured window")
    a("--rounds", type=int, default=3, help="measured windows, back to back")
    a("--seed", type=int, default=0)
    a("--request-timeout", type=float, default=300.0)
    a("--out", type=Path, help="JSON path (default bench/out/serving_overhead-TIME.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.client_procs < 1 or args.channels < args.client_procs:
        raise SystemExit("--channels must be at least --client-procs (>= 1)")
    if args.prompt_len < 1 or args.prompt_len + args.max_tokens > 4096:
        raise SystemExit("--prompt-len + --max-tokens must fit the preset's 4096-token context")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    args.out = args.out or ROOT / "bench" / "out" / f"serving_overhead-{stamp}.json"
    document = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    print(format_table(document["windows"], document["summary"]))
    errors = document["client_error_samples"]
    if errors:
        print(f"client errors (first {len(errors)}): {errors}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
