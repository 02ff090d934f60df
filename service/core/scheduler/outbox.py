"""A tick's outputs, gathered per sink and sent as one `Outputs` message each.

Tokens arrive as arrays (a step's sampled slots and tokens); the slot -> (sink, rid) maps are
arrays too, so splitting a step's tokens among the front ends is a few array operations. The
rest (events, logprobs, finals) is sparse and kept per request.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from service.core.scheduler.request import OutputSink
from service.protocol import Event, Final, Outputs, TokenLogprob


class Outbox:
    def __init__(self, max_rows: int) -> None:
        self.sink_of = np.zeros(max_rows, np.int32)  # per slot: the index of its row's sink
        self.rid_of = np.zeros(max_rows, np.int64)  # per slot: its row's rid
        self._sinks: list[OutputSink] = []
        self._index: dict[Hashable, int] = {}
        # Per call of `tokens`: the rows' sinks and rids then (a slot may change hands before
        # the tick's messages go out), their tokens and counts.
        self._tokens: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]] = []
        self._sparse: dict[int, Outputs] = {}  # sink index -> events, logprobs, finals

    def sink_index(self, sink: OutputSink) -> int:
        """The sink's index by its batch key; the latest sink object of a key is the one
        delivered to (a front end that registers again gets a new one)."""
        key = sink.batch_key
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._sinks)
            self._sinks.append(sink)
        else:
            self._sinks[index] = sink
        return index

    def bind(self, slot: int, sink: OutputSink, rid: int) -> None:
        """Route the outputs of `slot` to `sink` as `rid`'s."""
        self.sink_of[slot] = self.sink_index(sink)
        self.rid_of[slot] = rid

    def tokens(self, slots: np.ndarray, tokens: np.ndarray, counts: np.ndarray | None) -> None:
        """`slots[i]`'s new token is `tokens[i]` (or `counts[i]` consecutive ones)."""
        if len(slots):
            self._tokens.append((self.sink_of[slots], self.rid_of[slots], tokens, counts))

    def _of(self, sink: OutputSink) -> Outputs:
        index = self.sink_index(sink)
        out = self._sparse.get(index)
        if out is None:
            out = self._sparse[index] = Outputs()
        return out

    def event(self, sink: OutputSink, rid: int, event: Event) -> None:
        self._of(sink).events.setdefault(rid, []).append(event)

    def logprobs(self, sink: OutputSink, rid: int, logprobs: list[TokenLogprob]) -> None:
        self._of(sink).logprobs.setdefault(rid, []).extend(logprobs)

    def drafts(self, sink: OutputSink, rid: int, drafted: int, accepted: int) -> None:
        self._of(sink).drafts[rid] = (drafted, accepted)

    def final(self, sink: OutputSink, rid: int, final: Final) -> None:
        self._of(sink).finals[rid] = final

    def take(self) -> list[tuple[OutputSink, Outputs]]:
        """This tick's messages, one per sink that has something; the outbox starts over."""
        outputs = dict(self._sparse)
        for sinks, rids, tokens, counts in self._tokens:
            for index in np.unique(sinks).tolist():
                mine = sinks == index
                out = outputs.get(index)
                if out is None:
                    out = outputs[index] = Outputs()
                _add_tokens(out, rids[mine].tolist(), tokens, counts, mine)
        self._tokens = []
        self._sparse = {}
        return [(self._sinks[i], out) for i, out in outputs.items() if out]


def _add_tokens(
    out: Outputs, rids: list[int], tokens: np.ndarray, counts: np.ndarray | None, mine: np.ndarray
) -> None:
    if counts is None:
        if out.counts is not None:
            out.counts.extend([1] * len(rids))
        out.rids.extend(rids)
        out.tokens.extend(tokens[mine].tolist())
        return
    if out.counts is None:
        out.counts = [1] * len(out.rids)
    out.rids.extend(rids)
    out.counts.extend(counts[mine].tolist())
    out.tokens.extend(tokens[np.repeat(mine, counts)].tolist())
