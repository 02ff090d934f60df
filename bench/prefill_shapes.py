"""First-call and repeat latency of single-prompt prefill forwards at new prompt lengths.

A serving engine sees a new prompt length with nearly every request; on MLX's CUDA backend the
attention of an N>1 forward may build a per-shape kernel plan the first time a shape is seen.
This prints, for the given prompt lengths, the first forward's latency and a repeat's, for the plain
causal mask (what mlx-lm does) and for prompts padded to a length bucket with an array mask.

    python bench/prefill_shapes.py --preset smollm2-135m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from service.models.loader import load_model


def timed(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--lengths", default="33-40,70,130", help="e.g. 33-40,70,130")
    parser.add_argument("--bucket", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = []
    for part in args.lengths.split(","):
        lo, _, hi = part.partition("-")
        lengths += range(int(lo), int(hi or lo) + 1)
    lo = lengths[0]
    model = load_model(None, args.dtype, f"dummy:{args.preset}").model

    def causal(n: int):
        cache = make_prompt_cache(model)
        return lambda: model(mx.arange(n)[None], cache=cache)[:, -1]

    def bucketed(n: int):
        width = -(-n // args.bucket) * args.bucket
        cache = make_prompt_cache(model)
        tokens = mx.concatenate([mx.arange(n), mx.zeros(width - n, dtype=mx.int32)])[None]
        pos = mx.arange(width)
        mask = ((pos[None, :] <= pos[:, None]) & (pos[None, :] < n))[None, None]

        def run():
            saved = llama.create_attention_mask  # llama passes what this returns to attention
            llama.create_attention_mask = lambda *a, **k: mask
            try:
                return model(tokens, cache=cache)[:, n - 1]
            finally:
                llama.create_attention_mask = saved

        return run

    timed(causal(lo - 1))  # first use of the device
    rows = []
    print(f"{'mode':>9} {'len':>4} {'first ms':>9} {'repeat ms':>9}")
    for mode, build in (("causal", causal), ("bucketed", bucketed)):
        for n in lengths:
            first = timed(build(n))
            repeat = timed(build(n))
            rows.append({"mode": mode, "length": n, "first_ms": first, "repeat_ms": repeat})
            print(f"{mode:>9} {n:>4} {first:9.1f} {repeat:9.1f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
