"""Paged KV cache through gRPC: prefix sharing and parity with dense storage on the real model,
and a tight budget (on the thin random model) under which every request still completes without
leaking blocks."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.metrics import metric, scrape_metrics
from tests.helpers.requests import chat_request, to_stream, with_id
from tests.helpers.server import (
    THIN_KV_BYTES_PER_TOKEN,
    THIN_MODEL,
    THIN_MODEL_ID,
    ServerProcess,
    free_port,
    running_server,
    wait_idle,
)

pytestmark = [pytest.mark.slow, pytest.mark.model]

RULES = [
    f"Rule {i}: answer politely, keep facts straight, and cite the section number {i}."
    for i in range(30)
]
# ~600 tokens of system prompt (over 35 full 16-token blocks) shared by the requests of the
# sharing test: it outweighs what each request adds to it many times over.
SYSTEM = " ".join(RULES)
# The adoption test's shared system prompt, a third of SYSTEM (over a dozen full blocks): an
# adopting request reuses whole blocks whatever their number, and each of its cold runs
# prefills the whole prompt.
ADOPT_SYSTEM = " ".join(RULES[:10])
SHARED_TOKENS = 180  # fewer than ADOPT_SYSTEM's full blocks: what an adopting request must reuse
QUESTIONS = [
    "What is the capital of France?",
    "Name a primary color.",
    "What is two plus two?",
    "Which planet is closest to the sun?",
    "What do bees make?",
    "What is the opposite of hot?",
    "How many legs does a spider have?",
    "What color is the sky on a clear day?",
]


def _stats(stub: pb_grpc.GenerationServiceStub) -> pb.CacheStatsResponse:
    return stub.CacheStats(pb.CacheStatsRequest(), timeout=10)


def _active_bytes_with(
    stub: pb_grpc.GenerationServiceStub, requests: list[pb.GenerateRequest]
) -> int:
    """Start streams one after another (each once the previous one decodes, so it finds the
    shared prefix cached), read the KV bytes in use while all decode, then cancel them. Waits
    first for what earlier tests left running (a cancelled stream ends a tick later)."""
    wait_idle(stub)
    calls, started = [], []
    for request in requests:
        call = stub.StreamGenerate(to_stream(request), timeout=300)
        first = threading.Event()

        def drain(c=call, ev=first) -> None:
            try:
                for _ in c:
                    ev.set()
            except grpc.RpcError:
                ev.set()

        threading.Thread(target=drain, daemon=True).start()
        assert first.wait(120), "stream produced nothing"
        calls.append(call)
        started.append(first)
    stats = _stats(stub)
    # Stats are published before a tick's tokens are delivered: every stream that has
    # produced a token is in them.
    assert sorted(slot.request_id for slot in stats.slots) == sorted(
        r.request_id for r in requests
    ), stats
    for call in calls:
        call.cancel()
    wait_idle(stub)
    return stats.used_bytes


def test_shared_system_prompt_is_stored_once(stub: pb_grpc.GenerationServiceStub) -> None:
    def request(i: int) -> pb.GenerateRequest:
        return chat_request(
            QUESTIONS[i],
            system=SYSTEM,
            request_id=f"share-{i}",
            max_tokens=400,
            stopping=pb.StoppingCriteria(ignore_eos=True),
        )

    assert _stats(stub).storage_backend == "paged"
    one = _active_bytes_with(stub, [request(0)])
    eight = _active_bytes_with(stub, [with_id(request(i), f"share8-{i}") for i in range(8)])
    assert one > 0
    assert eight <= 2.5 * one, f"8 sharers use {eight} bytes, one uses {one}"


def test_adopting_requests_decode_like_cold_runs(stub: pb_grpc.GenerationServiceStub) -> None:
    before = _stats(stub)
    cold = [
        stub.Generate(
            chat_request(q, system=ADOPT_SYSTEM, max_tokens=12, cache_prompt=False), timeout=120
        )
        for q in QUESTIONS[:2]
    ]
    assert all(r.usage.cached_tokens == 0 for r in cold)
    warm_up = stub.Generate(
        chat_request(QUESTIONS[5], system=ADOPT_SYSTEM, max_tokens=2), timeout=120
    )
    assert warm_up.usage.prompt_tokens > SHARED_TOKENS
    for q, expected in zip(QUESTIONS[:2], cold):
        got = stub.Generate(chat_request(q, system=ADOPT_SYSTEM, max_tokens=12), timeout=120)
        assert got.usage.cached_tokens >= SHARED_TOKENS, got.usage
        assert list(got.token_ids) == list(expected.token_ids), q
    after = _stats(stub)
    assert after.prefix_hits >= before.prefix_hits + 2
    assert after.prefix_hit_tokens >= before.prefix_hit_tokens + 2 * SHARED_TOKENS


@pytest.fixture(scope="module")
def dense_server() -> Iterator[ServerProcess]:
    with running_server("--decode-storage-backend", "dense", "--max-batch-size", "4") as s:
        yield s


def test_paged_output_equals_dense_output(
    stub: pb_grpc.GenerationServiceStub, dense_server: ServerProcess
) -> None:
    with grpc.insecure_channel(dense_server.target) as channel:
        dense = pb_grpc.GenerationServiceStub(channel)
        assert _stats(dense).storage_backend == "dense"
        for q in QUESTIONS[:3]:
            request = chat_request(q, max_tokens=24, cache_prompt=False)
            paged_out = stub.Generate(request, timeout=120)
            dense_out = dense.Generate(request, timeout=120)
            assert list(paged_out.token_ids) == list(dense_out.token_ids), q
            assert paged_out.text == dense_out.text


# The tight budget: 16 blocks of 16 tokens of float32 K/V. Each of the 8 requests (~40 prompt
# tokens, 48 generated) needs about 6 blocks, its first two shared: room for 3 at a time, while
# the 8 rows of a batch all start at once. Blocks, not weights, decide what runs: the thin random
# model (the embedded tokenizer's prompts).
TIGHT_BLOCKS, TIGHT_REQUESTS, TIGHT_TOKENS = 16, 8, 48


def test_tight_budget_completes_everything_without_leaks() -> None:
    budget = str(TIGHT_BLOCKS * 16 * THIN_KV_BYTES_PER_TOKEN)
    metrics_port = free_port()
    with (
        running_server(
            *THIN_MODEL, "--kv-cache-budget", budget, "--max-batch-size", "8",
            "--max-queue-depth", "16", "--metrics-port", str(metrics_port),
        ) as server,
        grpc.insecure_channel(server.target) as channel,
    ):  # fmt: skip
        stub = pb_grpc.GenerationServiceStub(channel)
        assert _stats(stub).total_blocks == TIGHT_BLOCKS
        results: dict[int, pb.GenerateResponse | grpc.RpcError] = {}

        def run(i: int) -> None:
            request = chat_request(
                QUESTIONS[i % 8],
                request_id=f"tight-{i}",
                max_tokens=TIGHT_TOKENS,
                stopping=pb.StoppingCriteria(ignore_eos=True),
            )
            try:
                results[i] = stub.Generate(request, timeout=600)
            except grpc.RpcError as exc:
                results[i] = exc

        threads = [threading.Thread(target=run, args=(i,)) for i in range(TIGHT_REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        failures = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
        assert not failures, {i: (e.code(), e.details()) for i, e in failures.items()}
        for r in results.values():
            assert r.finish_reason == pb.FINISH_REASON_LENGTH
            assert r.usage.completion_tokens == TIGHT_TOKENS
        idle = wait_idle(stub)
        assert idle.active_blocks == 0
        assert idle.free_blocks == idle.total_blocks
        assert idle.preemptions >= 1  # the budget really was tight

        # A request that can never fit the budget is refused at once, with no RetryInfo
        # (a retry would fail again).
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(chat_request("hi", max_tokens=400), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV cache budget" in refused.value.details()
        details = error_details(refused.value)
        assert details.reason == "KV_BUDGET_EXCEEDED" and details.retry_delay is None
        assert details.metadata["capacity_tokens"] == str(TIGHT_BLOCKS * 16)

        # The metrics saw the same: the preemptions, the refusal, the pool's size, all free.
        samples = scrape_metrics(f"http://127.0.0.1:{metrics_port}/metrics")
        model = {"model": THIN_MODEL_ID}
        assert metric(samples, "mlxserve_preemptions_total", **model) == idle.preemptions
        assert metric(samples, "mlxserve_rejections_total", **model, reason="kv_budget") == 1
        done = metric(samples, "mlxserve_requests_total", **model, finish_reason="length")
        assert done == TIGHT_REQUESTS
        assert metric(samples, "mlxserve_kv_cache_capacity_blocks", **model) == TIGHT_BLOCKS
        assert metric(samples, "mlxserve_kv_cache_capacity_bytes", **model) == int(budget)
        assert metric(samples, "mlxserve_kv_cache_usage_ratio", **model) == 0
