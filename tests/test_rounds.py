"""bench/rounds.py: each burst round's tokens/s for ours and a peer, their ratio round by round,
and our TTFT beside the part of it spent in the engine core."""

from __future__ import annotations

import pytest

from bench import rounds


def burst(rates: list[float], c: int, server_ttft: float | None) -> dict:
    """A level of `c`-request rounds, each round's requests making `rate` tokens/s together."""
    requests, t = [], 0.0
    for rate in rates:
        seconds = 10 * c / rate  # every request: 10 tokens
        requests += [{"start": t, "latency": seconds, "completion_tokens": 10} for _ in range(c)]
        t += seconds + 1
    summary = {"concurrency": c, "ttft_p50": 0.05}
    if server_ttft is not None:
        summary["server_ttft_p50"] = server_ttft
        summary["server_queue_p50"] = server_ttft / 4
    return {"summary": summary, "requests": requests}


def test_rounds_ratio_and_the_cores_share_of_ttft() -> None:
    document = {
        "ours": [burst([100.0, 300.0], 4, 0.04)],
        "peers": {"raw": [burst([200.0, 200.0], 4, None)]},
    }
    (row,) = rounds.summarize(document, "raw")
    assert row["ours_tok_s"] == pytest.approx({"median": 200.0, "min": 100.0, "max": 300.0})
    assert row["ours_over_raw"] == pytest.approx({"median": 1.0, "min": 0.5, "max": 1.5})
    assert row["ttft_p50_ms"] == 50.0 and row["server_ttft_p50_ms"] == 40.0
    assert row["server_queue_p50_ms"] == 10.0
    assert (
        "server_ttft_p50_ms"
        not in rounds.summarize({"ours": [burst([1.0], 1, None)], "peers": {}}, "raw")[0]
    )
