"""Decode attention over K/V gathered from a paged pool against attention over views of one
contiguous (mirror) array, for all layers of a SmolLM2-shaped step, side by side in one run.

    python bench/kv_mirror_micro.py --batch 8,16 --context 140 [--out mirror.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

LAYERS, HEADS, KV_HEADS, HEAD_DIM, POOL_SLOTS = 30, 9, 3, 64, 8192


def timed(fn, repeats: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(pools: list[mx.array], b: int, t: int, repeats: int) -> tuple[float, float]:
    """Median ms of one step's attention (all layers): K/V gathered, then over mirror views."""
    rows = np.random.randint(0, POOL_SLOTS * KV_HEADS, (b, KV_HEADS, t)).astype(np.int32)
    read = mx.array(rows)
    mirrors = [mx.random.normal((b, KV_HEADS, t + 128, HEAD_DIM)) for _ in range(2 * LAYERS)]
    q = mx.random.normal((b, HEADS, 1, HEAD_DIM))
    mask = mx.ones((b, 1, 1, t), dtype=mx.bool_)
    mx.eval(mirrors, q, read)

    def attend(k_of, v_of) -> None:
        outs = [
            mx.fast.scaled_dot_product_attention(
                q, k_of(layer), v_of(layer), scale=HEAD_DIM**-0.5, mask=mask
            )
            for layer in range(LAYERS)
        ]
        mx.eval(outs)

    def gathered() -> None:
        attend(
            lambda n: mx.take(pools[2 * n], read, axis=0),
            lambda n: mx.take(pools[2 * n + 1], read, axis=0),
        )

    def mirrored() -> None:
        attend(lambda n: mirrors[2 * n][:, :, :t], lambda n: mirrors[2 * n + 1][:, :, :t])

    return timed(gathered, repeats), timed(mirrored, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="8,16")
    parser.add_argument("--context", type=int, default=140)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    t = args.context
    pools = [mx.random.normal((POOL_SLOTS * KV_HEADS, HEAD_DIM)) for _ in range(2 * LAYERS)]
    mx.eval(pools)
    print(f"{mx.default_device()}, {LAYERS} layers, {t} positions: decode attention per step")
    print("   B  gathered ms  mirror ms  speed-up")
    results = []
    for b in (int(x) for x in args.batch.split(",")):
        g, m = measure(pools, b, t, args.repeats)
        print(f"{b:>4} {g:12.1f} {m:10.1f} {g / m:8.2f}x", flush=True)
        results.append({"batch": b, "context": t, "gathered_ms": g, "mirror_ms": m})
    if args.out:
        Path(args.out).write_text(json.dumps({"results": results}, indent=1))


if __name__ == "__main__":
    main()
