"""PrefillPlan: which tokens a prefill still has to compute, cut into chunks aligned to multiples
of the chunk size counted from position 0 (so an adopted prefix that ends on a boundary leaves
exactly the chunks a cold run would run after it; docs/scheduler.md)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.core.scheduler.prefill_plan import PrefillPlan


def test_cold_plan_cuts_from_position_zero() -> None:
    assert PrefillPlan(1000).chunks(256) == [(0, 256), (256, 512), (512, 768), (768, 1000)]


def test_total_an_exact_multiple_has_no_empty_last_chunk() -> None:
    assert PrefillPlan(1024).chunks(256) == [(0, 256), (256, 512), (512, 768), (768, 1024)]
    assert PrefillPlan(512).chunks(512) == [(0, 512)]


def test_prompt_shorter_than_a_chunk_is_one_chunk() -> None:
    assert PrefillPlan(7).chunks(2048) == [(0, 7)]
    assert PrefillPlan(1).chunks(1) == [(0, 1)]


@pytest.mark.parametrize("chunk", [None, 0])
def test_no_chunk_size_means_the_whole_rest(chunk: int | None) -> None:
    assert PrefillPlan(5000).chunks(chunk) == [(0, 5000)]
    assert PrefillPlan(5000, cached_tokens=300).chunks(chunk) == [(300, 5000)]
    assert PrefillPlan(5000).next_chunk(1234, chunk) == (1234, 5000)


def test_cached_prefix_on_a_boundary_leaves_the_cold_chunks_after_it() -> None:
    cold = PrefillPlan(1000).chunks(256)
    warm = PrefillPlan(1000, cached_tokens=512).chunks(256)
    assert warm == [(512, 768), (768, 1000)]
    assert warm == [c for c in cold if c[0] >= 512]


def test_cached_prefix_off_a_boundary_runs_up_to_the_next_boundary_first() -> None:
    # Boundaries stay at multiples of 256 from position 0, not from the end of the prefix.
    assert PrefillPlan(1000, cached_tokens=300).chunks(256) == [
        (300, 512),
        (512, 768),
        (768, 1000),
    ]
    assert PrefillPlan(1000, cached_tokens=16).chunks(512) == [(16, 512), (512, 1000)]


def test_cached_prefix_covering_everything_plans_nothing() -> None:
    plan = PrefillPlan(512, cached_tokens=512)
    assert plan.chunks(256) == []


def test_next_chunk_starts_at_the_later_of_computed_and_cached() -> None:
    plan = PrefillPlan(1000, cached_tokens=300)
    assert plan.next_chunk(0, 256) == (300, 512)  # nothing computed yet: after the prefix
    assert plan.next_chunk(512, 256) == (512, 768)
    assert plan.next_chunk(768, 256) == (768, 1000)


def test_chunk_size_may_change_between_chunks_and_stays_aligned() -> None:
    """The adaptive chunk size switches 2048 -> 512 when a decode batch starts: the next
    chunk ends on the next multiple of the new size."""
    plan = PrefillPlan(5000)
    assert plan.next_chunk(0, 2048) == (0, 2048)
    assert plan.next_chunk(2048, 512) == (2048, 2560)
    assert plan.next_chunk(2300, 512) == (2300, 2560)
    assert plan.next_chunk(2560, 2048) == (2560, 4096)


def test_an_empty_plan_has_no_chunks() -> None:
    assert PrefillPlan(0).chunks(16) == []


@given(
    total=st.integers(1, 5000),
    cached_fraction=st.floats(0, 1),
    chunk=st.integers(1, 3000),
)
def test_chunks_are_contiguous_bounded_and_aligned(
    total: int, cached_fraction: float, chunk: int
) -> None:
    cached = min(int(total * cached_fraction), total - 1)
    chunks = PrefillPlan(total, cached_tokens=cached).chunks(chunk)
    assert chunks[0][0] == cached and chunks[-1][1] == total
    for (_, end), (start, _) in itertools.pairwise(chunks):
        assert end == start
    assert all(0 < end - start <= chunk for start, end in chunks)
    assert all(end % chunk == 0 for _, end in chunks[:-1])  # every inner boundary is aligned
    # The cold plan's chunks from the first boundary at or after the prefix are the same.
    boundary = -(-cached // chunk) * chunk
    cold = PrefillPlan(total).chunks(chunk)
    assert [c for c in chunks if c[0] >= boundary] == [c for c in cold if c[0] >= boundary]
    if cached % chunk == 0:
        assert chunks == [c for c in cold if c[0] >= cached]


def test_last_alone_cuts_chunks_as_mlx_lm_prefills() -> None:
    """mlx-lm's generate_step prefills every token but the last in chunks of its step size
    counted from position 0, then the last token alone: `last_alone` plans the same forwards."""
    assert PrefillPlan(7, last_alone=True).chunks(2048) == [(0, 6), (6, 7)]
    assert PrefillPlan(4097, last_alone=True).chunks(2048) == [
        (0, 2048),
        (2048, 4096),
        (4096, 4097),
    ]
    assert PrefillPlan(4096, last_alone=True).chunks(2048) == [
        (0, 2048),
        (2048, 4095),
        (4095, 4096),
    ]
    assert PrefillPlan(1, last_alone=True).chunks(2048) == [(0, 1)]
    assert PrefillPlan(9, last_alone=True).chunks(None) == [(0, 8), (8, 9)]


@given(st.integers(1, 5000), st.sampled_from([None, 1, 7, 512, 2048]))
def test_last_alone_ends_with_the_last_token_and_loses_none(total: int, chunk: int | None) -> None:
    chunks = PrefillPlan(total, last_alone=True).chunks(chunk)
    assert chunks[-1] == (total - 1, total)
    assert all(a < b for a, b in chunks) and chunks[0][0] == 0
    assert all(b == c for (_, b), (c, _) in itertools.pairwise(chunks))
