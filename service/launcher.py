"""`python -m service`: one engine-core process and one or more gRPC front-end processes.

The launching process is front end 0; it starts the engine core (the only process that
imports MLX) and `--api-workers - 1` more front ends that share the port (SO_REUSEPORT). They
talk over ZeroMQ sockets in a private run directory (service.ipc).

Each front end watches the core through a pipe whose only writing end the core holds: when the
core exits, for whatever reason, the pipe reads EOF in every front end at once. A stop signal
to the launcher is passed to the other front ends; each drains, then the core is stopped.
Exit codes: 0 after a stop signal, 2 when the model cannot be loaded or the port bound, 3 when
the engine core died.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import signal
import sys
from multiprocessing.connection import Connection
from pathlib import Path

import structlog

from service import core
from service.config import ConfigError, ServerConfig
from service.frontend.engine_client import LoadFailedError
from service.logging import configure_logging
from service.server import LOAD_FAILED_EXIT, serve_frontend

log = structlog.get_logger(__name__)
CORE_STOP_TIMEOUT_S = 15.0


def run(config: ServerConfig) -> int:
    ctx = mp.get_context("spawn")  # no fork: the children start clean (MLX, gRPC threads)
    run_dir = core.make_run_dir()
    core_alive, core_holds = ctx.Pipe(duplex=False)
    engine = ctx.Process(
        target=core.run, args=(config, str(run_dir), core_holds), name="mlxserve-core"
    )
    engine.start()
    core_holds.close()  # the core's copy is the only writing end left
    workers = [
        ctx.Process(
            target=_worker,
            args=(config, str(run_dir), i, core_alive),
            name=f"mlxserve-frontend-{i}",
        )
        for i in range(1, config.api_workers)
    ]
    for w in workers:
        w.start()

    def stop_workers() -> None:
        for w in workers:
            if w.pid is not None and w.is_alive():
                os.kill(w.pid, signal.SIGTERM)

    code = 0
    try:
        code = asyncio.run(serve_frontend(config, run_dir, 0, core_alive, stop_workers))
    except LoadFailedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = LOAD_FAILED_EXIT
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        code = 2
    finally:
        stop_workers()
        for w in workers:
            w.join(CORE_STOP_TIMEOUT_S)
        _stop(engine)
        shutil.rmtree(run_dir, ignore_errors=True)
    if code == 0 and engine.exitcode not in (0, None, -signal.SIGTERM):
        code = engine.exitcode or 0
    return code


def _stop(engine: mp.process.BaseProcess) -> None:
    """Stop the core (it ends what still runs and exits), or kill it if it hangs."""
    if engine.is_alive() and engine.pid is not None:
        os.kill(engine.pid, signal.SIGTERM)
    engine.join(CORE_STOP_TIMEOUT_S)
    if engine.is_alive():
        engine.kill()
        engine.join()


def _worker(config: ServerConfig, run_dir: str, index: int, core_alive: Connection) -> None:
    """Front end `index` (> 0) in its own process."""
    configure_logging(config.log_level, config.log_format)
    try:
        code = asyncio.run(serve_frontend(config, Path(run_dir), index, core_alive))
    except (LoadFailedError, ConfigError):
        code = 2  # front end 0 says why
    sys.exit(code)
