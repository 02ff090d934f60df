"""The benchmark harness's plans and summaries (client.bench.workload, client.bench.metrics),
how it finds the repository's peers (bench/peers/), and the acceptance targets the comparison
runs check (bench/targets.py, not the client)."""

from __future__ import annotations

import argparse
import json

import pytest

import bench.peers
from bench import targets
from client.bench import report
from client.bench.cli import add_bench_arguments, checkout_peers, git_state, run_bench
from client.bench.metrics import LevelResult, RequestRecord
from client.bench.server import CHECKOUT_ROOT
from client.bench.workload import Workload, build_plan
from client.cli import build_parser


def test_min_requests_adds_rounds_only_where_c_times_rounds_falls_short():
    plan = build_plan(Workload(concurrency=(1, 4, 16), rounds=2, min_requests=8))
    sizes = [(level.concurrency, [len(b) for b in level.batches]) for level in plan.levels]
    assert sizes == [(1, [1] * 8), (4, [4, 4]), (16, [16, 16])]
    assert Workload.from_dict(Workload(min_requests=8).to_dict()).min_requests == 8


def test_summary_reports_the_server_measured_ttft_next_to_the_client_one():
    records = [
        RequestRecord(
            "q",
            ttft=0.020 + i / 1000,
            server_ttft=0.010 + i / 1000,
            server_queue=0.002 + i / 1000,
            latency=1.0,
        )
        for i in range(3)
    ]
    summary = LevelResult("ours", 1, wall_seconds=3.0, requests=records).summary()
    assert summary["ttft_p50"] == 0.021
    assert summary["server_ttft_p50"] == 0.011
    assert summary["server_queue_p50"] == 0.003
    # A peer's records carry no server TTFT: the key is absent rather than a made-up value.
    peer = LevelResult("raw", 1, wall_seconds=3.0, requests=[RequestRecord("q", ttft=0.02)])
    assert "server_ttft_p50" not in peer.summary() and "server_queue_p50" not in peer.summary()


def test_a_checkout_finds_its_peers_and_their_options() -> None:
    assert checkout_peers() is bench.peers
    assert set(bench.peers.PEERS) == {"mlx-lm", "raw", "mlx-lm-batch"}
    args = build_parser().parse_args(["bench", "--peer", "raw", "--peer-keep-eos"])
    assert args.peer == ["raw"] and args.peer_keep_eos


def test_without_peers_the_harness_names_where_they_are(tmp_path) -> None:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)  # as an installed client builds it: no peers module
    args = parser.parse_args(["--peer", "raw", "--out", str(tmp_path / "run.json")])
    with pytest.raises(ValueError, match=r"python -m bench\.compare"):
        run_bench(args, None)
    assert not (tmp_path / "run.json").exists()


def _level(target: str, concurrency: int, tokens: int) -> LevelResult:
    record = RequestRecord("q", max_tokens=tokens, completion_tokens=tokens)
    return LevelResult(target, concurrency, wall_seconds=1.0, requests=[record])


def test_targets_are_checked_from_a_runs_json(tmp_path) -> None:
    ours = [_level("ours", 1, 10), _level("ours", 8, 40), _level("ours", 16, 90)]
    peers = {"mlx-lm": [_level("mlx-lm", 8, 40), _level("mlx-lm", 16, 60)]}
    path = tmp_path / "run.json"
    report.write_json(path, {"dtype": "auto"}, ours, peers)
    assert "targets" not in json.loads(path.read_text())  # the client's report has none

    text = targets.annotate(path, "auto")
    recorded = json.loads(path.read_text())["targets"]
    assert recorded["kind"] == "cpu"
    assert {c["target"]: c["met"] for c in recorded["checks"]} == {
        "ours C=8 / C=1 >= 5x": False,
        "ours / mlx-lm at C=8 >= 1.2x": False,
        "ours / mlx-lm at C=16 >= 1.2x": True,
    }
    assert "NOT met" in text
    # The GPU targets name C=64 and the raw peer, which this run did not measure.
    assert targets.target_checks("gpu", json.loads(path.read_text())) == []


def test_a_commit_is_named_only_for_a_checkouts_root(tmp_path) -> None:
    """A bench's JSON names the commit of the tree it ran; a tree copied into another checkout
    (a branch's files unpacked inside this one) or outside any names none."""
    if CHECKOUT_ROOT is None or not (CHECKOUT_ROOT / ".git").exists():
        pytest.skip("not run from a git checkout")
    here = git_state()
    assert len(here["commit"]) == 40 and isinstance(here["dirty"], bool)
    assert git_state(CHECKOUT_ROOT / "bench") == {}
    assert git_state(tmp_path) == {}
