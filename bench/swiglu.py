"""mlx-lm's compiled `swiglu` against our `fast_swiglu` on the CPU (not a test): where the
multiply-add exp starts to pay, which sets `activations.FAST_MIN_ROWS`.

Each evaluation chains --layers calls, as a forward does, on float32 [rows, 1, --width] inputs;
prints the best of --repeats mean µs per call for each row count and writes JSON (--out).

    python bench/swiglu.py [--width 1536] [--rows 1,2,3,4,6,8,16] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.activations import swiglu

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from service.core.models import activations  # noqa: E402

Act = Callable[[mx.array, mx.array], mx.array]


def per_call_us(act: Act, gate: mx.array, up: mx.array, layers: int, repeats: int) -> float:
    def forward() -> mx.array:
        y = gate
        for _ in range(layers):
            y = act(y, up)
        return y

    for _ in range(3):
        mx.eval(forward())
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(10):
            mx.eval(forward())
        best = min(best, (time.perf_counter() - started) / 10)
    return best * 1e6 / layers


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=1536, help="the MLP's intermediate size")
    parser.add_argument("--rows", default="1,2,3,4,6,8,16")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    mx.set_default_device(mx.cpu)
    activations.warm()
    rows_out = []
    print(f"{'rows':>5} {'swiglu us':>10} {'fast us':>9} {'fast/swiglu':>12}")
    for rows in (int(r) for r in args.rows.split(",")):
        gate = mx.random.normal((rows, 1, args.width))
        up = mx.random.uniform(shape=(rows, 1, args.width)) * 0.5  # keeps the chain finite
        mx.eval(gate, up)
        plain = per_call_us(swiglu, gate, up, args.layers, args.repeats)
        fast = per_call_us(activations.fast_swiglu, gate, up, args.layers, args.repeats)
        rows_out.append({"rows": rows, "swiglu_us": plain, "fast_swiglu_us": fast})
        print(f"{rows:>5} {plain:>10.1f} {fast:>9.1f} {fast / plain:>12.2f}")
    if args.out:
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows_out}, indent=1)
        )
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
