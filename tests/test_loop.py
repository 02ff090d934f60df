"""service.core.loop: the engine-core loop on the real scheduler and a fake runner. Here: steps
read beside the next one's dispatch (update_beside_dispatch), on the loop's second thread."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from service.core.loop import CoreLoop
from service.core.scheduler.request import Request
from service.protocol import FinishReason, GenerationRequest
from tests.helpers.fake_runner import EOS, Delivered, Harness, ListSink
from tests.helpers.runtime import loaded_runtime

# Prompts, max_tokens, and when each request arrives (the tick before which it is submitted).
WORKLOAD = [
    ("a", (1, 2, 3), 12, 0),
    ("b", (5, 6), 7, 0),
    ("c", (9, 10, 11, 12, 13), 20, 0),
    ("d", (EOS - 3,), 9, 0),  # meets EOS after three tokens
    ("late", (40, 41), 6, 5),
    ("cancelled", (60,), 30, 1),
]


def _serve(beside: bool) -> Harness:
    h = Harness(beside=beside, max_batch_size=8)
    tick = 0
    while tick < 200:
        for request_id, prompt, max_tokens, at in WORKLOAD:
            if at == tick:
                h.submit(request_id, prompt, max_tokens=max_tokens)
        if tick == 9:
            h.cancel("cancelled")
        h.tick()
        tick += 1
        if tick > 10 and not h.sched.busy and h.loop._inflight is None:
            break
    return h


def test_steps_read_beside_the_next_dispatch_deliver_what_the_loop_thread_would():
    alone, beside = _serve(False), _serve(True)
    for request_id, *_ in WORKLOAD:
        assert beside.tokens(request_id) == alone.tokens(request_id), request_id
        assert beside.final(request_id).reason == alone.final(request_id).reason, request_id
    assert beside.final("d").reason == FinishReason.STOP.value
    assert beside.final("a").reason == FinishReason.LENGTH.value
    assert beside.final("cancelled").reason == FinishReason.CANCELLED.value
    # The steady decode steps were read on the other thread; prefill steps on the loop's.
    assert alone.engine.beside_threads == []
    assert len(beside.engine.beside_threads) >= 10
    assert all(name.startswith("engine-update") for name in beside.engine.beside_threads)
    assert threading.current_thread().name not in beside.engine.beside_threads


def test_reading_beside_needs_overlapped_steps():
    h = Harness()
    with pytest.raises(ValueError, match="overlap"):
        CoreLoop(h.sched, h.engine, overlap_steps=False, update_beside_dispatch=True)


def test_a_read_that_fails_beside_fails_the_running_requests_and_the_loop_serves_on():
    h = Harness(beside=True, max_batch_size=4)
    real = h.engine.read_beside
    failures = []

    def failing(pending):
        if not failures:
            failures.append(threading.current_thread().name)
            raise RuntimeError("injected: reading the step failed")
        return real(pending)

    h.engine.read_beside = failing  # type: ignore[method-assign]
    done = threading.Event()
    thread = threading.Thread(target=h.loop.run, daemon=True)
    thread.start()
    try:
        for i in range(3):
            h.submit(f"r{i}", (1 + 10 * i, 2 + 10 * i), max_tokens=30)
        for _ in range(500):
            if all(h.received[f"r{i}"] and h.outputs(f"r{i}")[-1].finished for i in range(3)):
                break
            done.wait(0.01)
        assert failures and failures[0].startswith("engine-update")
        for i in range(3):
            final = h.final(f"r{i}")
            assert final.reason == FinishReason.ERROR.value, final
        # The loop is still serving.
        h.submit("after", (1, 2, 3), max_tokens=5)
        for _ in range(500):
            if h.received["after"] and h.outputs("after")[-1].finished:
                break
            done.wait(0.01)
        assert h.tokens("after") == [4, 5, 6, 7, 8]
        assert h.final("after").reason == FinishReason.LENGTH.value
    finally:
        h.loop.stop()
        thread.join(5)
    assert not thread.is_alive()


@pytest.mark.skipif(not mx.cuda.is_available(), reason="needs MLX's CUDA backend")
@pytest.mark.model  # the dummy preset takes the embedded model's tokenizer
def test_a_cuda_core_reading_beside_the_dispatch_gives_the_tokens_read_on_its_thread():
    """The real runner: steps read through their readout on the second thread, while the next
    step's graph (fed by the same tokens on the device) is dispatched."""
    # A shape whose heads the CUDA kernel reads (the tiny preset's are too narrow).
    with loaded_runtime("smollm2-135m", max_batch_size=8) as runtime:
        assert runtime.engine_config is not None
        assert runtime.engine_config.update_beside_dispatch
        outs: dict[bool, dict[int, list[int]]] = {}
        for beside in (True, False):
            loop = CoreLoop(
                runtime.scheduler,
                runtime.runner,
                overlap_steps=True,
                update_beside_dispatch=beside,
            )
            calls: list[list[Delivered]] = []
            sink = ListSink(calls)
            for i in range(6):
                prompt = tuple(range(20 + i, 20 + i + 3 + 5 * i))
                request = GenerationRequest(
                    f"b{i}", prompt, max_tokens=24 + 4 * i, ignore_eos=True, cache_prompt=False
                )
                loop.submit(Request(request, sink, rid=i + 1))
            for _ in range(400):
                assert loop._drain(block=False)
                loop.turn()
                loop._deliver()
                if sum(d.finished for c in calls for d in c) == 6 and loop._inflight is None:
                    break
            assert sum(d.finished for c in calls for d in c) == 6
            tokens: dict[int, list[int]] = {}
            for delivered in (d for c in calls for d in c):
                tokens.setdefault(delivered.rid, []).extend(delivered.token_ids)
            outs[beside] = tokens
        assert outs[True] == outs[False]
        assert [len(outs[True][i + 1]) for i in range(6)] == [24 + 4 * i for i in range(6)]


def test_steps_are_counted_by_how_they_were_planned():
    """A lone request's first step (admission, prefill) is planned after the step before was
    read; its decode steps while the one before runs. A request arriving mid-decode makes one
    more serial step, to admit it."""
    h = Harness(max_batch_size=8)
    h.submit("a", (1, 2, 3), max_tokens=12)
    for tick in range(100):
        if tick == 4:
            before = (h.loop.steps.serial, h.loop.steps.overlapped)
            h.submit("b", (5, 6), max_tokens=3)
        h.tick()
        if tick > 4 and not h.sched.busy and h.loop._inflight is None:
            break
    assert len(h.tokens("a")) == 12 and len(h.tokens("b")) == 3
    assert before[0] == 1 and before[1] >= 2
    assert h.loop.steps.serial == 2
    assert h.loop.steps.overlapped >= 9
