"""Prefill plans: which tokens a sequence still has to put into its KV cache, in which chunks.

Chunk boundaries are aligned to multiples of the chunk size counted from the start of the
sequence, not from the end of an adopted prefix. A request that adopts a cached prefix ending
on a chunk boundary therefore runs exactly the chunks a cold run would run after it, which is
what makes its output identical to the cold run (docs/scheduler.md, Parity). The CLI and
the server both plan through this module.

With `last_alone`, the last token is a chunk of its own, as mlx-lm's `generate_step` prefills
(every token but the last, then the last as the first decode step): a model on mlx-lm's own
caches then runs exactly the forwards mlx-lm runs, and on a GPU, where a product's rounding
depends on how many rows it has, gets its numbers bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillPlan:
    total_tokens: int  # tokens that must be in the cache when prefill is done
    cached_tokens: int = 0  # adopted from the prefix cache: skipped
    last_alone: bool = False  # the last token is a chunk of its own (mlx-lm's prefill)

    def next_chunk(self, num_computed: int, chunk_size: int | None) -> tuple[int, int]:
        """The [start, end) token range of the next chunk; chunk_size None means the rest."""
        start = max(num_computed, self.cached_tokens)
        end = self.total_tokens
        if chunk_size is not None and chunk_size > 0:
            end = min((start // chunk_size + 1) * chunk_size, end)
        if self.last_alone and start < self.total_tokens - 1:
            end = min(end, self.total_tokens - 1)
        return start, end

    def chunks(self, chunk_size: int | None) -> list[tuple[int, int]]:
        """Every chunk from the end of the adopted prefix to the end (for planning and tests)."""
        out, done = [], self.cached_tokens
        while done < self.total_tokens:
            start, end = self.next_chunk(done, chunk_size)
            out.append((start, end))
            done = end
        return out
