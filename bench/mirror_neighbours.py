"""What forwards beside the CPU's decode mirror cost (not a test): on a preset's random weights,
the model runner alone (no scheduler), B rows decoding over the mirror.

- `prefill-after-decode`: the wall time of a 32-token prefill after N decode-only steps. A
  mirrored step's attention reads only the mirror; if its write into the paged pool were left
  unevaluated, N steps of writes would wait in the graph and run inside this prefill.
- `one-token-pass`: the CPU time (all threads) of a decode step, and of a one-token prompt's
  prefill forward plus a decode step. Were such a forward run as a decode step, it would free
  the mirror (a lone row) and the next step would copy every row back in.

Prints one line per measurement and writes JSON (`--out`); `--repo` names the checkout to import,
for A/Bs of two trees run in alternation:

    env $(python -m service.common.blas --env) OPENBLAS_NUM_THREADS=1 \\
        python bench/mirror_neighbours.py --preset thin-30 --steps 10,1000 --out a.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--preset", default="thin-30")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=16, help="rows decoding before the prefill")
    parser.add_argument("--steps", default="10,1000", help="decode steps before the prefill")
    parser.add_argument("--batch", type=int, default=224, help="rows beside the one-token pass")
    parser.add_argument("--repeats", type=int, default=30, help="one-token passes measured")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(args.repo))
    from service.common.logging import configure_logging

    configure_logging("warning", "console")  # here, not in a helper a test calls
    rows = [prefill_after_decode(args, int(n)) for n in args.steps.split(",")]
    rows.append(one_token_pass(args))
    if args.out:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=args.repo, capture_output=True, text=True
        ).stdout.strip()
        document = {"args": {k: str(v) for k, v in vars(args).items()}, "commit": commit}
        args.out.write_text(json.dumps({**document, "rows": rows}, indent=1) + "\n")


def _runtime(args: argparse.Namespace, batch: int) -> Any:
    from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
    from service.core.runtime import Runtime

    runtime = Runtime(
        CoreConfig(
            model=ModelConfig(load_format=f"dummy:{args.preset}", dtype=args.dtype),
            scheduling=SchedulingConfig(max_batch_size=batch, max_queue_depth=batch),
        )
    )
    runtime.load()
    return runtime


class _Prompt:
    """A fresh row in slot `slot` with room for `tokens` prompt tokens and a few more."""

    def __init__(self, runtime: Any, slot: int, tokens: int) -> None:
        from service.core.scheduler.plan import RowJoin, StepPlan
        from service.protocol import SamplingParams

        self.runtime, self.slot = runtime, slot
        self.seq = runtime.kv.new_sequence(False)
        runtime.kv.ensure_slots(self.seq, tokens + 8)
        update = runtime.kv.take_update()
        join = RowJoin(slot, f"prompt-{slot}-{time.monotonic_ns()}", SamplingParams(), [1], 0)
        plan = StepPlan(-1, joins=[join], tables=[(slot, list(self.seq.block_ids))])
        plan.capacity = update.capacity
        runtime.runner.collect(runtime.runner.submit(plan))

    def prefill(self, tokens: list[int]) -> None:
        from service.core.scheduler.plan import Chunk, StepPlan

        plan = StepPlan(-1, prefill=[[Chunk(self.slot, tokens, True)]])
        self.runtime.runner.collect(self.runtime.runner.submit(plan))

    def leave(self) -> None:
        from service.core.scheduler.plan import RowLeave, StepPlan

        plan = StepPlan(-1, leaves=[RowLeave(self.slot, True)])
        self.runtime.runner.collect(self.runtime.runner.submit(plan))
        self.runtime.kv.free_sequence(self.seq)


def _decode(runtime: Any, slots: list[int]) -> None:
    from service.core.scheduler.plan import StepPlan

    runtime.runner.collect(runtime.runner.submit(StepPlan(-1, decode=slots)))


def prefill_after_decode(args: argparse.Namespace, steps: int) -> dict[str, Any]:
    from bench.step_anatomy import _Rows

    runtime = _runtime(args, args.rows + 1)
    _Rows(runtime, args.rows)
    slots = list(range(args.rows))
    started = time.perf_counter()
    for _ in range(steps):
        _decode(runtime, slots)
    step_ms = (time.perf_counter() - started) / steps * 1e3
    prompt = _Prompt(runtime, args.rows, 32)
    started = time.perf_counter()
    prompt.prefill(list(range(17, 49)))
    row = {
        "measure": "prefill-after-decode",
        "preset": args.preset,
        "rows": args.rows,
        "decode_steps": steps,
        "decode_step_ms": step_ms,
        "prefill_ms": (time.perf_counter() - started) * 1e3,
    }
    print(
        f"{args.preset}, {args.rows} rows: after {steps} decode steps ({step_ms:.2f} ms each), "
        f"a 32-token prefill takes {row['prefill_ms']:.1f} ms",
        flush=True,
    )
    return row


def one_token_pass(args: argparse.Namespace) -> dict[str, Any]:
    from bench.step_anatomy import _Rows

    runtime = _runtime(args, args.batch + 1)
    _Rows(runtime, args.batch)
    slots = list(range(args.batch))
    for _ in range(5):
        _decode(runtime, slots)
    alone, beside = [], []
    for _ in range(args.repeats):
        started = time.process_time()
        _decode(runtime, slots)
        alone.append(time.process_time() - started)
        prompt = _Prompt(runtime, args.batch, 1)
        started = time.process_time()
        prompt.prefill([17])
        _decode(runtime, slots)
        beside.append(time.process_time() - started)
        prompt.leave()
    row = {
        "measure": "one-token-pass",
        "preset": args.preset,
        "batch": args.batch,
        "decode_cpu_ms": statistics.median(alone) * 1e3,
        "pass_and_decode_cpu_ms": statistics.median(beside) * 1e3,
    }
    print(
        f"{args.preset}, {args.batch} rows: a decode step {row['decode_cpu_ms']:.2f} ms CPU; "
        f"a one-token prompt's pass and the step {row['pass_and_decode_cpu_ms']:.2f} ms "
        f"(medians of {args.repeats})",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
