"""Paged KV cache bookkeeping: a ref-counted block pool with a chained-hash prefix cache.

Pure Python on purpose (no mlx, no numpy). The scheduler owns the `KVCacheManager`, as vLLM v1's
scheduler owns its KVCacheManager and nano-vllm's its BlockManager: it admits, adopts prefixes,
reserves slots, commits, truncates and frees here, and hands the engine each step's block tables
and a `BlockUpdate` (blocks to copy, how many blocks the K/V arrays must cover). The engine's
storage owns the K/V arrays and never decides a block id.

- A block is free when its ref_count is 0. A free block that still carries a hash is a cached
  prefix: lookup() finds it and touch() adopts it until allocate() reuses it.
- The engine's K/V arrays cover block ids below the pool's `capacity` and grow only when the
  pool raises it, so allocate() keeps ids low: the lowest free uncached id first (a freed
  block before one never used), then a never-used id below `capacity`, then a cached block,
  least recently freed first (a cold prefix is dropped only when memory is really needed),
  and only when every block below `capacity` is in use does `capacity` double. The arrays
  then stay within twice the peak of blocks in use (or the initial capacity), whatever the
  traffic; the prefix cache lives in what they already hold.
- A full block is registered under hash(parent block's hash, its tokens), so requests with a
  common prompt prefix adopt the same blocks by reference and store that prefix once. A
  sequence's first block chains from its `root` instead (`namespace_root`): the same tokens
  under another LoRA adapter have other K/V, and must never share blocks with the base's.
- A sequence about to write into a block that others also hold gets a private copy first.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

_HASH_BYTES = 16


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block; stable across processes, unlike the salted hash()."""
    digest = hashlib.blake2b(digest_size=_HASH_BYTES)
    # A tag byte keeps "no parent" distinct from every parent hash value.
    if parent_hash is None:
        digest.update(b"\x00")
    else:
        digest.update(b"\x01" + parent_hash.to_bytes(_HASH_BYTES, "little"))
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return int.from_bytes(digest.digest(), "little")


def namespace_root(key: str) -> int:
    """The parent hash of the first block of sequences whose K/V depend on more than their
    tokens (e.g. a LoRA adapter, and the load of it: `key` names both)."""
    digest = hashlib.blake2b(b"\x02" + key.encode(), digest_size=_HASH_BYTES)
    return int.from_bytes(digest.digest(), "little")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is the prefix cache's entry for this hash (full blocks only).
    block_hash: int | None = None


@dataclass(frozen=True)
class KVCacheStats:
    block_size: int
    num_total_blocks: int
    num_free_blocks: int
    num_active_blocks: int
    num_cached_blocks: int
    evictions: int
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_hit_tokens: int = 0


class BlockPool:
    """Fixed-size blocks with ref counts, low-ids-first allocation, an LRU queue of cached free
    blocks and a hash -> block prefix map.

    `capacity` (default: all blocks) is how many blocks the engine's arrays hold now; it grows
    (doubling, up to num_blocks) only when all of them are in use."""

    def __init__(self, num_blocks: int, block_size: int, capacity: int | None = None) -> None:
        if num_blocks < 0 or block_size < 1:
            raise ValueError(f"bad pool shape: {num_blocks} blocks of {block_size} tokens")
        self.block_size = block_size
        self._blocks = [Block(i) for i in range(num_blocks)]
        self._hash_to_block: dict[int, int] = {}
        self._capacity = num_blocks if capacity is None else max(0, min(capacity, num_blocks))
        # Every free block is in exactly one of these: freed uncached blocks (a min-heap: the
        # lowest id goes first), the never-used ids [_next_new, num_blocks), and cached blocks
        # least recently freed first (the eviction order).
        self._free_uncached: list[int] = []
        self._next_new = 0
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    @property
    def num_total_blocks(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        """Blocks with ids below this may be handed out now; beyond it the engine's arrays
        would have to grow (allocate raises it only when every block below is in use)."""
        return self._capacity

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_count 0, cached or not: all of them can be allocated."""
        never_used = len(self._blocks) - self._next_new
        return len(self._free_uncached) + never_used + len(self._free_cached)

    @property
    def num_free_cached_blocks(self) -> int:
        """Free blocks still holding a cached prefix (evictable)."""
        return len(self._free_cached)

    @property
    def num_active_blocks(self) -> int:
        return self.num_total_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks carrying a hash, whether in use or free."""
        return len(self._hash_to_block)

    def block(self, block_id: int) -> Block:
        if not 0 <= block_id < len(self._blocks):
            raise IndexError(f"no block {block_id} in a pool of {len(self._blocks)}")
        return self._blocks[block_id]

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks with ref_count 1, evicting cold prefixes if needed; None if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if not self.can_allocate(n):
            return None
        block_ids = []
        for _ in range(n):
            block = self._pop_free()
            block.ref_count = 1
            block_ids.append(block.block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Adopt blocks by reference: another holder for each (a prefix hit)."""
        blocks = [self.block(block_id) for block_id in block_ids]
        for block in blocks:  # validate before mutating, so a bad call changes nothing
            if block.ref_count == 0 and block.block_hash is None:
                raise ValueError(f"block {block.block_id} is free and uncached: nothing to adopt")
        for block in blocks:
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id. Blocks reaching 0 join the free queue in the given order
        (the first is evicted first), so pass a sequence's blocks tail first."""
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            if self.block(block_id).ref_count < count:
                raise ValueError(f"double free of block {block_id}")
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is None:
                heapq.heappush(self._free_uncached, block_id)
            else:  # keeps its hash: still a prefix hit until reused
                self._free_cached[block_id] = None

    def cache_full_block(self, block_id: int, block_hash: int) -> bool:
        """Register a held, full block under block_hash; True if it became the cache entry.
        An existing entry for the hash wins: the block stays an uncached duplicate."""
        block = self.block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free: only held blocks can be registered")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block_id} is already cached under another hash")
            return False
        if block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        self._hash_to_block[block_hash] = block_id
        return True

    def lookup(self, block_hash: int) -> int | None:
        return self._hash_to_block.get(block_hash)

    def copy_on_write(self, block_id: int) -> tuple[int, bool] | None:
        """Make block_id safe to write for one holder: (block to write, whether the engine must
        copy block_id's K/V into it first), or None when a copy is needed but no block is free.

        A shared block is replaced by a fresh one for this holder. A sole holder writes in
        place; if the block is cached it leaves the prefix cache, since its contents will no
        longer match the hash (cheaper than copying to keep a prefix nobody else holds)."""
        block = self.block(block_id)
        if block.ref_count == 0:
            raise ValueError(f"block {block_id} is free: nobody may write it")
        if block.ref_count == 1:
            if block.block_hash is not None:
                self._uncache(block)
            return block_id, False
        new_ids = self.allocate(1)
        if new_ids is None:
            return None
        block.ref_count -= 1  # still >= 1: the other holders keep it
        return new_ids[0], True

    def stats(self) -> KVCacheStats:
        return KVCacheStats(
            block_size=self.block_size,
            num_total_blocks=self.num_total_blocks,
            num_free_blocks=self.num_free_blocks,
            num_active_blocks=self.num_active_blocks,
            num_cached_blocks=self.num_cached_blocks,
            evictions=self.evictions,
        )

    def _pop_free(self) -> Block:
        """The next free block (the caller checked there is one): see the module docstring."""
        if self._free_uncached:
            return self._blocks[heapq.heappop(self._free_uncached)]
        if self._next_new < self._capacity or not self._free_cached:
            if self._next_new >= self._capacity:  # every block below capacity is in use
                self._capacity = min(len(self._blocks), max(1, 2 * self._capacity))
            self._next_new += 1
            return self._blocks[self._next_new - 1]
        block_id, _ = self._free_cached.popitem(last=False)
        block = self._blocks[block_id]
        self._uncache(block)
        self.evictions += 1
        return block

    def _uncache(self, block: Block) -> None:
        assert block.block_hash is not None
        del self._hash_to_block[block.block_hash]
        block.block_hash = None


@dataclass
class SequenceBlocks:
    """One sequence's block table."""

    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_tokens: int = 0  # token positions with a reserved slot
    # Chained hashes of the leading full blocks already registered (or adopted).
    block_hashes: list[int] = field(default_factory=list)
    cache_prefix: bool = True  # register this sequence's full blocks in the prefix cache
    root: int | None = None  # what its first block's hash chains from (namespace_root)

    def blocks_needed(self, num_new_tokens: int) -> int:
        """New blocks to hold num_tokens + num_new_tokens positions."""
        total = self.num_tokens + num_new_tokens
        return max(0, _ceil_div(total, self.block_size) - len(self.block_ids))


@dataclass(frozen=True)
class BlockUpdate:
    """What the engine's storage must do before a step's forward: grow its K/V arrays to cover
    `capacity` blocks, then copy whole blocks (src, dst) in order (copy-on-write)."""

    capacity: int = 0
    copies: tuple[tuple[int, int], ...] = ()


class KVManager(Protocol):
    """The scheduler's KV bookkeeping (one per engine, chosen once): `KVCacheManager` for the
    paged pool, `UnpagedKV` for storage that grows per sequence without blocks."""

    @property
    def prefix_caching(self) -> bool:
        """Whether `admit` can find cached prompt prefixes."""
        ...

    @property
    def paged(self) -> bool:
        """Whether positions live in blocks (else every reservation succeeds)."""
        ...

    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    def new_sequence(
        self, cache_prefix: bool = True, root: int | None = None
    ) -> SequenceBlocks: ...
    def admit(
        self, seq: SequenceBlocks, token_ids: Sequence[int], use_prefix: bool, keep_free: int
    ) -> int | None: ...
    def blocks_needed(self, seq: SequenceBlocks, num_tokens: int) -> int: ...
    def ensure_slots(self, seq: SequenceBlocks, num_tokens: int) -> bool: ...
    def register_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> int: ...
    def truncate(self, seq: SequenceBlocks, num_tokens: int) -> None: ...
    def free_sequence(self, seq: SequenceBlocks) -> None: ...
    def take_update(self) -> BlockUpdate: ...


class KVCacheManager:
    """The scheduler's view of the pool: sequences grow, share prompt prefixes, roll back and
    get freed. Block copies and capacity growth accumulate until `take_update`."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        capacity: int | None = None,
    ):
        self.pool = BlockPool(num_blocks, block_size, capacity)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_lookups = 0
        self.prefix_hits = 0
        self.prefix_hit_tokens = 0
        # (src, dst) copies the engine must perform before the next forward writes K/V.
        self._pending_copies: list[tuple[int, int]] = []

    @property
    def prefix_caching(self) -> bool:
        return self.enable_prefix_caching

    @property
    def paged(self) -> bool:
        return True

    @property
    def num_blocks(self) -> int:
        return self.pool.num_total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (cached-but-free ones included)."""
        return self.pool.num_free_blocks

    @property
    def capacity_tokens(self) -> int:
        """The most tokens one sequence could ever hold: the whole pool."""
        return self.num_blocks * self.block_size

    def new_sequence(self, cache_prefix: bool = True, root: int | None = None) -> SequenceBlocks:
        return SequenceBlocks(self.block_size, cache_prefix=cache_prefix, root=root)

    def admit(
        self, seq: SequenceBlocks, token_ids: Sequence[int], use_prefix: bool, keep_free: int
    ) -> int | None:
        """Give an empty sequence slots for all of token_ids: adopt the cached full blocks that
        start them (when use_prefix) and reserve the rest, leaving at least keep_free blocks
        free. Returns how many tokens the adopted blocks cover (prefill starts there), or None
        (nothing changed) when the blocks are short."""
        if seq.block_ids or seq.num_tokens:
            raise ValueError("only an empty sequence can be admitted")
        prefix = self.match_prefix(token_ids, seq.root) if use_prefix else []
        cached = len(prefix) * self.block_size
        needed = self.blocks_required(seq, len(token_ids) - cached, prefix)
        if needed > self.pool.num_free_blocks - keep_free:
            return None
        assert self.allocate_slots(seq, len(token_ids) - cached, prefix)
        return cached

    def blocks_needed(self, seq: SequenceBlocks, num_tokens: int) -> int:
        """New blocks positions 0..num_tokens-1 would take beyond those reserved."""
        missing = num_tokens - seq.num_tokens
        return seq.blocks_needed(missing) if missing > 0 else 0

    def ensure_slots(self, seq: SequenceBlocks, num_tokens: int) -> bool:
        """Make positions 0..num_tokens-1 have slots (idempotent; all or nothing)."""
        missing = num_tokens - seq.num_tokens
        return True if missing <= 0 else self.allocate_slots(seq, missing)

    def take_update(self) -> BlockUpdate:
        """What the storage must do before the next forward (and forget it here)."""
        copies, self._pending_copies = self._pending_copies, []
        return BlockUpdate(self.pool.capacity, tuple(copies))

    def match_prefix(self, token_ids: Sequence[int], root: int | None = None) -> list[int]:
        """Blocks of the longest cached run of full blocks that starts token_ids (chained from
        `root`). At most (len - 1) // block_size blocks: the last prompt token is always
        prefilled, since the model must produce its logits. The ids stay valid only until the
        pool next changes: pass them straight to allocate_slots. Call once per admission
        attempt (it counts)."""
        if not self.enable_prefix_caching:
            return []
        self.prefix_lookups += 1
        size = self.block_size
        matched: list[int] = []
        parent = root
        for index in range((len(token_ids) - 1) // size):
            parent = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            matched.append(block_id)
        if matched:
            self.prefix_hits += 1
            self.prefix_hit_tokens += len(matched) * size
        return matched

    def blocks_required(
        self, seq: SequenceBlocks, num_new_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> int:
        """Free blocks allocate_slots(seq, num_new_tokens, prefix_blocks) would consume.
        Adopting a held prefix block costs nothing; adopting a free cached one takes it."""
        adopted = sum(1 for block_id in prefix_blocks if self.pool.block(block_id).ref_count == 0)
        total = seq.num_tokens + len(prefix_blocks) * self.block_size + num_new_tokens
        grown = max(0, _ceil_div(total, self.block_size) - len(seq.block_ids) - len(prefix_blocks))
        copies = sum(
            1
            for index in self._write_range(seq, num_new_tokens)
            if self.pool.block(seq.block_ids[index]).ref_count > 1
        )
        return adopted + grown + copies

    def allocate_slots(
        self, seq: SequenceBlocks, num_new_tokens: int, prefix_blocks: Sequence[int] = ()
    ) -> bool:
        """Reserve slots for num_new_tokens more positions (after adopting prefix_blocks, from
        match_prefix, into an empty seq). All or nothing: False leaves everything unchanged.
        Shared blocks in the written range are copied on write (see take_update)."""
        if num_new_tokens < 0:
            raise ValueError(f"cannot reserve {num_new_tokens} tokens")
        if not prefix_blocks and seq.num_tokens + num_new_tokens <= len(seq.block_ids) * (
            self.block_size
        ):
            # The common decode step: the positions fit blocks this sequence alone holds and
            # nobody has cached; anything else (copy-on-write, leaving the cache) takes the
            # full path below.
            pool, blocks = self.pool, seq.block_ids
            if all(
                pool.block(blocks[i]).ref_count == 1 and pool.block(blocks[i]).block_hash is None
                for i in self._write_range(seq, num_new_tokens)
            ):
                seq.num_tokens += num_new_tokens
                return True
        if prefix_blocks:
            if seq.block_ids:
                raise ValueError("prefix blocks can only start an empty sequence")
            if any(self.pool.block(block_id).block_hash is None for block_id in prefix_blocks):
                raise ValueError("stale prefix match: a block left the cache; match again")
        if not self.pool.can_allocate(self.blocks_required(seq, num_new_tokens, prefix_blocks)):
            return False
        if prefix_blocks:
            self.pool.touch(prefix_blocks)
            seq.block_ids.extend(prefix_blocks)
            seq.block_hashes = [self._hash_of(block_id) for block_id in prefix_blocks]
            seq.num_tokens = len(prefix_blocks) * self.block_size
        for index in self._write_range(seq, num_new_tokens):
            result = self.pool.copy_on_write(seq.block_ids[index])
            assert result is not None, "copies were reserved above"
            new_id, copied = result
            if copied:
                self._pending_copies.append((seq.block_ids[index], new_id))
                seq.block_ids[index] = new_id
        new_ids = self.pool.allocate(seq.blocks_needed(num_new_tokens))
        assert new_ids is not None, "growth was reserved above"
        seq.block_ids.extend(new_ids)
        seq.num_tokens += num_new_tokens
        return True

    def register_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> int:
        """Register seq's newly full blocks in the prefix cache; token_ids are the tokens whose
        K/V has been written (prompt + generated). Returns how many became cache entries."""
        if not (self.enable_prefix_caching and seq.cache_prefix):
            return 0
        size = self.block_size
        registered = 0
        for index in range(len(seq.block_hashes), min(len(token_ids), seq.num_tokens) // size):
            parent = seq.block_hashes[-1] if seq.block_hashes else seq.root
            block_hash = hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
            seq.block_hashes.append(block_hash)
            registered += self.pool.cache_full_block(seq.block_ids[index], block_hash)
        return registered

    def truncate(self, seq: SequenceBlocks, num_tokens: int) -> None:
        """Roll seq back to num_tokens positions (e.g. rejected draft tokens)."""
        if not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"cannot truncate {seq.num_tokens} tokens to {num_tokens}")
        keep = _ceil_div(num_tokens, self.block_size)
        self.pool.free(reversed(seq.block_ids[keep:]))
        del seq.block_ids[keep:]
        # A partly kept full block will be rewritten: its hash no longer describes seq.
        del seq.block_hashes[num_tokens // self.block_size :]
        seq.num_tokens = num_tokens

    def free_sequence(self, seq: SequenceBlocks) -> None:
        # Tail first: a prefix's tail is then evicted before its head, which more prompts share.
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids.clear()
        seq.block_hashes.clear()
        seq.num_tokens = 0

    def stats(self) -> KVCacheStats:
        return replace(
            self.pool.stats(),
            prefix_lookups=self.prefix_lookups,
            prefix_hits=self.prefix_hits,
            prefix_hit_tokens=self.prefix_hit_tokens,
        )

    def _write_range(self, seq: SequenceBlocks, num_new_tokens: int) -> range:
        """Indices of seq's existing blocks that positions [num_tokens, +num_new_tokens) hit."""
        if num_new_tokens <= 0:
            return range(0)
        end = min(len(seq.block_ids), _ceil_div(seq.num_tokens + num_new_tokens, self.block_size))
        return range(seq.num_tokens // self.block_size, end)

    def _hash_of(self, block_id: int) -> int:
        block_hash = self.pool.block(block_id).block_hash
        assert block_hash is not None
        return block_hash


class UnpagedKV:
    """The KVManager of storage without blocks (dense arrays per sequence, mlx-lm's own caches):
    each sequence's storage grows as it is written, with no pool to share, budget or copy, so
    every reservation succeeds and no block is ever needed, free or cached."""

    prefix_caching = False
    paged = False
    block_size = 1
    num_blocks = 0
    num_free_blocks = 0

    def new_sequence(self, cache_prefix: bool = True, root: int | None = None) -> SequenceBlocks:
        return SequenceBlocks(block_size=1, cache_prefix=False)

    def admit(
        self, seq: SequenceBlocks, token_ids: Sequence[int], use_prefix: bool, keep_free: int
    ) -> int | None:
        return 0

    def blocks_needed(self, seq: SequenceBlocks, num_tokens: int) -> int:
        return 0

    def ensure_slots(self, seq: SequenceBlocks, num_tokens: int) -> bool:
        return True

    def register_full_blocks(self, seq: SequenceBlocks, token_ids: Sequence[int]) -> int:
        return 0

    def truncate(self, seq: SequenceBlocks, num_tokens: int) -> None:
        pass

    def free_sequence(self, seq: SequenceBlocks) -> None:
        pass

    def take_update(self) -> BlockUpdate:
        return BlockUpdate()
