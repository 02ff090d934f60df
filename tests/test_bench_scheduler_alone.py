"""bench/scheduler_alone.py: the server's scheduler and core loop on a runner that computes
nothing still serve every request its whole completion, with rows joining and leaving."""

from __future__ import annotations

import argparse

from bench import scheduler_alone


def test_every_request_gets_its_completion_and_the_batch_turns_over():
    args = argparse.Namespace(
        preset="tiny-vocab",
        concurrency=8,
        requests=24,
        prompt_len=5,
        max_tokens=6,
        prefill_ms=0.05,
        log_level="info",
    )
    loop = scheduler_alone._loop(args)
    row = scheduler_alone._round(loop, args, seed=0)
    # The first 8 end at staggered lengths 1..6; the other 16 run all 6 tokens.
    staggered = sum(1 + i * 6 // 8 for i in range(8))
    assert row["tokens"] == staggered + 16 * 6
    assert loop.scheduler.num_waiting == 0
    # More steps than one cohort's completion: requests joined while others decoded.
    assert row["steps"] > 6
