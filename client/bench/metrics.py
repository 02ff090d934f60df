"""Per-request measurements and per-level summaries."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

PERCENTILES = (50, 95, 99)


def percentile(samples: Sequence[float], pct: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), None for no samples."""
    if not samples:
        return None
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * pct / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds."""

    prompt: str
    max_tokens: int = 0
    # Exact counts from the server's usage (the message count where no usage came back).
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    # Send time, relative to the level's start.
    start: float = 0.0
    # Send to the first message carrying tokens; None when no token arrived.
    ttft: float | None = None
    # The gap before each streamed message after the first, spread over the tokens it carried
    # (where the target says how many; an HTTP peer's SSE event counts as one).
    inter_token: list[float] = field(default_factory=list)
    latency: float = 0.0
    # Arrival to first token as the server measured it (our server's final Timing; None for
    # peers): the rest of `ttft` is the RPC, request parsing and tokenization.
    server_ttft: float | None = None
    # Of `server_ttft`, arrival to admission (the final Timing's queue_seconds): the rest is
    # the request's prefill and its wait for a pass.
    server_queue: float | None = None
    finish_reason: str | None = None
    error: str | None = None


class LevelKey:
    """What names a level: its concurrency (burst/closed) or its Poisson rate."""

    concurrency: int | None
    rate: float | None

    @property
    def label(self) -> str:
        return f"C={self.concurrency}" if self.rate is None else f"rate={self.rate:g}/s"

    @property
    def x(self) -> float:
        """The level's value on a plot's x axis."""
        return float(self.rate if self.rate is not None else self.concurrency or 0)


@dataclass
class LevelResult(LevelKey):
    """One level (a concurrency, or a Poisson rate) of one target."""

    target: str
    concurrency: int | None
    rate: float | None = None
    wall_seconds: float = 0.0
    requests: list[RequestRecord] = field(default_factory=list)
    # Target-specific figures (e.g. the peer's own prompt/decode rates).
    extra: dict[str, Any] = field(default_factory=dict)
    # Targets that only report totals (the in-process peers) set these directly.
    completion_tokens_total: int | None = None
    request_count: int | None = None

    @property
    def completion_tokens(self) -> int:
        if self.completion_tokens_total is not None:
            return self.completion_tokens_total
        return sum(r.completion_tokens for r in self.requests)

    @property
    def num_requests(self) -> int:
        return self.request_count if self.request_count is not None else len(self.requests)

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.requests if r.error is None]
        ttft = [r.ttft for r in ok if r.ttft is not None]
        itl = [gap for r in ok for gap in r.inter_token]
        prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        out: dict[str, Any] = {
            "target": self.target,
            "concurrency": self.concurrency,
            "rate": self.rate,
            "requests": self.num_requests,
            "errors": sum(r.error is not None for r in self.requests),
            "completion_tokens": self.completion_tokens,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
            "requests_per_second": (
                self.num_requests / self.wall_seconds if self.wall_seconds > 0 else 0.0
            ),
            "prompt_tokens_mean": (
                sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None
            ),
            # Little's law: the average number of requests in flight over the level.
            "mean_in_flight": (
                sum(r.latency for r in self.requests) / self.wall_seconds
                if self.requests and self.wall_seconds > 0
                else None
            ),
            "short_completions": sum(
                1 for r in ok if r.max_tokens and r.completion_tokens < r.max_tokens
            ),
        }
        for pct in PERCENTILES:
            out[f"ttft_p{pct}"] = percentile(ttft, pct)
        for pct in PERCENTILES:
            out[f"itl_p{pct}"] = percentile(itl, pct)
        server_ttft = [r.server_ttft for r in ok if r.server_ttft is not None]
        if server_ttft:
            out["server_ttft_p50"] = percentile(server_ttft, 50)
        server_queue = [r.server_queue for r in ok if r.server_queue is not None]
        if server_queue:
            out["server_queue_p50"] = percentile(server_queue, 50)
        out["latency_p50"] = percentile([r.latency for r in ok], 50)
        out.update(self.extra)
        return out

    def to_dict(self) -> dict[str, Any]:
        requests = []
        for record in self.requests:
            item = asdict(record)
            # Microseconds are plenty, and keep the JSON files small.
            item["inter_token"] = [round(gap, 6) for gap in record.inter_token]
            for key in ("start", "ttft", "server_ttft", "server_queue", "latency"):
                if item[key] is not None:
                    item[key] = round(item[key], 6)
            requests.append(item)
        return {"summary": self.summary(), "requests": requests}
