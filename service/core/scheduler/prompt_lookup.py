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


MAX_PAUSE = 64  # decode steps a row that keeps missing waits before it drafts again


class DraftPacing:
    """How much one row drafts, from how its drafts fared: a verification step costs more than
    a plain one (and cannot be queued before the previous step is read), so a row drafts only
    while its drafts are accepted. All accepted: the next draft may be one longer. None
    accepted: half as long; at zero the row pauses, twice as long after each further miss. Some
    accepted: as many as were, plus one."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self.length = max_tokens
        self.paused = 0  # plans left before the row drafts again
        self._backoff = 1

    @property
    def ready(self) -> bool:
        return self.paused == 0

    def allowed(self) -> int:
        """Draft tokens this plan may propose (0 while paused; each call is one plan)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.length

    def record(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.length = min(self.max_tokens, self.length + 1)
            self._backoff = 1
        elif accepted == 0:
            self.length //= 2
            if self.length == 0:
                self.miss()
        else:
            self.length = min(self.max_tokens, accepted + 1)
            self._backoff = 1

    def miss(self) -> None:
        """Nothing worth verifying (no draft, or none accepted): pause, longer each time."""
        self.paused = self._backoff
        self._backoff = min(MAX_PAUSE, self._backoff * 2)
        self.length = max(1, self.length)
