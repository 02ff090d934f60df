"""One request on a front end, from the engine core's token ids to what its RPC sends.

`RequestStream` is the request's only state in a front-end process, and the one place that
decides how the request ended, whoever ends it:
- the engine core (EOS, a stop token, max_tokens, the slot context, an engine error, a cancel)
  sends a `Final`, which the stream adopts;
- a stop string, matched here while detokenizing, ends it at once with STOP: the RPC's last
  message goes out without waiting for the core, which is told to free the sequence;
- the server's drain timeout ends it as cancelled (`end`);
- a full queue, the core's refusal of its response format, or the core's death fails it
  (`fail`): the RPC answers with a status.

The core client pushes each tick's outputs into the streams and wakes each stream once (under
load, every few ticks: service.frontend.core_client); the RPC takes everything that piled up
since it last sent (`take`), so a consumer that falls behind gets several tokens per message.
`python -m service generate` turns in-process outputs into text through the same class, so both
paths agree token for token.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from service.common.tokenizer import Tokenizer
from service.frontend.detokenizer import IncrementalDetokenizer
from service.protocol import Event, Final, FinishReason, GenerationRequest, Outputs, TokenLogprob


class Failure(enum.Enum):
    """Ends that are not a generation result: the RPC answers with an error status."""

    QUEUE_FULL = "queue_full"
    CORE_GONE = "core_gone"
    INVALID_FORMAT = "invalid_format"  # the core's grammar engine refused the format
    ADAPTER_NOT_FOUND = "adapter_not_found"  # unloaded while the request was on its way


@dataclass
class Delta:
    """What one or more engine steps add to the response."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)  # the core's lifecycle events
    final: Final | None = None  # set on the last delta
    stop_string: str = ""  # with `final`: the stop string that ended the request, if one did

    def __bool__(self) -> bool:
        return bool(self.token_ids or self.text or self.final is not None)


class RequestStream:
    def __init__(
        self,
        request: GenerationRequest,
        tokenizer: Tokenizer,
        eos_token_ids: frozenset[int],
        rid: int = 0,
    ) -> None:
        self.request = request
        self.rid = rid  # the core's handle of this request (unique in this front end)
        self._detok = IncrementalDetokenizer(
            tokenizer.decode, request.stop, tokenizer.ends_mid_character, tokenizer.text_bytes
        )
        self._no_text = (eos_token_ids if not request.ignore_eos else frozenset()) | (
            request.stop_token_ids
        )
        self.token_ids: list[int] = []
        self.final: Final | None = None  # how it ended, once it has
        self.failure: Failure | None = None
        self.failure_message = ""
        self.failure_code = ""  # a refused response format: the engine's refusal code
        self._pending = Delta()
        self._wake = asyncio.Event()
        # What the core told us, for a Final made here (a stop string).
        self._submitted_at = time.monotonic()
        self._admitted_at: float | None = None
        self._first_token_at: float | None = None
        self._cached_tokens = 0
        self._drafted = 0
        self._accepted = 0

    @property
    def ended(self) -> bool:
        return self.final is not None or self.failure is not None

    # -- what arrives ------------------------------------------------------------------
    def add_events(self, events: list[Event]) -> None:
        if self.ended:
            return
        self._pending.events.extend(events)
        for name, attrs in events:
            if name in ("admitted", "resumed") and self._admitted_at is None:
                self._admitted_at = time.monotonic()
                self._cached_tokens = int(attrs.get("prefix_hit_tokens", 0))

    def add_tokens(self, token_ids: list[int], logprobs: list[TokenLogprob] | None = None) -> bool:
        """New tokens of this request. True when a stop string ended it here: the core must be
        told to free the sequence."""
        if self.ended or not token_ids:
            return False
        if self._first_token_at is None:
            self._first_token_at = time.monotonic()
        pending = self._pending
        for i, token in enumerate(token_ids):
            self.token_ids.append(token)
            pending.token_ids.append(token)
            if logprobs is not None and i < len(logprobs):
                pending.logprobs.append(logprobs[i])
            if token not in self._no_text:
                pending.text += self._detok.push(token)
                if self._detok.stopped:
                    self._finish(self._final_here(FinishReason.STOP))
                    pending.stop_string = self._detok.matched_stop
                    return True
        return False

    def add_drafts(self, drafted: int, accepted: int) -> None:
        self._drafted += drafted
        self._accepted += accepted

    def adopt(self, final: Final) -> None:
        """The core ended the request."""
        if self.ended:
            return
        if final.reason != FinishReason.ERROR.value:
            self._pending.text += self._detok.flush()
        self._finish(final)

    def end(self) -> None:
        """The server's drain timeout passed: the held-back text, then CANCELLED."""
        if not self.ended:
            self._pending.text += self._detok.flush()
            self._finish(self._final_here(FinishReason.CANCELLED))

    def fail(self, failure: Failure, message: str = "", code: str = "") -> None:
        if not self.ended:
            self.failure, self.failure_message, self.failure_code = failure, message, code
            self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    @property
    def urgent(self) -> bool:
        """Its next message must not wait for a turn (service.frontend.core_client): it ended,
        or nothing of it was sent yet (its first tokens)."""
        return self.ended or len(self._pending.token_ids) == len(self.token_ids)

    # -- what the RPC sends ------------------------------------------------------------
    async def next_delta(self) -> Delta:
        """Everything that arrived since the last call (waits until something has)."""
        while not self._pending and not self._pending.events and not self.failure:
            self._wake.clear()
            await self._wake.wait()
        return self.take()

    def take(self) -> Delta:
        delta, self._pending = self._pending, Delta()
        return delta

    # -- helpers -----------------------------------------------------------------------
    def _finish(self, final: Final) -> None:
        self.final = final
        self._pending.final = final
        self._wake.set()

    def _final_here(self, reason: FinishReason) -> Final:
        """The Final of a request this front end ended, from what it has seen of it."""
        now = time.monotonic()
        start = self._submitted_at
        return Final(
            reason.value,
            None,
            len(self.request.prompt_token_ids),
            len(self.token_ids),
            self._cached_tokens,
            (self._admitted_at or now) - start,
            (self._first_token_at or now) - start,
            now - start,
            self._drafted,
            self._accepted,
        )


def push_outputs(
    out: Outputs, streams: Mapping[int, RequestStream], touched: dict[int, RequestStream]
) -> list[int]:
    """One tick's outputs into their streams (events, tokens, drafts, then the finals); the
    streams that got something go into `touched`. Returns the rids a stop string ended here."""
    stopped = []
    for rid, events in out.events.items():
        stream = streams.get(rid)
        if stream is not None:
            stream.add_events(events)
            touched[rid] = stream
    counts, tokens, logprobs = out.counts, out.tokens, out.logprobs
    offset = 0
    taken: dict[int, int] = {}  # per rid, its logprobs handed out (a rid may recur)
    for i, rid in enumerate(out.rids):
        n = 1 if counts is None else counts[i]
        stream = streams.get(rid)
        if stream is not None:
            lps = logprobs.get(rid)
            if lps is not None:
                first = taken.get(rid, 0)
                lps, taken[rid] = lps[first : first + n], first + n
            if stream.add_tokens(tokens[offset : offset + n], lps):
                stopped.append(rid)
            touched[rid] = stream
        offset += n
    for rid, (drafted, accepted) in out.drafts.items():
        stream = streams.get(rid)
        if stream is not None:
            stream.add_drafts(drafted, accepted)
    for rid, final in out.finals.items():
        stream = streams.get(rid)
        if stream is not None:
            stream.adopt(final)
            touched[rid] = stream
    return stopped
