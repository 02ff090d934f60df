"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character
(the tokenizer yields U+FFFD until the character's last byte arrives), and never
text that might be the start of a stop string. A matched stop string and
anything after it are dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
_MAX_UTF8_BYTES = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_strings: Sequence[str] = (),
        ends_mid_character: Callable[[Sequence[int]], bool | None] | None = None,
    ) -> None:
        self._decode = decode
        self._ends_mid_character = ends_mid_character
        self._stops = tuple(s for s in stop_strings if s)
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are already part of `_text`
        self._read_offset = 0
        self._text = ""  # all final text decoded so far (before stop truncation)
        self._emitted = 0  # characters of `_text` handed out
        self.stopped = False
        self.matched_stop = ""  # the stop string that matched (the earliest in the text)

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def push(self, token_id: int) -> str:
        """Add one generated token (that belongs in the text); return the text now safe to emit."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        self._absorb(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: release whatever is held back (no stop string matched)."""
        if self.stopped:
            return ""
        self._absorb(final=True)
        return self._release(final=True)

    def _absorb(self, final: bool) -> None:
        """Move the text of the tokens read so far into `_text`, unless it ends mid-character."""
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        pending = self._ids[self._read_offset :]
        incomplete = self._ends_mid_character(pending) if self._ends_mid_character else None
        if incomplete is None:
            # Without the tokens' bytes: a trailing U+FFFD is usually a character whose last
            # bytes have not arrived; a UTF-8 character has at most 4 bytes, so after 4 more
            # tokens it is a real U+FFFD.
            incomplete = full.endswith(_REPLACEMENT) and len(pending) < _MAX_UTF8_BYTES
        if incomplete and final:
            full = full.removesuffix(_REPLACEMENT)  # the generation ended inside a character
            incomplete = False
        if len(full) > len(prefix) and not incomplete:
            self._text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)

    def _release(self, final: bool) -> str:
        if self._stops:
            search_from = max(0, self._emitted - max(len(s) for s in self._stops) + 1)
            hits = [(i, s) for s in self._stops if (i := self._text.find(s, search_from)) >= 0]
            if hits:
                cut, self.matched_stop = min(hits, key=lambda hit: hit[0])
                self._text = self._text[:cut]
                self.stopped = True
                return self._take(cut)
            if not final:
                return self._take(len(self._text) - self._held_back())
        return self._take(len(self._text))

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:n]):
                    longest = n
                    break
        return longest

    def _take(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta
