"""bench/burst_admission.py: the simulated burst runs the real scheduler on the fake runner's
clock, and the scheduler's burst rule gets the burst its first tokens sooner than a decode step
beside every pass (simulated seconds, not a timed test)."""

from __future__ import annotations

from bench import burst_admission


def test_the_burst_rule_gets_first_tokens_sooner_in_simulated_time() -> None:
    args = burst_admission.parse(["--requests", "48", "--max-tokens", "8"])
    first = burst_admission.simulate(args, 30.0, "prefill-first")
    beside = burst_admission.simulate(args, 30.0, "decode-beside")
    assert first["ttft_max_ms"] < beside["ttft_max_ms"]
    assert first["ttft_p50_ms"] <= beside["ttft_p50_ms"]
    assert first["tok_s"] >= beside["tok_s"] > 0
    # Both at once: no arrival spread, one pass either way.
    assert burst_admission.simulate(args, 0.0, "prefill-first") == burst_admission.simulate(
        args, 0.0, "decode-beside"
    )
