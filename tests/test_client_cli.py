"""End to end: the CLI and the Python clients against a real server on the embedded model."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from client import AsyncGenerationClient, GenerationClient, build_request, to_stream_request
from client.bench.server import ServerProcess
from mlxserve.v1 import generation_pb2 as pb

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


def run_cli(target: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "client", "--target", target, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_generate_greedy_chat_answers_paris(server_target: str) -> None:
    done = run_cli(server_target, "generate", QUESTION, "--max-tokens", "16", "--temperature", "0")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "completion=" in done.stderr


def test_stream_prints_tokens_and_finish(server_target: str) -> None:
    done = run_cli(server_target, "stream", QUESTION, "--max-tokens", "16")
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "finish=" in done.stderr


def test_stats_lists_batch_state(server_target: str) -> None:
    done = run_cli(server_target, "stats")
    assert done.returncode == 0, done.stderr
    assert "active_sequences:" in done.stdout


def test_info_json(server_target: str) -> None:
    done = run_cli(server_target, "info", "--json")
    assert done.returncode == 0, done.stderr
    assert '"model_id"' in done.stdout


def test_invalid_request_exits_1_with_code(server_target: str) -> None:
    done = run_cli(server_target, "generate", "hi", "--temperature", "-1")
    assert done.returncode == 1
    assert done.stderr.startswith("error: INVALID_ARGUMENT:")
    assert len(done.stderr.strip().splitlines()) == 1


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
