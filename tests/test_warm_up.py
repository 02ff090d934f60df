"""service.core.warm_up: the prefill pass shapes built before serving, run on throwaway rows
that leave nothing behind."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from service.core import warm_up
from service.core.engine.runner import GATHERED_SPAN_CAP, MIN_PADDED_SPAN, gathered_spans
from tests.helpers.runtime import loaded_runtime


def test_pass_shapes_are_powers_of_two_of_rows_within_the_token_cap():
    shapes = warm_up.pass_shapes(max_rows=8, max_tokens=1024)
    assert {rows for rows, _ in shapes} == {2, 4, 8}
    assert all(rows * width <= 1024 for rows, width in shapes)
    assert (2, 512) in shapes and (4, 256) in shapes and (8, 128) in shapes
    assert (4, 512) not in shapes
    assert warm_up.pass_shapes(max_rows=1, max_tokens=1024) == []


def test_gathered_spans_run_from_the_floor_to_the_cap():
    assert gathered_spans(16) == [64, 128, 256]
    assert gathered_spans(32) == [64, 128, 256]
    assert gathered_spans(128) == [256]
    # Wider than the cap: only the narrowest span such a chunk can have.
    assert gathered_spans(256) == [512]


@pytest.mark.model  # the dummy preset takes the embedded model's tokenizer
def test_warm_prefill_passes_run_each_shape_and_leave_the_pool_as_it_was():
    with loaded_runtime(max_batch_size=4) as runtime:
        runner, kv = runtime.runner, runtime.kv
        free = kv.num_free_blocks
        seen = []
        submit = runner.submit

        def recording(plan, *args, **kwargs):
            seen.extend((len(p), len(p[0].tokens)) for p in plan.prefill)
            return submit(plan, *args, **kwargs)

        runner.submit = recording
        storage = runner.storage
        gathered = []
        gather = storage.write_and_gather
        storage.write_and_gather = lambda *a: (
            gathered.append((a[1].batch_size, a[1].width, int(a[1].starts.min()), a[1].span))
            or gather(*a)
        )
        shapes = warm_up.pass_shapes(max_rows=4, max_tokens=128)
        assert warm_up.warm_prefill_passes(runner, kv, shapes) == len(shapes)
        # Each shape with nothing cached, then after a cached prefix at each span it can pad
        # to, the floor's up to the cap (the rows gather).
        spans = {width: gathered_spans(width) for _, width in shapes}
        assert spans[16] == [MIN_PADDED_SPAN, 2 * MIN_PADDED_SPAN, GATHERED_SPAN_CAP]
        assert spans[64] == [128, GATHERED_SPAN_CAP]
        assert seen == [shape for shape in shapes for _ in range(1 + len(spans[shape[1]]))]
        passes = sorted(set(gathered))
        assert passes == sorted(
            (rows, width, span - width, span) for rows, width in shapes for span in spans[width]
        )
        assert len(gathered) == len(passes) * storage.num_layers
        storage.write_and_gather = gather
        assert kv.num_free_blocks == free
        assert all(row is None for row in runner.rows)
        # A spent budget builds nothing more (the rest is built on first use).
        assert warm_up.warm_prefill_passes(runner, kv, shapes, budget_s=-1.0) == 0
        assert kv.num_free_blocks == free
        # One row at each first width bucket, each followed by its decode step; with progress
        # due at every step, a line for each.
        seen.clear()
        with capture_logs() as logs, pytest.MonkeyPatch.context() as patch:
            patch.setattr(warm_up, "PROGRESS_EVERY_S", 0.0)
            warm_up.warm_single_row(runner, kv, batch_size=4, decode_graph=False)
        assert seen == [(1, width) for width in warm_up.SINGLE_ROW_WIDTHS]
        lines = [e for e in logs if e["event"] == "building single-row passes and decode steps"]
        assert [(e["done"], e["of"], e["width"]) for e in lines] == [
            (i + 1, len(warm_up.SINGLE_ROW_WIDTHS), w)
            for i, w in enumerate(warm_up.SINGLE_ROW_WIDTHS)
        ]
        assert kv.num_free_blocks == free
        assert all(row is None for row in runner.rows)


def test_progress_is_quiet_when_quick_and_says_how_far_when_slow(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [100.0]
    monkeypatch.setattr(warm_up.time, "monotonic", lambda: clock[0])
    with capture_logs() as logs:
        quick = warm_up._Progress("quick stage", 3)
        for done in (1, 2, 3):
            clock[0] += 0.1
            quick.step(done)
    assert logs == []
    with capture_logs() as logs:
        slow = warm_up._Progress("slow stage", 4)
        for done in (1, 2, 3, 4):
            clock[0] += 3.0  # a line once 5 s have passed since the last, and the last step
            slow.step(done, rows=done)
    assert [(e["event"], e["done"], e["of"], e["seconds"], e["rows"]) for e in logs] == [
        ("slow stage", 2, 4, 6.0, 2),
        ("slow stage", 4, 4, 12.0, 4),
    ]
