"""What forwards cost on this machine, learned from the engine's own timings.

The scheduler sizes prefill chunks with these while rows decode (`--max-prefill-stall-ms`, see
docs/prefill-stalls.md): a decoding stream waits one decode step plus the prefill pass that runs
before it, so a pass may take the stall bound minus a decode step.

A prefill forward's seconds are modelled as a sum over its rows, each adding n new tokens after
c already cached:

    seconds = a + b * sum(n) + g * sum(c + n) + d * sum(n * (c + (n + 1) / 2))

a: once per forward (the weights are read once); b: per new token (projections, MLP); g: per
position read (each row's K/V); d: per (query, key) pair of causal attention, the term that
makes a chunk slower the longer its prompt's context. The four are fitted by non-negative least
squares on relative error over the last forwards measured, so the model follows what the machine
does now (other load, another model) with nothing to configure, and never predicts that more
tokens cost less. It only extrapolates so far: a forward is never planned at more than twice
the tokens of the largest one measured recently.

Pure Python: four unknowns, a few dozen observations.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from collections.abc import Sequence

RowShape = tuple[int, int]  # (new tokens, tokens already cached) of one row of a forward

WINDOW = 32  # forwards the fit looks at: recent enough to follow a change of load
# A full window is refitted once this many forwards are new: one more of 32 barely moves the
# fit, which costs a busy CPU step more Python than anything else the scheduler does.
REFIT_AFTER = 4
GROWTH = 2  # a planned forward's tokens are at most this many times the largest measured
_RIDGE = 1e-6  # keeps the normal equations solvable when the window's shapes are all alike


def features(rows: Sequence[RowShape]) -> tuple[float, float, float, float]:
    """The model's four regressors of one forward (see the module docstring)."""
    tokens = positions = pairs = 0.0
    for n, c in rows:
        tokens += n
        positions += c + n
        pairs += n * (c + (n + 1) / 2)
    return 1.0, tokens, positions, pairs


class PrefillCostModel:
    """Seconds of a prefill forward from its rows' shapes, fitted online."""

    def __init__(self, window: int = WINDOW) -> None:
        self._seen: deque[tuple[tuple[float, ...], float, int]] = deque(maxlen=window)
        self._coefficients: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
        self._new = 0  # forwards observed since the last fit

    @property
    def observations(self) -> int:
        return len(self._seen)

    @property
    def coefficients(self) -> tuple[float, float, float, float]:
        """The fit of the window, made when a prediction asks after new observations (every
        prefill pass is observed): at once while the window fills, then every REFIT_AFTER
        forwards."""
        full = len(self._seen) == self._seen.maxlen
        if self._new >= (REFIT_AFTER if full else 1):
            self._coefficients = _fit([x for x, _, _ in self._seen], [t for _, t, _ in self._seen])
            self._new = 0
        return self._coefficients

    def observe(self, rows: Sequence[RowShape], seconds: float) -> None:
        """Record one measured forward (a later prediction refits)."""
        if seconds <= 0 or not rows:
            return
        self._seen.append((features(rows), seconds, sum(n for n, _ in rows)))
        self._new += 1

    def predict(self, rows: Sequence[RowShape]) -> float:
        """Predicted seconds of a forward of these rows (0 before any observation)."""
        return sum(w * x for w, x in zip(self.coefficients, features(rows)))

    def max_tokens(
        self, planned: Sequence[RowShape], context: int, budget: float, limit: int
    ) -> int:
        """The most new tokens (at most `limit`) a row holding `context` tokens can add to a
        forward of the `planned` rows with its predicted seconds within `budget`; 0 if none."""
        largest = max((n for _, _, n in self._seen), default=0)
        limit = min(limit, GROWTH * largest - sum(n for n, _ in planned))

        def fits(n: int) -> bool:
            return self.predict([*planned, (n, context)]) <= budget

        if limit < 1 or not fits(1):
            return 0
        lo, hi = 1, limit  # fits(lo); the cost grows with n, so bisect for the last fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        return lo


class RunningMedian:
    """The median of the last `window` samples (e.g. decode step times)."""

    def __init__(self, window: int = 64) -> None:
        self._samples: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._samples.append(value)

    @property
    def value(self) -> float | None:
        return statistics.median(self._samples) if self._samples else None


def _fit(xs: list[tuple[float, ...]], ts: list[float]) -> tuple[float, float, float, float]:
    """Non-negative least squares of t ~ w.x on relative error (each row divided by its t).

    With four unknowns the exact solution is found by trying every subset of the features:
    the unconstrained fit on each subset, kept if no coefficient is negative; the best of those
    is the non-negative optimum. Columns are scaled to 1 first, so their units do not matter.
    Every subset's normal equations and residual come from one Gram matrix of the rows (the
    fit runs every few prefill passes: one pass over the rows, not one per subset)."""
    k = len(xs[0])
    n = len(xs)
    rows = [[x / t for x in xv] for xv, t in zip(xs, ts)]  # target: 1 for every row
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    rows = [[r[j] / scale[j] for j in range(k)] for r in rows]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    ones = [sum(r[i] for r in rows) for i in range(k)]  # rows' columns against the target
    best: tuple[float, list[float]] | None = None
    # Largest subsets first, and a smaller one only if it fits clearly better: where the window
    # cannot tell the terms apart (one shape seen), the cost is spread over all of them.
    for size in range(k, 0, -1):
        for subset in itertools.combinations(range(k), size):
            ata = [[gram[i][j] for j in subset] for i in subset]
            for d in range(size):
                ata[d][d] += _RIDGE * n
            w = _solve(ata, [ones[i] for i in subset])
            if w is None or min(w) < 0:
                continue
            full = [0.0] * k
            for j, value in zip(subset, w):
                full[j] = value
            # |rows.w - 1|^2 = w'Gw - 2 w'(rows'1) + n
            fitted = sum(full[i] * gram[i][j] * full[j] for i in range(k) for j in range(k))
            residual = fitted - 2 * sum(full[i] * ones[i] for i in range(k)) + n
            if best is None or residual < best[0] - 1e-9 * n:
                best = (residual, full)
    if best is None:
        return (0.0,) * 4  # type: ignore[return-value]
    w = best[1]
    return tuple(w[j] / scale[j] for j in range(k))  # type: ignore[return-value]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting (a is tiny)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x
