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
from typing import Any, Protocol

import mlx.core as mx
import structlog

from service.core.engine import paged_attention
from service.core.engine.batch_view import StepLayout
from service.core.engine.compiled_decode import DecodeGraph
from service.core.engine.config import EngineConfig
from service.core.engine.kv_paged import SlotsNotReservedError
from service.core.engine.sampler import RowSamplerState, SamplingParams, sample, verify_draft
from service.core.engine.state_store import SequenceState, StateStore, StateUndo
from service.core.engine.storage import KVStorage
from service.core.kv.block_pool import BlockUpdate
from service.core.models import rope
from service.core.models.layout import CacheLayout

log = structlog.get_logger(__name__)


BACKEND_ERROR = "inference backend error"  # what a failed request's caller is told


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
    state: SequenceState | None = None  # recurrent state (stateful models)


@dataclass
class StepRow:
    """One row of a forward: new tokens to feed (None = the last sampled token). `block_ids`:
    paged storage, the row's block table, covering every position up to this step's last
    (the scheduler's KVCacheManager reserved them)."""

    seq: EngineSequence
    tokens: Sequence[int] | None = None
    sample: bool = True
    block_ids: Sequence[int] = ()
    inputs: list[int] | tuple[mx.array, int] | None = None  # resolved at submit; for a replay


@dataclass
class RowResult:
    seq: EngineSequence
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    error: str | None = None


@dataclass
class DraftRow:
    """A row of a verification forward: its last sampled token and the tokens drafted after
    it (none: a plain decode step)."""

    seq: EngineSequence
    last_token: int
    draft: list[int] = field(default_factory=list)
    block_ids: Sequence[int] = ()  # as StepRow's, covering the last token and the draft


@dataclass
class Verified:
    """What a verification forward gave one row: its emitted tokens, in order."""

    seq: EngineSequence
    results: list[RowResult]
    drafted: int
    accepted: int


@dataclass
class PendingStep:
    rows: list[StepRow]
    sampled_rows: list[int]  # indices into rows of the rows that sampled
    tokens: mx.array | None
    logprobs: mx.array | None  # [S] chosen-token logprobs, when any row asked
    top: tuple[mx.array, mx.array] | None  # ([S, K] ids, [S, K] logprobs)
    hidden: mx.array | None  # set when no row sampled: what must be evaluated
    state_undo: StateUndo | None = None  # puts the rows' recurrent states back on a retry
    results: list[RowResult] | None = None  # already read (rows that were run one by one)


# Test hook: (sequence, "build" | "evaluate") -> whether that stage fails for it.
FaultInjector = Callable[[EngineSequence, str], bool]


class ForwardEngine(Protocol):
    """What the scheduler calls on an engine (`Engine`, or service.core.tensor_parallel's
    `ReplicatedEngine` under tensor parallel): forwards, and the per-sequence state they run
    on. KV block bookkeeping is not here: the scheduler's KVManager does it and hands each
    forward its rows' block tables and a BlockUpdate."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def batched(self) -> bool: ...

    def add_sequence(
        self,
        seq_id: str,
        params: SamplingParams,
        prompt_token_ids: Sequence[int],
        *,
        want_logprobs: bool = False,
        top_logprobs: int = 0,
        sampler: RowSamplerState | None = None,
        num_cached: int = 0,
    ) -> EngineSequence: ...
    def release(self, seq: EngineSequence, final: bool = True) -> None: ...
    def submit(
        self, rows: list[StepRow], dispatch: bool = True, update: BlockUpdate | None = None
    ) -> PendingStep: ...
    def dispatch(self, pending: PendingStep) -> PendingStep: ...
    def finish_rows(self, pending: PendingStep) -> list[RowResult]: ...
    def verify(self, rows: list[DraftRow], update: BlockUpdate | None = None) -> list[Verified]: ...
    def prefill(
        self, rows: list[StepRow], update: BlockUpdate | None = None
    ) -> list[RowResult]: ...


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
        cache: CacheLayout,
        config: EngineConfig | None = None,
        *,
        split_head: bool = False,
        fault_injector: FaultInjector | None = None,
        contain_failures: bool = True,
    ) -> None:
        """`cache`: what the model keeps per sequence (service.core.models.layout); `config`: how
        its forwards run (service.core.engine.config, resolved before the engine is built)."""
        self.model = model
        self.storage = storage
        self.cache = cache
        self.config = config = config or EngineConfig()
        self.states = StateStore(cache.states) if cache.stateful else None
        if storage.name != config.storage:
            raise ValueError(f"the config runs {config.storage} storage, not {storage.name}")
        if config.decode_attention == "direct" and not paged_attention.install(model):
            raise ValueError("direct decode attention needs the model's attention function")
        self._fault_injector = fault_injector
        # Redo a failed step row by row, so only the failing rows end. Off under tensor
        # parallel, where the other ranks could not follow the redo (service.core.tensor_parallel).
        self._contain = contain_failures
        self._head = ModelHead(model, split_head)
        self.decode_graph = (
            DecodeGraph(self._head, storage, cache) if config.compile_decode else None
        )

    @property
    def batched(self) -> bool:
        return self.config.batched

    @property
    def decode_path(self) -> str:
        return self.config.decode_path

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
        num_cached: int = 0,
    ) -> EngineSequence:
        """A sequence for the forwards. `num_cached`: its first positions are stored already
        (a prompt prefix the scheduler adopted from the prefix cache): prefill starts there."""
        state = sampler or RowSamplerState(params, prompt_token_ids=list(prompt_token_ids))
        if num_cached and self.states is not None:
            raise ValueError("a recurrent state cannot be adopted from a cached prefix")
        return EngineSequence(
            seq_id,
            self.storage.new_sequence(),
            state,
            num_cached=num_cached,
            want_logprobs=want_logprobs,
            top_logprobs=top_logprobs,
            state=self.states.new_sequence() if self.states is not None else None,
        )

    def release(self, seq: EngineSequence, final: bool = True) -> None:
        """Free the sequence's storage handle and state (its KV blocks are the scheduler's).
        `final`: it will not be re-added (False when it is preempted: it comes back with its
        sampler state)."""
        self.storage.release(seq.kv)
        if seq.state is not None and self.states is not None:
            self.states.release(seq.state)
        seq.next_input = None
        seq.num_cached = 0

    # -- forwards --------------------------------------------------------------------
    def submit(
        self, rows: list[StepRow], dispatch: bool = True, update: BlockUpdate | None = None
    ) -> PendingStep:
        """Build one forward for `rows` and (unless dispatch=False) queue it on the device,
        returning without waiting. `update`: what the KV manager changed since the last
        forward (applied to the storage first). A step built with dispatch=False is queued by
        `dispatch`: the scheduler builds step N+1 while step N runs and dispatches it once N's
        tokens are read, so the KV pool is not still referenced by N when N+1's in-place writes
        run.

        If building the batched forward raises, each row is run alone, so the error ends only
        the rows it comes from (their results carry it)."""
        if not self.batched and len(rows) > 1:
            raise ValueError("this engine runs one row per forward (per-row path)")
        if update is not None:
            self.storage.apply(update)
        for r in rows:
            r.inputs = self._row_input(r)
        lengths = [len(r.inputs) if isinstance(r.inputs, list) else 1 for r in rows]
        if self.config.single_row_prefill and len(rows) > 1 and max(lengths) > 1:
            raise ValueError("a recurrent model's multi-token forward carries one row")
        try:
            return self._submit(rows, lengths, dispatch)
        except SlotsNotReservedError:
            raise  # the scheduler's bug, not the rows': nothing to contain
        except Exception as exc:
            if not self._contain:
                raise
            if len(rows) == 1:
                log.warning(
                    "building a forward failed", request_id=rows[0].seq.seq_id, error=str(exc)
                )
                return PendingStep(
                    rows,
                    [],
                    None,
                    None,
                    None,
                    None,
                    results=[RowResult(rows[0].seq, error=BACKEND_ERROR)],
                )
            log.warning(
                "building a batched forward failed; running its rows one by one", error=str(exc)
            )
            return self._run_rows_alone(rows)

    def _submit(self, rows: list[StepRow], lengths: list[int], dispatch: bool) -> PendingStep:
        starts = [r.seq.num_cached for r in rows]
        layout = StepLayout([r.seq.kv for r in rows], starts, lengths, [r.block_ids for r in rows])
        if self.config.shape_buckets and max(lengths) > 1:
            layout.pad_width = shape_bucket(max(lengths))
            layout.pad_span = shape_bucket(max(layout.total_lengths))
        tokens = self._input_tokens(rows, layout.width)  # [B, N]
        decode = layout.width == 1
        sampled = [i for i, r in enumerate(rows) if r.sample]
        states = self.states.begin([r.seq.state for r in rows]) if self.states is not None else None
        last_logits: mx.array | None = None
        if decode and self.decode_graph is not None and len(sampled) == len(rows):
            last_logits = self.decode_graph.logits(tokens, layout)  # [B, V]
        else:
            views = self.storage.views(layout, self.cache, states, self.config.grouped_query_mask)
            self._check_faults(rows, "build")
            row_lengths = rope.ROW_LENGTHS.set(lengths)
            try:
                hidden = self._head.hidden(tokens, views)  # [B, N, H] (logits if not split)
            finally:
                rope.ROW_LENGTHS.reset(row_lengths)
        if states is not None:
            states.commit()
        for r, n in zip(rows, lengths):
            r.seq.num_cached += n
        undo = states.undo if states is not None else None

        if last_logits is None:
            if not sampled:
                # Evaluating the last hidden state forces every layer's K/V write.
                pending = PendingStep(rows, [], None, None, None, hidden, state_undo=undo)
                return self.dispatch(pending) if dispatch else pending
            if decode:
                last_hidden = (
                    hidden[mx.array(sampled), 0] if len(sampled) < len(rows) else hidden[:, 0]
                )
            else:
                last = mx.array([lengths[i] - 1 for i in sampled])
                last_hidden = hidden[mx.array(sampled), last]  # [S, H]
            last_logits = self._head.logits(last_hidden)  # [S, V]
        states_of_rows = [rows[i].seq.sampler for i in sampled]
        drawn, processed = sample(last_logits, states_of_rows)
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
        pending = PendingStep(rows, sampled, drawn, logprobs, top, None, state_undo=undo)
        return self.dispatch(pending) if dispatch else pending

    def _run_rows_alone(self, rows: list[StepRow]) -> PendingStep:
        """Run each row as its own forward and read it now (after a batched forward failed)."""
        results: list[RowResult] = []
        for row in rows:
            tokens = row.inputs if isinstance(row.inputs, list) else None
            single = StepRow(row.seq, tokens, row.sample, row.block_ids)
            if single.tokens is None:
                row.seq.next_input = row.inputs  # type: ignore[assignment]
            results.extend(self.finish_rows(self.submit([single])))
        for res in results:
            if res.token_id is not None:
                res.seq.next_input = (mx.array([res.token_id], dtype=mx.int32), 0)
        return PendingStep(rows, [], None, None, None, None, results=results)

    def verify(self, rows: list[DraftRow], update: BlockUpdate | None = None) -> list[Verified]:
        """Speculative decoding: one forward over each row's last token and drafted tokens
        (rows with no draft take a plain decode step in the same forward); each row keeps the
        drafts the model agrees with plus one token of its own (sampler.verify_draft); the
        rejected positions' K/V is left behind (each row's num_cached stops before it: the
        scheduler gives their slots back). Read at once: the next step depends on how much was
        accepted. Not for recurrent models (a state cannot be rolled back) nor native caches."""
        if self.states is not None or self.config.native_caches:
            raise ValueError("speculative decoding needs attention caches that can roll back")
        if update is not None:
            self.storage.apply(update)
        lengths = [1 + len(r.draft) for r in rows]
        step_rows = [StepRow(r.seq, [r.last_token, *r.draft]) for r in rows]
        for row in step_rows:
            row.inputs = list(row.tokens or ())
        starts = [r.seq.num_cached for r in rows]
        layout = StepLayout([r.seq.kv for r in rows], starts, lengths, [r.block_ids for r in rows])
        tokens = self._input_tokens(step_rows, layout.width)
        views = self.storage.views(
            layout, self.cache, None, self.config.grouped_query_mask, gather=True
        )
        hidden = self._head.hidden(tokens, views)  # [B, N, H]
        row_idx = mx.array([i for i, n in enumerate(lengths) for _ in range(n)])
        col_idx = mx.array([j for n in lengths for j in range(n)])
        logits = self._head.logits(hidden[row_idx, col_idx])  # [sum(lengths), V]
        mx.eval(logits)
        out: list[Verified] = []
        offset = 0
        for r, start, n in zip(rows, starts, lengths):
            seq = r.seq
            emitted, processed = verify_draft(logits[offset : offset + n], r.draft, seq.sampler)
            offset += n
            accepted = len(emitted) - 1
            # Valid K/V: the last token and the accepted drafts; the last emitted token is the
            # next step's input.
            seq.num_cached = start + accepted + 1
            seq.next_input = (mx.array([emitted[-1]], dtype=mx.int32), 0)
            results = []
            lp = None
            if seq.want_logprobs:
                lp = processed[: len(emitted)] - mx.logsumexp(
                    processed[: len(emitted)], axis=-1, keepdims=True
                )
            for j, token in enumerate(emitted):
                result = RowResult(seq, token_id=token)
                if lp is not None:
                    result.logprob = lp[j, token].item()
                    if seq.top_logprobs:
                        top = mx.argsort(-lp[j])[: seq.top_logprobs].tolist()
                        result.top_logprobs = [(t, lp[j, t].item()) for t in top]
                seq.sampler.record(token)
                results.append(result)
            out.append(Verified(seq, results, drafted=len(r.draft), accepted=accepted))
        return out

    @staticmethod
    def dispatch(pending: PendingStep) -> PendingStep:
        if pending.results is not None:
            return pending
        if pending.tokens is None:
            mx.async_eval(pending.hidden)
        else:
            extra = [x for x in (pending.logprobs, *(pending.top or ())) if x is not None]
            mx.async_eval([pending.tokens, *extra])
        return pending

    def finish_rows(self, pending: PendingStep) -> list[RowResult]:
        """Read a submitted step's tokens (the evaluation boundary). One result per sampled row,
        and one per row that failed."""
        if pending.results is not None:
            return pending.results
        try:
            if pending.tokens is None:
                mx.eval(pending.hidden)
                return []
            self._check_faults([pending.rows[i] for i in pending.sampled_rows], "evaluate")
            token_ids = pending.tokens.tolist()
        except Exception as exc:
            if not self._contain:
                raise
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

    def prefill(self, rows: list[StepRow], update: BlockUpdate | None = None) -> list[RowResult]:
        return self.finish_rows(self.submit(rows, update=update))

    def step(self, rows: list[StepRow], update: BlockUpdate | None = None) -> list[RowResult]:
        """One forward for any number of rows; a single request is a batch of one."""
        if self.batched or len(rows) <= 1:
            return self.finish_rows(self.submit(rows, update=update))
        if update is not None:
            self.storage.apply(update)
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

    def _check_faults(self, rows: list[StepRow], stage: str) -> None:
        if self._fault_injector is None:
            return
        for row in rows:
            if self._fault_injector(row.seq, stage):
                raise EngineError(f"injected {stage} fault for {row.seq.seq_id}")

    def _finish_rows_one_by_one(self, pending: PendingStep) -> list[RowResult]:
        """Redo the failed step per row, so a failure ends only the rows that really fail.
        The step's K/V writes are redone by the retries; its recurrent states are put back."""
        if self.config.native_caches:
            # mlx-lm's caches appended the step already: a redo would append it twice.
            return [RowResult(row.seq, error=BACKEND_ERROR) for row in pending.rows]
        if pending.state_undo is not None and self.states is not None:
            self.states.undo(pending.state_undo)
        results = []
        for row in pending.rows:
            seq = row.seq
            n = len(row.inputs) if isinstance(row.inputs, list) else 1
            seq.num_cached -= n  # undo the failed step's advance, then redo it alone
            try:
                if self._fault_injector is not None and self._fault_injector(seq, "evaluate"):
                    raise EngineError(f"injected evaluate fault for {seq.seq_id}")
                seq.next_input = row.inputs if not isinstance(row.inputs, list) else None
                tokens = row.inputs if isinstance(row.inputs, list) else None
                single = StepRow(seq, tokens, row.sample, row.block_ids)
                results.extend(self.finish_rows(self.submit([single])))
            except Exception as exc:
                log.warning("row evaluation failed", request_id=seq.seq_id, error=str(exc))
                results.append(RowResult(seq, error=BACKEND_ERROR))
        return results


class ModelHead:
    """Splits a model into its trunk and its LM head, so only the rows' last positions are
    projected to the vocabulary (a 2048-token prefill would otherwise spend most of its time
    in the head). Families whose head is not a plain projection (service.core.models.families)
    run whole and we slice the logits."""

    def __init__(self, model: Any, split: bool) -> None:
        self._model = model
        self.split = split

    def hidden(self, tokens: mx.array, views: list) -> mx.array:
        if self.split:
            return self._model.model(tokens, cache=views)
        return self._model(tokens, cache=views)

    def logits(self, hidden: mx.array) -> mx.array:
        if not self.split:
            return hidden  # already logits
        model = self._model
        if "lm_head" in model:  # tied models have none (mlx-lm creates or drops it)
            return model.lm_head(hidden)
        return model.model.embed_tokens.as_linear(hidden)
