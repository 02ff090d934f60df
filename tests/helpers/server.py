"""The real server as a subprocess (or in this process), and waiting on it.

`start_server()` launches `python -m service` on a free port, follows its stdout (JSON log
lines) in a thread, polls grpc.health.v1 from the moment the process exists (recording every
answer, so a test can see NOT_SERVING before SERVING) and returns once it reports SERVING.
Only a test marked `slow` may start one (conftest clears `servers_allowed` for the others).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.ports import free_port
from tests.helpers.paths import REPO_ROOT
from tests.helpers.requests import chat_request, to_stream

READY_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
GENERATION_SERVICE = "mlxserve.v1.GenerationService"
# Reconnect quickly while the server is starting, so the loading phase is observable.
FAST_RECONNECT = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 200),
]
# Random weights with the embedded SmolLM2's depth, vocabulary and tokenizer (its chat template
# too) at a width whose steps cost next to nothing (the `thin-30` preset): for tests of serving
# mechanics that hold whatever the weights (memory, KV budgets, preemption by blocks). Its K/V
# per token: 30 layers of one 32-wide head for K and for V, in float32.
THIN_MODEL = ("--load-format", "dummy:thin-30")
THIN_MODEL_ID = "dummy:thin-30"
THIN_KV_BYTES_PER_TOKEN = 30 * 2 * 1 * 32 * 4
# Between two health checks while the server starts: each check costs the starting server (and
# this process) CPU that its loading competes for.
HEALTH_POLL_S = 0.05
_STATUS_NAME = health_pb2.HealthCheckResponse.ServingStatus.Name

# Whether the running test may start a server (or an engine core in this process): conftest
# sets it before each test, true only for tests marked `slow`, so a test of the fast tier that
# starts one fails instead of quietly slowing down `make test-fast`.
servers_allowed = True


def _check_allowed() -> None:
    if not servers_allowed:
        raise AssertionError("this test starts a server: mark it slow (pytest.mark.slow)")


@dataclass
class ServerProcess:
    """A running `python -m service`; its stdout lines are collected as they arrive."""

    proc: subprocess.Popen
    target: str
    lines: list[str] = field(default_factory=list)
    # Health answers seen while starting, in order ("NOT_SERVING", "SERVING", ...).
    health_history: list[str] = field(default_factory=list)
    # Status code of a Generate sent while health still said NOT_SERVING (None: no probe),
    # and the error it got.
    probe_while_loading: grpc.StatusCode | None = None
    probe_error: grpc.RpcError | None = None
    returncode: int | None = None
    _reader: threading.Thread | None = None

    def _follow(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def records(self) -> list[dict[str, Any]]:
        """The JSON log records printed so far (non-JSON lines are skipped)."""
        out = []
        for line in list(self.lines):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    out.append(record)
        return out

    def wait_for_record(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 5.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            for record in self.records():
                if predicate(record):
                    return record
            if time.monotonic() > deadline:
                tail = "\n".join(self.lines[-30:])
                message = f"no matching log record within {timeout} s; log tail:\n{tail}"
                raise AssertionError(message)
            time.sleep(0.05)

    def finished_record(self, request_id: str, timeout: float = 5.0) -> dict[str, Any]:
        """The scheduler's "request finished" log record of one request."""
        return self.wait_for_record(
            lambda r: r.get("event") == "request finished" and r.get("request_id") == request_id,
            timeout,
        )

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit (raises subprocess.TimeoutExpired), then for the last
        of its output to be read."""
        code = self.proc.wait(timeout)
        if self._reader is not None:
            self._reader.join(5)
        return code

    def kill_process_group(self) -> None:
        """SIGKILL the launcher and every process of its group at once, as a crashed host or
        an OOM kill would (needs `own_process_group`); waits for the launcher to be gone."""
        assert os.getpgid(self.proc.pid) == self.proc.pid, "not started in its own group"
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.wait(STOP_TIMEOUT_S)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`. Returns the exit code of the SIGTERM (None if
        it had to be killed)."""
        if self.proc.poll() is not None:
            return self.returncode if self.returncode is not None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.returncode = self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.wait(5)
            self.returncode = None
        return self.returncode


def open_channel(
    target: str, credentials: grpc.ChannelCredentials | None = None, options: list | None = None
) -> grpc.Channel:
    """A channel to `target`: TLS with `credentials`, else plaintext."""
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def _wait_serving(
    server: ServerProcess, timeout: float, credentials: grpc.ChannelCredentials | None
) -> None:
    deadline = time.monotonic() + timeout
    with open_channel(server.target, credentials, FAST_RECONNECT) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        generation = pb_grpc.GenerationServiceStub(channel)
        while True:
            if server.proc.poll() is not None:
                tail = "\n".join(server.lines[-40:])
                raise RuntimeError(f"server exited with {server.proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                server.stop()
                raise TimeoutError(f"server not SERVING within {timeout} s")
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                time.sleep(HEALTH_POLL_S)
                continue
            status = _STATUS_NAME(answer.status)
            server.health_history.append(status)
            if status == "SERVING":
                return
            if server.probe_while_loading is None:
                _probe_generate(server, generation, health)
            time.sleep(HEALTH_POLL_S)


def _probe_generate(
    server: ServerProcess,
    generation: pb_grpc.GenerationServiceStub,
    health: health_pb2_grpc.HealthStub,
) -> None:
    """Send a tiny Generate while loading; keep its outcome only if health still says
    NOT_SERVING afterwards (otherwise the model may have finished loading in between)."""
    request = pb.GenerateRequest(text="Hi", stopping=pb.StoppingCriteria(max_tokens=1))
    error = None
    try:
        generation.Generate(request, timeout=30)
        code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        code, error = exc.code(), exc
    after = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    if after.status == health_pb2.HealthCheckResponse.NOT_SERVING:
        server.probe_while_loading, server.probe_error = code, error


def start_server(
    *flags: str,
    env: dict[str, str] | None = None,
    timeout: float = READY_TIMEOUT_S,
    credentials: grpc.ChannelCredentials | None = None,
    own_process_group: bool = False,
) -> ServerProcess:
    """Start `python -m service` with `flags` (and extra `env`); return once it is SERVING.
    `credentials`: how to reach a TLS server (health needs no token). `own_process_group`:
    the launcher leads a new session, so `kill_process_group` reaches it and its children (the
    engine core, other front ends) and nothing of the test's."""
    _check_allowed()
    for attempt in range(3):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "service", "--host", "127.0.0.1", "--port", str(port), *flags],
            cwd=REPO_ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            encoding="utf-8",
            errors="replace",
            bufsize=1,
            start_new_session=own_process_group,
        )
        server = ServerProcess(proc, f"127.0.0.1:{port}")
        server._reader = threading.Thread(target=server._follow, daemon=True)
        server._reader.start()
        try:
            _wait_serving(server, timeout, credentials)
            return server
        except RuntimeError:
            # Another process may have taken the free port first: try a new one.
            server.stop()
            if attempt == 2 or not any("could not bind" in line for line in server.lines):
                raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def running_server(
    *flags: str,
    env: dict[str, str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> Iterator[ServerProcess]:
    server = start_server(*flags, env=env, credentials=credentials)
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def running_replicas(
    *flags_each: Sequence[str], own_process_group: bool = False
) -> Iterator[list[ServerProcess]]:
    """One server per entry of `flags_each` (its flags), started side by side: replicas behind
    a load balancer. Each is stopped on exit unless the test already stopped or killed it."""
    with ThreadPoolExecutor(len(flags_each)) as pool:
        futures = [
            pool.submit(start_server, *flags, own_process_group=own_process_group)
            for flags in flags_each
        ]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            raise errors[0]
        yield started
    finally:
        for server in started:
            server.stop()


@contextlib.asynccontextmanager
async def in_process_server(config: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A front end (servicer) on this event loop, behind a real grpc.aio server on a free
    port, and an engine core on a thread of this process, joined by the real ZeroMQ channel:
    for tests that need to reach into the servicer. Yields (stub, servicer)."""
    _check_allowed()
    import shutil

    from service.core.server import CoreServer
    from service.frontend.core_client import CoreClient
    from service.frontend.servicer import GenerationServicer, served_model
    from service.frontend.telemetry.telemetry import Telemetry
    from service.launcher import make_run_dir

    run_dir = make_run_dir()
    core = CoreServer(config.core, run_dir)
    thread = threading.Thread(target=core.serve, name="core", daemon=True)
    thread.start()
    client = CoreClient(run_dir, 0)
    server = grpc.aio.server()
    servicer = GenerationServicer(config.frontend_process, client, Telemetry())
    try:
        servicer.set_model(served_model(await client.connect()))
        pb_grpc.add_GenerationServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield pb_grpc.GenerationServiceStub(channel), servicer
    finally:
        await server.stop(0)
        servicer.close()
        await client.close_sockets()
        core.stop()
        thread.join(30)
        shutil.rmtree(run_dir, ignore_errors=True)


def wait_until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll `predicate` until it returns something truthy (returned); fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
    return result


def wait_idle(
    stub: pb_grpc.GenerationServiceStub, timeout: float = 20.0, *, free_blocks: bool = False
) -> pb.CacheStatsResponse:
    """CacheStats once nothing runs or waits (and, with `free_blocks`, no block is held by a
    running request); fails after `timeout`."""

    def idle() -> pb.CacheStatsResponse | None:
        stats = stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
        busy = stats.active_sequences or stats.queued_requests
        return None if busy or (free_blocks and stats.active_blocks) else stats

    return wait_until(idle, "the server to be idle", timeout)


def start_draining(channel: grpc.Channel, replica: ServerProcess, timeout: float = 120.0) -> Any:
    """Start a long stream on `replica` (through `channel`, straight to it), then SIGTERM it and
    wait until it drains: the stream keeps it draining until the caller cancels it. Returns the
    stream, its first message read."""
    long = pb_grpc.GenerationServiceStub(channel).StreamGenerate(
        to_stream(
            chat_request(
                "Tell me a long story about the sea.",
                max_tokens=4000,
                request_id="long",
                stopping=pb.StoppingCriteria(ignore_eos=True),
            )
        ),
        timeout=timeout,
    )
    next(long)
    replica.proc.send_signal(signal.SIGTERM)
    replica.wait_for_record(lambda r: r.get("event") == "draining", timeout=10)
    return long
