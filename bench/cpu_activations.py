"""mlx-lm's SwiGLU (`silu(gate) * up`, MLX's exp) against ours (service.models.activations)
at decode and prefill shapes of SmolLM2's MLP, side by side in one run; prints and writes JSON.

    python bench/cpu_activations.py [--out activations.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.activations import swiglu

from service.models.activations import fast_swiglu

SHAPES = [(1, 1, 1536), (8, 1, 1536), (16, 1, 1536), (64, 1, 1536), (8, 37, 1536)]


def timed(fn, gate: mx.array, up: mx.array, repeats: int) -> float:
    for _ in range(5):
        mx.eval(fn(gate, up))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn(gate, up))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    print(f"{mx.default_device()}: one SwiGLU, median ms (x30 layers for a step)")
    print("shape".ljust(16), "mlx-lm".rjust(8), "ours".rjust(8), "speed-up".rjust(9))
    results = []
    for shape in SHAPES:
        gate, up = mx.random.normal(shape) * 4, mx.random.normal(shape)
        mx.eval(gate, up)
        theirs = timed(swiglu, gate, up, args.repeats)
        ours = timed(fast_swiglu, gate, up, args.repeats)
        print(str(shape).ljust(16), f"{theirs:8.3f} {ours:8.3f} {theirs / ours:8.2f}x", flush=True)
        results.append({"shape": list(shape), "mlx_lm_ms": theirs, "ours_ms": ours})
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
