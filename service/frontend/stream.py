"""One request's stream on the front end: from the engine's token ids to what the client sees.

The engine core sends token ids (and logprobs); here they become UTF-8-safe text deltas, stop
strings are matched (the caller then aborts the sequence in the core and ends the RPC with
STOP), and the final usage and timing are taken from the core's summary. The same code turns
`python -m service generate`'s in-process outputs into text, so both paths agree token for
token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from service.common.tokenizer import Tokenizer
from service.frontend.detokenizer import IncrementalDetokenizer
from service.protocol import Final, FinishReason, GenerationRequest, StepOutput
from service.protocol import TokenLogprob as EngineLogprob


@dataclass
class Delta:
    """What one or more engine steps add to the response."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[EngineLogprob] = field(default_factory=list)
    final: Final | None = None  # set on the last delta
    stop_string: str = ""  # with `final`: the stop string that ended the request, if one did


class RequestStream:
    def __init__(
        self, request: GenerationRequest, tokenizer: Tokenizer, eos_token_ids: frozenset[int]
    ) -> None:
        self.request = request
        self._detok = IncrementalDetokenizer(
            tokenizer.decode, request.stop, tokenizer.ends_mid_character
        )
        self._no_text = (eos_token_ids if not request.ignore_eos else frozenset()) | (
            request.stop_token_ids
        )
        self.token_ids: list[int] = []
        self.stopped = False  # a stop string matched: the core must be told to stop
        self.done = False

    def push(self, out: StepOutput) -> Delta:
        """Take one engine output (tokens, maybe the final summary) of this request."""
        delta = Delta()
        if self.done:
            return delta
        for i, token in enumerate(out.token_ids):
            if self.stopped:
                break  # generated after the stop string, before the core heard of it
            self.token_ids.append(token)
            delta.token_ids.append(token)
            if i < len(out.logprobs):
                delta.logprobs.append(out.logprobs[i])
            if token not in self._no_text:
                delta.text += self._detok.push(token)
                self.stopped = self._detok.stopped
        if out.final is not None:
            self.done = True
            final = out.final
            if self.stopped:
                # Our abort ended it: a stop, with the tokens up to the stop string.
                delta.stop_string = self._detok.matched_stop
                final = Final(
                    FinishReason.STOP.value,
                    None,
                    final.prompt_tokens,
                    len(self.token_ids),
                    final.cached_tokens,
                    final.queue_seconds,
                    final.ttft_seconds,
                    final.total_seconds,
                    final.drafted_tokens,
                    final.accepted_tokens,
                )
            elif final.reason != FinishReason.ERROR.value:
                delta.text += self._detok.flush()
            delta.final = final
        return delta

    def end(self, final: Final) -> Delta:
        """End the stream here (the server is shutting down): the held-back text and `final`."""
        delta = Delta()
        if not self.done:
            self.done = True
            delta.text = self._detok.flush()
            delta.final = final
        return delta
