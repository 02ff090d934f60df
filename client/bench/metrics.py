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
    completion_tokens: int = 0
    # Send to the first message carrying tokens; None when no token arrived.
    ttft: float | None = None
    # The gap before each streamed message, spread over the tokens it carried.
    inter_token: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str | None = None


@dataclass
class LevelResult:
    """One concurrency level of one target."""

    target: str
    concurrency: int
    wall_seconds: float = 0.0
    requests: list[RequestRecord] = field(default_factory=list)
    # Target-specific figures (e.g. the peer's own prompt/decode rates).
    extra: dict[str, Any] = field(default_factory=dict)
    # Targets that only report totals (the in-process peer) set these directly.
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
        ttft = [r.ttft for r in self.requests if r.ttft is not None]
        itl = [gap for r in self.requests for gap in r.inter_token]
        out: dict[str, Any] = {
            "target": self.target,
            "concurrency": self.concurrency,
            "requests": self.num_requests,
            "errors": sum(r.error is not None for r in self.requests),
            "completion_tokens": self.completion_tokens,
            "wall_seconds": self.wall_seconds,
            "tokens_per_second": self.tokens_per_second,
            "requests_per_second": (
                self.num_requests / self.wall_seconds if self.wall_seconds > 0 else 0.0
            ),
        }
        for pct in PERCENTILES:
            out[f"ttft_p{pct}"] = percentile(ttft, pct)
        for pct in PERCENTILES:
            out[f"itl_p{pct}"] = percentile(itl, pct)
        out.update(self.extra)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary(), "requests": [asdict(r) for r in self.requests]}
