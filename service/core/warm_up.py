"""Forwards run on throwaway rows before the server says SERVING, so that no request waits for
what MLX builds on a shape's first use: attention plans, the decode kernels, the compiled
decode graphs and, on a GPU, the CUDA graphs and matmul plans of every prefill pass shape the
scheduler can plan (a cold shape costs several times a warm pass). Each pass shape is built
once as a burst runs it, rows with nothing cached (paged storage attends over their own K/V),
then as a chunk after a cached prefix runs it at each span it can pad to (the K/V gathered under
a mask: another attention graph on the same matmul shapes per span)."""

from __future__ import annotations

import time
from typing import Any

import structlog

from service.core.engine.compiled_decode import row_buckets
from service.core.engine.runner import gathered_spans
from service.core.kv.block_pool import KVManager
from service.core.scheduler.plan import Chunk, RowJoin, RowLeave, StepPlan
from service.protocol import SamplingParams

log = structlog.get_logger(__name__)

SINGLE_ROW_WIDTHS = (16, 32, 64, 128)
# Widths of the multi-row passes built ahead: runner.shape_bucket's buckets that a burst of
# chat-sized prompts fills. Longer chunks build their shapes on first use.
PASS_WIDTHS = (16, 32, 64, 128, 256, 512)
STEP = -1  # the plans' step number: no scheduler step
# The most seconds start-up spends on multi-row pass shapes: a model whose kernels MLX compiles
# per shape (quantized matmuls on CUDA) could otherwise take many minutes; the shapes left are
# built on first use.
PASS_BUDGET_S = 90.0
PROGRESS_EVERY_S = 5.0  # a warm-up stage that runs longer says how far it is this often


class _Progress:
    """A stage's progress in the log, at most every PROGRESS_EVERY_S: quiet when start-up is
    quick, a line every few seconds when MLX compiles kernels per shape (quantized matmuls on
    CUDA)."""

    def __init__(self, stage: str, total: int) -> None:
        self.stage, self.total = stage, total
        self.started = self.last = time.monotonic()

    def step(self, done: int, **fields: Any) -> None:
        now = time.monotonic()
        if now - self.last >= PROGRESS_EVERY_S or (done == self.total and self.last > self.started):
            self.last = now
            log.info(
                self.stage,
                done=done,
                of=self.total,
                seconds=round(now - self.started, 1),
                **fields,
            )


def warm_single_row(runner: Any, kv: KVManager, batch_size: int, decode_graph: bool) -> None:
    """One row's prefill at each of the first width buckets and its decode step; with
    `decode_graph`, every batch bucket's compiled decode step too."""
    buckets = row_buckets(batch_size) if decode_graph else []
    progress = _Progress(
        "building single-row passes and decode steps", len(SINGLE_ROW_WIDTHS) + len(buckets)
    )
    done = 0
    for width in SINGLE_ROW_WIDTHS:
        # Room for the prefill, its decode step and one decode step per row bucket.
        seqs = _prefill_rows(runner, kv, 1, width, width + 2 + len(row_buckets(batch_size)))
        if seqs is None:
            return  # a pool too small to warm up in: the first requests pay instead
        runner.collect(runner.submit(StepPlan(STEP, decode=[0])))
        done += 1
        progress.step(done, width=width)
        if width == SINGLE_ROW_WIDTHS[0] and buckets:
            # Every batch bucket's compiled decode step (and its CUDA graphs) now, not on the
            # first burst that reaches it.
            for rows in buckets:
                runner.min_rows = rows
                runner.collect(runner.submit(StepPlan(STEP, decode=[0])))
                done += 1
                progress.step(done, rows=rows)
            runner.min_rows = 0
        _leave(runner, kv, seqs)


def pass_shapes(max_rows: int, max_tokens: int) -> list[tuple[int, int]]:
    """(rows, width) of the multi-row prefill passes to build: a power of two of rows (the
    runner pads a pass up to one), each width of PASS_WIDTHS within the pass's token cap."""
    shapes = []
    rows = 2
    while rows <= max_rows:
        shapes.extend((rows, w) for w in PASS_WIDTHS if rows * w <= max_tokens)
        rows *= 2
    return shapes


def warm_prefill_passes(
    runner: Any, kv: KVManager, shapes: list[tuple[int, int]], budget_s: float = PASS_BUDGET_S
) -> int:
    """Run prefill passes of each shape on throwaway rows (every row sampling, as a burst of
    whole prompts does), in order, until `budget_s` has passed: one with nothing cached, then
    one after a cached prefix at each span of runner.gathered_spans (the rows join with that
    prefix counted as stored: what it holds does not matter to a shape). Returns how many
    shapes ran (a pool too small for the next stops there; a span it lacks room for is left to
    first use)."""
    done = 0
    progress = _Progress("building prefill pass shapes", len(shapes))
    for rows, width in shapes:
        if time.monotonic() - progress.started > budget_s:
            log.warning(
                "prefill pass shapes left to build on first use: the start-up budget is spent",
                built=done,
                left=len(shapes) - done,
                budget_s=budget_s,
            )
            return done
        seqs = _prefill_rows(runner, kv, rows, width, width)
        if seqs is None:
            return done
        _leave(runner, kv, seqs)
        for span in gathered_spans(width):
            seqs = _prefill_rows(runner, kv, rows, width, span, cached=span - width)
            if seqs is None:
                break
            _leave(runner, kv, seqs)
        done += 1
        progress.step(done, rows=rows, width=width)
    return done


def _prefill_rows(
    runner: Any, kv: KVManager, rows: int, width: int, reserve: int, cached: int = 0
) -> list[Any] | None:
    """Join `rows` throwaway rows in slots 0.. with `reserve` positions each, `cached` of them
    counted as stored, and run one prefill pass of `width` tokens on every one (each sampling,
    as a whole prompt does); their blocks, or None (nothing held) when the pool lacks the
    room."""
    seqs = []
    for _ in range(rows):
        seqs.append(kv.new_sequence(cache_prefix=False))
        if not kv.ensure_slots(seqs[-1], reserve):
            for blocks in seqs:
                kv.free_sequence(blocks)
            kv.take_update()
            return None
    update = kv.take_update()
    prompt = [0] * (cached + width)
    plan = StepPlan(
        STEP,
        joins=[RowJoin(s, f"warm-up-{s}", SamplingParams(), prompt, cached) for s in range(rows)],
        tables=[(s, list(blocks.block_ids)) for s, blocks in enumerate(seqs)],
        capacity=update.capacity,
        copies=list(update.copies),
        prefill=[[Chunk(s, [0] * width, True) for s in range(rows)]],
    )
    runner.collect(runner.submit(plan))
    return seqs


def _leave(runner: Any, kv: KVManager, seqs: list[Any]) -> None:
    """The throwaway rows leave the runner and give their blocks back."""
    runner.collect(
        runner.submit(StepPlan(STEP, leaves=[RowLeave(s, True) for s in range(len(seqs))]))
    )
    for blocks in seqs:
        kv.free_sequence(blocks)
