"""Prompt-lookup drafting: guess a row's next tokens from its own prompt and output.

Text that repeats spans of its context (summaries, code edits, answers quoting a document)
often continues the way an earlier occurrence of its last few tokens continued. `NgramIndex`
keeps, for every n-gram of the row's tokens (n from min_ngram to max_ngram), where it last
occurred; a proposal is the continuation of the longest n-gram that ends the row and occurred
before. Updating costs O(max_ngram) per token and proposing O(max_ngram): no scan of the
context.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"bad n-gram range [{min_ngram}, {max_ngram}]")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        # n -> {n-gram: end position (exclusive) of its latest occurrence before the newest}
        self._seen: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(min_ngram, max_ngram + 1)
        }
        self._pending: dict[int, tuple[tuple[int, ...], int]] = {}  # n -> newest, not yet seen

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in range(self.min_ngram, self.max_ngram + 1):
                # The previous newest n-gram becomes searchable; the new one waits (a proposal
                # must come from an earlier occurrence, not from the suffix itself).
                if n in self._pending:
                    gram, gram_end = self._pending.pop(n)
                    self._seen[n][gram] = gram_end
                if end >= n:
                    self._pending[n] = (tuple(self.tokens[end - n :]), end)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest n-gram
        ending the row; [] when none occurred."""
        tokens = self.tokens
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if len(tokens) < n:
                continue
            end = self._seen[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []
