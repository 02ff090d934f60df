"""Scheduler policies through real gRPC on the embedded SmolLM2 (docs/scheduler.md):
chunked prefill interleaved with decode steps, chunks sized by the prefill stall bound,
priority preemption, the per-slot context budget, --no-batch, and deterministic
CLI == server."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.core.scheduler.scheduler import MIN_PREFILL_CHUNK, STALL_BOUND_STEPS
from tests.helpers.paths import REPO_ROOT
from tests.helpers.requests import chat_request, to_stream, with_id
from tests.helpers.server import free_port, running_server

pytestmark = [pytest.mark.slow, pytest.mark.model]

QUESTION = "What is the capital of France?"
PARAGRAPH = (
    "The old harbour town grew rich on the spice trade. Merchants came from distant lands "
    "with cloth, copper and salt, and every spring the quays filled with ships and sailors. "
)
LONG_PROMPT = PARAGRAPH * 22  # ~850 tokens as a chat user message: 7 chunks
CHUNK = 128
CTX_SIZE, BATCH = 20000, 5
STREAM_PROMPTS = [
    "Tell me a long story about a dragon.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holiday.",
    "Explain how a steam engine works.",
]
ENDLESS = pb.StoppingCriteria(max_tokens=1000, ignore_eos=True)
THREE = pb.StoppingCriteria(max_tokens=3, ignore_eos=True)
SERVICE = [sys.executable, "-m", "service", "--host", "127.0.0.1", "--log-format", "json"]


@pytest.fixture(scope="module")
def chunked_server() -> Iterator:
    """Fixed 128-token chunks, 5 rows, 20000 tokens of context shared by the slots."""
    flags = ["--prefill-chunk-size", str(CHUNK), "--max-batch-size", str(BATCH)]
    flags += ["--ctx-size", str(CTX_SIZE), "--deterministic", "--log-format", "json"]
    with running_server(*flags) as server:
        yield server


def _stub(channel: grpc.Channel | grpc.aio.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(channel)


async def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def _decoding_streams(stub, arrivals: dict[str, list[float]]) -> list[asyncio.Future]:
    """One endless greedy stream per key of `arrivals` (its request_id; prompts from
    STREAM_PROMPTS), each noting when its tokens arrive. Cancel the tasks to end them."""

    async def decode(request_id: str, prompt: str) -> None:
        request = chat_request(prompt, request_id=request_id, stopping=ENDLESS)
        call = stub.StreamGenerate(to_stream(request), timeout=300)
        try:
            async for message in call:
                if message.token_ids:
                    arrivals[request_id].append(time.monotonic())
        finally:
            call.cancel()

    return [
        asyncio.ensure_future(decode(rid, prompt)) for rid, prompt in zip(arrivals, STREAM_PROMPTS)
    ]


# -- chunked prefill does not stall the decoding streams --------------------------------------


async def test_long_prefill_is_interleaved_with_decode_steps(chunked_server) -> None:
    """4 streams decode; a ~850-token prompt arrives and is prefilled in 128-token chunks. The
    streams keep receiving tokens between its arrival and its first token (decode steps run
    between the chunks), and no gap between their tokens comes near the whole prefill."""
    arrivals: dict[str, list[float]] = {f"dec-{i}": [] for i in range(len(STREAM_PROMPTS))}
    async with grpc.aio.insecure_channel(chunked_server.target) as channel:
        stub = _stub(channel)

        tasks = _decoding_streams(stub, arrivals)
        try:
            await _wait_until(
                lambda: all(len(a) >= 3 for a in arrivals.values()), 120, "4 decoding streams"
            )
            sent = time.monotonic()
            first_token, prompt_tokens = None, 0
            long_request = chat_request(LONG_PROMPT, max_tokens=1, request_id="long-prompt")
            async for message in stub.StreamGenerate(to_stream(long_request), timeout=300):
                if message.token_ids and first_token is None:
                    first_token = time.monotonic()
                if message.finish_reason:
                    prompt_tokens = message.usage.prompt_tokens
            assert all(not t.done() for t in tasks), "a decoding stream ended early"
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    assert first_token is not None
    assert 800 <= prompt_tokens <= 900
    window = first_token - sent
    chunks = -(-prompt_tokens // CHUNK)
    for request_id, times in arrivals.items():
        inside = [t for t in times if sent < t < first_token]
        # One decode step per chunk: a token per chunk (the last may race the long's token).
        assert len(inside) >= max(2, chunks - 2), (
            f"{request_id} got {len(inside)} tokens during the {window:.1f} s prefill "
            f"of {chunks} chunks"
        )
        # The longest wait for a token is about one chunk, not the whole prompt.
        points = [sent, *inside, first_token]
        longest = max(b - a for a, b in itertools.pairwise(points))
        assert longest < 0.5 * window, f"{request_id} stalled {longest:.1f} of {window:.1f} s"


# -- the prefill stall bound -----------------------------------------------------------------


async def test_the_default_stall_bound_sizes_the_chunks_while_streams_decode() -> None:
    """2 streams decode; a ~470-token prompt arrives. With the default bound (4 running median
    decode steps) the scheduler sizes each prefill pass so that its predicted time fits the
    bound less a step (its debug log says what it planned and measured); the prompt completes
    with its tokens, and the streams never wait for a token anywhere near what one 512-token
    chunk costs here. Wall-clock assertions are loose: the CPU is shared."""
    streams: dict[str, list[float]] = {f"dec-{i}": [] for i in range(2)}
    flags = ["--max-batch-size", "3", "--log-format", "json", "--log-level", "debug"]
    with running_server(*flags) as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = _stub(channel)
            long_request = chat_request(PARAGRAPH * 12, request_id="long", stopping=THREE)
            tokenized = await stub.Tokenize(pb.TokenizeRequest(chat=long_request.chat), timeout=30)

            tasks = _decoding_streams(stub, streams)
            try:
                # A few decode steps for the running median.
                await _wait_until(
                    lambda: all(len(a) >= 8 for a in streams.values()), 120, "2 decoding streams"
                )
                sent = time.monotonic()
                final = await stub.Generate(long_request, timeout=300)
                done = time.monotonic()
                assert all(not t.done() for t in tasks), "a decoding stream ended early"
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        passes = [
            r
            for r in server.records()
            if r.get("event") == "prefill pass" and "long" in r.get("request_ids", ())
        ]

    prompt_tokens = len(tokenized.token_ids)
    assert 400 <= prompt_tokens <= 600
    assert final.usage.prompt_tokens == prompt_tokens
    assert len(final.token_ids) == final.usage.completion_tokens == 3
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    # The whole prompt (less a prefix adopted from the cache) went through the passes, in
    # chunks the budget sized.
    chunks = [r["tokens"][r["request_ids"].index("long")] for r in passes]
    assert sum(chunks) == prompt_tokens - final.usage.cached_tokens and len(chunks) > 5
    for record in passes:
        assert record["budget_ms"] is not None, "a pass not sized by the stall bound"
        # The bound is 4 decode steps; the pass gets it less a step.
        assert record["bound_ms"] == pytest.approx(STALL_BOUND_STEPS * record["step_ms"], rel=0.01)
        assert 0 < record["budget_ms"] < record["bound_ms"]
        assert (
            record["predicted_ms"] <= record["budget_ms"]
            or record["tokens"][0] == MIN_PREFILL_CHUNK
        ), record
    bound_s = max(r["bound_ms"] for r in passes) / 1000
    worst = max(
        b - a
        for times in streams.values()
        for a, b in itertools.pairwise(times)
        if b > sent and a < done
    )
    assert worst < max(2.0, 8 * bound_s), f"a stream waited {worst:.2f} s (bound {bound_s:.2f} s)"


# -- per-slot context, deterministic CLI == server -------------------------------------------


def test_slot_context_is_ctx_size_shared_by_the_slots(chunked_server) -> None:
    per_slot = CTX_SIZE // BATCH
    with grpc.insecure_channel(chunked_server.target) as channel:
        stub = _stub(channel)
        stats = stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert stats.slot_context_tokens == info.slot_context_tokens == per_slot
        assert stats.max_batch_size == info.max_batch_size == BATCH
        # A prompt that does not fit one slot is refused up front.
        too_long = pb.GenerateRequest(token_ids=pb.TokenIdsInput(ids=[42] * per_slot))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(too_long, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert str(per_slot) in (err.value.details() or "")


def test_deterministic_cli_equals_the_server(chunked_server) -> None:
    with grpc.insecure_channel(chunked_server.target) as channel:
        served = _stub(channel).Generate(chat_request(QUESTION, max_tokens=24), timeout=120)
    cli = subprocess.run(
        [sys.executable, "-m", "service", "generate", QUESTION, "--max-tokens", "24", "--json"],
        cwd=REPO_ROOT,
        env={**os.environ, "MLXSERVE_DETERMINISTIC": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert cli.returncode == 0, cli.stderr[-2000:]
    result = json.loads(cli.stdout.strip().splitlines()[-1])
    assert result["token_ids"] == list(served.token_ids)
    assert len(result["token_ids"]) > 1
    assert result["text"].startswith(served.text)
    assert result["finish_reason"] == "stop" and served.finish_reason == pb.FINISH_REASON_STOP


# -- preemption -----------------------------------------------------------------------------


LOW_TOKENS = 32  # each low-priority request's length: it is still decoding when high arrives


@pytest.mark.parametrize(
    ("policy", "low_priorities", "victim"),
    [("longest-first", (0, 0), "low-0"), ("lowest-priority", (0, -1), "low-1")],
    ids=["longest-first", "lowest-priority"],
)
async def test_high_priority_arrival_preempts_and_the_victim_output_is_unchanged(
    policy: str, low_priorities: tuple[int, int], victim: str
) -> None:
    """Two low-priority requests fill a 2-row batch (low-0 started first, so it has generated
    more); a high-priority one arrives and finishes before both. The policy's victim is
    re-queued and re-prefilled with prompt + generated, and its tokens equal its solo run."""
    low = pb.StoppingCriteria(max_tokens=LOW_TOKENS, ignore_eos=True)
    lows = {
        f"low-{i}": chat_request(prompt, request_id=f"low-{i}", stopping=low, priority=priority)
        for i, (prompt, priority) in enumerate(zip(STREAM_PROMPTS, low_priorities))
    }
    high = chat_request(QUESTION, max_tokens=8, request_id="high", priority=5)
    tokens: dict[str, list[int]] = {rid: [] for rid in [*lows, "high"]}
    finished: dict[str, tuple[float, int]] = {}
    flags = ["--max-batch-size", "2", "--enable-preemption", "--preemption-policy", policy]
    with running_server(*flags, "--log-format", "json") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = _stub(channel)

            async def stream(request: pb.GenerateRequest) -> None:
                async for message in stub.StreamGenerate(to_stream(request), timeout=300):
                    tokens[request.request_id].extend(message.token_ids)
                    if message.finish_reason:
                        finished[request.request_id] = (time.monotonic(), message.finish_reason)

            tasks = [asyncio.ensure_future(stream(lows["low-0"]))]
            await _wait_until(lambda: len(tokens["low-0"]) >= 4, 120, "low-0 decoding")
            tasks.append(asyncio.ensure_future(stream(lows["low-1"])))
            await _wait_until(lambda: len(tokens["low-1"]) >= 1, 120, "low-1 decoding")
            tasks.append(asyncio.ensure_future(stream(high)))
            await asyncio.gather(*tasks)
            stats = await stub.CacheStats(pb.CacheStatsRequest(), timeout=10)

            assert stats.preemptions == 1
            assert finished["high"][0] < min(finished[r][0] for r in lows)
            for request_id in lows:
                assert len(tokens[request_id]) == LOW_TOKENS
                assert finished[request_id][1] == pb.FINISH_REASON_LENGTH
            preempted = [r for r in server.records() if r.get("event") == "preempted"]
            assert [r["request_id"] for r in preempted] == [victim]
            assert 0 < preempted[0]["generated"] < LOW_TOKENS
            solo = await stub.Generate(with_id(lows[victim], f"{victim}-solo"), timeout=300)
            assert tokens[victim] == list(solo.token_ids), f"{victim} differs from its solo run"


# -- context budget refusal, --no-batch --------------------------------------------------------


def test_ctx_size_too_small_per_slot_refuses_to_start() -> None:
    """--ctx-size 1000 over 4 slots gives 250 < 512 tokens per slot: the server exits non-zero
    with a message naming 512, without ever serving."""
    started = time.monotonic()
    proc = subprocess.run(
        [*SERVICE, "--port", str(free_port()), "--ctx-size", "1000", "--max-batch-size", "4"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - started
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "512" in output
    assert '"event": "serving"' not in output
    assert elapsed < 90


async def test_no_batch_serves_concurrent_requests_one_at_a_time() -> None:
    requests = [
        chat_request(QUESTION, max_tokens=10, request_id="nb-0"),
        chat_request("Name three fruits.", max_tokens=10, request_id="nb-1"),
        chat_request("Write a haiku about the sea.", max_tokens=10, request_id="nb-2"),
    ]
    with running_server("--no-batch", "--log-format", "json") as server:
        async with grpc.aio.insecure_channel(server.target) as channel:
            stub = _stub(channel)
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            stats = await stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
            assert info.decode_path == "sequential worker"
            assert info.max_batch_size == stats.max_batch_size == 1
            alone = [
                await stub.Generate(with_id(r, f"{r.request_id}-alone"), timeout=120)
                for r in requests
            ]

            done = asyncio.Event()
            seen = {"active": 0, "queued": 0}

            async def watch() -> None:
                while not done.is_set():
                    s = await stub.CacheStats(pb.CacheStatsRequest(), timeout=5)
                    seen["active"] = max(seen["active"], s.active_sequences)
                    seen["queued"] = max(seen["queued"], s.queued_requests)
                    await asyncio.sleep(0.02)

            watcher = asyncio.ensure_future(watch())
            together = await asyncio.gather(*(stub.Generate(r, timeout=120) for r in requests))
            done.set()
            await watcher
    for a, t in zip(alone, together):
        assert list(t.token_ids) == list(a.token_ids)
        assert t.text == a.text and t.finish_reason == a.finish_reason
    assert seen["active"] == 1  # one sequence at a time ...
    assert seen["queued"] >= 1  # ... while the others wait
