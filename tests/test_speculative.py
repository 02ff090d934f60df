"""Prompt-lookup speculative decoding: drafting, exact verification, rollback, and through the
real server the same greedy tokens as without it."""

from __future__ import annotations

import collections

import grpc
import mlx.core as mx
import numpy as np
import pytest

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.core.engine.config import resolve
from service.core.engine.paged_attention import kernel_available
from service.core.engine.sampler import RowSamplerState, verify_draft
from service.core.engine.storage import PoolShape, make_storage
from service.core.models.families import family
from service.core.models.layout import probe_layout
from service.core.scheduler.prompt_lookup import MAX_PAUSE, DraftPacing, NgramIndex
from service.protocol import SamplingParams
from tests.helpers.metrics import EMBEDDED_MODEL_ID, metric, scrape_metrics
from tests.helpers.requests import chat_request, to_stream, with_id
from tests.helpers.server import free_port, running_server, wait_idle
from tests.helpers.tiny import PROMPTS, DraftRow, StepRow, make_engine, paged, prompt, tiny_llama

# -- drafting ------------------------------------------------------------------------------------


def test_the_longest_earlier_ngram_proposes_its_continuation() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 5, 9, 9, 1, 2, 3])
    assert index.propose(3) == [4, 5, 9]  # (1, 2, 3) occurred before, followed by 4 5 9
    index.extend([4])
    assert index.propose(2) == [5, 9]
    fresh = NgramIndex(2, 2)
    fresh.extend([7, 8, 6])
    assert fresh.propose(4) == []  # the suffix alone is no earlier occurrence


def test_a_later_occurrence_wins_over_an_earlier_one() -> None:
    index = NgramIndex(1, 1)
    index.extend([5, 1, 5, 2, 5])
    assert index.propose(1) == [2]


def test_pacing_drafts_while_drafts_are_accepted_and_backs_off_when_they_miss() -> None:
    pacing = DraftPacing(4)
    assert pacing.allowed() == 4
    pacing.record(4, 4)
    assert pacing.allowed() == 4  # capped at the configured length
    pacing.record(4, 1)
    assert pacing.allowed() == 2  # as many as were accepted, plus one
    pacing.record(2, 0)
    assert pacing.allowed() == 1
    pacing.record(1, 0)  # nothing accepted at length 1: pause one plan
    assert (pacing.ready, pacing.allowed(), pacing.allowed()) == (False, 0, 1)
    pacing.record(1, 0)  # again: pause twice as long
    assert [pacing.allowed() for _ in range(3)] == [0, 0, 1]
    pacing.record(1, 1)  # a hit resets the back-off and lengthens the draft
    assert pacing.allowed() == 2
    for _ in range(20):
        pacing.miss()
    assert pacing.paused == MAX_PAUSE


# -- verification is exact ---------------------------------------------------------------------


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax() -> None:
    logits = mx.array(np.eye(6, dtype=np.float32)[[3, 4, 1, 2]] * 10)  # argmaxes 3 4 1 2
    state = RowSamplerState(SamplingParams())
    assert verify_draft(logits, [3, 4, 5], state)[0] == [3, 4, 1]  # third draft rejected
    assert verify_draft(logits, [3, 4, 1], state)[0] == [3, 4, 1, 2]  # all kept, plus one
    assert verify_draft(logits[:1], [], state)[0] == [3]  # no draft: a plain step


def test_sampled_verification_keeps_the_models_distribution() -> None:
    """Rejection sampling against a fixed draft on a 5-token vocabulary: the first emitted
    token is distributed as p0 and, after an accepted first draft, the second as p1."""
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(3, 5)).astype(np.float32))
    p = np.array(mx.softmax(logits, axis=-1))
    draft = [2, 0]
    firsts: collections.Counter[int] = collections.Counter()
    seconds: collections.Counter[int] = collections.Counter()
    n = 6000
    for seed in range(n):
        state = RowSamplerState(SamplingParams(temperature=1.0, seed=seed))
        emitted, _ = verify_draft(logits, draft, state)
        firsts[emitted[0]] += 1
        if emitted[0] == draft[0]:
            seconds[emitted[1]] += 1
    first = np.array([firsts[t] for t in range(5)]) / n
    second = np.array([seconds[t] for t in range(5)]) / sum(seconds.values())
    assert np.abs(first - p[0]).max() < 0.02
    assert np.abs(second - p[1]).max() < 0.03


# -- the engine: one forward per verification, rejected K/V given back ---------------------------


def _plain_and_verified(plain, spec) -> tuple[list[list[int]], list[list[int]], list]:
    """13 greedy tokens per prompt from `plain` decoding, and from `spec` verifying drafts of
    three (two right, the third wrong) per forward; with `spec`'s sequences."""
    seqs = [plain.add_sequence(f"p{i}", SamplingParams(), p) for i, p in enumerate(PROMPTS)]
    want = [[r.token_id] for r in plain.prefill([_row(s, p) for s, p in zip(seqs, PROMPTS)])]
    for _ in range(12):
        for w, r in zip(want, plain.step([_row(s) for s in seqs])):
            w.append(r.token_id)
    seqs = [spec.add_sequence(f"s{i}", SamplingParams(), p) for i, p in enumerate(PROMPTS)]
    got = [[r.token_id] for r in spec.prefill([_row(s, p) for s, p in zip(seqs, PROMPTS)])]
    while min(len(g) for g in got) < 13:
        rows = []
        for i, s in enumerate(seqs):
            n = len(got[i])
            truth = want[i][n : n + 3]
            draft = [*truth[:2], (truth[2] + 1) % 256] if len(truth) == 3 else []
            rows.append(DraftRow(s, got[i][-1], draft))
        for i, verified in enumerate(spec.verify(rows)):
            got[i] += [r.token_id for r in verified.results]
    return want, [g[:13] for g in got], seqs


def test_engine_verification_matches_plain_decoding_and_rolls_back() -> None:
    """Drafts half right: the tokens equal plain greedy decoding, and once the rejected drafts'
    slots are given back (as the scheduler does) each row holds exactly the blocks its cached
    positions need."""
    model = tiny_llama()
    storage = paged()
    spec = make_engine(model, storage)
    want, got, seqs = _plain_and_verified(make_engine(model, paged()), spec)
    assert got == want
    for s in seqs:
        blocks = spec.blocks(s)
        assert blocks.num_tokens == s.num_cached
        assert len(blocks.block_ids) == -(-s.num_cached // storage.block_size)
    for s in seqs:
        spec.release(s)
    assert spec.manager is not None and spec.manager.stats().num_active_blocks == 0


@pytest.mark.skipif(not kernel_available(), reason="the compiled direct decode path is CUDA's")
def test_cuda_verification_as_a_decode_step_matches_plain_decoding() -> None:
    """On CUDA a verification forward runs as the compiled decode step of one virtual row per
    position: its tokens equal plain greedy decoding's, drafts right or wrong, and released rows
    leave no block held."""
    model = tiny_llama(hidden_size=128, heads=4, kv_heads=2)  # head_dim 32: the kernel's
    layout = probe_layout(model)
    config = resolve(family("llama"), layout, paged=True, batched=True, cuda=True)
    assert config.compile_decode and config.decode_attention == "direct"

    def engine():
        storage = make_storage(config, model, layout, PoolShape(num_blocks=64, block_size=8))
        return make_engine(model, storage, config)

    spec = engine()
    want, got, seqs = _plain_and_verified(engine(), spec)
    assert got == want
    for s in seqs:
        spec.release(s)
    assert spec.manager is not None and spec.manager.stats().num_active_blocks == 0


def _row(seq, tokens=None):
    return StepRow(seq, tokens)


# -- through the server ----------------------------------------------------------------------------

SUMMARY = (
    "Summarize: The river flows from the mountains to the sea. The river flows from the "
    "mountains to the sea, past the old mill and the stone bridge. The river flows from the "
    "mountains to the sea."
)


@pytest.mark.slow
@pytest.mark.model
def test_greedy_output_is_unchanged_by_speculation(reference) -> None:
    """The embedded model on a repetitive prompt, alone and two rows together: the same tokens
    as the shared server without speculation, with drafts accepted."""
    requests = [
        chat_request(SUMMARY, max_tokens=40, cache_prompt=False),
        chat_request("Repeat: one two three, one two three, one two three", max_tokens=30),
    ]
    want = [reference(r) for r in requests]
    metrics = f"http://127.0.0.1:{(port := free_port())}/metrics"
    flags = ("--draft-kind", "prompt-lookup", "--log-format", "json", "--metrics-port", str(port))
    with running_server(*flags) as server, grpc.insecure_channel(server.target) as channel:
        spec = pb_grpc.GenerationServiceStub(channel)
        info = spec.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        assert info.speculation.draft_kind == "prompt-lookup"
        assert info.speculation.max_batch == 2
        alone = spec.Generate(requests[0], timeout=120)
        assert list(alone.token_ids) == list(want[0].token_ids)
        assert alone.usage.accepted_tokens > 0
        assert alone.usage.drafted_tokens >= alone.usage.accepted_tokens
        futures = [spec.Generate.future(r, timeout=120) for r in requests]
        replies = [future.result() for future in futures]
        for reply, w in zip(replies, want):
            assert list(reply.token_ids) == list(w.token_ids)
        # Prometheus counts what the requests' usage reports.
        samples = scrape_metrics(metrics)
        for name, field in (("draft", "drafted_tokens"), ("accepted", "accepted_tokens")):
            total = getattr(alone.usage, field) + sum(getattr(r.usage, field) for r in replies)
            counted = metric(
                samples, f"mlxserve_spec_decode_{name}_tokens_total", model=EMBEDDED_MODEL_ID
            )
            assert counted == total, name
        stats = spec.CacheStats(pb.CacheStatsRequest(), timeout=10)
        assert stats.active_sequences == 0 and stats.active_blocks == 0


@pytest.mark.slow
@pytest.mark.model
def test_no_match_means_no_drafts(stub) -> None:
    request = chat_request("Name a primary color.", max_tokens=8, cache_prompt=False)
    want = stub.Generate(request, timeout=120)
    flags = ("--draft-kind", "prompt-lookup", "--prompt-lookup-min-ngram", "4")
    with running_server(*flags) as server, grpc.insecure_channel(server.target) as channel:
        got = pb_grpc.GenerationServiceStub(channel).Generate(request, timeout=120)
    assert list(got.token_ids) == list(want.token_ids)
    assert got.usage.drafted_tokens == 0


def test_prompts_of_the_tiny_model_are_repetitive_enough() -> None:
    assert NgramIndex(2, 3).propose(2) == []
    index = NgramIndex(2, 3)
    index.extend(prompt(1, 5) * 2)
    assert index.propose(2)


@pytest.mark.slow
@pytest.mark.model
def test_speculation_through_preemption_and_cancellation(reference, one_slot_server) -> None:
    """One slot, preemption on (conftest.one_slot_server): a speculating request is evicted by
    a higher-priority one and resumes with the same tokens as a plain server's; a cancelled
    speculating stream frees everything."""
    plain = chat_request(SUMMARY, max_tokens=40, cache_prompt=False)
    want = reference(plain)  # the greedy test's first request: its run on the shared server
    low = with_id(plain, "spec-low")
    with grpc.insecure_channel(one_slot_server.target) as channel:
        spec = pb_grpc.GenerationServiceStub(channel)
        before = wait_idle(spec, 10).preemptions  # the server is shared: count from here
        stream = spec.StreamGenerate(to_stream(low), timeout=120)
        first = next(stream)
        high = chat_request("Hi", max_tokens=3, priority=5)
        assert len(spec.Generate(high, timeout=120).token_ids) == 3
        messages = [first, *stream]
        assert [t for m in messages for t in m.token_ids] == list(want.token_ids)
        assert spec.CacheStats(pb.CacheStatsRequest(), timeout=10).preemptions >= before + 1
        cancelled = spec.StreamGenerate(to_stream(low), timeout=120)
        next(cancelled)
        cancelled.cancel()
        stats = wait_idle(spec, 10)
        assert stats.active_blocks == 0
