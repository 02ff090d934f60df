"""The engine: runs forwards the scheduler asks for. Mechanism, no policy.

`submit(rows)` builds one forward for any mix of rows (prefill chunks of any
length and single decode tokens), samples the rows that need a token, and
queues the work on the device without waiting. `finish_rows(pending)` is the
evaluation boundary: it reads the sampled tokens, and if the device raises,
retries the rows one by one so that only the failing rows end in error.
`prefill` and `step` are the synchronous conveniences built on the pair.
A decode row may feed the token its previous step sampled before that token is
read: that is what lets the scheduler queue step N+1 before reading step N.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import structlog

from service.engine import paged_attention
from service.engine.batch_view import KVStorage, StepLayout, make_views
from service.engine.compiled_decode import DecodeGraph
from service.engine.kv_paged import OutOfBlocksError
from service.engine.sampler import RowSamplerState, SamplingParams, sample

log = structlog.get_logger(__name__)


class EngineError(RuntimeError):
    """An evaluation failed for a row; the message is safe to show to the caller."""


@dataclass(eq=False)
class EngineSequence:
    """Engine-side state of one sequence: its KV handle, sampler state and cache length."""

    seq_id: str
    kv: Any
    sampler: RowSamplerState
    num_cached: int = 0  # tokens whose K/V are stored
    # The token the last step sampled, maybe not yet read: (that step's [S] tokens, our row).
    next_input: tuple[mx.array, int] | None = None
    top_logprobs: int = 0
    want_logprobs: bool = False


@dataclass
class StepRow:
    """One row of a forward: new tokens to feed (None = the last sampled token)."""

    seq: EngineSequence
    tokens: Sequence[int] | None = None
    sample: bool = True
    inputs: list[int] | tuple[mx.array, int] | None = None  # resolved at submit; for a replay


@dataclass
class RowResult:
    seq: EngineSequence
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None


@dataclass
class PendingStep:
    rows: list[StepRow]
    sampled_rows: list[int]  # indices into rows of the rows that sampled
    tokens: mx.array | None
    logprobs: mx.array | None  # [S] chosen-token logprobs, when any row asked
    top: tuple[mx.array, mx.array] | None  # ([S, K] ids, [S, K] logprobs)
    hidden: mx.array | None  # set when no row sampled: what must be evaluated


FaultInjector = Callable[[EngineSequence], bool]


def shape_bucket(n: int) -> int:
    """Round a multi-token forward's length up: powers of two from 16 to 1024, then multiples
    of 1024. Few distinct shapes means few per-shape attention plans (see Engine)."""
    if n <= 1024:
        return max(16, 1 << (n - 1).bit_length())
    return -(-n // 1024) * 1024


class Engine:
    def __init__(
        self,
        model: Any,
        storage: KVStorage,
        num_layers: int,
        *,
        batched: bool = True,
        shape_buckets: bool = False,
        overlap_steps: bool = False,
        direct_decode: bool = False,
        compile_decode: bool = False,
        fault_injector: FaultInjector | None = None,
    ) -> None:
        """shape_buckets: pad multi-token forwards (prefill chunks) to `shape_bucket` lengths
        with a masked tail. On MLX's CUDA backend the attention of such a forward builds a
        cuDNN plan per distinct shape (~50 ms the first time, measured on an H200), so
        unpadded prompts of new lengths would pay it on nearly every request.

        overlap_steps: the scheduler may dispatch decode step N+1 before reading step N, as
        mlx-lm's generate loop does, so the device never waits for the host between steps.
        Only safe for the pool's memory when decode steps write it in place (paged storage's
        `write_in_place`, the CUDA kernel): MLX's functional scatter would copy each layer's
        pool, which step N still references. The runtime turns both on together.

        direct_decode: decode steps attend straight from the paged pool through each row's
        slots (service.engine.paged_attention: a CUDA kernel, or MLX ops elsewhere) instead of
        gathering padded K/V and masking it. Needs paged storage and a llama-family model.

        compile_decode: direct decode steps whose rows all sample replay a compiled graph
        (service.engine.compiled_decode) instead of building the forward op by op."""
        self.model = model
        self.storage = storage
        self.num_layers = num_layers
        self.batched = batched
        self.decode_path = "batched" if batched else "per-row"
        self.shape_buckets = shape_buckets
        self.overlap_steps = overlap_steps
        if direct_decode and not (hasattr(storage, "attend") and paged_attention.install(model)):
            raise ValueError("direct decode attention needs paged storage and a llama-family model")
        self.direct_decode = direct_decode
        self._fault_injector = fault_injector
        self._head = ModelHead(model)
        self.decode_graph: DecodeGraph | None = None
        if compile_decode:
            self.compile_decode_steps()

    def compile_decode_steps(self) -> None:
        """From now on, direct decode steps replay compiled graphs (see compile_decode)."""
        if not self.direct_decode:
            raise ValueError("compiled decode steps need direct decode attention")
        self.decode_graph = DecodeGraph(self._head, self.storage, self.num_layers)

    # -- sequences -------------------------------------------------------------------
    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        want_logprobs: bool = False,
        top_logprobs: int = 0,
        sampler: RowSamplerState | None = None,
        cache_prefix: bool = True,
    ) -> EngineSequence:
        state = sampler or RowSamplerState(params, prompt_token_ids=list(prompt_token_ids))
        return EngineSequence(
            seq_id,
            self.storage.new_sequence(cache_prefix),
            state,
            want_logprobs=want_logprobs,
            top_logprobs=top_logprobs,
        )

    def release(self, seq: EngineSequence) -> None:
        self.storage.release(seq.kv)
        seq.next_input = None
        seq.num_cached = 0

    def adopt_prefix(self, seq: EngineSequence, token_ids: Sequence[int]) -> int:
        """Adopt cached prompt-prefix blocks (paged storage; 0 for dense) into a fresh
        sequence; prefill then starts at the returned position (seq.num_cached)."""
        adopt = getattr(self.storage, "adopt_prefix", None)
        if adopt is None or seq.num_cached:
            return 0
        seq.num_cached = adopt(seq.kv, token_ids)
        return seq.num_cached

    # -- paged KV bookkeeping (no-ops for dense storage) --------------------------------
    @property
    def paged(self) -> bool:
        return hasattr(self.storage, "manager")

    def commit_tokens(self, seq: EngineSequence, token_ids: Sequence[int]) -> None:
        """Offer the sequence's computed full blocks to the prefix cache."""
        if self.paged:
            self.storage.commit_tokens(seq.kv, token_ids[: seq.num_cached])

    def blocks_needed(self, seq: EngineSequence, num_new_tokens: int) -> int:
        """New blocks `num_new_tokens` more positions would take (0 for dense storage)."""
        if not self.paged:
            return 0
        reserved = seq.kv.blocks.num_tokens
        missing = seq.num_cached + num_new_tokens - reserved
        return seq.kv.blocks.blocks_needed(missing) if missing > 0 else 0

    def reserve(self, seq: EngineSequence, num_new_tokens: int) -> bool:
        """Reserve KV slots for `num_new_tokens` positions past the cached ones, all or nothing.
        Always True for dense storage (it grows without a budget)."""
        if not self.paged:
            return True
        return self.storage.ensure_reserved(seq.kv, seq.num_cached + num_new_tokens)

    def free_blocks(self) -> int | None:
        """Blocks that can be handed out now (cached-but-free ones included); None = dense."""
        return self.storage.manager.pool.num_free_blocks if self.paged else None

    def capacity_tokens(self) -> int | None:
        """The most tokens one sequence could ever hold (the whole pool); None = dense."""
        return self.storage.num_blocks * self.storage.block_size if self.paged else None

    def _reserve_blocks(self, rows: list[StepRow], lengths: list[int]) -> None:
        """Paged storage: every row's new positions need slots before the forward. Idempotent,
        so blocks a scheduler reserved ahead are not reserved twice."""
        for r, n in zip(rows, lengths):
            if not self.reserve(r.seq, n):
                raise OutOfBlocksError(f"no free KV block for {r.seq.seq_id}")

    # -- forwards --------------------------------------------------------------------
    def submit(self, rows: list[StepRow], dispatch: bool = True) -> PendingStep:
        """Build one forward for `rows` and (unless dispatch=False) queue it on the device,
        returning without waiting. A step built with dispatch=False is queued by `dispatch`:
        the scheduler builds step N+1 while step N runs and dispatches it once N's tokens are
        read, so the KV pool is not still referenced by N when N+1's in-place writes run."""
        if not self.batched and len(rows) > 1:
            raise ValueError("this engine runs one row per forward (per-row path)")
        for r in rows:
            r.inputs = self._row_input(r)
        lengths = [len(r.inputs) if isinstance(r.inputs, list) else 1 for r in rows]
        self._reserve_blocks(rows, lengths)
        starts = [r.seq.num_cached for r in rows]
        layout = StepLayout([r.seq.kv for r in rows], starts, lengths)
        if self.shape_buckets and max(lengths) > 1:
            layout.pad_width = shape_bucket(max(lengths))
            layout.pad_span = shape_bucket(max(layout.total_lengths))
        tokens = self._input_tokens(rows, layout.width)  # [B, N]
        direct = self.direct_decode and layout.width == 1
        sampled = [i for i, r in enumerate(rows) if r.sample]
        last_logits: mx.array | None = None
        if direct and self.decode_graph is not None and len(sampled) == len(rows):
            last_logits = self.decode_graph.logits(tokens, layout)  # [B, V]
        else:
            views = make_views(self.storage, layout, self.num_layers, direct)
            hidden = self._head.hidden(tokens, views)  # [B, N, H]
        for r, n in zip(rows, lengths):
            r.seq.num_cached += n

        if last_logits is None:
            if not sampled:
                # Evaluating the last hidden state forces every layer's K/V write.
                pending = PendingStep(rows, [], None, None, None, hidden)
                return self.dispatch(pending) if dispatch else pending
            if layout.width == 1:
                last_hidden = (
                    hidden[mx.array(sampled), 0] if len(sampled) < len(rows) else hidden[:, 0]
                )
            else:
                last = mx.array([lengths[i] - 1 for i in sampled])
                last_hidden = hidden[mx.array(sampled), last]  # [S, H]
            last_logits = self._head.logits(last_hidden)  # [S, V]
        states = [rows[i].seq.sampler for i in sampled]
        drawn, processed = sample(last_logits, states)
        logprobs = top = None
        if any(rows[i].seq.want_logprobs for i in sampled):
            all_lp = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
            logprobs = mx.take_along_axis(all_lp, drawn[:, None], axis=-1)[:, 0]
            k = max(rows[i].seq.top_logprobs for i in sampled)
            if k > 0:
                top_ids = mx.argsort(-all_lp, axis=-1)[:, :k]
                top = (top_ids, mx.take_along_axis(all_lp, top_ids, axis=-1))
        for j, i in enumerate(sampled):
            rows[i].seq.next_input = (drawn, j)
        pending = PendingStep(rows, sampled, drawn, logprobs, top, None)
        return self.dispatch(pending) if dispatch else pending

    @staticmethod
    def dispatch(pending: PendingStep) -> PendingStep:
        if pending.tokens is None:
            mx.async_eval(pending.hidden)
        else:
            extra = [x for x in (pending.logprobs, *(pending.top or ())) if x is not None]
            mx.async_eval([pending.tokens, *extra])
        return pending

    def finish_rows(self, pending: PendingStep) -> list[RowResult]:
        """Read a submitted step's tokens (the evaluation boundary). One result per sampled row."""
        if pending.tokens is None:
            mx.eval(pending.hidden)
            return []
        try:
            self._check_faults(pending)
            token_ids = pending.tokens.tolist()
        except Exception as exc:
            log.warning("batched evaluation failed; retrying rows one by one", error=str(exc))
            return self._finish_rows_one_by_one(pending)
        results = []
        lps = pending.logprobs.tolist() if pending.logprobs is not None else None
        tops = (pending.top[0].tolist(), pending.top[1].tolist()) if pending.top else None
        for j, i in enumerate(pending.sampled_rows):
            seq = pending.rows[i].seq
            result = RowResult(seq, token_id=int(token_ids[j]))
            if seq.want_logprobs and lps is not None:
                result.logprob = float(lps[j])
                if tops and seq.top_logprobs:
                    k = seq.top_logprobs
                    result.top_logprobs = list(zip(tops[0][j][:k], tops[1][j][:k]))
            seq.sampler.record(result.token_id)
            results.append(result)
        return results

    def prefill(self, rows: list[StepRow]) -> list[RowResult]:
        return self.finish_rows(self.submit(rows))

    def step(self, rows: list[StepRow]) -> list[RowResult]:
        """One forward for any number of rows; a single request is a batch of one."""
        if self.batched or len(rows) <= 1:
            return self.finish_rows(self.submit(rows))
        return [res for row in rows for res in self.finish_rows(self.submit([row]))]

    # -- helpers ---------------------------------------------------------------------
    @staticmethod
    def _input_tokens(rows: list[StepRow], width: int) -> mx.array:
        """The step's [B, width] input ids. A decode step whose rows all feed tokens of one
        earlier step (the steady state) takes them with one op instead of B slices + a stack."""
        refs = [r.inputs for r in rows]
        if width == 1 and all(isinstance(x, tuple) for x in refs):
            source = refs[0][0]
            if all(x[0] is source for x in refs):
                index = [x[1] for x in refs]
                if index != list(range(source.shape[0])):
                    source = source[mx.array(index)]
                return source.astype(mx.int32)[:, None]
        return mx.stack([Engine._pad_row(x, width) for x in refs])

    @staticmethod
    def _row_input(row: StepRow) -> list[int] | tuple[mx.array, int]:
        if row.tokens is not None:
            if len(row.tokens) == 0:
                raise ValueError("a step row needs at least one token")
            return list(row.tokens)
        if row.seq.next_input is None:
            raise ValueError(f"sequence {row.seq.seq_id} has no sampled token to feed")
        return row.seq.next_input

    @staticmethod
    def _pad_row(x: list[int] | tuple[mx.array, int], width: int) -> mx.array:
        if isinstance(x, list):
            return mx.array(x + [0] * (width - len(x)), dtype=mx.int32)
        source, j = x
        x = source[j : j + 1].astype(mx.int32)
        return x if width == 1 else mx.concatenate([x, mx.zeros(width - 1, dtype=mx.int32)])

    def _check_faults(self, pending: PendingStep) -> None:
        if self._fault_injector is None:
            return
        for i in pending.sampled_rows:
            if self._fault_injector(pending.rows[i].seq):
                raise EngineError(f"injected fault for {pending.rows[i].seq.seq_id}")

    def _finish_rows_one_by_one(self, pending: PendingStep) -> list[RowResult]:
        """Redo the failed step per row, so a failure ends only the rows that really fail."""
        results = []
        for i in pending.sampled_rows:
            row = pending.rows[i]
            seq = row.seq
            n = len(row.tokens) if row.tokens is not None else 1
            seq.num_cached -= n  # undo the failed step's advance, then redo it alone
            try:
                if self._fault_injector is not None and self._fault_injector(seq):
                    raise EngineError(f"injected fault for {seq.seq_id}")
                seq.next_input = row.inputs if not isinstance(row.inputs, list) else None
                tokens = row.inputs if isinstance(row.inputs, list) else None
                results.extend(self.finish_rows(self.submit([StepRow(seq, tokens, True)])))
            except Exception as exc:
                log.warning("row evaluation failed", request_id=seq.seq_id, error=str(exc))
                results.append(RowResult(seq, error="inference backend error"))
        return results


class ModelHead:
    """Splits a model into its trunk and its LM head, so only the rows' last positions are
    projected to the vocabulary (a 2048-token prefill would otherwise spend most of its time
    in the head). Architectures we do not know run whole and we slice the logits."""

    _SPLITTABLE = ("llama", "qwen2", "qwen3", "mistral")

    def __init__(self, model: Any) -> None:
        self._model = model
        module = type(model).__module__.rsplit(".", 1)[-1]
        self.split = module in self._SPLITTABLE and hasattr(model, "model")

    def hidden(self, tokens: mx.array, views: list) -> mx.array:
        if self.split:
            return self._model.model(tokens, cache=views)
        return self._model(tokens, cache=views)

    def logits(self, hidden: mx.array) -> mx.array:
        if not self.split:
            return hidden  # already logits
        model = self._model
        if getattr(model.args, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
            return model.model.embed_tokens.as_linear(hidden)
        return model.lm_head(hidden)
