"""deploy/nginx/mlxserve.conf in front of two real replicas, one of them killed under load.

nginx (Debian's, run in the foreground with its own prefix, pid and logs in a temporary
directory) serves the shipped configuration with the test's ports written in. Streams go
through it to both replicas; then one replica's whole process group (launcher and engine core)
is SIGKILLed. Its calls end at once, each with the status the protocol gives it; the other
replica's calls finish; every new call goes to the survivor and succeeds, including those
nginx first tries on the dead replica (refused connections: the calls had not started).
Behind nginx, the client's retry policy (client.Balancing) carries calls past a draining
replica.
"""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from client import Balancing, GenerationClient
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.paths import REPO_ROOT
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import (
    ServerProcess,
    free_port,
    running_replicas,
    start_draining,
    wait_until,
)

NGINX_CONF = REPO_ROOT / "deploy" / "nginx" / "mlxserve.conf"
NGINX = shutil.which("nginx") or next(
    (p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if Path(p).exists()), None
)
DEADLINE_S = 60.0  # every call's deadline; a call that hangs fails the test instead
ENDED_WITHIN_S = 5.0  # a call on the killed replica ends this soon after the kill
STREAM_TOKENS = 16
FAIL_TIMEOUT_S = 1

pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(
        NGINX is None, reason="nginx is not installed (scripts/install.sh installs Debian's)"
    ),
]


def nginx_config(replicas: list[str], port: int, logs: Path) -> str:
    """The shipped configuration with these replicas, this port and these log paths."""
    text = NGINX_CONF.read_text()
    servers = re.findall(r"^\s*server 127\.0\.0\.1:\d+ ", text, flags=re.M)
    assert len(servers) == 2, "the shipped upstream should list two example replicas"
    addresses = iter(replicas)
    text = re.sub(
        r"(?m)^(\s*server )127\.0\.0\.1:\d+ ", lambda m: f"{m[1]}{next(addresses)} ", text
    )
    text, listens = re.subn(
        r"(?m)^(\s*)listen 8080 http2;", rf"\g<1>listen 127.0.0.1:{port} http2;", text
    )
    assert listens == 1
    text, logs_moved = re.subn(r"/var/log/nginx/", f"{logs}/", text)
    assert logs_moved == 1
    # Sooner than the shipped 10 s, so that the test sees nginx probe the dead replica again.
    text, timeouts = re.subn(r"fail_timeout=10s", f"fail_timeout={FAIL_TIMEOUT_S}s", text)
    assert timeouts == 2
    return text


@contextmanager
def running_nginx(replicas: list[str], tmp: Path) -> Iterator[tuple[str, Path]]:
    """nginx in the foreground (not the system service) on a free port; yields its target and
    its access log."""
    port = free_port()
    (tmp / "mlxserve.conf").write_text(nginx_config(replicas, port, tmp))
    temp_paths = " ".join(
        f"{kind}_temp_path {tmp}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (tmp / "nginx.conf").write_text(
        f"daemon off;\nworker_processes 1;\npid {tmp}/nginx.pid;\n"
        f"error_log {tmp}/error.log info;\nevents {{ worker_connections 256; }}\n"
        f"http {{ {temp_paths} include {tmp}/mlxserve.conf; }}\n"
    )
    assert NGINX is not None
    # -e: the startup error log too, not Debian's /var/log/nginx/error.log
    command = [NGINX, "-p", str(tmp), "-c", str(tmp / "nginx.conf"), "-e", str(tmp / "error.log")]
    check = subprocess.run([*command, "-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while True:
            assert proc.poll() is None, f"nginx exited: {proc.stderr.read() if proc.stderr else ''}"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert time.monotonic() < deadline, "nginx did not listen within 10 s"
            time.sleep(0.05)
        yield f"127.0.0.1:{port}", tmp / "mlxserve.access.log"
    finally:
        proc.send_signal(signal.SIGQUIT)  # graceful: its logs are complete after this
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Call:
    request_id: str
    code: grpc.StatusCode | None = None  # None: still running
    details: str = ""
    tokens: int = 0
    ended_at: float = 0.0


def stream(stub: pb_grpc.GenerationServiceStub, call: Call) -> None:
    request = chat_request(
        "Tell me a long story about the sea.",
        max_tokens=STREAM_TOKENS,
        request_id=call.request_id,
        stopping=pb.StoppingCriteria(ignore_eos=True),
    )
    try:
        for message in stub.StreamGenerate(to_stream(request), timeout=DEADLINE_S):
            call.tokens += len(message.token_ids)
        call.code = grpc.StatusCode.OK
    except grpc.RpcError as exc:
        call.code, call.details = exc.code(), exc.details() or ""
    call.ended_at = time.monotonic()


def queued_ids(server: ServerProcess) -> set[str]:
    return {r["request_id"] for r in server.records() if r.get("event") == "request queued"}


def test_nginx_fails_over_when_a_replica_is_killed(tmp_path: Path) -> None:
    # One sequence per replica at a time, so each replica has one call running and one queued.
    flags = ("--parallel", "1", "--log-format", "json")
    with (
        running_replicas(flags, flags, own_process_group=True) as (victim, survivor),
        running_nginx([victim.target, survivor.target], tmp_path) as (target, access_log),
        grpc.insecure_channel(target) as channel,
        grpc.insecure_channel(victim.target) as direct_channel,
    ):
        stub = pb_grpc.GenerationServiceStub(channel)
        calls = [Call(f"nginx-{i}") for i in range(4)]
        threads = [threading.Thread(target=stream, args=(stub, c)) for c in calls]
        for t in threads:
            t.start()
        # nginx alternates: two calls per replica, one running and one queued behind it.
        wait_until(
            lambda: len(queued_ids(victim) | queued_ids(survivor)) == 4, "4 queued", DEADLINE_S
        )
        on_victim = [c for c in calls if c.request_id in queued_ids(victim)]
        assert len(on_victim) == 2, "nginx did not alternate between the replicas"
        # And one straight to the victim, without nginx: queued third there.
        direct = Call("direct")
        threads.append(
            threading.Thread(
                target=stream, args=(pb_grpc.GenerationServiceStub(direct_channel), direct)
            )
        )
        threads[-1].start()
        wait_until(lambda: "direct" in queued_ids(victim), "the direct call queued", DEADLINE_S)
        wait_until(lambda: any(c.tokens for c in on_victim), "a token from the victim", DEADLINE_S)

        killed_at = time.monotonic()
        victim.kill_process_group()

        # New calls: each goes to the survivor (nginx skips the dead replica) and succeeds.
        new_ids = [f"new-{i}" for i in range(4)]
        routed_after = None
        for request_id in new_ids:
            future = stub.Generate.future(
                chat_request("Say hi.", max_tokens=2, request_id=request_id), timeout=DEADLINE_S
            )
            if routed_after is None:
                wait_until(
                    lambda: "new-0" in queued_ids(survivor),
                    "the survivor queued a call",
                    DEADLINE_S,
                )
                routed_after = time.monotonic() - killed_at
            reply = future.result()
            assert reply.request_id == request_id and reply.token_ids
        # They waited for the survivor's own calls (one sequence at a time).
        first_calls_done_after = time.monotonic() - killed_at
        # Once fail_timeout has passed, nginx tries the dead replica again: the connection is
        # refused, so the call had not started and goes on to the survivor.
        time.sleep(FAIL_TIMEOUT_S + 0.1)
        for i in range(2):
            request_id = f"late-{i}"
            reply = stub.Generate(
                chat_request("Say hi.", max_tokens=2, request_id=request_id), timeout=DEADLINE_S
            )
            assert reply.request_id == request_id and reply.token_ids
            new_ids.append(request_id)
        assert set(new_ids) <= queued_ids(survivor)

        for t in threads:
            t.join(DEADLINE_S + 5)
        assert not any(t.is_alive() for t in threads)

    # The victim's calls ended at once, none near its deadline: a stream that was running gets
    # RST_STREAM INTERNAL_ERROR from nginx (gRPC's HTTP/2 mapping makes that INTERNAL), a call
    # still queued (no reply yet) gets nginx's UNAVAILABLE; without nginx, the lost connection
    # is UNAVAILABLE too.
    for call in [*on_victim, direct]:
        assert call.code is not None and call.code != grpc.StatusCode.OK, call
        assert call.ended_at - killed_at < ENDED_WITHIN_S, call
    running, queued = sorted(on_victim, key=lambda c: -c.tokens)
    assert running.tokens > 0 and running.code == grpc.StatusCode.INTERNAL, running
    assert "RST_STREAM" in running.details, running
    assert queued.tokens == 0 and queued.code == grpc.StatusCode.UNAVAILABLE, queued
    assert queued.details == "no mlxserve replica could take the call", queued
    assert direct.tokens == 0 and direct.code == grpc.StatusCode.UNAVAILABLE, direct
    # The survivor's own calls were not disturbed.
    for call in calls:
        if call not in on_victim:
            assert call.code == grpc.StatusCode.OK and call.tokens == STREAM_TOKENS, call

    # nginx's log: every new call was answered by the survivor (a call it first tried on the
    # dead replica names both, in order).
    lines = access_log.read_text().splitlines()
    generates = [line for line in lines if "/Generate " in line]
    assert len(generates) == len(new_ids)
    for line in generates:
        upstream = re.search(r"upstream=(\S+(?:, \S+)*) upstream_status", line)
        assert upstream is not None and upstream[1].split(", ")[-1] == survivor.target, line
        assert "grpc_status=0" in line, line
    retried = sum(", " in line.split("upstream=")[1] for line in lines)
    assert retried >= 1, "nginx never retried a call on the survivor"
    print(
        f"\nreplica killed: {len(on_victim) + 1} calls failed (running through nginx: "
        f"{running.code.name}; queued through nginx: {queued.code.name}; direct: "
        f"{direct.code.name}), all within "
        f"{max(c.ended_at for c in [*on_victim, direct]) - killed_at:.2f} s; "
        f"{retried} calls retried by nginx on the survivor; the first new call reached the "
        f"survivor {routed_after:.2f} s after the kill; the first 4 new calls were done "
        f"{first_calls_done_after:.2f} s after it"
    )


def test_client_retry_policy_covers_a_draining_replica_behind_nginx(tmp_path: Path) -> None:
    """nginx does not read grpc.health.v1: a draining replica still gets calls through it and
    refuses them with UNAVAILABLE before any reply. The client's retry policy alone
    (Balancing without health checking, which through nginx would watch one replica) sends
    each such call again, and nginx passes it to the other replica."""
    flags = ("--log-format", "json", "--drain-timeout", "120")
    with (
        running_replicas(flags, flags) as (draining, other),
        running_nginx([draining.target, other.target], tmp_path) as (target, access_log),
        grpc.insecure_channel(draining.target) as direct,
        GenerationClient(target, balancing=Balancing(health_service=None)) as client,
    ):
        # A running stream keeps the replica draining while the calls go through nginx.
        long = start_draining(direct, draining, 2 * DEADLINE_S)
        ids = [f"retried-{i}" for i in range(4)]
        for request_id in ids:
            reply = client.generate(
                chat_request("Say hi.", max_tokens=1, request_id=request_id), timeout=DEADLINE_S
            )
            assert reply.request_id == request_id and reply.token_ids
        assert next(long).token_ids, "the draining replica's running stream stopped"
        long.cancel()
        assert draining.wait(30) == 0

    assert not set(ids) & queued_ids(draining)
    assert set(ids) <= queued_ids(other)
    # nginx passed some attempts to the draining replica (each answered UNAVAILABLE, a gRPC
    # status inside an HTTP 200, so nginx itself does not retry them): the client did.
    to_draining = [
        line
        for line in access_log.read_text().splitlines()
        if "/Generate " in line and f"upstream={draining.target} " in line
    ]
    assert to_draining, "nginx sent no call to the draining replica: nothing was retried"
    print(f"\n{len(to_draining)} attempts refused by the draining replica, all retried")
