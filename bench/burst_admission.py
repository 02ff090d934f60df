"""A burst's admission, simulated: the real scheduler and core loop on the fake runner of the
tests (tests/helpers/fake_runner.py), whose clock advances by a cost model of each forward, so
that admission policies can be compared without a GPU (not a test; no MLX).

N requests arrive spread uniformly over --spread ms (the front ends deliver a burst over some
tens of ms); a prefill pass costs --pass-ms plus --token-us per prompt token, a decode step
--step-ms whatever its rows (a host-bound GPU: the defaults are an H200's for SmolLM2's shape,
bench/results/README.md). Prints, per spread, the first token's time after each request's
arrival (p50, max) and the burst's tokens per simulated second, for the scheduler as it is
(`prefill-first`: a pass that ends every prefill of a burst runs alone, Scheduler.
_admits_a_burst) and with a decode step beside every pass (`decode-beside`); writes JSON.

    PYTHONPATH=. .venv/bin/python bench/burst_admission.py [--requests 256] [--spread 0,10,30,60]
        [--pass-ms 9] [--token-us 3] [--step-ms 7] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from service.common.logging import configure_logging
from tests.helpers.fake_runner import FakeRunner, Harness


def _prefill_read_first(runner: FakeRunner) -> Callable[[Any], Any]:
    """The runner's take_prefill, reading a plan's prefill forwards before the decode step is
    built (as ModelRunner.submit does): their time has passed when the first tokens go out."""
    take = runner.take_prefill

    def take_prefill(pending: Any) -> Any:
        spent = sum(sum(part.prefill_seconds) for part in pending.prefill)
        runner.clock.now += spent
        pending.seconds -= spent
        return take(pending)

    return take_prefill


def simulate(args: argparse.Namespace, spread_ms: float, policy: str) -> dict[str, float]:
    def cost(rows: list[tuple[int | None, int]]) -> float:
        if any(n is not None for n, _ in rows):
            return args.pass_ms / 1e3 + args.token_us / 1e6 * sum(n or 0 for n, _ in rows)
        return args.step_ms / 1e3

    n = args.requests
    arrivals = np.sort(np.random.default_rng(args.seed).uniform(0, spread_ms / 1e3, n))
    h = Harness(
        cost=cost,
        max_batch_size=n,
        max_queue_depth=2 * n,
        max_batch_prefill=n,
        max_batch_prefill_tokens=args.prefill_tokens,
    )
    h.engine.take_prefill = _prefill_read_first(h.engine)  # type: ignore[method-assign]
    if policy == "decode-beside":
        h.sched._admits_a_burst = lambda plan, prefilling: False  # type: ignore[method-assign]
    clock = h.engine.clock
    submitted = 0
    while True:
        arrived = False
        while submitted < n and arrivals[submitted] <= clock.now:
            prompt = [1 + submitted % 500] * args.prompt_tokens
            h.submit(f"r{submitted}", prompt=prompt, max_tokens=args.max_tokens, ignore_eos=True)
            submitted, arrived = submitted + 1, True
        idle = not arrived and not h.sched.busy and h.loop._inflight is None
        if idle and submitted == n:
            break
        if idle:
            clock.now = float(arrivals[submitted])
            continue
        h.tick()
    ttft = [h.token_times[f"r{i}"][0] - arrivals[i] for i in range(n)]
    end = max(times[-1] for times in h.token_times.values())
    return {
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_max_ms": max(ttft) * 1e3,
        "tok_s": n * args.max_tokens / end,
    }


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--spread", default="0,10,30,60", help="arrival spreads, ms")
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--pass-ms", type=float, default=9.0)
    parser.add_argument("--token-us", type=float, default=3.0)
    parser.add_argument("--step-ms", type=float, default=7.0)
    parser.add_argument("--prefill-tokens", type=int, default=16384)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    return parser.parse_args(argv)


def main() -> None:
    args = parse()
    configure_logging("warning", "console")  # a line per simulated request would bury the table
    rows = []
    for spread in (float(s) for s in args.spread.split(",")):
        for policy in ("prefill-first", "decode-beside"):
            row = {"spread_ms": spread, "policy": policy, **simulate(args, spread, policy)}
            rows.append(row)
            print(
                f"spread {spread:5.0f} ms  {policy:14s} TTFT p50 {row['ttft_p50_ms']:6.1f} ms"
                f"  max {row['ttft_max_ms']:6.1f} ms  {row['tok_s']:8.0f} tok/s"
            )
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
