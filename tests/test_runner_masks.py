"""service/core/engine/runner.py under token masks (structured output), on a tiny random llama:
a constrained row samples only what its mask allows, a decode step's constrained rows wait for
their masks (given after the step is built) while the other rows of the batch get bit for bit
what they get alone, greedy or seeded; prefill and verification forwards take the plan's masks;
penalties stay finite beside -inf."""

from __future__ import annotations

from collections.abc import Iterable

import mlx.core as mx
import numpy as np
import pytest

from service.core.engine.config import EngineConfig
from service.core.scheduler.plan import RowMasks
from service.protocol import SamplingParams
from tests.helpers.tiny import (
    PROMPTS,
    VOCAB,
    DraftRow,
    Driven,
    StepRow,
    make_engine,
    paged,
    tiny_llama,
)

WORDS = (VOCAB + 31) // 32


def row_mask(allowed: Iterable[int] | None) -> np.ndarray:
    """One bitmask row: these tokens (None: all of them)."""
    if allowed is None:
        return np.full(WORDS, -1, np.int32)
    bits = np.zeros(WORDS * 32, bool)
    bits[list(allowed)] = True
    return np.packbits(bits, bitorder="little").view(np.int32)


def masks(rows: list[tuple[int, Iterable[int] | None]]) -> RowMasks:
    return RowMasks(
        [slot for slot, _ in rows], WORDS, np.stack([row_mask(a) for _, a in rows]).tobytes()
    )


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def engine(model, batched: bool = True) -> Driven:
    return make_engine(model, paged(), EngineConfig(batched=batched))


def greedy_alone(
    model, prompt: list[int], steps: int, params: SamplingParams | None = None
) -> list[int]:
    e = engine(model)
    seq = e.add_sequence("alone", params or SamplingParams(), prompt)
    out = [e.prefill([StepRow(seq, prompt)])[0].token_id]
    for _ in range(steps):
        out.append(e.step([StepRow(seq)])[0].token_id)
    return out


def constrained_step(e: Driven, rows: list[StepRow], given: RowMasks) -> list:
    pending = e.submit(rows)
    e.sample(pending, given)
    return e.finish_rows(pending)


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "per-row"])
def test_masks_bind_constrained_rows_and_leave_the_others_as_alone(model, batched) -> None:
    steps = 6
    free_alone = greedy_alone(model, PROMPTS[1], steps)
    open_alone = greedy_alone(model, PROMPTS[2], steps)
    e = engine(model, batched)
    forced = e.add_sequence("forced", SamplingParams(), PROMPTS[0], constrained=True)
    free = e.add_sequence("free", SamplingParams(), PROMPTS[1])
    wide = e.add_sequence("open", SamplingParams(), PROMPTS[2], constrained=True)
    out: dict[str, list[int]] = {"forced": [], "free": [], "open": []}
    plan_masks = masks([(forced.slot, [7]), (wide.slot, None)])
    if batched:
        rows = [StepRow(s, p) for s, p in zip((forced, free, wide), PROMPTS)]
        first = e.finish_rows(e.submit(rows, masks=plan_masks))
    else:
        first = []
        for s, p in zip((forced, free, wide), PROMPTS):
            first += e.finish_rows(e.submit([StepRow(s, p)], masks=plan_masks))
    for r in first:
        out[r.seq.seq_id].append(r.token_id)
    for step in range(steps):
        allowed = [3, 5] if step % 2 else [7]
        given = masks([(forced.slot, allowed), (wide.slot, None)])
        for r in constrained_step(e, [StepRow(forced), StepRow(free), StepRow(wide)], given):
            out[r.seq.seq_id].append(r.token_id)
    assert out["forced"][0] == 7
    assert all(t == 7 for t in out["forced"][1::2])
    assert all(t in (3, 5) for t in out["forced"][2::2])
    assert out["free"] == free_alone  # unconstrained: exactly what it gets alone
    assert out["open"] == open_alone  # a mask that allows everything changes nothing


def test_a_decode_step_with_constrained_rows_waits_for_their_masks(model) -> None:
    e = engine(model)
    seq = e.add_sequence("c", SamplingParams(), PROMPTS[0], constrained=True)
    e.finish_rows(e.submit([StepRow(seq, PROMPTS[0])], masks=masks([(seq.slot, None)])))
    pending = e.submit([StepRow(seq)])
    with pytest.raises(RuntimeError, match="before its masks"):
        e.finish_rows(pending)


@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.9, seed=11)], ids=["greedy", "seeded"]
)
def test_masks_staged_while_the_step_dispatches_sample_as_masks_given_after(model, params) -> None:
    """`stage_masks` (the loop's second thread, while the step is dispatched) makes a step's
    masks ready; `sample` with the same masks then draws what it draws given them after, greedy
    (the masked argmax) or seeded (the general sampler)."""
    runs = {}
    for staged in (False, True):
        e = engine(model)
        forced = e.add_sequence("forced", params, PROMPTS[0], constrained=True)
        free = e.add_sequence("free", SamplingParams(), PROMPTS[1])
        rows = [StepRow(forced, PROMPTS[0]), StepRow(free, PROMPTS[1])]
        out = [r.token_id for r in e.finish_rows(e.submit(rows, masks=masks([(0, None)])))]
        for step in range(4):
            given = masks([(forced.slot, [3, 5] if step % 2 else [7])])
            pending = e.submit([StepRow(forced), StepRow(free)], dispatch=False)
            if staged:
                e.engine.stage_masks(pending, given)
                assert pending.decode is not None and pending.decode.staged is not None
            e.engine.dispatch(pending)
            e.sample(pending, given)
            assert pending.decode is not None and pending.decode.staged is None
            out += [r.token_id for r in e.finish_rows(pending)]
        runs[staged] = out
    assert runs[True] == runs[False]
    assert runs[True][2::4] == [7, 7] and set(runs[True][4::4]) <= {3, 5}


def test_a_prefill_forward_beside_a_chunk_that_does_not_sample(model) -> None:
    """Only the sampling rows' logits are masked, each with its own row's mask."""
    e = engine(model)
    long = e.add_sequence("long", SamplingParams(), PROMPTS[2])
    seq = e.add_sequence("c", SamplingParams(), PROMPTS[1], constrained=True)
    rows = [StepRow(long, PROMPTS[2][:10], sample=False), StepRow(seq, PROMPTS[1])]
    (result,) = e.finish_rows(e.submit(rows, masks=masks([(seq.slot, [11])])))
    assert result.seq is seq and result.token_id == 11


def test_a_constrained_prefill_needs_its_mask(model) -> None:
    e = engine(model)
    seq = e.add_sequence("c", SamplingParams(), PROMPTS[0], constrained=True)
    with pytest.raises(ValueError, match="no token mask"):
        e.prefill([StepRow(seq, PROMPTS[0])])


def test_seeded_sampling_keeps_its_draws_and_stays_in_the_mask(model) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = greedy_alone(model, PROMPTS[1], 8, params)
    e = engine(model)
    same = e.add_sequence("same", params, PROMPTS[1], constrained=True)
    narrow = e.add_sequence("narrow", SamplingParams(temperature=1.0, seed=5), PROMPTS[0], True)
    narrow_row = e.engine.rows[narrow.slot]
    assert narrow_row is not None
    first = e.finish_rows(
        e.submit(
            [StepRow(same, PROMPTS[1]), StepRow(narrow, PROMPTS[0])],
            masks=masks([(same.slot, None), (narrow.slot, range(40, 48))]),
        )
    )
    out = {r.seq.seq_id: [r.token_id] for r in first}
    for _ in range(8):
        given = masks([(same.slot, None), (narrow.slot, range(40, 48))])
        for r in constrained_step(e, [StepRow(same), StepRow(narrow)], given):
            out[r.seq.seq_id].append(r.token_id)
    assert out["same"] == alone  # the same key, the same draws: the same distribution
    assert all(40 <= t < 48 for t in out["narrow"])
    assert len(set(out["narrow"])) > 1  # still sampled among the allowed tokens


def test_penalties_and_logprobs_stay_finite_beside_forbidden_tokens(model) -> None:
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2)
    e = engine(model)
    seq = e.add_sequence(
        "p", params, PROMPTS[0], want_logprobs=True, top_logprobs=4, constrained=True
    )
    allowed = [t for t in range(VOCAB) if t not in PROMPTS[0]][:20]
    (r,) = e.finish_rows(e.submit([StepRow(seq, PROMPTS[0])], masks=masks([(seq.slot, allowed)])))
    tokens = [r.token_id]
    for _ in range(6):
        (r,) = constrained_step(e, [StepRow(seq)], masks([(seq.slot, allowed)]))
        tokens.append(r.token_id)
        assert r.logprob is not None and np.isfinite(r.logprob)
        top = [t for t, v in r.top_logprobs if np.isfinite(v)]
        assert set(top) <= set(allowed)
    assert set(tokens) <= set(allowed)


def test_verification_positions_take_their_masks(model) -> None:
    e = engine(model)
    seq = e.add_sequence("v", SamplingParams(), PROMPTS[0], constrained=True)
    first = e.finish_rows(e.submit([StepRow(seq, PROMPTS[0])], masks=masks([(seq.slot, [9])])))
    assert first[0].token_id == 9
    # Drafts 9, 9: the first position allows only 9 (kept), the second forbids 9.
    given = masks([(seq.slot, [9]), (seq.slot, [4, 6]), (seq.slot, [2])])
    (verified,) = e.verify([DraftRow(seq, 9, [9, 9])], given)
    emitted = [r.token_id for r in verified.results]
    assert emitted[0] == 9 and emitted[1] in (4, 6) and len(emitted) == 2


def test_apply_token_masks_matches_the_engine_reference() -> None:
    from llguidance.numpy import apply_token_bitmask_inplace

    from service.core.engine.sampler import apply_token_masks

    rng = np.random.default_rng(3)
    logits = rng.standard_normal((4, VOCAB)).astype(np.float32)
    words = np.stack(
        [row_mask(None), row_mask([0, 31, 32, 255]), row_mask(range(0, VOCAB, 3)), row_mask([])]
    )
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, words)
    got = np.asarray(apply_token_masks(mx.array(logits), words))
    assert np.array_equal(got, expected)
    assert np.array_equal(got[0], logits[0])  # all ones: bit for bit
    wide = np.asarray(apply_token_masks(mx.zeros((1, VOCAB + 40)), words[:1]))
    assert np.isneginf(wide[0, VOCAB:]).all() and (wide[0, :VOCAB] == 0).all()
    half = mx.array(logits).astype(mx.bfloat16)  # masked in its own dtype, allowed logits as-is
    masked = apply_token_masks(half, words)
    assert masked.dtype == mx.bfloat16
    expected = np.asarray(half.astype(mx.float32))
    apply_token_bitmask_inplace(expected, words)
    assert np.array_equal(np.asarray(masked.astype(mx.float32)), expected)
