"""The engine core alone, in-process: tokens/s and CPU per token without gRPC or front ends.

Keeps C requests in flight (closed loop: a finished request is replaced at once, so rows join
and leave the batch all the time) on a preset's random weights, token-id prompts, ignore_eos,
until --requests have finished; prints tokens/s and the process's CPU microseconds per
generated token for each round, their median and range, and writes JSON (`--out`). For A/Bs
of two versions of the code, run it from each checkout in alternation (`--repo` names the
checkout to import; the JSON records its commit). One OpenBLAS thread, as
bench/serving_overhead.py gives the server: this model's products gain nothing from a second,
whose idle spinning would be billed as the core's CPU.

    env $(python -m service.common.blas --env) OPENBLAS_NUM_THREADS=1 python bench/core_alone.py \\
        --preset tiny-vocab --concurrency 256 --requests 1024 --rounds 3 --out a.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--preset", default="tiny-vocab")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512, help="prompt ids stay below it")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    runtime = _runtime(args)
    rounds = []
    for r in range(args.rounds):
        row = _round(runtime, args, seed=r)
        rounds.append(row)
        print(
            f"round {r}: {row['tokens']} tokens in {row['seconds']:.2f} s = {row['tok_s']:.0f} "
            f"tok/s; CPU {row['cpu_us_per_token']:.1f} us/token",
            flush=True,
        )
    runtime.shutdown()
    summary = {
        key: {
            "median": statistics.median(r[key] for r in rounds),
            "min": min(r[key] for r in rounds),
            "max": max(r[key] for r in rounds),
        }
        for key in ("tok_s", "cpu_us_per_token")
    }
    print(
        f"median {summary['tok_s']['median']:.0f} tok/s "
        f"({summary['tok_s']['min']:.0f}-{summary['tok_s']['max']:.0f}), "
        f"{summary['cpu_us_per_token']['median']:.1f} us/token "
        f"({summary['cpu_us_per_token']['min']:.1f}-{summary['cpu_us_per_token']['max']:.1f})"
    )
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=args.repo, capture_output=True, text=True
        ).stdout.strip()
        document = {"args": {k: str(v) for k, v in vars(args).items()}, "commit": commit}
        args.out.write_text(json.dumps({**document, "rounds": rounds, "summary": summary}))


def _runtime(args: argparse.Namespace) -> Any:
    from service.common.config import (
        CoreConfig,
        ModelConfig,
        ObservabilityConfig,
        SchedulingConfig,
    )
    from service.common.logging import configure_logging
    from service.core.runtime import Runtime

    configure_logging("warning", "console")
    config = CoreConfig(
        model=ModelConfig(load_format=f"dummy:{args.preset}", dtype=args.dtype),
        scheduling=SchedulingConfig(max_batch_size=args.concurrency, max_queue_depth=args.requests),
        observability=ObservabilityConfig(log_level="warning"),
    )
    runtime = Runtime(config)
    runtime.start()
    runtime.wait_ready()
    return runtime


class CountingSink:
    """Every request's outputs: counts tokens and finished requests; wakes the driver."""

    batch_key = "core-alone"

    def __init__(self) -> None:
        self.tokens = 0
        self.finished = 0
        self.changed = threading.Event()

    def deliver(self, outputs: Any) -> None:
        self.tokens += len(outputs.tokens)
        if outputs.finals:
            self.finished += len(outputs.finals)
            self.changed.set()


def _round(runtime: Any, args: argparse.Namespace, seed: int) -> dict[str, float]:
    from service.core.scheduler.request import Request
    from service.protocol import GenerationRequest

    rng = random.Random(seed)
    sink = CountingSink()
    submitted = 0

    def submit() -> None:
        nonlocal submitted
        prompt = tuple(rng.randrange(17, args.vocab) for _ in range(args.prompt_len))
        request = GenerationRequest(
            f"r{seed}-{submitted}",
            prompt,
            max_tokens=args.max_tokens,
            ignore_eos=True,
            cache_prompt=False,
        )
        runtime.loop.submit(Request(request, sink, rid=submitted))
        submitted += 1

    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(min(args.concurrency, args.requests)):
        submit()
    while sink.finished < args.requests:
        sink.changed.wait(60)
        sink.changed.clear()
        while submitted < args.requests and submitted - sink.finished < args.concurrency:
            submit()
    seconds = time.perf_counter() - started
    cpu_s = time.process_time() - cpu
    return {
        "tokens": sink.tokens,
        "seconds": seconds,
        "tok_s": sink.tokens / seconds,
        "cpu_us_per_token": cpu_s / sink.tokens * 1e6,
    }


if __name__ == "__main__":
    main()
