"""What a quantized projection costs for a batch's rows, by the shape MLX's quantized matmul
sees them in: [B, 1, D] (as mlx-lm's models carry decode activations), [B, D] (the rows folded
into one matrix, as service.core.models.quantized does on CUDA), [B, D] against the weight
dequantized in the same graph (a dense product with the dequantization's cost), and the same
product dense in the activations' dtype, for reference.

Each timing is the median over --reps of `mx.eval` on --chain products in a row (chained, so
one product's output is the next one's input scale, keeping them in order), divided by the
chain: the per-call sync cost is shared out. Prints milliseconds per product and writes JSON.

    python bench/quantized_rows.py --batch 1,8,64,256,2048 --shapes 14336x4096,4096x14336
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx

from service.core.models.loader import parse_dtype


def timed(step, reps: int) -> float:
    mx.eval(step())  # build and run once (kernel compiles, allocations)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(step())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain(product, x: mx.array, n: int):
    def step() -> mx.array:
        y, out = x, []
        for _ in range(n):
            z = product(y)
            out.append(z)
            y = x * (1 + 0 * z[..., :1])  # depends on z, same values as x
        return mx.stack(out)

    return step


def measure(out_dim: int, in_dim: int, batch: int, args, dtype: mx.Dtype) -> dict[str, float]:
    mx.random.seed(0)
    w = (mx.random.normal((out_dim, in_dim)) * 0.02).astype(dtype)
    wq, scales, biases = mx.quantize(w, group_size=args.group_size, bits=args.bits)
    quant = dict(group_size=args.group_size, bits=args.bits)

    def qmm(x: mx.array) -> mx.array:
        return mx.quantized_matmul(x, wq, scales, biases, transpose=True, **quant)

    rows = mx.random.normal((batch, in_dim)).astype(dtype)
    mx.eval(w, wq, scales, biases, rows)
    forms = {
        "rows_3d": (qmm, rows[:, None, :]),
        "rows_2d": (qmm, rows),
        "dequantized": (lambda x: x @ mx.dequantize(wq, scales, biases, **quant).T, rows),
        "dense": (lambda x: x @ w.T, rows),
    }
    return {
        name: timed(chain(product, x, args.chain), args.reps) / args.chain * 1e3
        for name, (product, x) in forms.items()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--batch", default="1,2,4,8,16,64,256,512,2048", help="rows, comma-separated"
    )
    parser.add_argument(
        "--shapes",
        default="14336x4096,4096x14336,4096x4096",
        help="OUTxIN weight shapes (default: Llama-3.1-8B's MLP and attention projections)",
    )
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--chain", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    dtype = parse_dtype(args.dtype)
    results = []
    for shape in args.shapes.split(","):
        out_dim, in_dim = (int(v) for v in shape.split("x"))
        for batch in (int(b) for b in args.batch.split(",")):
            ms = measure(out_dim, in_dim, batch, args, dtype)
            results.append({"out": out_dim, "in": in_dim, "batch": batch, "ms": ms})
            print(
                f"{shape:>12} B={batch:<4} [B,1,D] {ms['rows_3d']:8.3f} ms  "
                f"[B,D] {ms['rows_2d']:8.3f} ms  dequantized {ms['dequantized']:8.3f} ms  "
                f"dense {ms['dense']:8.3f} ms",
                flush=True,
            )
    if args.out:
        meta = {"device": str(mx.default_device()), "bits": args.bits, "dtype": args.dtype}
        args.out.write_text(json.dumps({"args": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
