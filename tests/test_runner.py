"""The model runner's row table: a plan that names a slot with no row in it is refused at once,
naming the slot: a scheduler bug, which running the other rows one by one would not contain."""

from __future__ import annotations

import pytest

from service.core.engine.config import EngineConfig
from service.core.engine.runner import EmptySlotError
from service.core.scheduler.plan import Chunk, StepPlan
from service.protocol import SamplingParams
from tests.helpers.tiny import StepRow, make_engine, paged, prompt, tiny_llama


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_a_plan_naming_an_empty_slot_is_refused(kind):
    engine = make_engine(
        tiny_llama(), paged(decode_attention="mirror"), EngineConfig(decode_attention="mirror")
    )
    seqs = [engine.add_sequence(f"r{i}", SamplingParams(), prompt(i, 5)) for i in range(2)]
    engine.prefill([StepRow(s, prompt(i, 5)) for i, s in enumerate(seqs)])
    empty = 5
    assert engine.engine.rows[empty] is None
    slots = [seqs[0].slot, empty, seqs[1].slot]
    plan = (
        StepPlan(100, decode=slots)
        if kind == "decode"
        else StepPlan(100, prefill=[[Chunk(s, [3], True) for s in slots]])
    )
    built = []
    build = engine.engine._build
    engine.engine._build = lambda *a: built.append(a) or build(*a)
    with pytest.raises(EmptySlotError, match=f"slot {empty} runs with no row in it"):
        engine.engine.submit(plan)
    assert len(built) == 1, "the rows were run one by one"
