"""The scheduler and core loop alone: their CPU per generated token, with no model at all (not
a test).

The server's own scheduler and KV manager (built by the runtime for a preset, as `serve`
builds them) and the real core loop drive a runner that computes nothing: every row samples
token 7 and a prefill pass reports a fixed time to the stall bound. C requests stay in flight
(closed loop: token-id prompts, ignore_eos, a fixed completion length, the first C requests
ending at staggered lengths so that rows join and leave at every step), as
bench/serving_overhead.py drives the server. Single-threaded and free of MLX's work, the
figure is steady enough to show changes to the per-step bookkeeping that the noise of a whole
server hides. `--profile N` prints cProfile's top N functions of the last round.

    python bench/scheduler_alone.py --concurrency 256 --rounds 3 [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.core_alone import CountingSink  # noqa: E402
from service.core.scheduler.plan import RowMasks, StepPlan, StepResult  # noqa: E402

TOKEN = 7


@dataclass
class _Pending:
    plan: StepPlan
    prefill_taken: bool = False


class IdleRunner:
    """The loop's Runner that runs nothing: each sampling row draws TOKEN; each prefill pass
    took `prefill_s` seconds. Not the tests' FakeRunner (tests/helpers/fake_runner.py), which
    records every forward row by row: that work would be counted as the scheduler's."""

    def __init__(self, prefill_s: float) -> None:
        self.prefill_s = prefill_s

    def submit(self, plan: StepPlan, dispatch: bool = True) -> _Pending:
        return _Pending(plan)

    def dispatch(self, pending: _Pending) -> _Pending:
        return pending

    def sample(self, pending: _Pending, masks: RowMasks) -> _Pending:
        return pending

    def stage_masks(self, pending: _Pending, masks: RowMasks) -> None:
        return None

    def take_prefill(self, pending: _Pending) -> StepResult:
        pending.prefill_taken = True  # collect returns the decode part alone
        return self._prefill(pending.plan)

    def collect(self, pending: _Pending) -> StepResult:
        plan = pending.plan
        prefill = self._prefill(plan) if not pending.prefill_taken else StepResult.empty(plan.step)
        decode = np.asarray(plan.decode, np.int32)
        slots = np.concatenate([prefill.slots, decode])
        result = StepResult(plan.step, slots, np.full(len(slots), TOKEN, np.int32))
        result.prefill_seconds = prefill.prefill_seconds
        result.prefill_rows = len(prefill.slots)
        result.decoded = bool(plan.decode)
        return result

    def read_beside(self, pending: _Pending) -> StepResult | None:
        return None

    def load_adapter(self, name: str, path: str, slot: int) -> Any:
        raise NotImplementedError

    def _prefill(self, plan: StepPlan) -> StepResult:
        slots = np.asarray([c.slot for f in plan.prefill for c in f if c.sample], np.int32)
        result = StepResult(plan.step, slots, np.full(len(slots), TOKEN, np.int32))
        result.prefill_seconds = [self.prefill_s] * len(plan.prefill)
        result.prefill_rows = len(slots)
        return result


def _loop(args: argparse.Namespace) -> Any:
    from service.common.config import (
        CoreConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulingConfig,
    )
    from service.core.loop import CoreLoop
    from service.core.runtime import Runtime

    config = CoreConfig(
        model=ModelConfig(load_format=f"dummy:{args.preset}", dtype="float32"),
        scheduling=SchedulingConfig(
            max_batch_size=args.concurrency, max_queue_depth=args.concurrency
        ),
        observability=ObservabilityConfig(log_level=args.log_level),
    )
    runtime = Runtime(config)
    runtime.load()  # the scheduler and KV manager the server would build
    return CoreLoop(runtime.scheduler, IdleRunner(args.prefill_ms / 1000), overlap_steps=False)


def _round(loop: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    from service.core.scheduler.request import Request
    from service.protocol import GenerationRequest

    rng = random.Random(seed)
    sink = CountingSink()
    submitted = 0
    # Made before the clock starts: a client's work, not the scheduler's.
    prompts = [
        tuple(rng.randrange(17, 500) for _ in range(args.prompt_len)) for _ in range(args.requests)
    ]

    def submit() -> None:
        nonlocal submitted
        prompt = prompts[submitted]
        # The first C requests end at staggered lengths, so that from then on a few requests
        # end, and a few join, at every step (as in a closed loop that has settled).
        first = submitted < args.concurrency
        staggered = 1 + submitted * args.max_tokens // args.concurrency
        max_tokens = staggered if first else args.max_tokens
        request = GenerationRequest(
            f"r{seed}-{submitted}", prompt, max_tokens=max_tokens, ignore_eos=True
        )
        loop.submit(Request(request, sink, rid=submitted))
        submitted += 1

    steps = 0
    limit = 4 * args.requests * (args.prompt_len + args.max_tokens)  # far past any schedule
    for _ in range(args.concurrency):
        submit()
    cpu = time.process_time()
    while sink.finished < args.requests:
        room = args.concurrency - (submitted - sink.finished)
        for _ in range(min(room, args.requests - submitted)):
            submit()
        loop._drain(block=False)
        loop.turn()
        loop._deliver()
        steps += 1
        if steps > limit:
            raise RuntimeError(f"{args.requests - sink.finished} requests did not finish")
    cpu_s = time.process_time() - cpu
    loop._finish_inflight()
    loop._deliver()
    return {
        "tokens": sink.tokens,
        "steps": steps,
        "cpu_us_per_token": cpu_s / sink.tokens * 1e6,
        "cpu_us_per_step": cpu_s / steps * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = parser.add_argument
    a("--preset", default="tiny-vocab")
    a("--concurrency", type=int, default=256)
    a("--requests", type=int, default=2048)
    a("--prompt-len", type=int, default=32)
    a("--max-tokens", type=int, default=128)
    a(
        "--prefill-ms",
        type=float,
        default=0.05,
        help="what each prefill pass reports it took: small, so that the stall bound (which "
        "weighs it against these steps' sub-millisecond length) never holds prompts back",
    )
    a("--log-level", default="info", help="the server's default: a line per finished request")
    a("--log-file", default=os.devnull, help="where the log's JSON lines go")
    a("--rounds", type=int, default=3)
    a("--profile", type=int, default=0, help="print cProfile's top N of the last round")
    a("--out", type=Path)
    args = parser.parse_args()
    from service.common.logging import configure_logging

    # JSON lines, as a server whose stdout is not a terminal writes them, to --log-file.
    log_file = open(args.log_file, "w")  # noqa: SIM115 (open for the process's life)
    with contextlib.redirect_stdout(log_file):
        configure_logging(args.log_level, "json")
    loop = _loop(args)
    rounds = []
    for r in range(args.rounds):
        profiler = cProfile.Profile() if args.profile and r == args.rounds - 1 else None
        if profiler is not None:
            profiler.enable()
        row = _round(loop, args, seed=r)
        if profiler is not None:
            profiler.disable()
        rounds.append(row)
        print(
            f"round {r}: {row['tokens']} tokens, {row['steps']} steps: "
            f"{row['cpu_us_per_token']:.2f} us/token, {row['cpu_us_per_step']:.0f} us/step",
            flush=True,
        )
        if profiler is not None:
            pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile)
    per_token = [r["cpu_us_per_token"] for r in rounds]
    low, high = min(per_token), max(per_token)
    print(f"median {statistics.median(per_token):.2f} us/token ({low:.2f}-{high:.2f})")
    if args.out:
        document = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds}
        args.out.write_text(json.dumps(document))


if __name__ == "__main__":
    main()
