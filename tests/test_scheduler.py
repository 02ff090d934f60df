"""Scheduler decisions on a fake engine, one tick at a time (no model, no threads). The KV
bookkeeping is the scheduler's own and real: UnpagedKV by default, or a KVCacheManager."""

from __future__ import annotations

import threading
import time

import pytest

from service.core.kv.block_pool import KVCacheManager
from service.core.scheduler.request import Request, SequenceStatus
from service.core.scheduler.scheduler import (
    ADAPTIVE_CHUNK_BUSY,
    ADAPTIVE_CHUNK_IDLE,
    QueueFullError,
    SpeculationConfig,
)
from service.protocol import FinishReason, GenerationRequest, Outputs
from tests.helpers.fake_runner import EOS, Harness

# -- admission ----------------------------------------------------------------------------


def test_admission_in_priority_order_fifo_within_a_priority() -> None:
    h = Harness(max_batch_size=1)
    for request_id, priority in [("a0", 0), ("b5", 5), ("c5", 5), ("d0", 0), ("e9", 9)]:
        h.submit(request_id, max_tokens=1, priority=priority)
    h.run()
    assert h.engine.added == ["e9", "b5", "c5", "a0", "d0"]


def test_waiting_requests_admitted_by_priority_when_a_slot_frees() -> None:
    h = Harness(max_batch_size=1)
    h.submit("first", max_tokens=3)
    h.tick()
    h.submit("low", max_tokens=1, priority=-1)
    h.submit("high", max_tokens=1, priority=3)
    h.run()
    assert h.engine.added == ["first", "high", "low"]


def test_queue_depth_limit_raises_queue_full() -> None:
    h = Harness(max_batch_size=1, max_queue_depth=2)
    h.submit("a")  # takes the free slot at the next tick: not counted as waiting
    h.submit("b")
    h.submit("c")
    with pytest.raises(QueueFullError, match=r"^Server is busy\. Retry later\.$"):
        h.submit("d")
    h.tick()  # "a" is admitted; "b" and "c" wait and fill the queue
    assert h.loop.queue_depth == 2
    with pytest.raises(QueueFullError):
        h.submit("d")
    h.run()
    assert all(h.final(r).finish_reason is FinishReason.LENGTH for r in "abc")
    assert h.loop.queue_depth == 0
    h.submit("d")  # room again
    h.run()
    assert h.final("d").finish_reason is FinishReason.LENGTH


def test_a_burst_that_fits_the_batch_is_never_refused() -> None:
    h = Harness(max_batch_size=8, max_queue_depth=2)
    for i in range(10):
        h.submit(f"r{i}")
    with pytest.raises(QueueFullError):
        h.submit("one-too-many")
    h.run()
    assert all(h.final(f"r{i}").finish_reason is FinishReason.LENGTH for i in range(10))


def test_max_batch_size_is_respected() -> None:
    h = Harness(max_batch_size=3)
    for i in range(7):
        h.submit(f"r{i}", max_tokens=2 + i % 3)
    max_running = 0
    for _ in range(100):
        h.tick()
        max_running = max(max_running, len(h.running))
        assert len(h.running) <= 3
        if all(s.is_finished for s in h.seqs.values()):
            break
    assert max_running == 3
    assert all(len(f.rows) <= 3 for f in h.engine.forwards)
    assert all(len(h.tokens(f"r{i}")) == 2 + i % 3 for i in range(7))


def test_new_requests_join_at_the_next_tick() -> None:
    h = Harness(max_batch_size=4)
    h.submit("a", max_tokens=50)
    h.tick()
    h.tick()
    h.submit("b", max_tokens=50)
    h.tick()
    assert {s.request_id for s in h.running} == {"a", "b"}
    assert h.seqs["b"].status is SequenceStatus.DECODING


# -- cancellation and finishing -------------------------------------------------------------


def test_cancel_ends_a_running_sequence_within_one_tick() -> None:
    h = Harness(max_batch_size=2)
    h.submit("keep", max_tokens=8)
    h.submit("gone", max_tokens=100)
    h.tick()
    h.tick()
    assert h.seqs["gone"].status is SequenceStatus.DECODING
    h.cancel("gone")
    forwards_before = len(h.engine.forwards)
    h.tick()
    assert h.seqs["gone"].finish_reason is FinishReason.CANCELLED
    assert h.final("gone").finish_reason is FinishReason.CANCELLED
    assert "gone" in h.engine.released
    assert "gone" not in {s.request_id for s in h.running}
    n_gone = len(h.tokens("gone"))
    h.run()
    assert len(h.tokens("gone")) == n_gone  # nothing more after the final output
    assert all("gone" not in f.ids for f in h.engine.forwards[forwards_before:])
    assert h.final("keep").finish_reason is FinishReason.LENGTH
    assert len(h.tokens("keep")) == 8


def test_cancel_of_a_waiting_request_frees_its_queue_place() -> None:
    h = Harness(max_batch_size=1, max_queue_depth=2)
    h.submit("running", max_tokens=20)
    h.tick()
    h.submit("waiting")
    h.tick()
    assert h.loop.queue_depth == 1
    h.cancel("waiting")
    h.tick()
    assert h.final("waiting").finish_reason is FinishReason.CANCELLED
    assert h.loop.queue_depth == 0
    assert "waiting" not in h.engine.added  # never took a slot
    h.cancel("running")
    h.tick()
    assert h.final("running").finish_reason is FinishReason.CANCELLED
    assert h.engine.live == set()


def test_cancel_targets_the_sequence_when_its_request_id_is_reused_at_once() -> None:
    """A's cancel and B (same request_id) arrive in one inbox drain: A ends, B runs, and
    B's own cancel later ends B (it used to find nothing: finishing A dropped B's entry)."""
    h = Harness(max_batch_size=2)
    a = h.submit("x", max_tokens=100)
    h.tick()
    h.tick()
    assert a.status is SequenceStatus.DECODING
    h.sched.cancel(a)
    b = h.submit("x", max_tokens=100)
    h.tick()
    assert a.finish_reason is FinishReason.CANCELLED
    assert b.status is SequenceStatus.DECODING and b in h.running
    h.tick()
    h.sched.cancel(b)
    h.tick()
    assert b.finish_reason is FinishReason.CANCELLED
    assert h.running == [] and h.engine.live == set()
    forwards = len(h.engine.forwards)
    for _ in range(3):
        h.tick()
    assert len(h.engine.forwards) == forwards  # nothing decodes on


def test_finished_rows_are_released_at_once() -> None:
    h = Harness(max_batch_size=2)
    h.submit("short", max_tokens=2)
    h.submit("long", max_tokens=10)
    for _ in range(20):
        h.tick()
        short = h.seqs["short"]
        if short.is_finished:
            # Its KV and its slot are free at once; the runner drops its row before the
            # next forward runs.
            assert short not in h.running and short.blocks is None and short.slot == -1
            forwards = len(h.engine.forwards)
            h.tick()
            assert "short" in h.engine.released
            assert all("short" not in f.ids for f in h.engine.forwards[forwards:])
            break
        assert "short" not in h.engine.released
    else:
        raise AssertionError("short never finished")
    assert not h.seqs["long"].is_finished
    h.run()
    assert sorted(h.engine.released) == ["long", "short"]
    assert h.engine.live == set()


def test_eos_gives_stop_and_max_tokens_gives_length() -> None:
    h = Harness()
    h.submit("eos", prompt=[EOS - 3], max_tokens=10)  # generates 997, 998, 999 = EOS
    h.submit("len", prompt=[10], max_tokens=4)
    h.submit("ignore", prompt=[EOS - 1], max_tokens=3, ignore_eos=True)
    h.submit("stop-token", prompt=[20], max_tokens=10, stop_token_ids=frozenset({22}))
    h.run()
    assert h.tokens("eos") == [997, 998, 999]
    assert h.final("eos").finish_reason is FinishReason.STOP
    assert h.tokens("len") == [11, 12, 13, 14]
    assert h.final("len").finish_reason is FinishReason.LENGTH
    assert h.tokens("ignore") == [999, 0, 1]
    assert h.final("ignore").finish_reason is FinishReason.LENGTH
    assert h.tokens("stop-token") == [21, 22]
    assert h.final("stop-token").finish_reason is FinishReason.STOP
    final = h.final("len")
    assert final.completion_tokens == 4 and final.prompt_tokens == 1


def test_slot_context_ends_with_length() -> None:
    h = Harness(slot_context=10)
    h.submit("a", prompt=list(range(7)), max_tokens=100)
    h.run()
    assert len(h.tokens("a")) == 3
    assert h.final("a").finish_reason is FinishReason.LENGTH


def test_outputs_carry_lifecycle_events_in_order() -> None:
    h = Harness()
    h.submit("a", prompt=[10, 11], max_tokens=3)
    h.run()
    names = [name for out in h.outputs("a") for name, _ in out.events]
    assert names == ["queued", "admitted", "prefill_chunk", "first_token", "finished"]
    finished = dict(next(a for out in h.outputs("a") for n, a in out.events if n == "finished"))
    assert finished["finish_reason"] == "length" and finished["completion_tokens"] == 3


def test_outputs_arrive_in_order_with_exactly_one_final() -> None:
    h = Harness(max_batch_size=2)
    h.submit("a", prompt=[100], max_tokens=6)
    h.submit("b", prompt=[500, 501], max_tokens=9)
    h.run()
    assert h.tokens("a") == [101, 102, 103, 104, 105, 106]
    assert h.tokens("b") == list(range(502, 511))
    for request_id in ("a", "b"):
        outputs = h.outputs(request_id)
        assert all(not o.finished for o in outputs[:-1])
        assert all(len(o.token_ids) == 1 for o in outputs[:-1])
        final = h.final(request_id)
        assert final.completion_tokens == len(h.tokens(request_id))
        assert final.total_seconds >= final.ttft_seconds >= final.queue_seconds >= 0
    # Every sink call carries only that request's outputs.
    for request_id in ("a", "b"):
        for call in h.received[request_id]:
            assert {o.rid for o in call} == {h.seqs[request_id].rid}


# -- forwards -------------------------------------------------------------------------------


def test_a_decode_tick_submits_one_forward_for_all_decoding_rows() -> None:
    h = Harness(max_batch_size=4)
    for i in range(3):
        h.submit(f"r{i}", prompt=[10 * (i + 1)], max_tokens=8)
    h.tick()  # prefill of all three (batched), then their first decode step
    prefill = h.engine.forwards[0]
    assert sorted(prefill.ids) == ["r0", "r1", "r2"] and not prefill.is_decode
    before = len(h.engine.forwards)
    h.tick()  # a pure decode tick
    new = h.engine.forwards[before:]
    assert len(new) == 1
    assert new[0].is_decode and sorted(new[0].ids) == ["r0", "r1", "r2"]
    h.run()
    decode_forwards = [f for f in h.engine.forwards if f.is_decode]
    assert all(len(f.rows) <= 3 for f in decode_forwards)
    # 8 tokens each: 1 from the prefill and 7 decode steps, each one forward for all rows.
    for i in range(3):
        first = 10 * (i + 1) + 1
        assert h.tokens(f"r{i}") == list(range(first, first + 8))


def test_each_decode_tick_runs_exactly_one_forward() -> None:
    """Each tick with decoding rows and nothing to prefill submits exactly one forward."""
    h = Harness(max_batch_size=2)
    h.submit("a", max_tokens=30)
    h.tick()
    for _ in range(10):
        before = len(h.engine.forwards)
        h.tick()
        assert len(h.engine.forwards) - before == 1


def test_chunk_size_choice() -> None:
    h = Harness(max_prefill_stall_ms=0)
    assert h.sched.chunk_size() == ADAPTIVE_CHUNK_IDLE == 2048
    h.submit("a", max_tokens=50)
    h.tick()
    assert h.seqs["a"].status is SequenceStatus.DECODING
    assert h.sched.chunk_size() == ADAPTIVE_CHUNK_BUSY == 512
    # With the stall bound (the default) 512 until a decode step is measured, then 2048 is
    # only the cap: the budget sizes the chunk.
    bounded = Harness()
    bounded.submit("a", max_tokens=50)
    bounded.tick()
    assert bounded.sched.chunk_size() == ADAPTIVE_CHUNK_BUSY
    bounded.tick()
    bounded.tick()
    assert bounded.sched.prefill_budget() is not None
    assert bounded.sched.chunk_size() == ADAPTIVE_CHUNK_IDLE
    assert Harness(prefill_chunk_size=100).sched.chunk_size() == 100
    assert Harness(prefill_chunk_size=0).sched.chunk_size() is None  # whole prompt


def test_prefill_chunks_2048_when_idle() -> None:
    h = Harness(max_batch_size=2)
    h.submit("long", prompt=[1] * 5000, max_tokens=2)
    h.run()
    assert h.prefill_chunks("long") == [2048, 2048, 904]
    assert h.tokens("long") == [2, 3]


def test_prefill_chunks_512_while_decoding_with_the_stall_bound_off() -> None:
    h = Harness(max_batch_size=2, max_prefill_stall_ms=0)
    h.submit("decoding", max_tokens=100)
    h.tick()
    h.submit("long", prompt=[1] * 1500, max_tokens=2)
    for _ in range(3):
        before = len(h.engine.forwards)
        h.tick()
        new = h.engine.forwards[before:]
        # each tick: one prefill chunk of the long prompt, and a decode step for the other
        assert any(f.is_decode and "decoding" in f.ids for f in new)
    assert h.prefill_chunks("long") == [512, 512, 476]
    h.cancel("decoding")
    h.run()


def test_prefill_chunk_size_fixed() -> None:
    h = Harness(prefill_chunk_size=300)
    h.submit("long", prompt=[1] * 1000, max_tokens=1)
    h.run()
    assert h.prefill_chunks("long") == [300, 300, 300, 100]


def test_prefill_chunk_size_zero_means_whole_prompt() -> None:
    h = Harness(prefill_chunk_size=0)
    h.submit("long", prompt=[1] * 5000, max_tokens=1)
    h.run()
    assert h.prefill_chunks("long") == [5000]


def test_chunked_prefill_samples_only_on_the_last_chunk() -> None:
    h = Harness(prefill_chunk_size=4)
    h.submit("a", prompt=list(range(10)), max_tokens=2)
    h.run()
    assert h.tokens("a") == [10, 11]  # sampled after the last prompt token (9), not before
    assert h.prefill_chunks("a") == [4, 4, 2]


def test_last_token_alone_prefills_as_mlx_lm_does() -> None:
    """Models on mlx-lm's own caches: every prompt token but the last, then the last alone (the
    forward that samples), as mlx-lm's generate_step runs them; the tokens are unchanged."""
    h = Harness(last_token_alone=True, max_batch_prefill=1)
    h.submit("a", prompt=list(range(10)), max_tokens=2)
    h.submit("one", prompt=[3], max_tokens=1)
    h.run()
    assert h.prefill_chunks("a") == [9, 1] and h.tokens("a") == [10, 11]
    assert h.prefill_chunks("one") == [1]


# -- the loop thread ------------------------------------------------------------------------


def test_the_loop_blocks_when_idle_and_wakes_for_a_request() -> None:
    h = Harness(max_batch_size=2)
    turns: list[float] = []
    real_turn = h.loop.turn

    def counting_turn() -> None:
        turns.append(time.monotonic())
        real_turn()

    h.loop.turn = counting_turn  # type: ignore[method-assign]
    done = threading.Event()
    thread = threading.Thread(target=h.loop.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)
        assert turns == [], "no busy loop while idle"
        request = GenerationRequest("threaded", (1, 2, 3), max_tokens=5)
        tokens: list[int] = []

        class Sink:
            batch_key = "threaded"

            def deliver(self, batch: Outputs) -> None:
                tokens.extend(batch.tokens)
                if batch.finals:
                    done.set()

        h.loop.submit(Request(request, Sink()))
        assert done.wait(5), "the request was not served"
        assert tokens == [4, 5, 6, 7, 8]
        time.sleep(0.2)
        n = len(turns)
        time.sleep(0.3)
        assert len(turns) == n, "back to blocking once idle again"
    finally:
        h.loop.stop()
        thread.join(5)
    assert not thread.is_alive()


# -- the scheduler's KV cache manager -------------------------------------------------------


def test_the_scheduler_adopts_cached_prefixes_and_frees_every_block() -> None:
    """The second request adopts the first one's cached prompt blocks and prefills only its
    own suffix; every forward's rows came with block tables covering their positions (the fake
    engine checks), and once both end every block is free again (the prefix stays cached)."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    h = Harness(kv=kv, max_batch_size=2)
    system = list(range(100, 112))  # three full blocks
    h.submit("a", prompt=[*system, 1], max_tokens=3)
    h.run()
    h.submit("b", prompt=[*system, 2, 3], max_tokens=3)
    h.run()
    assert h.final("b").cached_tokens == 12
    assert h.prefill_chunks("b") == [2]
    assert h.tokens("b") == [4, 5, 6]
    assert kv.num_free_blocks == 32 and kv.pool.num_cached_blocks >= 3
    assert kv.stats().prefix_hits == 1


def test_blocks_running_short_preempt_and_the_request_resumes_with_its_tokens() -> None:
    """Two requests that together outgrow a six-block pool: the scheduler preempts one,
    frees its blocks, resumes it once the other has finished, and both get every token."""
    kv = KVCacheManager(num_blocks=6, block_size=4)
    h = Harness(kv=kv, max_batch_size=2, kv_admission_watermark=0.0)
    h.submit("a", prompt=[10, 11, 12, 13, 14, 15], max_tokens=10)
    h.submit("b", prompt=[50, 51, 52, 53, 54, 55], max_tokens=10)
    h.run()
    assert h.tokens("a") == list(range(16, 26))
    assert h.tokens("b") == list(range(56, 66))
    assert h.sched.stats.preemptions >= 1
    assert sum(h.final(r).finish_reason is FinishReason.LENGTH for r in "ab") == 2
    assert kv.num_free_blocks == 6
    assert max(p.capacity for p in h.engine.plans) <= 6


def test_rejected_drafts_give_their_slots_back() -> None:
    """Speculation on the fake model: drafts from the prompt are partly wrong; after every
    tick a decoding row holds exactly the slots of its cached positions."""
    kv = KVCacheManager(num_blocks=32, block_size=4)
    spec = SpeculationConfig(num_draft_tokens=4, max_batch=2, min_ngram=1, max_ngram=2)
    h = Harness(kv=kv, max_batch_size=2, speculation=spec)
    h.submit("a", prompt=[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], max_tokens=12)
    for _ in range(40):
        h.tick()
        seq = h.seqs["a"]
        if seq.is_finished:
            break
        if seq.status is SequenceStatus.DECODING:
            assert seq.blocks is not None
            assert seq.blocks.num_tokens == h.sched.context_tokens(seq)
    else:
        raise AssertionError("a never finished")
    assert h.tokens("a") == list(range(3, 15))
    final = h.final("a")
    assert final.drafted_tokens > final.accepted_tokens > 0
    assert kv.num_free_blocks == 32


def test_rows_whose_drafts_never_pay_stop_verifying() -> None:
    """Drafts from a prompt the fake model never follows are all rejected: the row backs off
    and most steps are plain decode steps again (queued ahead, not read first)."""
    spec = SpeculationConfig(num_draft_tokens=4, max_batch=2, min_ngram=1, max_ngram=1)
    h = Harness(max_batch_size=2, speculation=spec)
    # After each generated token t the prompt offers "t 1": a draft [1, ...] the model, which
    # says t + 1, rejects.
    prompt = [x for t in range(8, 68) for x in (t, 1)] + [7]
    h.submit("a", prompt=prompt, max_tokens=60)
    h.run()
    verify = [p for p in h.engine.plans if p.verify]
    decode = [p for p in h.engine.plans if p.decode]
    assert 0 < len(verify) < len(decode) / 4
    assert h.tokens("a") == list(range(8, 68))


# -- LoRA adapters ----------------------------------------------------------------------------


def test_a_request_joins_with_its_adapters_slot_and_gives_it_back() -> None:
    h = Harness(max_batch_size=4, adapters=("sql", "chat"))
    h.submit("a", adapter="chat")
    h.submit("b")
    h.submit("c", adapter="sql")
    h.tick()
    assert h.engine.adapter_of == {"a": 2, "b": 0, "c": 1}
    assert h.sched.adapters.get("chat").users == 1  # type: ignore[union-attr]
    h.run()
    assert h.tokens("a") == h.tokens("b") == [4, 5, 6, 7]
    assert all(h.sched.adapters.get(n).users == 0 for n in ("sql", "chat"))  # type: ignore[union-attr]


def test_a_request_naming_an_adapter_not_served_is_refused_at_once() -> None:
    h = Harness(adapters=("sql",))
    h.submit("a", adapter="nope")
    h.submit("b", adapter="sql")
    h.run()
    assert h.rejected == {"a": "adapter 'nope' is not served; served adapters: sql"}
    assert h.engine.added == ["b"] and h.received["a"] == []


def test_an_adapter_unloads_after_its_last_request_ends() -> None:
    """Unloading an adapter in use: new requests naming it are refused, the running one
    finishes with it, and the plan after its row left clears the slot (the fake runner checks
    that no row uses a slot it clears)."""
    h = Harness(max_batch_size=2, adapters=("sql", "chat"))
    h.submit("a", adapter="sql", max_tokens=6)
    h.tick()
    replies = []
    h.loop.unload_adapter("sql", replies.append)
    h.submit("b", adapter="sql")
    h.tick()
    assert replies[0].pending_requests == 1 and replies[0].error is None
    assert h.adapters_changed == 1 and h.sched.adapters.served == ["chat"]
    assert "being unloaded" in h.rejected["b"]
    h.run()
    assert h.final("a").finish_reason is FinishReason.LENGTH and len(h.tokens("a")) == 6
    unloads = [i for i, p in enumerate(h.engine.plans) if p.unload]
    assert [h.engine.plans[i].unload for i in unloads] == [[1]]
    assert h.engine.adapters == {2: "chat"}
    h.loop.unload_adapter("sql", replies.append)
    h.tick()
    assert replies[1].reason == "not_found" and "no adapter named 'sql'" in (replies[1].error or "")


def test_an_unused_adapter_is_cleared_by_the_next_plan() -> None:
    h = Harness(adapters=("sql",))
    replies = []
    h.loop.unload_adapter("sql", replies.append)
    h.tick()
    assert replies[0].pending_requests == 0
    assert h.engine.plans[-1].unload == [1] and h.engine.adapters == {}
    assert not h.sched.busy


def test_adapters_load_between_steps_into_the_lowest_free_slot() -> None:
    h = Harness(max_batch_size=2, adapters=("sql",))
    h.submit("a", adapter="sql", max_tokens=8)
    h.tick()
    replies = []
    h.loop.load_adapter("chat", "/adapters/chat", replies.append)
    h.loop.load_adapter("sql", "/adapters/sql", replies.append)
    h.loop.load_adapter("bad", "refused", replies.append)
    h.tick()
    loaded, exists, refused = replies
    assert loaded.adapter is not None and loaded.adapter.name == "chat"
    assert (exists.reason, refused.reason) == ("exists", "refused")
    assert "refused" in (refused.error or "") and h.adapters_changed == 1
    h.submit("b", adapter="chat")
    h.run()
    assert h.engine.adapter_of["b"] == 2 and h.engine.adapters == {1: "sql", 2: "chat"}


def test_the_prefix_cache_is_shared_only_under_the_same_adapter() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    h = Harness(kv=kv, max_batch_size=1, adapters=("sql", "chat"))
    system = list(range(100, 112))  # three full blocks
    for request_id, adapter in [("base", ""), ("sql1", "sql"), ("chat", "chat"), ("sql2", "sql")]:
        h.submit(request_id, prompt=[*system, 1], max_tokens=2, adapter=adapter)
        h.run()
    h.submit("base2", prompt=[*system, 2], max_tokens=2)
    h.run()
    cached = {r: h.final(r).cached_tokens for r in ("base", "sql1", "chat", "sql2", "base2")}
    assert cached == {"base": 0, "sql1": 0, "chat": 0, "sql2": 12, "base2": 12}
