"""Scheduler policies (docs/scheduler.md) on the fake engine of tests.helpers.fake_runner.py,
tick by tick: adaptive / fixed / disabled chunking, chunks sized by the prefill stall bound on
a fake clock, decode steps between the chunks of a long prompt, the prefill grant
interval, batched prefill and its token cap, priority order, and preemption (victim choice per
policy; the victim keeps its tokens and is re-prefilled)."""

from __future__ import annotations

import itertools

import pytest

from service.core.scheduler.request import Request, SequenceStatus
from service.core.scheduler.scheduler import MIN_PREFILL_CHUNK, PrefillPass
from service.protocol import FinishReason, GenerationRequest
from tests.helpers.fake_runner import Forward, Harness, ListSink


def tick(h: Harness) -> list[Forward]:
    """Run one tick; the forwards it submitted."""
    before = len(h.engine.forwards)
    h.tick()
    return h.engine.forwards[before:]


def prefill_forwards(forwards: list[Forward]) -> list[Forward]:
    return [f for f in forwards if not f.is_decode]


def decode_forwards(forwards: list[Forward]) -> list[Forward]:
    return [f for f in forwards if f.is_decode]


def prefilled_ids(forwards: list[Forward]) -> list[str]:
    return [seq_id for f in prefill_forwards(forwards) for seq_id, _ in f.rows]


def start_decoding(h: Harness, *request_ids: str, max_tokens: int = 200) -> None:
    """Submit short requests and tick until they all decode, a decode step in flight (a burst's
    prefill-only plan leaves none)."""
    for i, request_id in enumerate(request_ids):
        h.submit(request_id, prompt=[100 * (i + 1)], max_tokens=max_tokens)
    for _ in range(10):
        h.tick()
        decoding = all(h.seqs[r].status is SequenceStatus.DECODING for r in request_ids)
        if decoding and h.loop._inflight is not None:
            return
    raise AssertionError("the requests did not start decoding")


# -- a burst's admission -------------------------------------------------------------------


def test_a_burst_prefills_before_its_rows_decode() -> None:
    """Prompts arriving together at an idle engine: the pass that prefills them all runs alone,
    then they decode in one step; prompts that arrive while few rows decode join the same way
    (the decoding rows wait that pass); the tokens are the same."""
    h = Harness(max_batch_size=8, max_batch_prefill=8)
    for i in range(3):
        h.submit(f"a{i}", prompt=[100 * (i + 1)], max_tokens=6)
    first = tick(h)
    assert prefilled_ids(first) == ["a0", "a1", "a2"] and not decode_forwards(first)
    second = tick(h)
    assert not prefill_forwards(second) and decode_forwards(second)[0].ids == ["a0", "a1", "a2"]
    for i in range(4):
        h.submit(f"b{i}", prompt=[400 + 100 * i], max_tokens=6)
    forwards = tick(h)
    assert prefilled_ids(forwards) == [f"b{i}" for i in range(4)]
    assert not decode_forwards(forwards)
    h.run()
    for i in range(3):
        assert h.tokens(f"a{i}") == list(range(100 * (i + 1) + 1, 100 * (i + 1) + 7))
    assert h.tokens("b3") == list(range(701, 707))


def test_a_lone_prompt_or_a_pass_that_leaves_prompts_waiting_does_not_hold_decoding() -> None:
    """One prompt decodes in the plan that prefills it; a pass that cannot end every prefill (a
    CPU's few rows a pass) runs beside a decode step, so decoding never waits on a long queue."""
    h = Harness(max_batch_size=8, max_batch_prefill=2)
    h.submit("lone", prompt=[100], max_tokens=20)
    forwards = tick(h)
    assert prefilled_ids(forwards) == ["lone"] and decode_forwards(forwards)[0].ids == ["lone"]
    for i in range(4):
        h.submit(f"q{i}", prompt=[1000 + 100 * i], max_tokens=4)
    forwards = tick(h)
    assert prefilled_ids(forwards) == ["q0", "q1"]
    assert "lone" in decode_forwards(forwards)[0].ids
    h.run()


# -- chunk size by state ------------------------------------------------------------------


def test_adaptive_chunk_2048_idle_512_while_a_batch_decodes_aligned_from_zero() -> None:
    """With the stall bound off, the chunk size is chosen each tick: 2048 while nothing decodes,
    512 while a row decodes; boundaries stay at multiples of the current size from position 0."""
    h = Harness(max_batch_size=4, max_prefill_stall_ms=0)
    h.submit("long", prompt=[1] * 5000, max_tokens=1)
    h.submit("short", prompt=[7, 8, 9], max_tokens=3)
    h.tick()  # nothing decodes yet: long [0, 2048) and short's whole prompt, batched
    assert h.prefill_chunks("long") == [2048]
    assert h.seqs["short"].status is SequenceStatus.DECODING
    h.tick()  # short decodes: long [2048, 2560)
    assert h.prefill_chunks("long") == [2048, 512]
    h.tick()  # short got its 3rd token before this tick's prefill: idle again, [2560, 4096)
    assert h.seqs["short"].finish_reason is FinishReason.LENGTH
    h.run()
    assert h.prefill_chunks("long") == [2048, 512, 1536, 904]
    assert h.tokens("long") == [2]


def test_adaptive_chunk_is_512_for_a_prompt_arriving_while_streams_decode() -> None:
    h = Harness(max_batch_size=3, max_prefill_stall_ms=0)
    start_decoding(h, "d0", "d1")
    h.submit("long", prompt=[1] * 2000, max_tokens=1)
    for _ in range(4):
        h.tick()
    assert h.prefill_chunks("long") == [512, 512, 512, 464]
    assert h.tokens("long") == [2]


def test_fixed_chunk_size_applies_while_decoding_too() -> None:
    h = Harness(max_batch_size=2, prefill_chunk_size=300)
    start_decoding(h, "dec")
    h.submit("long", prompt=[1] * 1000, max_tokens=1)
    for _ in range(4):
        h.tick()
    assert h.prefill_chunks("long") == [300, 300, 300, 100]
    assert h.sched.chunk_size() == 300


def test_chunk_size_zero_prefills_the_whole_prompt_even_while_decoding() -> None:
    h = Harness(max_batch_size=2, prefill_chunk_size=0)
    start_decoding(h, "dec")
    h.submit("long", prompt=[1] * 5000, max_tokens=2)
    forwards = tick(h)
    assert h.prefill_chunks("long") == [5000]
    assert len(prefill_forwards(forwards)) == 1
    assert h.seqs["long"].status is SequenceStatus.DECODING


# -- chunks sized by the prefill stall bound (--max-prefill-stall-ms) -------------------------

DECODE_S = 0.075


def cpu_like(rows: list[tuple[int | None, int]]) -> float:
    """Seconds of a forward shaped like this CPU's: a decode step 75 ms; a prefill forward 70 ms
    plus, per row of n tokens after c cached, 15 us per cached position and per token 3.5 ms
    plus 4.5 us per position it attends to (a chunk gets slower as the context grows)."""
    if all(n is None for n, _ in rows):
        return DECODE_S
    return 0.070 + sum(
        15e-6 * c + n * (3.5e-3 + 4.5e-6 * (c + n / 2)) for n, c in rows if n is not None
    )


STREAMS = ("s0", "s1", "s2", "s3")


def admit_long_while_streams_decode(
    h: Harness, prompt_tokens: int, *longs: str
) -> tuple[float, float]:
    """4 streams decode; then the prompts arrive and are prefilled to their first token. Returns
    the clock when they arrived and when the last of them got its first token."""
    start_decoding(h, *STREAMS, max_tokens=100_000)
    for _ in range(3):
        h.tick()  # a few decode steps: the running median step time is known
    for long in longs or ("long",):
        h.submit(long, prompt=[5] * prompt_tokens, max_tokens=1)
    sent = h.engine.clock.now
    for _ in range(5000):
        h.tick()
        if all(h.tokens(long) for long in longs or ("long",)):
            return sent, h.engine.clock.now
    raise AssertionError("the prompt did not finish its prefill")


def worst_stream_gap(h: Harness, sent: float, first: float) -> float:
    """The longest wait of a stream for its next token between the two instants."""
    gaps = []
    for stream in STREAMS:
        times = h.token_times[stream]
        gaps += [b - a for a, b in itertools.pairwise(times) if b > sent and a < first]
    return max(gaps)


def long_passes(h: Harness, request_id: str = "long") -> list[PrefillPass]:
    return [p for p in h.sched.costs.passes if request_id in p.request_ids]


def test_a_growing_context_gets_smaller_chunks_within_the_stall_bound() -> None:
    """The default bound is 4 median decode steps; each chunk of a 3000-token prompt is sized
    so that its predicted time fits the bound less a step. The context grows, so the chunks
    shrink; the prompt completes; no stream waits much longer than the bound."""
    h = Harness(cost=cpu_like, max_batch_size=5)
    sent, first = admit_long_while_streams_decode(h, 3000)
    chunks = h.prefill_chunks("long")
    assert sum(chunks) == 3000 and h.tokens("long") == [6]
    bound = h.sched.stall_bound()
    assert bound == pytest.approx(4 * DECODE_S)  # steps measured without the prefill passes
    passes = long_passes(h)  # the most recent ones the scheduler keeps
    assert [p.rows[0][0] for p in passes] == chunks[-len(passes) :]
    for p in passes:
        assert p.budget_s == pytest.approx(bound - DECODE_S)
        assert p.predicted_s is not None
        assert p.predicted_s <= p.budget_s or p.rows[0][0] == MIN_PREFILL_CHUNK
    # Small probes first (no forward this large measured yet), then the budget decides.
    body = chunks[4:-1]
    quarter = len(body) // 4
    assert sum(body[:quarter]) > 2 * sum(body[-quarter:])
    assert body[-1] < body[0] < 512
    assert worst_stream_gap(h, sent, first) <= 1.2 * bound
    # Without the bound (512-token chunks) the same prompt stalls the streams several times as
    # long per token.
    off = Harness(cost=cpu_like, max_batch_size=5, max_prefill_stall_ms=0)
    sent, first = admit_long_while_streams_decode(off, 3000)
    assert off.prefill_chunks("long") == [512] * 5 + [440]
    assert worst_stream_gap(off, sent, first) > 5 * bound


def test_a_burst_beside_fewer_streams_is_not_held_to_the_stall_bound() -> None:
    """More prompts prefill than rows decode (a burst, the first of it already decoding): the
    bound would keep more requests from their first token than it spares streams a longer gap,
    so one pass takes them all. With fewer prompts than streams, the budget sizes the pass."""
    h = Harness(cost=cpu_like, max_batch_size=16, max_batch_prefill=16)
    start_decoding(h, "s0", max_tokens=10_000)
    for _ in range(3):
        h.tick()
    burst = [f"p{i}" for i in range(8)]
    for request_id in burst:
        h.submit(request_id, prompt=[5] * 300, max_tokens=1)
    passes = prefill_forwards(tick(h))
    assert len(passes) == 1
    assert sorted(passes[0].ids) == burst
    assert all(h.prefill_chunks(r) == [300] for r in burst)
    assert h.sched.costs.passes[-1].budget_s is None
    # 4 streams, 2 prompts: each pass within the budget, in chunks.
    few = Harness(cost=cpu_like, max_batch_size=16, max_batch_prefill=16)
    sent, first = admit_long_while_streams_decode(few, 300, "q0", "q1")
    assert len(few.prefill_chunks("q0")) > 1
    assert all(p.budget_s is not None for p in list(few.sched.costs.passes)[-3:])
    assert worst_stream_gap(few, sent, first) <= 1.2 * few.sched.stall_bound()


def test_an_explicit_stall_bound_in_ms_sizes_the_chunks() -> None:
    h = Harness(cost=cpu_like, max_batch_size=5, max_prefill_stall_ms=1000)
    sent, first = admit_long_while_streams_decode(h, 3000)
    assert h.sched.stall_bound() == 1.0
    assert all(p.budget_s == pytest.approx(1.0 - DECODE_S) for p in long_passes(h))
    assert worst_stream_gap(h, sent, first) <= 1.2
    default = Harness(cost=cpu_like, max_batch_size=5)
    admit_long_while_streams_decode(default, 3000)
    assert len(h.prefill_chunks("long")) < len(default.prefill_chunks("long")) / 3


def test_the_default_bound_follows_the_measured_decode_step() -> None:
    slow = Harness(cost=lambda rows: 0.2 if rows[0][0] is None else 0.01, max_batch_size=2)
    start_decoding(slow, "s0")
    for _ in range(3):
        slow.tick()
    assert slow.sched.stall_bound() == pytest.approx(0.8)


def test_the_default_bound_follows_the_decode_steps_as_they_slow_down() -> None:
    """The streams' steps slow down while a long prompt prefills (their contexts grow, other
    load arrives): the running median, and with it the bound and each pass's budget, follows."""
    steps = iter(itertools.chain([0.1] * 40, itertools.repeat(0.2)))

    def cost(rows: list[tuple[int | None, int]]) -> float:
        return next(steps) if rows[0][0] is None else cpu_like(rows)

    h = Harness(cost=cost, max_batch_size=5)
    admit_long_while_streams_decode(h, 3000)
    passes = long_passes(h)
    assert passes[0].budget_s == pytest.approx(0.3)  # 4 x 100 ms, less a step
    assert passes[-1].budget_s == pytest.approx(0.6)
    assert h.sched.stall_bound() == pytest.approx(0.8)


def test_with_nothing_decoding_the_chunk_is_not_limited_by_the_bound() -> None:
    h = Harness(cost=cpu_like, max_prefill_stall_ms=50)
    h.submit("long", prompt=[1] * 5000, max_tokens=1)
    h.run()
    assert h.prefill_chunks("long") == [2048, 2048, 904]  # each far over 50 ms
    assert all(p.budget_s is None and p.predicted_s is None for p in long_passes(h))


def test_a_prompt_still_completes_when_not_even_the_minimum_chunk_fits() -> None:
    """Every prefill forward takes a second against a 40 ms bound: minimum chunks, one a tick,
    until the prompt is done; the stream keeps getting a token every tick."""
    h = Harness(cost=lambda rows: 0.01 if rows[0][0] is None else 1.0, max_batch_size=2)
    start_decoding(h, "s0", max_tokens=1000)
    h.tick()
    h.tick()
    before = len(h.tokens("s0"))
    h.submit("long", prompt=[5] * 21, max_tokens=1)
    ticks = 0
    while not h.tokens("long"):
        h.tick()
        ticks += 1
    assert h.prefill_chunks("long") == [MIN_PREFILL_CHUNK] * 10 + [1]
    assert h.tokens("long") == [6]
    assert len(h.tokens("s0")) - before == ticks
    h.cancel("s0")
    h.run()


def test_prompts_prefilled_together_share_the_pass_budget() -> None:
    h = Harness(cost=cpu_like, max_batch_size=6)
    admit_long_while_streams_decode(h, 1500, "a", "b")
    assert sum(h.prefill_chunks("a")) == sum(h.prefill_chunks("b")) == 1500
    assert h.tokens("a") == h.tokens("b") == [6]
    passes = [p for p in h.sched.costs.passes if p.budget_s]
    assert any(len(p.rows) == 2 for p in passes)  # batched while both fit the budget
    for p in passes:
        # A second row joins only within the budget; the first gets at least the minimum.
        assert p.predicted_s <= p.budget_s or p.rows == [(MIN_PREFILL_CHUNK, p.rows[0][1])]


def test_on_the_per_row_path_the_rows_of_a_pass_share_its_budget_as_separate_forwards() -> None:
    h = Harness(cost=cpu_like, batched=False, max_batch_size=4)  # each row its own forward
    start_decoding(h, "s0", "s1", max_tokens=100_000)
    for _ in range(3):
        h.tick()
    for long in ("a", "b"):
        h.submit(long, prompt=[5] * 600, max_tokens=1)
    shared = 0
    while not (h.tokens("a") and h.tokens("b")):
        before = len(h.sched.costs.passes)
        h.tick()
        new = list(h.sched.costs.passes)[before:]
        assert len(new) <= 2 and all(len(p.rows) == 1 for p in new)
        if len(new) == 2:
            shared += 1
            assert new[0].predicted_s + new[1].predicted_s <= new[0].budget_s
    assert shared > 0
    assert sum(h.prefill_chunks("a")) == sum(h.prefill_chunks("b")) == 600


def test_a_fixed_chunk_size_is_not_resized_by_the_stall_bound() -> None:
    h = Harness(cost=cpu_like, max_batch_size=5, prefill_chunk_size=256)
    admit_long_while_streams_decode(h, 1000)
    assert h.prefill_chunks("long") == [256, 256, 256, 232]
    assert h.sched.stall_bound() is None


# -- decode steps between the chunks of a long prompt ----------------------------------------


def test_decode_steps_interleave_between_the_chunks_of_a_long_prompt() -> None:
    """4 streams decode; a 2000-token prompt arrives (chunks of 256). Every tick runs exactly one
    prefill pass (one chunk) and one decode step for all 4 streams, and each stream gets one
    token per tick: the streams never stall for the whole prompt."""
    streams = ["s0", "s1", "s2", "s3"]
    h = Harness(max_batch_size=5, prefill_chunk_size=256)
    start_decoding(h, *streams)
    got_before = {s: len(h.tokens(s)) for s in streams}
    h.submit("long", prompt=[5] * 2000, max_tokens=4)
    ticks = 0
    while not h.tokens("long"):
        forwards = tick(h)
        ticks += 1
        prefills = prefill_forwards(forwards)
        assert len(prefills) == 1 and prefills[0].ids == ["long"]
        decodes = decode_forwards(forwards)
        assert len(decodes) == 1
        assert set(streams) <= set(decodes[0].ids)
        assert ticks <= 20
    assert ticks == 8  # ceil(2000 / 256) chunks, one per tick
    assert h.prefill_chunks("long") == [256] * 7 + [208]
    for s in streams:
        assert len(h.tokens(s)) - got_before[s] == ticks  # one token per stream per tick
    # The streams' tokens continue unbroken: the chunks did not disturb them.
    for i, s in enumerate(streams):
        first = 100 * (i + 1) + 1
        assert h.tokens(s) == list(range(first, first + len(h.tokens(s))))
    for s in streams:
        h.cancel(s)
    h.run()


def test_without_chunking_the_streams_wait_one_tick_for_the_whole_prompt() -> None:
    streams = ["s0", "s1"]
    h = Harness(max_batch_size=3, prefill_chunk_size=0)
    start_decoding(h, *streams)
    got_before = {s: len(h.tokens(s)) for s in streams}
    h.submit("long", prompt=[5] * 2000, max_tokens=4)
    tick(h)
    assert h.tokens("long") == [6]
    assert all(len(h.tokens(s)) - got_before[s] == 1 for s in streams)


# -- grant interval ---------------------------------------------------------------------------


def _prefill_schedule(h: Harness, max_ticks: int = 200) -> list[list[str]]:
    """Per tick, the ids that got a prefill chunk, until nothing prefills any more."""
    schedule = []
    for _ in range(max_ticks):
        if not any(
            s.status in (SequenceStatus.QUEUED, SequenceStatus.PREFILLING) for s in h.seqs.values()
        ):
            return schedule
        schedule.append(prefilled_ids(tick(h)))
    raise AssertionError("prefill did not end")


@pytest.mark.parametrize("grant", [1, 3, 16])
def test_a_parked_low_priority_prefill_gets_its_turn_after_grant_ticks(grant: int) -> None:
    """Under a token cap that fits one chunk, a high-priority prefill takes every pass; the
    low-priority one, parked each tick, is guaranteed the pass after `grant` parked ticks."""
    high_chunks = grant + 4
    h = Harness(
        max_batch_size=4,
        prefill_chunk_size=100,
        max_batch_prefill_tokens=100,
        prefill_grant_interval=grant,
    )
    h.submit("high", prompt=[1] * (100 * high_chunks), max_tokens=2, priority=1)
    h.submit("low", prompt=[2] * 100, max_tokens=2, priority=0)
    schedule = _prefill_schedule(h)
    assert schedule[:grant] == [["high"]] * grant  # low parked `grant` ticks
    assert schedule[grant] == ["low"]  # then it has the pass to itself
    assert schedule[grant + 1 :] == [["high"]] * (high_chunks - grant)
    assert h.prefill_chunks("high") == [100] * high_chunks
    h.run()
    assert h.tokens("low") == [3, 4]


def test_grant_interval_zero_lets_a_parked_prefill_wait_until_the_pass_is_free() -> None:
    h = Harness(
        max_batch_size=4,
        prefill_chunk_size=100,
        max_batch_prefill_tokens=100,
        prefill_grant_interval=0,
    )
    h.submit("high", prompt=[1] * 3000, max_tokens=2, priority=1)
    h.submit("low", prompt=[2] * 100, max_tokens=2, priority=0)
    schedule = _prefill_schedule(h)
    assert schedule == [["high"]] * 30 + [["low"]]
    assert h.seqs["low"].parked_ticks == 0


def test_default_grant_interval_is_16() -> None:
    h = Harness(max_batch_size=4, prefill_chunk_size=100, max_batch_prefill_tokens=100)
    assert h.sched.config.prefill_grant_interval == 16
    h.submit("high", prompt=[1] * 2000, max_tokens=1, priority=1)
    h.submit("low", prompt=[2] * 100, max_tokens=1)
    schedule = _prefill_schedule(h)
    assert schedule.index(["low"]) == 16


# -- batched prefill ------------------------------------------------------------------------


def test_batched_prefill_groups_up_to_max_batch_prefill_requests() -> None:
    h = Harness(max_batch_size=8, max_batch_prefill=3)
    for i in range(5):
        h.submit(f"r{i}", prompt=[10 * i + 1] * 10, max_tokens=2)
    first = prefill_forwards(tick(h))
    assert [f.ids for f in first] == [["r0", "r1", "r2"]]  # one forward, FIFO
    second = prefill_forwards(tick(h))
    assert [f.ids for f in second] == [["r3", "r4"]]
    h.run()
    assert all(len(h.tokens(f"r{i}")) == 2 for i in range(5))


def test_batched_prefill_respects_the_token_cap() -> None:
    h = Harness(max_batch_size=8, max_batch_prefill=4, max_batch_prefill_tokens=25)
    for request_id, n in [("a", 10), ("b", 10), ("c", 10), ("d", 5)]:
        h.submit(request_id, prompt=[3] * n, max_tokens=1)
    first = prefill_forwards(tick(h))
    assert len(first) == 1
    assert first[0].ids[:2] == ["a", "b"] and "c" not in first[0].ids
    h.run()
    for f in prefill_forwards(h.engine.forwards):
        assert sum(len(tokens or ()) for _, tokens in f.rows) <= 25
    assert all(h.tokens(r) == [4] for r in "abcd")


def test_default_token_cap_is_twice_max_batch_prefill_times_min_chunk_512() -> None:
    """Idle (chunk 2048), max_batch_prefill 4: the cap is 2 * 4 * 512 = 4096 tokens, so two
    2000-token prompts share the first pass and the third waits a tick."""
    h = Harness(max_batch_size=4, max_batch_prefill=4)
    for request_id in ("a", "b", "c"):
        h.submit(request_id, prompt=[1] * 2000, max_tokens=1)
    assert [f.ids for f in prefill_forwards(tick(h))] == [["a", "b"]]
    assert [f.ids for f in prefill_forwards(tick(h))] == [["c"]]


def test_token_cap_zero_means_no_cap() -> None:
    h = Harness(max_batch_size=4, max_batch_prefill=4, max_batch_prefill_tokens=0)
    for request_id in ("a", "b", "c"):
        h.submit(request_id, prompt=[1] * 2000, max_tokens=1)
    assert [f.ids for f in prefill_forwards(tick(h))] == [["a", "b", "c"]]


def test_one_chunk_over_the_cap_still_runs_alone() -> None:
    h = Harness(max_batch_size=2, prefill_chunk_size=0, max_batch_prefill_tokens=100)
    h.submit("big", prompt=[1] * 5000, max_tokens=1)
    h.submit("small", prompt=[1] * 10, max_tokens=1)
    assert [f.ids for f in prefill_forwards(tick(h))] == [["big"]]
    assert [f.ids for f in prefill_forwards(tick(h))] == [["small"]]


# -- priority order ----------------------------------------------------------------------


def test_prefill_runs_in_priority_order_fifo_within_a_priority() -> None:
    h = Harness(max_batch_size=8, max_batch_prefill=1)
    for request_id, priority in [("a0", 0), ("b5", 5), ("c5", 5), ("d0", 0), ("e9", 9)]:
        h.submit(request_id, max_tokens=1, priority=priority)
    order = []
    for _ in range(5):
        order += prefilled_ids(tick(h))
    assert order == ["e9", "b5", "c5", "a0", "d0"]


def test_a_higher_priority_arrival_overtakes_a_chunked_prefill() -> None:
    h = Harness(max_batch_size=4, max_batch_prefill=1, prefill_chunk_size=100)
    h.submit("low", prompt=[1] * 500, max_tokens=1)
    schedule = [prefilled_ids(tick(h)) for _ in range(2)]
    h.submit("high", prompt=[2] * 300, max_tokens=1, priority=5)
    schedule += _prefill_schedule(h)
    assert schedule == [["low"]] * 2 + [["high"]] * 3 + [["low"]] * 3
    assert h.prefill_chunks("low") == [100] * 5


# -- preemption: victim choice ----------------------------------------------------------------


def _seq(request_id: str, priority: int, generated: int, order: int) -> Request:
    seq = Request(GenerationRequest(request_id, (1, 2), priority=priority), ListSink([]))
    seq.output_token_ids = list(range(generated))
    seq.arrival_order = order
    seq.status = SequenceStatus.DECODING
    return seq


def test_longest_first_picks_the_most_generated() -> None:
    sched = Harness(enable_preemption=True).sched
    a, b, c = _seq("a", 0, 3, 0), _seq("b", -5, 1, 1), _seq("c", 0, 7, 2)
    assert sched.choose_victim([a, b, c]) is c
    # A tie in generated tokens goes to the lower priority.
    x, y = _seq("x", 0, 5, 0), _seq("y", -1, 5, 1)
    assert sched.choose_victim([x, y]) is y


def test_lowest_priority_picks_the_lowest_priority_ties_by_most_generated() -> None:
    sched = Harness(enable_preemption=True, preemption_policy="lowest-priority").sched
    a, b, c = _seq("a", 0, 9, 0), _seq("b", -1, 2, 1), _seq("c", -1, 4, 2)
    assert sched.choose_victim([a, b, c]) is c
    low, busy = _seq("low", -2, 0, 0), _seq("busy", -1, 50, 1)
    assert sched.choose_victim([low, busy]) is low


def _run_recording_finish_order(h: Harness, max_ticks: int = 500) -> list[str]:
    order: list[str] = []
    for _ in range(max_ticks):
        h.tick()
        order += [r for r, s in h.seqs.items() if s.is_finished and r not in order]
        if len(order) == len(h.seqs) and h.loop._inflight is None and not h.sched.busy:
            return order
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize(
    ("policy", "victim", "preemptions"),
    [("longest-first", "old", 2), ("lowest-priority", "young", 1)],
)
def test_a_high_priority_arrival_on_a_full_batch_preempts_the_policy_victim(
    policy: str, victim: str, preemptions: int
) -> None:
    """`old` (priority 0) has generated most, `young` (priority -1) less: longest-first evicts
    old, lowest-priority evicts young. The arrival finishes first; both low ones complete.

    With longest-first the re-queued `old` (priority 0) then outranks the running `young`
    (priority -1) and evicts it at the next tick: two preemptions where lowest-priority needs
    one."""
    h = Harness(max_batch_size=2, enable_preemption=True, preemption_policy=policy)
    h.submit("old", prompt=[100], max_tokens=30)
    for _ in range(4):
        h.tick()
    h.submit("young", prompt=[500], max_tokens=30, priority=-1)
    for _ in range(2):
        h.tick()
    assert h.seqs["old"].num_generated > h.seqs["young"].num_generated > 0
    h.submit("high", prompt=[800], max_tokens=3, priority=5)
    h.tick()
    assert h.sched.stats.preemptions == 1
    assert h.seqs[victim].status is SequenceStatus.QUEUED
    assert victim in h.engine.released and victim not in h.engine.live
    assert {s.request_id for s in h.running} == {"old", "young", "high"} - {victim}
    order = _run_recording_finish_order(h)
    assert order[0] == "high"
    assert h.tokens("old") == list(range(101, 131))
    assert h.tokens("young") == list(range(501, 531))
    assert h.sched.stats.preemptions == preemptions
    assert h.seqs["young"].preemptions == 1


def test_only_lower_priority_rows_are_preempted() -> None:
    h = Harness(max_batch_size=2, enable_preemption=True)
    h.submit("vip", prompt=[100], max_tokens=40, priority=5)
    for _ in range(6):
        h.tick()
    h.submit("low", prompt=[500], max_tokens=40)
    h.tick()
    # An equal-priority arrival preempts nobody; a priority-5 one evicts `low`, not `vip`
    # (although vip has generated more).
    h.submit("peer", prompt=[700], max_tokens=2, priority=0)
    for _ in range(3):
        h.tick()
    assert h.sched.stats.preemptions == 0
    assert h.seqs["peer"].status is SequenceStatus.QUEUED
    h.submit("vip2", prompt=[800], max_tokens=2, priority=5)
    h.tick()
    assert h.sched.stats.preemptions == 1
    assert h.seqs["low"].status is SequenceStatus.QUEUED
    assert h.seqs["vip"].status is SequenceStatus.DECODING
    h.run()
    assert h.tokens("low") == list(range(501, 541))


def test_preemption_is_off_by_default() -> None:
    h = Harness(max_batch_size=1)
    h.submit("low", prompt=[100], max_tokens=10)
    h.tick()
    h.submit("high", prompt=[500], max_tokens=2, priority=9)
    order = _run_recording_finish_order(h)
    assert order == ["low", "high"]
    assert h.sched.stats.preemptions == 0


def test_two_high_arrivals_preempt_two_victims() -> None:
    h = Harness(max_batch_size=2, enable_preemption=True)
    h.submit("l1", prompt=[100], max_tokens=20)
    h.submit("l2", prompt=[200], max_tokens=20)
    for _ in range(3):
        h.tick()
    h.submit("h1", prompt=[300], max_tokens=3, priority=1)
    h.submit("h2", prompt=[400], max_tokens=3, priority=1)
    order = _run_recording_finish_order(h)
    assert set(order[:2]) == {"h1", "h2"}
    assert h.sched.stats.preemptions == 2
    assert h.tokens("l1") == list(range(101, 121))
    assert h.tokens("l2") == list(range(201, 221))


# -- preemption: the victim keeps its tokens and is re-prefilled ---------------------------


def test_the_victim_keeps_its_tokens_and_is_re_prefilled_with_prompt_plus_generated() -> None:
    h = Harness(max_batch_size=1, enable_preemption=True, prefill_chunk_size=4)
    prompt = list(range(100, 110))
    h.submit("low", prompt=prompt, max_tokens=12)
    for _ in range(8):
        h.tick()
    streamed_before = h.tokens("low")
    assert 0 < len(streamed_before) < 11
    h.submit("high", prompt=[500], max_tokens=3, priority=1)
    h.tick()
    low = h.seqs["low"]
    assert low.status is SequenceStatus.QUEUED and low.slot == -1
    # The step in flight is read before the eviction: its token is kept and streamed.
    kept = list(low.output_token_ids)
    assert kept == h.tokens("low") == [*streamed_before, streamed_before[-1] + 1]
    assert low.num_computed == 0 and low.preemptions == 1
    assert h.loop.queue_depth == 1  # re-queued
    assert h.engine.live == {"high"}
    forwards_before = len(h.engine.forwards)
    order = _run_recording_finish_order(h)
    assert order == ["high", "low"]
    # Re-admitted as a new engine sequence, prefilled from position 0 with prompt + generated,
    # in chunks aligned to 4, sampling only on the last chunk.
    assert h.engine.added == ["low", "high", "low"]
    refed = [
        tokens
        for f in h.engine.forwards[forwards_before:]
        for seq_id, tokens in f.rows
        if seq_id == "low" and tokens is not None
    ]
    assert [t for chunk in refed for t in chunk] == prompt + kept
    assert [len(c) for c in refed[:-1]] == [4] * (len(refed) - 1)
    # It continues exactly as if never interrupted: 12 consecutive tokens, one final.
    assert h.tokens("low") == list(range(110, 122))
    final = h.final("low")
    assert final.finish_reason is FinishReason.LENGTH
    assert final.completion_tokens == 12 and final.prompt_tokens == 10
    assert h.loop.queue_depth == 0 and h.engine.live == set()
    low_events = [name for out in h.outputs("low") for name, _ in out.events]
    assert low_events.count("admitted") == 1
    i = low_events.index("preempted")
    assert low_events[i + 1] == "resumed"
    assert ("preempted", {"generated": len(kept)}) in [
        e for o in h.outputs("low") for e in o.events
    ]


def test_a_victim_preempted_mid_prefill_restarts_its_prefill() -> None:
    h = Harness(max_batch_size=1, enable_preemption=True, prefill_chunk_size=4)
    h.submit("low", prompt=list(range(100, 120)), max_tokens=3)
    h.tick()
    h.tick()
    assert h.seqs["low"].status is SequenceStatus.PREFILLING
    h.submit("high", prompt=[500], max_tokens=2, priority=1)
    order = _run_recording_finish_order(h)
    assert order == ["high", "low"]
    assert h.prefill_chunks("low") == [4, 4] + [4] * 5
    assert h.tokens("low") == [120, 121, 122]
