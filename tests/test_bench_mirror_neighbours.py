"""bench/mirror_neighbours.py runs on the CPU's mirrored decode path and reports both of its
measurements."""

from __future__ import annotations

import argparse

from bench import mirror_neighbours


def test_both_measurements_run_beside_mirrored_rows():
    args = argparse.Namespace(preset="tiny-vocab", dtype="float32", rows=3, batch=3, repeats=2)
    after = mirror_neighbours.prefill_after_decode(args, 4)
    assert after["decode_steps"] == 4 and after["prefill_ms"] > 0 and after["decode_step_ms"] > 0
    passes = mirror_neighbours.one_token_pass(args)
    assert passes["pass_and_decode_cpu_ms"] > 0 and passes["decode_cpu_ms"] > 0
