"""`python -m service`: one engine-core process and one or more gRPC front-end processes.

The launching process is front end 0; it starts the engine core (the only process that
imports MLX) and `--api-workers - 1` more front ends that share the port (SO_REUSEPORT); those
listen only once the model is ready, while front end 0 answers NOT_SERVING during the load. They
talk over ZeroMQ sockets in a private run directory (service.protocol).

Each front end watches the core through a pipe whose only writing end the core holds: when the
core exits, for whatever reason, the pipe reads EOF in every front end at once. A stop signal
to the launcher is passed to the other front ends; each drains, then the core is stopped.
Exit codes: 0 after a stop signal, 2 when the model cannot be loaded or the port bound, 3 when
the engine core died.

With --metrics-port and several front ends, prometheus-client's multiprocess mode is set up
here, before any front end imports it (service.frontend.server is imported late for that):
each front end keeps its counters in the run directory and front end 0's /metrics adds them up.

The engine core starts before this process imports the front end's modules (transformers for
the tokenizer, gRPC), so that the two import side by side: this module imports neither the
core's modules nor the front end's at its top.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path

import structlog

from service.common.config import (
    ConfigError,
    CoreConfig,
    FrontendProcessConfig,
    ServerConfig,
    visible_gpus,
)
from service.common.logging import configure_logging, exit_now
from service.common.ports import free_port

log = structlog.get_logger(__name__)
CORE_STOP_TIMEOUT_S = 15.0
RANK_LOST_STOP_TIMEOUT_S = 1.0
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus-client reads it when first imported


def run(config: ServerConfig) -> int:
    ctx = mp.get_context("spawn")  # no fork: the children start clean (MLX, gRPC threads)
    run_dir = make_run_dir()
    if config.observability.metrics_port and config.frontend.api_workers > 1:
        metrics_dir = run_dir / "metrics"
        metrics_dir.mkdir()
        os.environ[MULTIPROC_ENV] = str(metrics_dir)  # the spawned front ends inherit it
    try:
        rank_env = _rank_environments(config, run_dir)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        shutil.rmtree(run_dir, ignore_errors=True)
        return 2
    # One pipe per core rank: whichever rank exits, its pipe reads EOF in every front end.
    core_alive: list[Connection] = []
    ranks: list[mp.process.BaseProcess] = []
    for rank, env in enumerate(rank_env):
        alive, holds = ctx.Pipe(duplex=False)
        name = "mlxserve-core" if rank == 0 else f"mlxserve-core-rank-{rank}"
        process = ctx.Process(
            target=_core, args=(config.core, str(run_dir), holds, rank, env), name=name
        )
        process.start()
        holds.close()  # the rank's copy is the only writing end left
        core_alive.append(alive)
        ranks.append(process)
    workers = [
        ctx.Process(
            target=_worker,
            args=(config.frontend_process, str(run_dir), i, core_alive),
            name=f"mlxserve-frontend-{i}",
        )
        for i in range(1, config.frontend.api_workers)
    ]
    for w in workers:
        w.start()
    # Only now, while the core imports MLX: front end 0's own modules.
    from service.frontend.core_client import LoadFailedError
    from service.frontend.server import LOAD_FAILED_EXIT, serve_frontend

    def stop_workers() -> None:
        for w in workers:
            if w.pid is not None and w.is_alive():
                os.kill(w.pid, signal.SIGTERM)

    code = 0
    error = None
    try:
        code = asyncio.run(
            serve_frontend(config.frontend_process, run_dir, 0, core_alive, stop_workers)
        )
    except LoadFailedError as exc:
        error, code = str(exc), LOAD_FAILED_EXIT
    except ConfigError as exc:
        error, code = str(exc), 2
    finally:
        stop_workers()
        for w in workers:
            w.join(CORE_STOP_TIMEOUT_S)
        # A tensor-parallel group that lost a rank cannot finish a step, and the ranks left may
        # be blocked in a collective that waits for it, where a stop signal is never handled.
        lost = len(ranks) > 1 and any(p.exitcode is not None for p in ranks)
        for process in ranks:
            _stop(process, RANK_LOST_STOP_TIMEOUT_S if lost else CORE_STOP_TIMEOUT_S)
        shutil.rmtree(run_dir, ignore_errors=True)
    if error is not None:  # after the children are gone: the last line of stderr
        print(f"error: {error}", file=sys.stderr)
    engine = ranks[0]
    if code == 0 and engine.exitcode not in (0, None, -signal.SIGTERM):
        code = engine.exitcode or 0
    return code


def _rank_environments(config: ServerConfig, run_dir: Path) -> list[dict[str, str]]:
    """Per engine-core rank, the MLX distributed variables (what `mlx.launch` sets): the ring
    backend's host file of local TCP ports, or NCCL's rendezvous and one GPU per rank."""
    n = config.model.tensor_parallel
    if n == 1:
        return [{}]
    backend = config.model.resolved_backend()
    if backend == "nccl":
        gpus = visible_gpus()
        if n > gpus:
            raise ConfigError(f"--tensor-parallel {n}: only {gpus} GPU(s) are visible")
        port = str(free_port())
        common = {
            "MLX_WORLD_SIZE": str(n),
            "NCCL_HOST_IP": "127.0.0.1",
            "NCCL_PORT": port,
            "NCCL_NVLS_ENABLE": "0",  # NVLink multicast off (not available on these hosts)
        }
        return [{**common, "MLX_RANK": str(r), "CUDA_VISIBLE_DEVICES": str(r)} for r in range(n)]
    hostfile = run_dir / "hostfile.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
    # The ranks share this machine's cores: split the BLAS threads between them.
    threads = str(max(1, (os.cpu_count() or 1) // n))
    return [
        {"MLX_RANK": str(r), "MLX_HOSTFILE": str(hostfile), "OPENBLAS_NUM_THREADS": threads}
        for r in range(n)
    ]


def _stop(engine: mp.process.BaseProcess, timeout: float = CORE_STOP_TIMEOUT_S) -> None:
    """Stop the core (it ends what still runs and exits), or kill it if it hangs."""
    if engine.is_alive() and engine.pid is not None:
        os.kill(engine.pid, signal.SIGTERM)
    engine.join(timeout)
    if engine.is_alive():
        engine.kill()
        engine.join()


def _core(
    config: CoreConfig,
    run_dir: str,
    alive: Connection,
    rank: int = 0,
    env: dict[str, str] | None = None,
) -> None:
    """An engine-core process (service.core.server.run), imported only there."""
    from service.core import server

    server.run(config, run_dir, alive, rank, env)


def _worker(
    config: FrontendProcessConfig, run_dir: str, index: int, core_alive: list[Connection]
) -> None:
    """Front end `index` (> 0) in its own process."""
    from service.frontend.core_client import LoadFailedError
    from service.frontend.server import serve_frontend

    configure_logging(config.observability.log_level, config.observability.log_format)
    try:
        code = asyncio.run(serve_frontend(config, Path(run_dir), index, core_alive))
    except (LoadFailedError, ConfigError):
        code = 2  # front end 0 says why
    exit_now(code)


def make_run_dir() -> Path:
    """Where the sockets and the saved tokenizer live while the server runs."""
    return Path(tempfile.mkdtemp(prefix="mlxserve-"))
