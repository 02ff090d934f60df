"""service/frontend/transport.py on the real server through real gRPC channels: the keepalive
policy,
--max-connection-age, TLS and mutual TLS (certificates made here), bearer tokens."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.common.config import ConfigError, TransportConfig
from service.frontend.transport import (
    MIN_CLIENT_PING_INTERVAL_MS,
    BearerTokenAuth,
    read_tokens,
    server_credentials,
)
from tests.helpers.certs import Pki, make_pki
from tests.helpers.paths import REPO_ROOT
from tests.helpers.server import ServerProcess, free_port, open_channel, running_server, wait_idle

TOKENS = "# operators\nfirst-token\n\n   second-token   \n# retired: old-token\n"
GOOD = [("authorization", "Bearer second-token")]
# gRPC's client never pings more often than once a second, however it is configured.
FASTEST_CLIENT_PING_MS = 1_000
MAX_PING_STRIKES = 2  # gRPC's default: the third ping too soon gets GOAWAY too_many_pings


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("auth") / "tokens"
    path.write_text(TOKENS)
    return path


# -- keepalive ----------------------------------------------------------------------------------


class StateLog:
    """A channel's connectivity states, in order, with when each began."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.started = time.monotonic()
        self.states: list[tuple[float, grpc.ChannelConnectivity]] = []
        self._changed = threading.Condition()
        channel.subscribe(self._record, try_to_connect=True)

    def _record(self, state: grpc.ChannelConnectivity) -> None:
        with self._changed:
            self.states.append((time.monotonic() - self.started, state))
            self._changed.notify_all()

    def left_ready_at(self) -> float | None:
        """When the channel first left READY (the connection closed), or None."""
        seen_ready = False
        for at, state in list(self.states):
            if state is grpc.ChannelConnectivity.READY:
                seen_ready = True
            elif seen_ready:
                return at
        return None

    def wait_left_ready(self, timeout: float) -> float | None:
        with self._changed:
            self._changed.wait_for(lambda: self.left_ready_at() is not None, timeout)
        return self.left_ready_at()

    def wait_ready_after(self, at: float, timeout: float) -> bool:
        """Whether the channel is READY again (a new connection) some time after `at`."""

        def ready_again() -> bool:
            return any(s is grpc.ChannelConnectivity.READY and t > at for t, s in self.states)

        with self._changed:
            return self._changed.wait_for(ready_again, timeout)


def _pinging_channel(target: str, interval_ms: int) -> grpc.Channel:
    """A client that pings every `interval_ms`, with or without calls in flight."""
    return grpc.insecure_channel(
        target,
        options=[
            ("grpc.keepalive_time_ms", interval_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # no cap on pings between data frames
        ],
    )


def _check_health(channel: grpc.Channel, **kwargs) -> health_pb2.HealthCheckResponse:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(), timeout=10, **kwargs)


@pytest.fixture(scope="module")
def pingers(server: ServerProcess) -> Iterator[tuple[grpc.Channel, StateLog, StateLog]]:
    """Two idle clients of the session's server, connected: one pinging every
    MIN_CLIENT_PING_INTERVAL_MS, one every FASTEST_CLIENT_PING_MS. (steady channel, its states,
    the fast one's states.)"""
    steady = _pinging_channel(server.target, MIN_CLIENT_PING_INTERVAL_MS)
    fast = _pinging_channel(server.target, FASTEST_CLIENT_PING_MS)
    with steady, fast:
        steady_log, fast_log = StateLog(steady), StateLog(fast)
        _check_health(steady)
        _check_health(fast)  # both connected; idle from here on
        yield steady, steady_log, fast_log


@pytest.fixture(autouse=True)
def _pingers_start_early(request: pytest.FixtureRequest) -> None:
    """The ping test waits for several of the steady client's pings (seconds apart, by policy):
    when it is to run, its clients start with the module's first slow test and ping while the
    other tests run, and the test, the module's last, checks what they saw."""
    ping_test = test_a_client_pinging_at_the_policy_interval_keeps_its_connection.__name__
    if request.node.get_closest_marker("slow") is not None and any(
        getattr(item, "originalname", item.name) == ping_test
        and getattr(item, "module", None) is request.module
        for item in request.session.items
    ):
        request.getfixturevalue("pingers")


# -- max connection age -------------------------------------------------------------------------


def _long_stream(max_tokens: int) -> pb.StreamGenerateRequest:
    return pb.StreamGenerateRequest(
        text="Once upon a time",
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
    )


@pytest.mark.slow
@pytest.mark.model
def test_an_aged_connection_is_closed_while_its_stream_completes() -> None:
    """--max-connection-age 0.5: the server sends GOAWAY about half a second after the
    connection opens (the client's channel leaves READY then), the stream running on it still
    finishes with all its tokens within the grace, and the next call opens a new connection."""
    with running_server(
        "--max-connection-age", "0.5", "--max-connection-age-grace", "120", "--log-format", "json"
    ) as server:
        channel = grpc.insecure_channel(server.target)
        with channel:
            states = StateLog(channel)
            stub = pb_grpc.GenerationServiceStub(channel)
            opened = time.monotonic()
            messages = list(stub.StreamGenerate(_long_stream(48), timeout=120))
            finished_at = time.monotonic() - states.started
            final = messages[-1]
            assert final.finish_reason == pb.FINISH_REASON_LENGTH
            assert sum(len(m.token_ids) for m in messages) == 48
            goaway_at = states.left_ready_at()
            assert goaway_at is not None, states.states
            # The GOAWAY came while the server was still generating this stream.
            assert goaway_at < (opened - states.started) + final.timing.total_seconds
            assert goaway_at < finished_at
            assert stub.CacheStats(pb.CacheStatsRequest(), timeout=10).total_completed == 1
            assert states.wait_ready_after(goaway_at, timeout=10), states.states


@pytest.mark.slow
@pytest.mark.model
def test_a_stream_past_the_grace_is_cut_and_its_slot_freed() -> None:
    """With a short grace the aged connection is closed under a stream still running: the
    client sees UNAVAILABLE, and the server cancels the sequence (nothing left running)."""
    with (
        running_server(
            "--max-connection-age",
            "0.5",
            "--max-connection-age-grace",
            "0.5",
            "--log-format",
            "json",
        ) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as cut:
            list(stub.StreamGenerate(_long_stream(2000), timeout=120))
        assert cut.value.code() is grpc.StatusCode.UNAVAILABLE
        server.wait_for_record(
            lambda r: (
                r.get("event") == "request finished" and r.get("finish_reason") == "cancelled"
            ),
            timeout=10,
        )
        # The line is logged during the tick that ends the request; its stats follow the tick.
        wait_idle(stub, timeout=10)


# -- TLS and tokens -----------------------------------------------------------------------------

RPCS: dict[str, Callable[[pb_grpc.GenerationServiceStub, list | None], object]] = {
    "Generate": lambda stub, md: stub.Generate(
        pb.GenerateRequest(text="Hi", stopping=pb.StoppingCriteria(max_tokens=2)),
        metadata=md,
        timeout=30,
    ),
    "StreamGenerate": lambda stub, md: list(
        stub.StreamGenerate(
            pb.StreamGenerateRequest(text="Hi", stopping=pb.StoppingCriteria(max_tokens=2)),
            metadata=md,
            timeout=30,
        )
    ),
    "CacheStats": lambda stub, md: stub.CacheStats(pb.CacheStatsRequest(), metadata=md, timeout=10),
    "GetModelInfo": lambda stub, md: stub.GetModelInfo(
        pb.GetModelInfoRequest(), metadata=md, timeout=10
    ),
    "Tokenize": lambda stub, md: stub.Tokenize(
        pb.TokenizeRequest(text="Hi"), metadata=md, timeout=10
    ),
}


@pytest.fixture(scope="module")
def tls_server(pki: Pki, token_file: Path) -> Iterator[ServerProcess]:
    """TLS and bearer tokens; reflection left open."""
    flags = [*pki.server_flags(), "--auth-token-file", str(token_file), "--log-format", "json"]
    with running_server(*flags, credentials=pki.channel_credentials()) as server:
        yield server


@pytest.fixture(scope="module")
def tls_channel(tls_server: ServerProcess, pki: Pki) -> Iterator[grpc.Channel]:
    with open_channel(tls_server.target, pki.channel_credentials()) as channel:
        yield channel


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("rpc", list(RPCS))
def test_every_rpc_works_over_tls_with_a_token(tls_channel, rpc) -> None:
    response = RPCS[rpc](pb_grpc.GenerationServiceStub(tls_channel), GOOD)
    assert response


@pytest.mark.slow
@pytest.mark.model
def test_generation_over_tls_answers(tls_channel) -> None:
    stub = pb_grpc.GenerationServiceStub(tls_channel)
    response = stub.Generate(
        pb.GenerateRequest(
            chat=pb.ChatInput(
                messages=[pb.ChatMessage(role="user", content="What is the capital of France?")]
            ),
            stopping=pb.StoppingCriteria(max_tokens=12),
        ),
        metadata=[("authorization", "Bearer first-token")],
        timeout=60,
    )
    assert "Paris" in response.text


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("rpc", list(RPCS))
@pytest.mark.parametrize(
    ("metadata", "reason"),
    [
        (None, "missing `authorization` metadata"),
        ([("authorization", "Bearer old-token")], "unknown bearer token"),  # a comment line
        ([("authorization", "Bearer first-token-and-more")], "unknown bearer token"),
        ([("authorization", "Bearer ")], "must be `Bearer <token>`"),
        ([("authorization", "Basic Zmlyc3QtdG9rZW4=")], "must be `Bearer <token>`"),
        ([("authorization", "first-token")], "must be `Bearer <token>`"),
    ],
    ids=["missing", "commented-out", "unknown", "empty", "basic", "no-scheme"],
)
def test_a_missing_or_unknown_token_is_unauthenticated(tls_channel, rpc, metadata, reason) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        RPCS[rpc](pb_grpc.GenerationServiceStub(tls_channel), metadata)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert reason in refused.value.details()


@pytest.mark.slow
@pytest.mark.model
def test_an_unauthenticated_request_is_refused_before_it_is_decoded(tls_channel) -> None:
    """Undecodable bytes without a token get UNAUTHENTICATED, not a decode error: nothing
    parses the body of a refused call."""
    raw = tls_channel.unary_unary("/mlxserve.v1.GenerationService/Generate")
    with pytest.raises(grpc.RpcError) as refused:
        raw(b"\xff\xff\xff\xff", timeout=10)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as undecodable:
        raw(b"\xff\xff\xff\xff", metadata=GOOD, timeout=10)
    assert undecodable.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
@pytest.mark.model
def test_health_and_reflection_need_no_token(tls_channel) -> None:
    assert _check_health(tls_channel).status == health_pb2.HealthCheckResponse.SERVING
    assert _reflection_services(tls_channel) >= {"mlxserve.v1.GenerationService"}


@pytest.mark.slow
@pytest.mark.model
def test_a_plaintext_client_cannot_talk_to_a_tls_server(tls_server) -> None:
    with grpc.insecure_channel(tls_server.target) as plain:
        with pytest.raises(grpc.RpcError) as refused:
            _check_health(plain)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        stub = pb_grpc.GenerationServiceStub(plain)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=GOOD, timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


@pytest.mark.slow
@pytest.mark.model
def test_a_client_trusting_another_ca_refuses_the_server(tls_server, pki) -> None:
    credentials = grpc.ssl_channel_credentials(root_certificates=pki.other_ca.read_bytes())
    with open_channel(tls_server.target, credentials) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _check_health(channel)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE


def _reflection_services(channel: grpc.Channel, metadata: list | None = None) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    responses = stub.ServerReflectionInfo(iter([request]), metadata=metadata, timeout=10)
    return {s.name for s in next(iter(responses)).list_services_response.service}


@pytest.fixture(scope="module")
def mtls_server(pki: Pki, token_file: Path) -> Iterator[ServerProcess]:
    """Mutual TLS, bearer tokens, and reflection behind the token too."""
    flags = [
        *pki.server_flags(mutual=True),
        "--auth-token-file",
        str(token_file),
        "--reflection-requires-auth",
        "--log-format",
        "json",
    ]
    with running_server(*flags, credentials=pki.channel_credentials(client_cert=True)) as server:
        yield server


@pytest.mark.slow
@pytest.mark.model
def test_mutual_tls_serves_a_client_with_a_certificate_the_ca_signed(mtls_server, pki) -> None:
    with open_channel(mtls_server.target, pki.channel_credentials(client_cert=True)) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        assert stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=GOOD, timeout=10).token_ids


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("client", ["no certificate", "another CA's certificate"])
def test_mutual_tls_refuses_other_clients(mtls_server, pki, client) -> None:
    key, cert = (
        (None, None)
        if client == "no certificate"
        else (pki.other_client_key.read_bytes(), pki.other_client_cert.read_bytes())
    )
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki.ca.read_bytes(), private_key=key, certificate_chain=cert
    )
    with open_channel(mtls_server.target, credentials) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Tokenize(pb.TokenizeRequest(text="Hi"), metadata=GOOD, timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError):
            _check_health(channel)  # no handshake, no health either


@pytest.mark.slow
@pytest.mark.model
def test_reflection_requires_a_token_when_told_to(mtls_server, pki) -> None:
    with open_channel(mtls_server.target, pki.channel_credentials(client_cert=True)) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            _reflection_services(channel)
        assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
        assert "mlxserve.v1.GenerationService" in _reflection_services(channel, GOOD)
        assert _check_health(channel).status == health_pb2.HealthCheckResponse.SERVING


# -- configuration, without a server ------------------------------------------------------------


def test_token_file_comments_and_blank_lines_are_skipped(token_file) -> None:
    assert read_tokens(str(token_file)) == [b"first-token", b"second-token"]


@pytest.mark.parametrize(
    ("content", "message"),
    [("# nothing\n\n", "holds no token"), ("two words\n", "contains whitespace")],
)
def test_a_token_file_without_usable_tokens_is_refused(tmp_path, content, message) -> None:
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(ConfigError, match=f"--auth-token-file .*{message}"):
        read_tokens(str(path))


def test_tokens_are_matched_exactly() -> None:
    auth = BearerTokenAuth([b"alpha", b"beta"], protect_reflection=False)
    assert auth.refusal([("authorization", "Bearer beta")]) is None
    assert auth.refusal([("authorization", "bearer  alpha ")]) is None  # scheme is case-blind
    for token in ("alph", "alphaa", "ALPHA", "beta\u00e9"):
        assert auth.refusal([("authorization", f"Bearer {token}")]) is not None


def test_a_key_that_does_not_match_the_certificate_is_refused(pki) -> None:
    config = TransportConfig(tls_cert=str(pki.server_cert), tls_key=str(pki.client_key))
    with pytest.raises(ConfigError, match=r"--tls-cert .* --tls-key"):
        server_credentials(config)


def test_a_client_ca_that_is_not_pem_is_refused(pki, tmp_path) -> None:
    junk = tmp_path / "ca.pem"
    junk.write_text("not a certificate\n")
    config = TransportConfig(
        tls_cert=str(pki.server_cert), tls_key=str(pki.server_key), tls_client_ca=str(junk)
    )
    with pytest.raises(ConfigError, match="--tls-client-ca"):
        server_credentials(config)


@pytest.mark.slow
def test_the_server_refuses_to_start_with_a_mismatched_key(pki) -> None:
    """One line, exit status 2, before the model loads."""
    flags = ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.client_key)]
    done = subprocess.run(
        [sys.executable, "-m", "service", "--port", str(free_port()), *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --tls-cert")


# -- keepalive, checked last (see _pingers_start_early) ----------------------------------------


@pytest.mark.slow
@pytest.mark.model
def test_a_client_pinging_at_the_policy_interval_keeps_its_connection(
    pingers: tuple[grpc.Channel, StateLog, StateLog],
) -> None:
    """Before: gRPC's default policy (pings at most every 5 minutes, none without calls) sent a
    10 s pinger GOAWAY too_many_pings after its third ping. The policy now accepts a ping
    every MIN_CLIENT_PING_INTERVAL_MS (half of 10 s); a client five times faster is still cut
    off, so the check is live. The module's last test: its clients have been pinging since the
    module's first slow test."""
    steady, steady_log, fast_log = pingers
    # The fast client's third ping too soon gets GOAWAY: the pings do reach the server.
    assert fast_log.wait_left_ready(timeout=10 * FASTEST_CLIENT_PING_MS / 1000) is not None
    # Enough pings for the steady client that, were each too soon, it would have been cut.
    pings = MAX_PING_STRIKES + 2
    remaining = pings * MIN_CLIENT_PING_INTERVAL_MS / 1000 + 1.5
    remaining -= time.monotonic() - steady_log.started
    assert steady_log.wait_left_ready(timeout=remaining) is None, steady_log.states
    assert steady_log.states[-1][1] is grpc.ChannelConnectivity.READY
    assert _check_health(steady).status == health_pb2.HealthCheckResponse.SERVING
