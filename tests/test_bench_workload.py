"""The benchmark harness's plans and summaries (client.bench.workload, client.bench.metrics)."""

from __future__ import annotations

from client.bench.metrics import LevelResult, RequestRecord
from client.bench.workload import Workload, build_plan


def test_min_requests_adds_rounds_only_where_c_times_rounds_falls_short():
    plan = build_plan(Workload(concurrency=(1, 4, 16), rounds=2, min_requests=8))
    sizes = [(level.concurrency, [len(b) for b in level.batches]) for level in plan.levels]
    assert sizes == [(1, [1] * 8), (4, [4, 4]), (16, [16, 16])]
    assert Workload.from_dict(Workload(min_requests=8).to_dict()).min_requests == 8


def test_summary_reports_the_server_measured_ttft_next_to_the_client_one():
    records = [
        RequestRecord("q", ttft=0.020 + i / 1000, server_ttft=0.010 + i / 1000, latency=1.0)
        for i in range(3)
    ]
    summary = LevelResult("ours", 1, wall_seconds=3.0, requests=records).summary()
    assert summary["ttft_p50"] == 0.021
    assert summary["server_ttft_p50"] == 0.011
    # A peer's records carry no server TTFT: the key is absent rather than a made-up value.
    peer = LevelResult("raw", 1, wall_seconds=3.0, requests=[RequestRecord("q", ttft=0.02)])
    assert "server_ttft_p50" not in peer.summary()
