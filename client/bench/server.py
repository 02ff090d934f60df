"""Starting and stopping a local mlxserve server (for --spawn-server, the bench scripts and the
tests), and the managed-process base the repository's peers reuse."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from client.client import GenerationClient


def _checkout_root() -> Path | None:
    """The repository root when this file sits in a checkout (client/bench/server.py), where
    `python -m service` resolves without an install; None in an installed client."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "service" / "__main__.py").is_file() else None


CHECKOUT_ROOT = _checkout_root()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_Process = TypeVar("_Process", bound="ManagedProcess")


class ManagedProcess:
    """A server subprocess with its log file: started (and ready) on entry, stopped on exit.
    Subclasses set `command` and say what "ready" means (`_wait_ready`); `env` is the child's
    environment (this one, unbuffered, by default) and `cwd` its directory (the checkout's root
    where there is one)."""

    stop_signal = signal.SIGTERM

    def __init__(
        self,
        command: list[str],
        *,
        log_path: Path | None,
        ready_timeout: float,
        env: dict[str, str] | None = None,
        cwd: Path | None = CHECKOUT_ROOT,
    ) -> None:
        self.command = command
        self.log_path = log_path
        self.ready_timeout = ready_timeout
        self.env = env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.cwd = cwd
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self._proc = subprocess.Popen(
                self.command, cwd=self.cwd, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()  # the child keeps its own descriptor
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        raise NotImplementedError

    def stop(self, grace: float = 30.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(self.stop_signal)  # lets the server drain and exit cleanly
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def log_tail(self, lines: int = 20) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def __enter__(self: _Process) -> _Process:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class ServerProcess(ManagedProcess):
    """`python -m service --port P` as a subprocess, SERVING on entry, stopped on exit. The server
    preloads OpenBLAS for MLX itself (it re-executes once with it), so no environment is set up
    here: this module needs neither MLX nor the server's code."""

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        log_path: Path | None = None,
        ready_timeout: float = 180.0,
        checkout: Path | None = None,
    ) -> None:
        """`checkout`: another checkout's server (a branch's worktree, for a bench that runs two
        trees side by side), its `service` package first on the path; default: this one's."""
        self.port = free_port()
        self.target = f"localhost:{self.port}"
        command = [sys.executable, "-m", "service", "--port", str(self.port), *extra_args]
        super().__init__(
            command, log_path=log_path, ready_timeout=ready_timeout, cwd=checkout or CHECKOUT_ROOT
        )
        if checkout is not None:  # the default environment, the checkout first on the path
            path = [str(checkout), *filter(None, [self.env.get("PYTHONPATH")])]
            self.env["PYTHONPATH"] = os.pathsep.join(path)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        with GenerationClient(self.target) as client:
            while True:
                # Check the process between short waits, so a crash fails fast with its log.
                if self._proc is None or self._proc.poll() is not None:
                    code = self._proc.returncode if self._proc else None
                    raise RuntimeError(f"server exited ({code}) during start-up\n{self.log_tail()}")
                try:
                    client.wait_ready(min(2.0, max(deadline - time.monotonic(), 0.1)))
                    return
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        self.stop()
                        raise
