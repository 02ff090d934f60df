"""What copying host data into an MLX array costs on MLX's CUDA backend (not a test).

A step that hands the device an array made from numpy (a decode step's packed plan, a batch's
token masks) pays for the copy on the thread that makes it. On CUDA, MLX's arrays live in unified
memory; a buffer the device touched last (MLX recycles freed buffers) is moved back to the host
page by page when the host writes into it. For each size, the loop makes a fresh array from the
same numpy data, uses it on the device beside a small matmul in flight, and waits; it reports the
host time of the copy (`make`) and of queuing the op that reads it (`use`), median and range of
three rounds. Also: an array copied once and then read each step, and one made by a device copy
of the upload.

    python3 bench/host_copy.py [--out host_copy.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np


def timed(
    make: Callable[[], mx.array],
    use: Callable[[mx.array, mx.array], mx.array],
    work: Callable[[], mx.array],
    n: int = 60,
) -> dict[str, float]:
    makes, uses = [], []
    for _ in range(3):
        made = used = 0.0
        for _ in range(n):
            busy = work()
            mx.async_eval(busy)  # the device is busy, as it is in a served step
            t0 = time.perf_counter()
            array = make()
            t1 = time.perf_counter()
            out = use(array, busy)
            mx.async_eval(out)
            made += t1 - t0
            used += time.perf_counter() - t1
            mx.eval(out)
        makes.append(made / n * 1e6)
        uses.append(used / n * 1e6)
    return {
        "make_us": statistics.median(makes),
        "use_us": statistics.median(uses),
        "use_us_min": min(uses),
        "use_us_max": max(uses),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("host_copy.json"))
    ap.add_argument("--steps", type=int, default=60, help="steps a round")
    args = ap.parse_args()
    x = mx.random.normal((64, 576)).astype(mx.bfloat16)
    head = (mx.random.normal((576, 49152)) * 0.05).astype(mx.bfloat16)

    def work() -> mx.array:
        return x @ head

    rows = {}
    for kb in (1, 16, 64, 256, 1024):
        data = np.arange(kb * 256, dtype=np.int32)
        rows[f"{kb} KB, fresh each step"] = timed(
            lambda data=data: mx.array(data), lambda a, b: a.sum(), work, args.steps
        )
    data = np.arange(256 * 256, dtype=np.int32)
    once = mx.array(data)
    mx.eval(once)
    rows["256 KB, copied once"] = timed(lambda: once, lambda a, b: a.sum(), work, args.steps)
    rows["256 KB, a device copy of the upload, evaluated first"] = timed(
        lambda: (lambda a: (mx.eval(a), a)[1])(mx.array(data) + 0),
        lambda a, b: a.sum(),
        work,
        args.steps,
    )
    for name, r in rows.items():
        print(
            f"{name}: make {r['make_us']:.0f} us, use {r['use_us']:.0f} us "
            f"({r['use_us_min']:.0f}-{r['use_us_max']:.0f})"
        )
    args.out.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
