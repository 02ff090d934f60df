"""MLX's CPU fallbacks against our compiled chains, per call, by input size (not a test).

RMSNorm: `mx.fast.rms_norm` (on the CPU, a fallback of a dozen primitives) against
service.core.models.norms' compiled chain and its wide path (`rms_norm_wide`, the rows' scales
compiled, the multiplies vectorized). RoPE's rotation with a forward's shared angles: the
fallback's products op by op against service.core.models.rope's compiled `_rotate`. Each figure
is the CPU microseconds of one call, from a chain of --chain calls evaluated together (as a
forward's layers are), the median of --reps. The crossover of the chain and the wide path sets
norms.COMPILED_MAX_ELEMENTS.

    env $(python -m service.common.blas --env) OPENBLAS_NUM_THREADS=1 \\
        python bench/cpu_compiled_chains.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.report import write_json  # noqa: E402
from service.core.models import norms, rope  # noqa: E402

NORM_SHAPES = [(rows, 1, width) for width in (64, 576) for rows in (1, 4, 16, 64, 228, 256)]
ROTATION_SHAPES = [(1, 9, 1, 64), (16, 9, 1, 64), (256, 9, 1, 64), (256, 2, 1, 32), (4, 9, 32, 64)]


def per_call_us(step: Callable[[mx.array], mx.array], x: mx.array, chain: int, reps: int) -> float:
    def run() -> mx.array:
        y = x
        for _ in range(chain):
            y = step(y)
        return y

    for _ in range(3):
        mx.eval(run())
    samples = []
    for _ in range(reps):
        started = time.process_time()
        mx.eval(run())
        samples.append((time.process_time() - started) / chain * 1e6)
    return statistics.median(samples)


def _fallback_rotation(x1, x2, cos, sin):
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


def norm_row(shape: tuple[int, ...], chain: int, reps: int) -> dict:
    x, weight = mx.random.normal(shape), mx.random.normal(shape[-1:])
    eps = mx.array(1e-5, mx.float32)
    mx.eval(x, weight)
    fallback = per_call_us(lambda y: mx.fast.rms_norm(y, weight, 1e-5), x, chain, reps)
    compiled = per_call_us(lambda y: norms.rms_norm(y, weight, eps), x, chain, reps)
    wide = per_call_us(lambda y: norms.rms_norm_wide(y, weight, eps), x, chain, reps)
    return {
        "op": "rms_norm",
        "shape": shape,
        "fallback_us": fallback,
        "compiled_us": compiled,
        "wide_us": wide,
    }


def rotation_row(shape: tuple[int, ...], chain: int, reps: int) -> dict:
    half = shape[-1] // 2
    x = mx.random.normal(shape)
    cos = mx.random.normal((shape[0], 1, shape[2], half))
    sin = mx.random.normal((shape[0], 1, shape[2], half))
    mx.eval(x, cos, sin)

    def rotating(rotate: Callable) -> Callable[[mx.array], mx.array]:
        return lambda y: mx.concatenate(list(rotate(y[..., :half], y[..., half:], cos, sin)), -1)

    fallback = per_call_us(rotating(_fallback_rotation), x, chain, reps)
    compiled = per_call_us(rotating(rope._rotate), x, chain, reps)
    return {"op": "rotation", "shape": shape, "fallback_us": fallback, "compiled_us": compiled}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=40)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for title, shapes, measure in (
        ("norm [rows, 1, width]", NORM_SHAPES, norm_row),
        ("rotation [rows, heads, tokens, head_dim]", ROTATION_SHAPES, rotation_row),
    ):
        print(f"{title:42s} {'elements':>10s} {'fallback us':>12s} {'compiled us':>12s} wide us")
        for shape in shapes:
            row = measure(shape, args.chain, args.reps)
            rows.append(row)
            fallback, compiled = row["fallback_us"], row["compiled_us"]
            wide = f"{row['wide_us']:8.1f}" if "wide_us" in row else ""
            print(f"{shape!s:42s} {math.prod(shape):10d} {fallback:12.1f} {compiled:12.1f} {wide}")
    write_json(args.out, args, rows=rows)


if __name__ == "__main__":
    main()
