"""Block pool bookkeeping: example tests plus a hypothesis state machine over the manager."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from service.core.kv.block_pool import (
    BlockPool,
    BlockUpdate,
    KVCacheManager,
    SequenceBlocks,
    UnpagedKV,
    hash_block_tokens,
    namespace_root,
)

BLOCK = 4


def _admit(manager: KVCacheManager, prompt: list[int]) -> SequenceBlocks | None:
    """What the scheduler does for a new request: adopt the cached prefix, reserve the rest."""
    seq = manager.new_sequence()
    prefix = manager.match_prefix(prompt)
    if not manager.allocate_slots(seq, len(prompt) - len(prefix) * BLOCK, prefix):
        return None
    manager.register_full_blocks(seq, prompt)
    return seq


# -- hashing and the sequence table ---------------------------------------------------------


def test_hash_is_chained_and_deterministic() -> None:
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(first, [5, 6]) != hash_block_tokens(first + 1, [5, 6])


def slot_mapping(seq: SequenceBlocks, start: int, count: int) -> list[int]:
    """Flat slot (block_id * block_size + offset) of each position in [start, start+count)."""
    size = seq.block_size
    return [seq.block_ids[p // size] * size + p % size for p in range(start, start + count)]


def test_sequence_blocks_needed() -> None:
    seq = SequenceBlocks(block_size=4, block_ids=[7, 2], num_tokens=5)
    assert seq.blocks_needed(3) == 0
    assert seq.blocks_needed(4) == 1


# -- pool examples --------------------------------------------------------------------------


def test_allocate_returns_none_when_exhausted_without_leaking() -> None:
    pool = BlockPool(num_blocks=3, block_size=BLOCK)
    held = pool.allocate(2)
    assert held == [0, 1]
    assert pool.allocate(2) is None
    assert pool.num_free_blocks == 1 and pool.num_active_blocks == 2
    pool.free(held)
    assert pool.allocate(3) is not None
    assert pool.num_free_blocks == 0


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=BLOCK)
    [a, b] = pool.allocate(2) or []
    pool.free([a])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b, a])
    assert pool.block(b).ref_count == 1  # validated before anything was dropped


def test_touch_of_free_uncached_block_raises() -> None:
    pool = BlockPool(num_blocks=1, block_size=BLOCK)
    with pytest.raises(ValueError):
        pool.touch([0])


def test_duplicate_hash_keeps_the_existing_entry() -> None:
    pool = BlockPool(num_blocks=2, block_size=BLOCK)
    a, b = pool.allocate(2) or []
    assert pool.cache_full_block(a, 42)
    assert not pool.cache_full_block(b, 42)
    assert pool.lookup(42) == a and pool.block(b).block_hash is None
    assert pool.num_cached_blocks == 1


def test_freed_cached_blocks_are_reused_last_and_evicted_tail_first() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK)
    seq = _admit(manager, list(range(13)))  # 3 full blocks + 1 partial
    assert seq is not None and seq.block_ids == [0, 1, 2, 3]
    pool = manager.pool
    assert pool.num_cached_blocks == 3
    manager.free_sequence(seq)
    # The uncached partial block goes out first, then the prefix from its tail backwards.
    assert pool.allocate(2) == [3, 2]
    assert pool.evictions == 1 and pool.num_cached_blocks == 2
    assert pool.allocate(2) == [1, 0]
    assert pool.evictions == 3 and pool.num_cached_blocks == 0


# -- allocation order: low ids first, the arrays grow only with the live set -----------------


def test_a_freed_block_is_reused_before_a_never_used_one() -> None:
    pool = BlockPool(num_blocks=10, block_size=BLOCK)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    assert pool.allocate(3) == [0, 2, 4]  # lowest free id first, freed or not


def test_cached_blocks_are_evicted_least_recently_freed_first_before_capacity_grows() -> None:
    pool = BlockPool(num_blocks=100, block_size=BLOCK, capacity=4)
    assert pool.allocate(4) == [0, 1, 2, 3] and pool.capacity == 4
    for block_id in range(4):
        pool.cache_full_block(block_id, 100 + block_id)
    pool.free([2, 0, 3, 1])  # the LRU order of the cached free blocks
    pool.touch([0])  # adopted again (a prefix hit) ...
    pool.free([0])  # ... and freed: now the most recently used
    assert pool.allocate(2) == [2, 3]  # the two coldest prefixes, not new ids 4 and 5
    assert pool.evictions == 2 and pool.lookup(101) == 1 and pool.lookup(100) == 0
    assert pool.capacity == 4  # the cache lives in the blocks the arrays already hold


def test_never_used_blocks_below_capacity_go_before_cached_ones() -> None:
    pool = BlockPool(num_blocks=100, block_size=BLOCK, capacity=8)
    [a] = pool.allocate(1) or []
    pool.cache_full_block(a, 7)
    pool.free([a])
    assert pool.allocate(1) == [1]  # the arrays hold block 1 already: keep the prefix
    assert pool.lookup(7) == a


def test_capacity_doubles_only_when_every_block_below_it_is_in_use() -> None:
    pool = BlockPool(num_blocks=10, block_size=BLOCK, capacity=2)
    assert pool.allocate(2) == [0, 1] and pool.capacity == 2
    assert pool.allocate(1) == [2] and pool.capacity == 4
    assert pool.allocate(3) == [3, 4, 5] and pool.capacity == 8
    assert pool.allocate(4) == [6, 7, 8, 9] and pool.capacity == 10  # capped at num_blocks
    assert pool.allocate(1) is None


def test_traffic_of_distinct_prompts_keeps_capacity_to_twice_the_live_set() -> None:
    """Many distinct requests, at most 4 at once, each caching its prompt's full blocks: the
    capacity stays within twice the peak of blocks in use (or its start), the ids below it."""
    initial = 8
    manager = KVCacheManager(num_blocks=4096, block_size=BLOCK, capacity=initial)
    pool = manager.pool
    live: list[SequenceBlocks] = []
    peak_active = 0
    for i in range(1000):
        prompt = [i % 7, *range(i * 10, i * 10 + 5 + i % 11)]  # 6-16 tokens, distinct
        seq = _admit(manager, prompt)
        assert seq is not None
        live.append(seq)
        assert manager.allocate_slots(seq, 3)  # a few decode steps
        peak_active = max(peak_active, pool.num_active_blocks)
        assert max(b for s in live for b in s.block_ids) < pool.capacity
        if len(live) == 4:
            manager.free_sequence(live.pop(i % 4))
    assert pool.capacity <= max(initial, 2 * peak_active)
    assert pool.num_cached_blocks > 0  # it still caches, within that capacity


def test_copy_on_write() -> None:
    pool = BlockPool(num_blocks=2, block_size=BLOCK)
    [a] = pool.allocate(1) or []
    pool.cache_full_block(a, 9)
    pool.touch([a])
    new_id, copied = pool.copy_on_write(a) or (None, None)
    assert copied and new_id != a
    assert pool.block(a).ref_count == 1 and pool.lookup(9) == a
    # Sole holder of a cached block writes in place; the block leaves the cache.
    assert pool.copy_on_write(a) == (a, False)
    assert pool.lookup(9) is None
    # Shared and no block free: None, and nothing changes.
    pool.touch([new_id])
    assert pool.copy_on_write(new_id) is None
    assert pool.block(new_id).ref_count == 2


# -- manager examples -----------------------------------------------------------------------


def test_shared_prefix_is_stored_once() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=BLOCK)
    system = list(range(100, 112))  # 3 full blocks
    first = _admit(manager, [*system, 1, 2])
    used_after_first = manager.pool.num_active_blocks
    second = _admit(manager, [*system, 3, 4, 5])
    assert first is not None and second is not None
    assert first.block_ids[:3] == second.block_ids[:3]
    assert manager.pool.num_active_blocks == used_after_first + 1  # only the suffix block
    assert all(manager.pool.block(b).ref_count == 2 for b in first.block_ids[:3])
    stats = manager.stats()
    assert (stats.prefix_lookups, stats.prefix_hits, stats.prefix_hit_tokens) == (2, 1, 12)


def test_match_prefix_leaves_at_least_one_token() -> None:
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    prompt = list(range(8))  # exactly 2 full blocks
    first = _admit(manager, prompt)
    assert first is not None and manager.pool.num_cached_blocks == 2
    assert len(manager.match_prefix(prompt)) == 1
    assert len(manager.match_prefix([*prompt, 99])) == 2
    assert manager.match_prefix(prompt[:4]) == []


def test_allocate_slots_is_all_or_nothing() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK)
    seq = manager.new_sequence()
    assert not manager.allocate_slots(seq, 13)
    assert seq.block_ids == [] and seq.num_tokens == 0 and manager.pool.num_free_blocks == 3


def test_adopting_free_cached_blocks_counts_against_free_space() -> None:
    manager = KVCacheManager(num_blocks=3, block_size=BLOCK)
    first = _admit(manager, list(range(9)))
    assert first is not None
    manager.free_sequence(first)
    prompt = [*range(8), 50, 51, 52, 53, 54]
    prefix = manager.match_prefix(prompt)
    assert len(prefix) == 2
    seq = manager.new_sequence()
    assert manager.blocks_required(seq, 5, prefix) == 4
    assert not manager.allocate_slots(seq, 5, prefix)
    assert manager.pool.num_cached_blocks == 2  # the failed attempt evicted nothing
    assert manager.allocate_slots(seq, 1, prefix)


def test_rewriting_a_shared_block_after_a_rollback_copies_it() -> None:
    """A sequence rolled back into a full block that another adopted writes a copy of it; the
    copy reaches the engine through take_update, once."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK)
    first = _admit(manager, list(range(9)))
    assert first is not None
    manager.register_full_blocks(first, list(range(9)))
    second = _admit(manager, [*range(8), 42])
    assert second is not None and second.block_ids[:2] == first.block_ids[:2]
    shared = first.block_ids[1]
    manager.take_update()
    manager.truncate(first, 6)
    assert manager.allocate_slots(first, 1)
    assert first.block_ids[1] != shared and second.block_ids[1] == shared
    assert manager.take_update().copies == ((shared, first.block_ids[1]),)
    assert manager.take_update().copies == ()
    assert manager.allocate_slots(first, 1)  # now its own block: no copy
    assert manager.take_update().copies == ()


def test_admit_adopts_reserves_and_keeps_blocks_free() -> None:
    manager = KVCacheManager(num_blocks=6, block_size=BLOCK)
    first = manager.new_sequence()
    assert manager.admit(first, list(range(9)), True, 0) == 0  # nothing cached yet: 3 blocks
    manager.register_full_blocks(first, list(range(9)))
    second = manager.new_sequence()
    # 8 tokens adopted (2 held blocks, free to adopt), 2 more blocks for the rest: 2 of 3 free.
    assert manager.admit(second, [*range(8), 7, 7, 7, 7, 7], True, keep_free=2) is None
    assert second.block_ids == [] and manager.pool.num_free_blocks == 3
    assert manager.admit(second, [*range(8), 7, 7, 7, 7, 7], True, keep_free=1) == 8
    assert second.num_tokens == 13 and manager.pool.num_free_blocks == 1
    third = manager.new_sequence()
    assert manager.admit(third, list(range(9)), False, 0) is None  # no prefix: 3 blocks


def test_sequences_of_another_namespace_share_no_block() -> None:
    """The same prompt under two adapters (two roots) and the base: three sets of blocks; a
    second request under one adapter adopts that adapter's blocks only."""
    manager = KVCacheManager(num_blocks=32, block_size=BLOCK)
    prompt = list(range(13))
    roots = [None, namespace_root("sql#1"), namespace_root("chat#2")]
    assert len(set(roots)) == 3 and namespace_root("sql#1") == namespace_root("sql#1")
    first = []
    for root in roots:
        seq = manager.new_sequence(root=root)
        assert manager.admit(seq, prompt, True, 0) == 0  # nothing cached under this root yet
        manager.register_full_blocks(seq, prompt)
        first.append(seq)
    assert len({tuple(s.block_ids[:3]) for s in first}) == 3
    for root, earlier in zip(roots, first):
        again = manager.new_sequence(root=root)
        assert manager.admit(again, [*prompt, 5], True, 0) == 12
        assert again.block_ids[:3] == earlier.block_ids[:3]
    # Another load of the same adapter name is another namespace: its key says which load.
    assert manager.match_prefix([*prompt, 5], namespace_root("sql#3")) == []


def test_unpaged_kv_never_runs_short() -> None:
    kv = UnpagedKV()
    seq = kv.new_sequence()
    assert kv.admit(seq, list(range(100)), True, 10) == 0
    assert kv.ensure_slots(seq, 10**6) and kv.blocks_needed(seq, 10**6) == 0
    assert kv.take_update() == BlockUpdate()


# -- property test --------------------------------------------------------------------------


class BlockPoolMachine(RuleBasedStateMachine):
    """Random admit/decode/truncate/free/evict against a shadow model of slot contents."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = KVCacheManager(num_blocks=10, block_size=BLOCK, capacity=2)
        self.pool = self.manager.pool
        self.peak_active = 0
        self.seqs: dict[int, tuple[SequenceBlocks, list[int]]] = {}
        self.next_name = 0
        self.slots: dict[int, int] = {}  # flat slot -> token written there
        self.hash_tokens: dict[int, tuple[int, ...]] = {}  # chained hash -> tokens it covers

    def _write(self, seq: SequenceBlocks, tokens: list[int], start: int) -> None:
        size = BLOCK
        for src, dst in self.manager.take_update().copies:
            for offset in range(size):
                if src * size + offset in self.slots:
                    self.slots[dst * size + offset] = self.slots[src * size + offset]
        for slot, token in zip(
            slot_mapping(seq, start, len(tokens) - start), tokens[start:], strict=True
        ):
            self.slots[slot] = token
        parent = None
        for index in range(len(tokens) // size):
            parent = hash_block_tokens(parent, tokens[index * size : (index + 1) * size])
            self.hash_tokens[parent] = tuple(tokens[: (index + 1) * size])
        self.manager.register_full_blocks(seq, tokens)

    def _pick(self, index: int) -> int:
        return sorted(self.seqs)[index % len(self.seqs)]

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def admit(self, prompt: list[int]) -> None:
        before = self.pool.stats()
        seq = self.manager.new_sequence()
        cached = self.manager.admit(seq, prompt, True, keep_free=0)
        if cached is None:
            assert self.pool.stats().num_free_blocks == before.num_free_blocks
            assert seq.block_ids == []
            return
        assert cached < len(prompt) and cached % BLOCK == 0
        self._write(seq, prompt, cached)
        self.seqs[self.next_name] = (seq, list(prompt))
        self.next_name += 1

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50), token=st.integers(0, 1))
    def decode(self, index: int, token: int) -> None:
        name = self._pick(index)
        seq, tokens = self.seqs[name]
        others = {n: list(s.block_ids) for n, (s, _) in self.seqs.items() if n != name}
        if self.manager.allocate_slots(seq, 1):
            tokens.append(token)
            self._write(seq, tokens, len(tokens) - 1)
        assert others == {n: s.block_ids for n, (s, _) in self.seqs.items() if n != name}

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50), drop=st.integers(0, 6))
    def truncate(self, index: int, drop: int) -> None:
        seq, tokens = self.seqs[self._pick(index)]
        keep = max(1, len(tokens) - drop)
        self.manager.truncate(seq, keep)
        del tokens[keep:]

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def free(self, index: int) -> None:
        seq, _ = self.seqs.pop(self._pick(index))
        self.manager.free_sequence(seq)
        with pytest.raises(ValueError):
            self.pool.free([0] * (self.pool.block(0).ref_count + 1))

    @invariant()
    def ref_counts_match_holders(self) -> None:
        holders = [0] * self.pool.num_total_blocks
        for seq, _ in self.seqs.values():
            assert len(set(seq.block_ids)) == len(seq.block_ids)
            for block_id in seq.block_ids:
                holders[block_id] += 1
        free = [b for b in range(self.pool.num_total_blocks) if self.pool.block(b).ref_count == 0]
        assert len(free) == self.pool.num_free_blocks
        for block_id, count in enumerate(holders):
            assert self.pool.block(block_id).ref_count == count >= 0
            assert (block_id in free) == (count == 0)
        assert self.pool.num_free_blocks + self.pool.num_active_blocks == 10

    @invariant()
    def capacity_follows_the_blocks_in_use(self) -> None:
        self.peak_active = max(self.peak_active, self.pool.num_active_blocks)
        assert self.pool.capacity <= max(2, 2 * self.peak_active)
        held = [b for seq, _ in self.seqs.values() for b in seq.block_ids]
        assert all(b < self.pool.capacity for b in held)
        cached = [b for b in range(10) if self.pool.block(b).block_hash is not None]
        assert all(b < self.pool.capacity for b in cached)

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        for seq, tokens in self.seqs.values():
            assert seq.num_tokens == len(tokens)
            slots = slot_mapping(seq, 0, len(tokens))
            assert [self.slots.get(slot) for slot in slots] == tokens
            # Registered hashes describe the sequence's current full blocks, nothing stale.
            assert len(seq.block_hashes) <= len(tokens) // BLOCK
            for index, block_hash in enumerate(seq.block_hashes):
                assert self.hash_tokens[block_hash] == tuple(tokens[: (index + 1) * BLOCK])

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        cached = 0
        for block_id in range(self.pool.num_total_blocks):
            block_hash = self.pool.block(block_id).block_hash
            if block_hash is None:
                continue
            cached += 1
            assert self.pool.lookup(block_hash) == block_id
            contents = [self.slots.get(block_id * BLOCK + offset) for offset in range(BLOCK)]
            assert contents == list(self.hash_tokens[block_hash][-BLOCK:])
        assert cached == self.pool.num_cached_blocks


BlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
test_block_pool_state_machine = BlockPoolMachine.TestCase
