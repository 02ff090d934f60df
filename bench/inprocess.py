"""Drive the engine core's runtime (scheduler + engine, no gRPC, no front end) from a script:
what the in-process benchmarks share."""

from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Sequence

from service.core.runtime import Runtime
from service.core.scheduler.request import Request
from service.protocol import GenerationRequest, Outputs, SamplingParams


class Collect:
    """An output sink that counts tokens and notes how each request finished."""

    def __init__(self, expected: int) -> None:
        self.batch_key: Hashable = object()  # one deliver() per tick for all of them
        self.tokens = 0
        self.finals: dict[int, str] = {}
        self._expected = expected
        self._done = threading.Event()

    def deliver(self, outputs: Outputs) -> None:
        self.tokens += len(outputs.tokens)
        for rid, final in outputs.finals.items():
            self.finals[rid] = final.reason
        if len(self.finals) == self._expected:
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def run_batch(
    runtime: Runtime,
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    tag: str,
    timeout: float = 600,
) -> tuple[float, Collect]:
    """Submit every prompt at once (greedy, EOS ignored, no prefix cache); return the wall
    seconds until the last one finished, and the sink."""
    sink = Collect(len(prompts))
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        request = GenerationRequest(
            f"{tag}-{i}",
            tuple(prompt),
            SamplingParams(),
            max_tokens=max_tokens,
            ignore_eos=True,
            cache_prompt=False,
        )
        runtime.loop.submit(Request(request, sink, rid=i))
    if not sink.wait(timeout):
        raise TimeoutError(f"{tag}: {len(sink.finals)} of {len(prompts)} requests finished")
    bad = {rid: reason for rid, reason in sink.finals.items() if reason != "length"}
    if bad:
        raise RuntimeError(f"{tag}: requests did not run to max_tokens: {bad}")
    return time.perf_counter() - started, sink
