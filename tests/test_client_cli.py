"""End to end: the CLI and the Python clients against a real server on the embedded model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client import (
    AsyncGenerationClient,
    ErrorClass,
    GenerationClient,
    TLSConfig,
    build_request,
    error_details,
    response_format,
    to_stream_request,
)
from client.bench.server import ServerProcess
from mlxserve.v1 import generation_pb2 as pb
from tests.helpers.certs import SECURED_TOKEN, Pki
from tests.helpers.server import ServerProcess as RunningServer

pytestmark = pytest.mark.model

REPO_ROOT = Path(__file__).resolve().parents[1]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One real server for the module: health SERVING within 120 s, stopped afterwards."""
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    server = ServerProcess(log_path=log_path, ready_timeout=120.0)
    server.start()
    try:
        yield server.target
    finally:
        server.stop()


def run_cli(
    target: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client", "--target", target, *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.slow
def test_generate_greedy_chat_answers_paris(server_target: str) -> None:
    done = run_cli(server_target, "generate", QUESTION, "--max-tokens", "16", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "completion=" in done.stderr


@pytest.mark.slow
def test_stream_prints_tokens_and_finish(server_target: str) -> None:
    done = run_cli(server_target, "stream", QUESTION, "--max-tokens", "16")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "finish=" in done.stderr


@pytest.mark.slow
def test_stats_lists_batch_state(server_target: str) -> None:
    done = run_cli(server_target, "stats")
    assert done.returncode == 0, done.stderr
    assert "active_sequences:" in done.stdout


@pytest.mark.slow
def test_info_json(server_target: str) -> None:
    done = run_cli(server_target, "info", "--json")
    assert done.returncode == 0, done.stderr
    assert '"model_id"' in done.stdout


@pytest.mark.slow
def test_invalid_request_is_a_usage_error_naming_the_field(server_target: str) -> None:
    done = run_cli(server_target, "generate", "hi", "--temperature", "-1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("error: INVALID_ARGUMENT: sampling.temperature must be")
    assert lines[1:] == ["  field: sampling.temperature", "  reason: INVALID_REQUEST"]

    done = run_cli(server_target, "generate", "hi", "--temperature", "-1", "--json")
    assert done.returncode == 2
    error = json.loads(done.stderr)
    assert error["code"] == "INVALID_ARGUMENT"
    assert [v["field"] for v in error["field_violations"]] == ["sampling.temperature"]
    assert error["retry_delay_seconds"] is None


@pytest.mark.slow
def test_exit_status_says_rejected(server_target: str) -> None:
    """A request id that is already running: ALREADY_EXISTS, exit status 4, and the reason."""
    request = build_request(
        chat=[("user", "Tell me a long story.")],
        max_tokens=300,
        ignore_eos=True,
        request_id="cli-duplicate",
    )
    with GenerationClient(server_target) as client:
        stream = client.stream(request)
        next(stream)
        done = run_cli(server_target, "generate", "Hi", "--request-id", "cli-duplicate")
        stream.close()
    assert done.returncode == 4, done.stderr
    assert done.stderr.startswith("error: ALREADY_EXISTS:")
    assert "  reason: REQUEST_ID_IN_USE" in done.stderr.splitlines()


@pytest.mark.slow
async def test_clients_read_the_error_details(server_target: str) -> None:
    bad = build_request("Hi", top_p=0.0)
    with GenerationClient(server_target) as client, pytest.raises(grpc.RpcError) as sync_err:
        client.generate(bad)
    async with AsyncGenerationClient(server_target) as aclient:
        with pytest.raises(grpc.aio.AioRpcError) as async_err:
            await aclient.generate(bad)
    for err in (sync_err.value, async_err.value):
        details = error_details(err)
        assert details.code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.error_class is ErrorClass.USAGE
        assert [v.field for v in details.field_violations] == ["sampling.top_p"]


@pytest.mark.slow
def test_exit_status_says_unavailable() -> None:
    """Nothing listens there: UNAVAILABLE, exit status 3 (retry later)."""
    from tests.helpers.server import free_port

    done = run_cli(f"127.0.0.1:{free_port()}", "info", "--timeout", "5")
    assert done.returncode == 3, done.stderr
    assert "error: UNAVAILABLE:" in done.stderr


@pytest.mark.slow
def test_sync_client(server_target: str) -> None:
    with GenerationClient(server_target) as client:
        client.wait_ready(10)
        request = build_request(chat=[("user", QUESTION)], max_tokens=16, temperature=0.0)
        response = client.generate(request)
        assert "Paris" in response.text
        assert response.usage.completion_tokens == len(response.token_ids)

        # ignore_eos makes the length exact; the stream's tokens add up to the usage.
        messages = list(client.stream(QUESTION, max_tokens=5, ignore_eos=True))
        assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert messages[-1].usage.completion_tokens == 5
        assert sum(len(m.token_ids) for m in messages) == 5

        tokens = client.tokenize(chat=[("user", QUESTION)])
        assert tokens.token_ids and len(tokens.tokens) == len(tokens.token_ids)
        assert client.model_info().vocab_size > 0

        with pytest.raises(grpc.RpcError) as err:
            client.generate(QUESTION, top_p=2.0)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.slow
async def test_async_client(server_target: str) -> None:
    async with AsyncGenerationClient(server_target) as client:
        await client.wait_ready(10)
        request = build_request(chat=[{"role": "user", "content": QUESTION}], max_tokens=16)
        text = ""
        final: pb.StreamGenerateResponse | None = None
        async for message in client.stream(to_stream_request(request)):
            text += message.text
            final = message
        assert "Paris" in text
        assert final is not None and final.finish_reason != pb.FINISH_REASON_UNSPECIFIED

        response = await client.generate(request)
        assert response.text == text  # greedy: unary and streaming agree
        stats = await client.cache_stats()
        assert stats.total_completed >= 2


def test_build_request_round_trips_to_stream_request() -> None:
    request = build_request(
        "hi", max_tokens=4, temperature=0.5, seed=7, stop=["\n"], logit_bias={3: -5.0}
    )
    stream_request = to_stream_request(request)
    assert stream_request.text == "hi"
    assert stream_request.sampling.seed == 7
    assert stream_request.stopping.stop == ["\n"]
    assert stream_request.sampling.logit_bias[3] == -5.0
    # Unset sampling fields stay unset, so the server applies its defaults.
    assert not request.sampling.HasField("top_p")
    with pytest.raises(ValueError):
        build_request("hi", chat=[("user", "hi")])


def test_response_format_builder() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = build_request("hi", response_format=response_format(json_schema=schema))
    assert json.loads(request.response_format.json_schema) == schema
    assert response_format(choice=["x", "y"]).choice.options == ["x", "y"]
    assert response_format(json_object=True).WhichOneof("format") == "json_object"
    assert response_format(regex="[a-z]+").regex == "[a-z]+"
    assert to_stream_request(request).response_format == request.response_format
    with pytest.raises(ValueError):
        response_format(regex="a", grammar='start: "a"')
    with pytest.raises(ValueError):
        response_format()


@pytest.mark.slow
def test_cli_and_client_constrain_the_reply(server_target: str) -> None:
    done = run_cli(
        server_target, "generate", "Is Paris in France?", "--choice", "yes", "--choice", "no"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() in ("yes", "no")
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    with GenerationClient(server_target) as client:
        reply = client.generate(
            QUESTION, max_tokens=32, response_format=response_format(json_schema=schema)
        )
    assert reply.finish_reason == pb.FINISH_REASON_STOP
    assert isinstance(json.loads(reply.text)["city"], str)


# -- TLS, mutual TLS and tokens --------------------------------------------------------------


@pytest.fixture(scope="module")
def secured(secured_server: tuple[RunningServer, Pki]) -> tuple[str, Pki]:
    """The session's server that wants mutual TLS and a bearer token (conftest)."""
    server, pki = secured_server
    return server.target, pki


TOKEN = SECURED_TOKEN


def _tls_flags(pki: Pki) -> list[str]:
    return [
        "--tls-ca",
        str(pki.ca),
        "--tls-cert",
        str(pki.client_cert),
        "--tls-key",
        str(pki.client_key),
    ]


@pytest.mark.slow
def test_cli_with_tls_and_token(secured) -> None:
    target, pki = secured
    done = run_cli(
        target, *_tls_flags(pki), "--token", TOKEN, "generate", QUESTION, "--max-tokens", "12"
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    # The flags are accepted after the command too.
    done = run_cli(target, "info", *_tls_flags(pki), "--token", TOKEN, "--json")
    assert done.returncode == 0, done.stderr
    assert '"model_id"' in done.stdout


@pytest.mark.slow
def test_cli_token_from_the_environment(secured) -> None:
    target, pki = secured
    done = run_cli(target, *_tls_flags(pki), "stats", env={"MLXSERVE_TOKEN": TOKEN})
    assert done.returncode == 0, done.stderr
    assert "active_sequences:" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("drop", "code"),
    [("--token", "UNAUTHENTICATED"), ("--tls-cert", "UNAVAILABLE"), ("--tls-ca", "UNAVAILABLE")],
)
def test_cli_without_token_or_certificates_is_refused(secured, drop, code) -> None:
    target, pki = secured
    flags = [*_tls_flags(pki), "--token", TOKEN]
    i = flags.index(drop)
    del flags[i : i + 2]
    if drop == "--tls-cert":
        flags.remove("--tls-key")
        flags.remove(str(pki.client_key))
    done = run_cli(target, *flags, "tokenize", "hi", "--raw")
    assert done.returncode == (2 if code == "UNAUTHENTICATED" else 3)  # usage, unavailable
    # (gRPC itself may log the failed handshake first.)
    assert done.stderr.splitlines()[-1].startswith(f"error: {code}:"), done.stderr


@pytest.mark.slow
def test_cli_a_certificate_without_its_key_is_a_usage_error(secured) -> None:
    target, pki = secured
    done = run_cli(target, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert), "info")
    assert done.returncode == 2
    assert "--tls-cert and --tls-key" in done.stderr


@pytest.mark.slow
def test_clients_with_tls_and_token(secured) -> None:
    target, pki = secured
    tls = TLSConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    with GenerationClient(target, tls=tls, token=TOKEN) as client:
        client.wait_ready(10)
        assert (
            "Paris" in client.generate(build_request(chat=[("user", QUESTION)], max_tokens=12)).text
        )
        assert client.tokenize("Hello").token_ids
    with GenerationClient(target, tls=tls) as client, pytest.raises(grpc.RpcError) as refused:
        client.model_info()
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.slow
async def test_async_client_with_tls_and_token(secured) -> None:
    target, pki = secured
    tls = TLSConfig(ca_file=pki.ca, cert_file=pki.client_cert, key_file=pki.client_key)
    async with AsyncGenerationClient(target, tls=tls, token=TOKEN) as client:
        await client.wait_ready(10)
        messages = [m async for m in client.stream(QUESTION, max_tokens=4, ignore_eos=True)]
        assert messages[-1].usage.completion_tokens == 4
        assert (await client.cache_stats()).total_completed >= 1


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_bench_runs_against_a_secured_server(secured, tmp_path, processes: int) -> None:
    """From this process, and from client processes (each given the TLS files and token)."""
    target, pki = secured
    out = tmp_path / "bench.json"
    done = run_cli(
        target,
        *_tls_flags(pki),
        "--token",
        TOKEN,
        "bench",
        "--concurrency",
        str(processes),
        "--client-processes",
        str(processes),
        "--channels",
        str(processes),
        "--rounds",
        "1",
        "--max-tokens",
        "4",
        "--prompt-len",
        "16",
        "--warmup",
        "0",
        "--no-plot",
        "--out",
        str(out),
    )
    assert done.returncode == 0, done.stderr
    level = json.loads(out.read_text())["ours"][0]
    summary = level["summary"]
    assert summary["requests"] >= processes and summary["errors"] == 0
    assert summary["completion_tokens"] == 4 * summary["requests"]
    # Send times are relative to the level's start, whichever process sent them.
    assert all(0 <= r["start"] < 5 and r["ttft"] > 0 for r in level["requests"])
    # The server's own timing of each request: its queueing is part of its first token's time.
    assert all(0 <= r["server_queue"] <= r["server_ttft"] for r in level["requests"])
