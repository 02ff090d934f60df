"""Per-row sampling over random logits (service/core/engine/sampler.py)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from service.core.engine import sampler
from service.core.engine.sampler import RowSamplerState, SamplingParams, sample
from tests.helpers import cuda_source

VOCAB = 1000


def _logits(rows: int, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(0, 3, (rows, VOCAB)).astype(np.float32))


def _states(*params: SamplingParams) -> list[RowSamplerState]:
    return [RowSamplerState(p) for p in params]


def _draw(logits: mx.array, states: list[RowSamplerState]) -> list[int]:
    tokens, _ = sample(logits, states)
    return tokens.tolist()


def test_greedy_is_argmax() -> None:
    logits = _logits(6)
    expected = np.argmax(np.array(logits), axis=-1).tolist()
    assert _draw(logits, _states(*[SamplingParams()] * 6)) == expected


def test_greedy_rows_are_argmax_in_a_mixed_batch() -> None:
    logits = _logits(4, seed=1)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=1),
        SamplingParams(),
        SamplingParams(temperature=1.0, top_k=5, seed=2),
    ]
    tokens = _draw(logits, _states(*params))
    expected = np.argmax(np.array(logits), axis=-1)
    assert tokens[0] == expected[0] and tokens[2] == expected[2]


def test_top_k_1_equals_greedy() -> None:
    logits = _logits(5, seed=2)
    states = _states(*[SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(5)])
    assert _draw(logits, states) == np.argmax(np.array(logits), axis=-1).tolist()


def test_rows_without_logit_bias_stay_bit_identical() -> None:
    logits = _logits(4, seed=3)
    biased = SamplingParams(logit_bias=((7, 50.0), (9, -5.0)))
    params = [SamplingParams(), biased, SamplingParams(temperature=0.9, seed=5), SamplingParams()]
    tokens, processed = sample(logits, _states(*params))
    original, out = np.array(logits), np.array(processed)
    for row in (0, 2, 3):
        assert np.array_equal(out[row], original[row])  # bit for bit
    assert out[1, 7] == original[1, 7] + 50.0 and out[1, 9] == original[1, 9] - 5.0
    untouched = np.ones(VOCAB, bool)
    untouched[[7, 9]] = False
    assert np.array_equal(out[1, untouched], original[1, untouched])
    assert tokens.tolist()[1] == 7
    # The unbiased rows draw what they draw without the biased row.
    alone, _ = sample(logits[mx.array([0, 3])], _states(params[0], params[3]))
    assert [tokens.tolist()[0], tokens.tolist()[3]] == alone.tolist()


def test_a_huge_logit_bias_forces_its_token() -> None:
    logits = _logits(3, seed=4)
    params = [
        SamplingParams(logit_bias=((123, 100.0),)),
        SamplingParams(temperature=1.0, seed=3, logit_bias=((456, 100.0),)),
        SamplingParams(logit_bias=((int(np.argmax(np.array(logits)[2])), -100.0),)),
    ]
    tokens = _draw(logits, _states(*params))
    assert tokens[0] == 123 and tokens[1] == 456
    assert tokens[2] != int(np.argmax(np.array(logits)[2]))


def test_seeded_rows_are_reproducible_whatever_the_batch() -> None:
    """Same seed, same step, same logits row → same token, whatever the other rows are."""
    row = _logits(1, seed=5)
    seeded = SamplingParams(temperature=0.8, seed=1234)
    others_a = _logits(3, seed=6)
    others_b = _logits(5, seed=7)
    batches = {
        "alone": ([], []),
        "same-params": ([others_a], [SamplingParams(temperature=0.8, seed=s) for s in (1, 2, 3)]),
        "mixed": (
            [others_b],
            [
                SamplingParams(),
                SamplingParams(temperature=1.3, top_p=0.9, seed=9),
                SamplingParams(temperature=0.8, seed=10, logit_bias=((5, 3.0),)),
                SamplingParams(temperature=0.8),  # unseeded
                SamplingParams(temperature=0.5, min_p=0.1, seed=11),
            ],
        ),
    }
    sequences = {}
    for name, (extra, extra_params) in batches.items():
        state = RowSamplerState(seeded)
        other_states = _states(*extra_params)
        drawn = []
        for step in range(6):  # several steps: the per-row key advances the same way
            position = step % (len(extra_params) + 1)  # the row moves around the batch
            rows = [*np.array(extra[0])] if extra else []
            states = list(other_states)
            rows.insert(position, np.array(row)[0])
            states.insert(position, state)
            tokens = _draw(mx.array(np.stack(rows)), states)
            drawn.append(tokens[position])
        sequences[name] = drawn
    assert sequences["alone"] == sequences["same-params"] == sequences["mixed"]
    assert len(set(sequences["alone"])) > 1  # really sampled, not greedy


def test_different_seeds_draw_differently() -> None:
    logits = mx.zeros((1, VOCAB))  # uniform: each draw is a fresh random token
    draws = {
        seed: [_draw(logits, [state])[0] for state in [RowSamplerState(p)] for _ in range(8)]
        for seed in (1, 2)
        for p in [SamplingParams(temperature=1.0, seed=seed)]
    }
    assert draws[1] != draws[2]


def _peaked() -> mx.array:
    """Token 0 and 1 hold most of the mass; 998 tail tokens share the rest."""
    row = np.zeros(VOCAB, np.float32)
    row[0], row[1] = 10.0, 9.0
    return mx.array(row)


@pytest.mark.parametrize(
    ("params", "allowed"),
    [
        # At temperature 1.5: p0 ≈ 0.36, p1 ≈ 0.18, the tail ≈ 0.46 spread over 998 tokens.
        ({"top_p": 0.5}, {0, 1}),
        ({"top_p": 0.3}, {0}),
        ({"min_p": 0.3}, {0, 1}),
        ({"min_p": 0.6}, {0}),
        ({"top_k": 2}, {0, 1}),
        ({"top_p": 0.5, "min_p": 0.6}, {0}),
    ],
    ids=["top_p-0.5", "top_p-0.3", "min_p-0.3", "min_p-0.6", "top_k-2", "top_p+min_p"],
)
def test_filters_never_pick_a_masked_token(params: dict, allowed: set[int]) -> None:
    n = 300
    logits = mx.stack([_peaked()] * n)
    states = _states(*[SamplingParams(temperature=1.5, seed=i, **params) for i in range(n)])
    tokens = set(_draw(logits, states))
    assert tokens <= allowed
    assert tokens == allowed  # 300 draws: each allowed token shows up
    # Without the filter the tail would be drawn often: the test can see a leak.
    unfiltered = _states(*[SamplingParams(temperature=1.5, seed=i) for i in range(n)])
    assert len(set(_draw(logits, unfiltered)) - {0, 1}) > 20


def test_penalties_touch_only_their_row() -> None:
    logits = _logits(2, seed=8)
    penalized = RowSamplerState(
        SamplingParams(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5),
        prompt_token_ids=[1, 2, 3],
    )
    penalized.record(4)
    penalized.record(4)
    _, processed = sample(logits, [penalized, RowSamplerState(SamplingParams())])
    original, out = np.array(logits), np.array(processed)
    assert np.array_equal(out[1], original[1])
    changed = np.flatnonzero(out[0] != original[0]).tolist()
    assert set(changed) <= {1, 2, 3, 4} and 4 in changed
    expected_4 = original[0, 4]
    expected_4 = expected_4 / 1.5 if expected_4 > 0 else expected_4 * 1.5
    assert out[0, 4] == pytest.approx(expected_4 - (1.0 + 0.5 * 2), rel=1e-5)


def test_a_tiny_repetition_penalty_keeps_logprobs_finite() -> None:
    """The smallest positive penalty the API takes divides a logit past float32's range: the
    seen token still wins greedy, and every processed logit and logprob is a number."""
    logits = mx.array([[5.0, 1.0, -2.0, 0.5]])
    state = RowSamplerState(SamplingParams(repetition_penalty=1.4e-45), prompt_token_ids=[1, 2])
    tokens, processed = sample(logits, [state])
    assert tokens.tolist() == [1]
    logprobs = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
    assert mx.all(mx.isfinite(processed)).item() and mx.all(~mx.isnan(logprobs)).item()
    assert processed[0, 0].item() == 5.0  # unseen: untouched


def _mask_cases(vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits and token bitmasks whose masked argmax has every edge: ties (the lower id wins),
    a row with every token forbidden, one allowing a single token, one without a mask, and
    bits past the vocabulary."""
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, (6, vocab)).astype(np.float32)
    logits[0, [5, 700, 900]] = 50.0  # a three-way tie, all allowed
    width = -(-vocab // 32)
    words = rng.integers(0, 2**32, (6, width), dtype=np.uint64).astype(np.uint32)
    for token in (5, 700, 900):
        words[0, token // 32] |= np.uint32(1 << (token % 32))
    words[1] = 0  # nothing allowed: the first id, as mx.argmax of all -inf
    words[2] = 0
    words[2, 17] = 1 << 3  # only token 17 * 32 + 3
    words[3] = 0xFFFFFFFF  # no mask
    words[4, -1] = 0xFFFFFFFF  # the last word's bits past the vocabulary
    return logits, words.view(np.int32)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_masked_argmax_is_the_argmax_of_the_masked_logits(dtype: mx.Dtype) -> None:
    from service.core.engine.sampler import apply_token_masks, masked_argmax

    vocab = 1000  # not a multiple of 32
    logits, words = _mask_cases(vocab)
    x = mx.array(logits).astype(dtype)
    expected = mx.argmax(apply_token_masks(x, words), axis=-1).tolist()
    got = masked_argmax(x, words).tolist()
    assert got == expected
    assert got[0] == 5 and got[1] == 0 and got[2] == 17 * 32 + 3
    assert got[3] == int(np.argmax(np.asarray(x.astype(mx.float32))[3]))
    # Fewer words than the vocabulary needs: the ids past them are forbidden.
    narrow = words[:, :20]
    assert (
        masked_argmax(x, narrow).tolist()
        == mx.argmax(apply_token_masks(x, narrow), axis=-1).tolist()
    )
    assert max(masked_argmax(x, narrow).tolist()[3:]) < 20 * 32


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_masked_argmax_source_compiles(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The greedy-under-token-masks kernel, launched by its own host code for three logits
    dtypes and compiled by nvcc as MLX wraps it: no error, no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(sampler, "kernel_available", lambda: True)
    monkeypatch.setattr(sampler, "_masked_argmax_kernel", sampler._masked_argmax_kernel.__wrapped__)
    words = np.zeros((3, 16), np.int32)
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        sampler.masked_argmax(mx.zeros((3, 500), dtype), words)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == 3, compiled.log
    assert compiled.spills == 0, compiled.log
