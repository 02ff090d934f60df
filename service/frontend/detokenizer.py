"""Incremental detokenization with stop strings.

Text is released only when it is final: never half of a multi-byte character
(the tokenizer yields U+FFFD until the character's last byte arrives), and never
text that might be the start of a stop string. A matched stop string and
anything after it are dropped.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence

_REPLACEMENT = "\ufffd"
_MAX_UTF8_BYTES = 4


class IncrementalDetokenizer:
    def __init__(
        self,
        decode: Callable[[Sequence[int]], str],
        stop_strings: Sequence[str] = (),
        ends_mid_character: Callable[[Sequence[int]], bool | None] | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
    ) -> None:
        """`token_bytes`: each token's bytes, where the text is exactly their UTF-8 decoding
        (Tokenizer.text_bytes): the text then grows by an incremental UTF-8 decode of each
        token's bytes, with no decode of a token window per token."""
        self._decode = decode
        self._ends_mid_character = ends_mid_character
        self._token_bytes = token_bytes
        # Holds a character's leading bytes until its last arrives (invalid bytes: U+FFFD).
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if token_bytes else None
        self._stops = tuple(s for s in stop_strings if s)
        self._ids: list[int] = []
        self._prefix_offset = 0  # tokens before this are already part of `_text`
        self._read_offset = 0
        # Final text not handed out yet (held back as a possible start of a stop string). Text
        # handed out never ends in a stop string's prefix, so no stop string begins before it:
        # searching this tail alone finds every match.
        self._text = ""
        self._out: list[str] = []  # what was handed out, piece by piece
        self.stopped = False
        self.matched_stop = ""  # the stop string that matched (the earliest in the text)

    @property
    def text(self) -> str:
        return "".join(self._out)

    def push(self, token_id: int) -> str:
        """Add one generated token (that belongs in the text); return the text now safe to emit."""
        if self.stopped:
            return ""
        if self._utf8 is not None and self._token_bytes is not None:
            self._text += self._utf8.decode(self._token_bytes(token_id))
            return self._release(final=False)
        self._ids.append(token_id)
        self._absorb(final=False)
        return self._release(final=False)

    def flush(self) -> str:
        """At the end of generation: release whatever is held back (no stop string matched)."""
        if self.stopped:
            return ""
        if self._utf8 is None:
            self._absorb(final=True)
        # (A character whose last bytes never came is dropped, as the decode path drops it.)
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
            hits = [(i, s) for s in self._stops if (i := self._text.find(s)) >= 0]
            if hits:
                cut, self.matched_stop = min(hits, key=lambda hit: hit[0])
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
        """Hand out the first `end` characters of the held text."""
        delta, self._text = self._text[:end], self._text[end:]
        if delta:
            self._out.append(delta)
        return delta
