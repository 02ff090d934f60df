"""Per-row sampling over a batch of logits.

Rows that share their fusible parameters (temperature, top-p, top-k, min-p) are
drawn together with one `[B, vocab] -> [B]` operation. Each row draws its noise
from its own key, so a seeded request samples the same tokens whatever batch it
runs in. Logit bias and penalties touch only the rows that ask for them: the
other rows' logits stay bit-identical.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import mlx.core as mx
import numpy as np

from service.core.engine.kernel_source import cuda_kernel
from service.core.engine.paged_attention import kernel_available
from service.protocol import SamplingParams


@dataclass
class RowSamplerState:
    """What one sequence's sampling needs across steps: its key and token history."""

    params: SamplingParams
    prompt_token_ids: list[int] = field(default_factory=list)
    generated_counts: Counter[int] = field(default_factory=Counter)
    key: mx.array | None = None

    def __post_init__(self) -> None:
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else random.getrandbits(63)
            self.key = mx.random.key(seed)

    def next_key(self) -> mx.array:
        assert self.key is not None
        self.key, sub = mx.random.split(self.key)
        return sub

    def record(self, token_id: int) -> None:
        self.generated_counts[token_id] += 1


def _per_row(
    logits: mx.array,
    states: list[RowSamplerState],
    applies: Callable[[SamplingParams], bool],
    transform: Callable[[mx.array, RowSamplerState], mx.array],
) -> mx.array:
    """Transform only the rows whose parameters ask for it; the others stay bit-identical."""
    if not any(applies(s.params) for s in states):
        return logits
    return mx.stack(
        [transform(logits[i], s) if applies(s.params) else logits[i] for i, s in enumerate(states)]
    )


def _apply_bias(row: mx.array, state: RowSamplerState) -> mx.array:
    bias = state.params.logit_bias
    ids = mx.array([t for t, _ in bias])
    return row.at[ids].add(mx.array([b for _, b in bias], dtype=mx.float32))


def _apply_penalties(row: mx.array, state: RowSamplerState) -> mx.array:
    p = state.params
    if p.repetition_penalty != 1.0:
        seen = sorted(set(state.prompt_token_ids) | set(state.generated_counts))
        if seen:
            idx = mx.array(seen)
            old = row[idx]
            new = mx.where(old > 0, old / p.repetition_penalty, old * p.repetition_penalty)
            # A tiny penalty overflows a positive logit: kept finite, a logprob stays a number.
            big = mx.finfo(row.dtype).max
            new = mx.clip(new, -big, big)
            # A token a response format forbids stays -inf (-inf - -inf would be NaN).
            row = row.at[idx].add(mx.where(mx.isinf(old), 0.0, new - old))
    if (p.presence_penalty or p.frequency_penalty) and state.generated_counts:
        ids = sorted(state.generated_counts)
        counts = mx.array([state.generated_counts[i] for i in ids], dtype=mx.float32)
        row = row.at[mx.array(ids)].add(-(p.presence_penalty + p.frequency_penalty * counts))
    return row


def _mask_words(words: mx.array, logits: mx.array) -> mx.array:
    """logits [R, W, 32] capped by each token's bit: min(x, +inf) is x bit for bit, min(x,
    -inf) is -inf. A min rather than a `where`: it fuses with the unpacking into one elementwise
    kernel (MLX's CPU `where` is not vectorized)."""
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    return mx.minimum(logits, (bits.astype(logits.dtype) * 2 - 1) * mx.inf)


class _PerThread(threading.local):
    """A compiled graph is bound to the streams of the thread that traced it: one per thread."""

    def __init__(self) -> None:
        self.mask = mx.compile(_mask_words, shapeless=True)


_compiled = _PerThread()

# Greedy rows under token masks (structured output): the masked argmax as one kernel, where MLX
# would run the unpacking, the mask and the reduction as separate primitives, each with its host
# work, in an evaluation of its own (the masks come after the forward is queued).
_MASKED_ARGMAX_HEADER = """
// (v, i, nan) beats (bv, bi, bnan) in mx.argmax's order: NaN first, then the larger value,
// then the lower index.
__device__ inline bool mlxserve_beats(float v, int i, bool nan, float bv, int bi, bool bnan) {
    if (nan != bnan) {
        return nan;
    }
    if (!nan && v != bv) {
        return v > bv;
    }
    return i < bi;
}
"""

_MASKED_ARGMAX = """
    // One block per row: each thread walks every BLOCK-th word of the row's mask and reads the
    // logits of the tokens it allows, in increasing order; then the block reduces.
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int words_used = (V + 31) / 32 < W ? (V + 31) / 32 : W;
    const T* lr = logits + (size_t)row * V;
    const uint32_t* wr = words + (size_t)row * W;
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    bool best_nan = false;
    for (int w = tid; w < words_used; w += BLOCK) {
        uint32_t m = wr[w];
        while (m != 0u) {
            const int t = w * 32 + (__ffs(m) - 1);
            m &= m - 1u;
            if (t >= V) {
                break;
            }
            const float v = static_cast<float>(lr[t]);
            const bool nan = isnan(v);
            if (mlxserve_beats(v, t, nan, best, best_i, best_nan)) {
                best = v;
                best_i = t;
                best_nan = nan;
            }
        }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        const float v = __shfl_down_sync(0xffffffff, best, offset);
        const int i = __shfl_down_sync(0xffffffff, best_i, offset);
        const bool nan = __shfl_down_sync(0xffffffff, (int)best_nan, offset) != 0;
        if (mlxserve_beats(v, i, nan, best, best_i, best_nan)) {
            best = v;
            best_i = i;
            best_nan = nan;
        }
    }
    __shared__ float s_best[BLOCK / 32];
    __shared__ int s_i[BLOCK / 32];
    __shared__ int s_nan[BLOCK / 32];
    if (tid % 32 == 0) {
        s_best[tid / 32] = best;
        s_i[tid / 32] = best_i;
        s_nan[tid / 32] = best_nan;
    }
    __syncthreads();
    if (tid == 0) {
        for (int k = 1; k < BLOCK / 32; ++k) {
            if (mlxserve_beats(s_best[k], s_i[k], s_nan[k] != 0, best, best_i, best_nan)) {
                best = s_best[k];
                best_i = s_i[k];
                best_nan = s_nan[k] != 0;
            }
        }
        // Every masked logit -inf: mx.argmax's first index.
        out[row] = (!best_nan && best == -INFINITY) ? 0 : best_i;
    }
"""

MASKED_ARGMAX_BLOCK = 256


@cache
def _masked_argmax_kernel() -> Any:
    return cuda_kernel(
        name="mlxserve_masked_argmax",
        input_names=["logits", "words"],
        output_names=["out"],
        source=_MASKED_ARGMAX,
        header=_MASKED_ARGMAX_HEADER,
    )


def upload_words(words: np.ndarray) -> mx.array:
    """Token bitmasks as the device reads them (uint32). Copying host data into an MLX array
    on CUDA is slow host work (unified memory the device touched last), so a caller with time
    to spare makes this early, off the thread that dispatches."""
    return mx.array(np.ascontiguousarray(words).view(np.uint32))


def masked_argmax(
    logits: mx.array, words: np.ndarray, uploaded: mx.array | None = None
) -> mx.array:
    """int32 [rows]: `mx.argmax(apply_token_masks(logits, words), axis=-1)`, the greedy tokens
    of rows under token masks (a row of all ones is a row without one). One kernel on CUDA;
    `uploaded`: `upload_words(words)`, made already."""
    if not kernel_available():
        return mx.argmax(apply_token_masks(logits, words), axis=-1).astype(mx.int32)
    rows, vocab = logits.shape
    packed = uploaded if uploaded is not None else upload_words(words)
    (out,) = _masked_argmax_kernel()(
        inputs=[logits, packed],
        template=[
            ("T", logits.dtype),
            ("V", vocab),
            ("W", words.shape[1]),
            ("BLOCK", MASKED_ARGMAX_BLOCK),
        ],
        grid=(rows * MASKED_ARGMAX_BLOCK, 1, 1),
        threadgroup=(MASKED_ARGMAX_BLOCK, 1, 1),
        output_shapes=[(rows,)],
        output_dtypes=[mx.int32],
    )
    return out


def apply_token_masks(
    logits: mx.array, words: np.ndarray, uploaded: mx.array | None = None
) -> mx.array:
    """Structured output: -inf wherever a row's token bitmask forbids the token, in one fused
    op for the batch. `words`: int32 [rows, W], llguidance's layout (bit t % 32 of word t // 32
    allows token t). A row of all ones (-1) keeps its logits bit for bit; ids past 32 * W (a
    vocabulary padded beyond the mask) are forbidden. `uploaded`: `upload_words(words)`, made
    already."""
    rows, vocab = logits.shape
    width = -(-vocab // 32)
    if words.shape[1] != width:  # cut to the logits' words, or padded with forbidding zeros
        fitted = np.zeros((rows, width), np.int32)
        n = min(width, words.shape[1])
        fitted[:, :n] = words[:, :n]
        words, uploaded = fitted, None
    padded = logits
    if width * 32 != vocab:  # the last word's spare bits face -inf padding
        fill = mx.full((rows, width * 32 - vocab), -mx.inf, logits.dtype)
        padded = mx.concatenate([logits, fill], axis=1)
    packed = uploaded if uploaded is not None else upload_words(words)
    out = _compiled.mask(packed, padded.reshape(rows, width, 32))
    out = out.reshape(rows, width * 32)
    return out if width * 32 == vocab else out[:, :vocab]


def _filter(logits: mx.array, top_k: int, top_p: float, min_p: float) -> mx.array:
    """Mask tokens outside top-k / top-p / min-p with -inf; logits are [B, V] at temperature."""
    neg_inf = mx.array(-float("inf"), dtype=logits.dtype)
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = mx.sort(logits, axis=-1)[:, vocab - top_k][:, None]
        logits = mx.where(logits < kth, neg_inf, logits)
    if min_p > 0.0:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        top = mx.max(logprobs, axis=-1, keepdims=True)
        logits = mx.where(logprobs < top + mx.log(mx.array(min_p)), neg_inf, logits)
    if top_p < 1.0:
        order = mx.argsort(-logits, axis=-1)
        sorted_logits = mx.take_along_axis(logits, order, axis=-1)
        probs = mx.softmax(sorted_logits, axis=-1)
        # Keep a token if the mass before it is below top_p (the first token always stays).
        before = mx.cumsum(probs, axis=-1) - probs
        sorted_logits = mx.where(before < top_p, sorted_logits, neg_inf)
        inverse = mx.argsort(order, axis=-1)
        logits = mx.take_along_axis(sorted_logits, inverse, axis=-1)
    return logits


def sample(logits: mx.array, states: list[RowSamplerState]) -> tuple[mx.array, mx.array]:
    """Draw one token per row. Returns (tokens [B] int32, processed logits [B, V] float32)."""
    logits = logits.astype(mx.float32)
    logits = _per_row(logits, states, lambda p: bool(p.logit_bias), _apply_bias)
    logits = _per_row(logits, states, lambda p: p.has_penalties, _apply_penalties)

    groups: dict[tuple[float, float, int, float], list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault(s.params.fused_key, []).append(i)

    if len(groups) == 1:
        return _sample_group(logits, states, next(iter(groups))), logits
    tokens: list[mx.array] = [mx.array(0)] * len(states)
    for key, rows in groups.items():
        idx = mx.array(rows)
        drawn = _sample_group(logits[idx], [states[i] for i in rows], key)
        for j, i in enumerate(rows):
            tokens[i] = drawn[j]
    return mx.stack(tokens), logits


def _sample_group(
    logits: mx.array, states: list[RowSamplerState], key: tuple[float, float, int, float]
) -> mx.array:
    temperature, top_p, top_k, min_p = key
    if temperature == 0.0:
        return mx.argmax(logits, axis=-1).astype(mx.int32)
    scaled = _filter(logits / temperature, top_k, top_p, min_p)
    vocab = logits.shape[-1]
    # Gumbel-max with each row's own key: the draw does not depend on the batch around it.
    noise = mx.stack([mx.random.gumbel(shape=(vocab,), key=s.next_key()) for s in states])
    return mx.argmax(scaled + noise, axis=-1).astype(mx.int32)


def verify_draft(
    logits: mx.array, draft: list[int], state: RowSamplerState
) -> tuple[list[int], mx.array]:
    """Check drafted tokens against the model. logits [k+1, V]: the row's positions after its
    last token and after each of its k drafted tokens. Returns the tokens to emit (the accepted
    drafts, then one more: the model's own token where a draft was rejected, or the token after
    the last draft) and the processed logits (bias applied; for logprobs).

    Greedy: a draft is accepted while it is the argmax, so the output equals plain greedy
    decoding. Sampled: rejection sampling against a draft that is a point mass (q(d) = 1): d is
    kept with probability p(d), else one token is drawn from p with d removed, which leaves the
    output distributed exactly as drawing token by token from p."""
    logits = logits.astype(mx.float32)
    if state.params.logit_bias:
        logits = mx.stack([_apply_bias(row, state) for row in logits])
    k = len(draft)
    params = state.params
    if params.greedy:
        targets = mx.argmax(logits, axis=-1).tolist()
        out: list[int] = []
        for j in range(k):
            if targets[j] != draft[j]:
                return [*out, targets[j]], logits
            out.append(draft[j])
        return [*out, targets[k]], logits
    probs = mx.softmax(
        _filter(logits / params.temperature, params.top_k, params.top_p, params.min_p), axis=-1
    )
    if k:
        chances = probs[mx.arange(k), mx.array(draft)]
        draws = mx.random.uniform(shape=(k,), key=state.next_key())
        accepted = (draws < chances).tolist()
    else:
        accepted = []
    out = []
    for j in range(k):
        if not accepted[j]:
            residual = probs[j].at[draft[j]].multiply(0.0)
            token = mx.random.categorical(mx.log(residual), key=state.next_key())
            return [*out, int(token.item())], logits
        out.append(draft[j])
    bonus = mx.random.categorical(mx.log(probs[k]), key=state.next_key())
    return [*out, int(bonus.item())], logits
