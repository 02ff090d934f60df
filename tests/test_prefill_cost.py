"""The prefill cost model and the running median behind the stall bound (pure Python)."""

from __future__ import annotations

import random

import pytest

from service.core.scheduler.prefill_cost import (
    GROWTH,
    WINDOW,
    PrefillCostModel,
    RowShape,
    RunningMedian,
    features,
)

TRUE = (0.070, 3.5e-3, 15e-6, 4.5e-6)  # seconds: per forward, token, position, (q, k) pair


def true_cost(rows: list[RowShape]) -> float:
    return sum(w * x for w, x in zip(TRUE, features(rows)))


def test_features_of_a_batched_forward_sum_its_rows() -> None:
    assert features([(4, 0)]) == (1.0, 4.0, 4.0, 4 * 2.5)
    assert features([(4, 0), (2, 10)]) == (1.0, 6.0, 16.0, 10.0 + 2 * 11.5)


def test_the_fit_recovers_the_costs_of_a_model_shaped_machine() -> None:
    model = PrefillCostModel()
    rng = random.Random(0)
    for _ in range(WINDOW):
        rows = [(rng.randint(1, 600), rng.randint(0, 8000)) for _ in range(rng.randint(1, 3))]
        model.observe(rows, true_cost(rows))
    for got, want in zip(model.coefficients, TRUE):
        assert got == pytest.approx(want, rel=1e-3)
    late = [(16, 7800)]
    assert model.predict(late) == pytest.approx(true_cost(late), rel=1e-3)


def test_noisy_timings_still_predict_within_the_noise_and_never_negative() -> None:
    model = PrefillCostModel()
    rng = random.Random(1)
    for _ in range(200):
        rows = [(rng.randint(1, 200), rng.randint(0, 8000))]
        model.observe(rows, true_cost(rows) * rng.uniform(0.8, 1.25))
    assert min(model.coefficients) >= 0
    for shape in ([(8, 100)], [(64, 4000)], [(200, 7900)]):
        assert model.predict(shape) == pytest.approx(true_cost(shape), rel=0.25)


def test_costs_that_fall_as_the_context_grows_give_no_negative_term() -> None:
    """Nonsense data (later, longer forwards measured faster): the fit stays non-negative, so
    more tokens are never predicted to cost less."""
    model = PrefillCostModel()
    for i in range(10):
        model.observe([(32, 1000 * i)], 1.0 - 0.09 * i)
    assert min(model.coefficients) >= 0
    sizes = [model.predict([(n, 5000)]) for n in (1, 10, 100, 1000)]
    assert sizes == sorted(sizes)


def test_the_window_follows_a_change_of_speed() -> None:
    model = PrefillCostModel()
    shapes = [[(n, c)] for n in (8, 64, 256) for c in (0, 2000, 6000)]
    for shape in shapes * 4:
        model.observe(shape, true_cost(shape))
    for shape in shapes * 4:  # the machine got twice as slow (another job took a core)
        model.observe(shape, 2 * true_cost(shape))
    assert model.predict([(100, 3000)]) == pytest.approx(2 * true_cost([(100, 3000)]), rel=1e-3)


def test_max_tokens_is_the_largest_chunk_within_the_budget() -> None:
    model = PrefillCostModel()
    for shape in ([(512, 0)], [(512, 4096)], [(64, 7000)], [(300, 2000)], [(8, 100)]):
        model.observe(shape, true_cost(shape))
    for context, budget in [(0, 0.25), (2000, 0.25), (6000, 0.25), (3000, 1.0)]:
        n = model.max_tokens([], context, budget, limit=2048)
        assert n >= 1
        assert true_cost([(n, context)]) <= budget * 1.001
        assert true_cost([(n + 1, context)]) > budget * 0.999
    # Later in the prompt, fewer tokens fit the same budget.
    assert model.max_tokens([], 6000, 0.25, 2048) < model.max_tokens([], 0, 0.25, 2048)
    assert model.max_tokens([], 0, 10.0, limit=100) == 100
    assert model.max_tokens([], 8000, 0.05, 2048) == 0  # not even one token fits


def test_max_tokens_counts_the_rows_already_in_the_forward() -> None:
    model = PrefillCostModel()
    for shape in ([(512, 0)], [(512, 4096)], [(64, 7000)], [(300, 2000)], [(8, 100)]):
        model.observe(shape, true_cost(shape))
    alone = model.max_tokens([], 1000, 0.5, 2048)
    planned = [(alone // 2, 1000)]
    together = model.max_tokens(planned, 1000, 0.5, 2048)
    assert 0 < together < alone
    assert true_cost([*planned, (together, 1000)]) <= 0.5 * 1.001


def test_no_forward_is_planned_far_beyond_the_largest_measured() -> None:
    model = PrefillCostModel()
    assert model.max_tokens([], 0, 10.0, 2048) == 0  # nothing measured: nothing to go on
    model.observe([(10, 0)], 0.1)
    assert model.max_tokens([], 0, 10.0, 2048) == GROWTH * 10
    assert model.max_tokens([(5, 0)], 0, 10.0, 2048) == GROWTH * 10 - 5


def test_the_running_median_of_the_last_samples() -> None:
    median = RunningMedian(window=3)
    assert median.value is None
    for x in (5.0, 1.0, 3.0):
        median.add(x)
    assert median.value == 3.0
    median.add(10.0)  # 5.0 leaves the window
    assert median.value == 3.0
    median.add(20.0)
    assert median.value == 10.0


def test_observing_fits_nothing_until_a_prediction_asks(monkeypatch) -> None:
    """Every prefill pass is observed; the fit runs only when a prediction needs it, once for
    all the passes observed since the last."""
    from service.core.scheduler import prefill_cost

    fits = []
    fit = prefill_cost._fit
    monkeypatch.setattr(prefill_cost, "_fit", lambda xs, ts: fits.append(len(xs)) or fit(xs, ts))
    model = PrefillCostModel()
    for n in (8, 64, 256):
        model.observe([(n, 0)], true_cost([(n, 0)]))
    assert fits == []
    first = model.predict([(32, 0)])
    assert model.predict([(32, 0)]) == first and fits == [3]
    model.observe([(16, 100)], true_cost([(16, 100)]))
    model.max_tokens([], 0, budget=1.0, limit=64)
    assert fits == [3, 4]


def test_a_full_window_refits_every_few_forwards(monkeypatch) -> None:
    from service.core.scheduler import prefill_cost

    fits = []
    fit = prefill_cost._fit
    monkeypatch.setattr(prefill_cost, "_fit", lambda xs, ts: fits.append(len(xs)) or fit(xs, ts))
    model = PrefillCostModel()
    shapes = [[(n, c)] for n in (8, 64, 256, 512) for c in (0, 2000)]
    for shape in shapes * (WINDOW // len(shapes)):
        model.observe(shape, true_cost(shape))
    model.predict([(32, 0)])
    assert fits == [WINDOW]
    for shape in shapes[: prefill_cost.REFIT_AFTER - 1]:
        model.observe(shape, 2 * true_cost(shape))
        model.predict([(32, 0)])
    assert fits == [WINDOW]
    model.observe(shapes[0], 2 * true_cost(shapes[0]))
    model.predict([(32, 0)])
    assert fits == [WINDOW, WINDOW]
