"""Does a CUDA kernel wait on MLX's managed memory? (a benchmark, not a test; needs MLX's CUDA
backend and PyTorch, whose profiler reads CUPTI's kernel records, as bench/cuda_timeline.py).

MLX's CUDA allocator gives managed memory to arrays made from host data and to every array of 8
bytes or less (one shared pool of pages), and the host keeps writing that pool: each Python
number an op takes becomes such an array. docs/cuda-backend.md ("Constants stay out of managed
memory") says why our kernels take constants as template values or `device_memory.resident`
arrays; this measures it. One elementwise kernel (y = x * c + x, [rows, width] bfloat16) is
chained `--calls` times and evaluated, `--rounds` times, with its constant c read from:

- `template`: a template value (float bits), no memory read;
- `scalar-pool`: a cached [1] float32 array, as the kernels read eps and scale before;
- `resident`: the same constant copied into device memory (`device_memory.resident`);

and, for MLX's own kernels, `x * 0.5 + x` with the Python number against the same product with
a resident [width] vector. Between rounds the host makes `--host-scalars` fresh scalar arrays, as
an engine step does. Prints each variant's mean kernel times (CUPTI, its three costliest
kernels) and writes JSON (`--out`):

    python3 bench/managed_memory.py --rows 256 --width 576 --calls 59 --out managed.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_SOURCE = """
    const size_t i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N) {
        const float c = FROM_TEMPLATE ? __int_as_float(C_BITS) : c_arr[0];
        y[i] = static_cast<T>(static_cast<float>(x[i]) * c + static_cast<float>(x[i]));
    }
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--width", type=int, default=576)
    parser.add_argument("--calls", type=int, default=59, help="kernels a chain (a step's norms)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--host-scalars", type=int, default=200, help="made between rounds")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("needs PyTorch (its profiler reads CUPTI's kernel records)") from None
    import mlx.core as mx
    import numpy as np

    from bench.cuda_timeline import summarize, traced
    from bench.report import write_json
    from service.core.engine.device_memory import float_bits, resident

    if not mx.cuda.is_available():
        raise SystemExit("needs MLX's CUDA backend")
    kernel = mx.fast.cuda_kernel(
        name="mlxserve_managed_probe",
        input_names=["x", "c_arr"],
        output_names=["y"],
        source=_SOURCE,
    )
    n = args.rows * args.width
    x0 = mx.random.normal((args.rows, args.width)).astype(mx.bfloat16)
    pooled = mx.array([0.5], dtype=mx.float32)  # 4 bytes: MLX's managed scalar pool
    held = resident(np.array([0.5], np.float32))
    half = resident(np.full(args.width, 0.5, np.float32), mx.bfloat16)
    mx.eval(x0, pooled, held, half)

    def probe(c_arr: mx.array, from_template: bool) -> Callable[[mx.array], mx.array]:
        def call(x: mx.array) -> mx.array:
            (y,) = kernel(
                inputs=[x, c_arr],
                template=[
                    ("T", x.dtype),
                    ("N", n),
                    ("FROM_TEMPLATE", int(from_template)),
                    ("C_BITS", float_bits(0.5)),
                ],
                grid=(n, 1, 1),
                threadgroup=(256, 1, 1),
                output_shapes=[x.shape],
                output_dtypes=[x.dtype],
            )
            return y

        return call

    variants: dict[str, Callable[[mx.array], mx.array]] = {
        "template": probe(held, True),
        "scalar-pool": probe(pooled, False),
        "resident": probe(held, False),
        "mlx python scalar": lambda x: x * 0.5 + x,
        "mlx resident vector": lambda x: x * half + x,
    }
    results: dict[str, Any] = {}
    for label, step in variants.items():

        def run(step: Callable[[mx.array], mx.array] = step) -> None:
            for _ in range(args.rounds):
                x = x0
                for _ in range(args.calls):
                    x = step(x)
                mx.eval(x)
                mx.eval([mx.array(i) for i in range(args.host_scalars)])  # the host's writes

        run()
        _, kernels = traced(run)
        top = summarize(kernels, steps=args.rounds, top=3).get("top", [])
        results[label] = top
        for row in top:  # not `kernel`: that name is the probe's kernel, called by later variants
            mean_us = 1e3 * row["total_ms"] / row["count"]
            print(f"{label:>20}: {mean_us:8.2f} µs x{row['count']:<5} {row['name'][:70]}")
    write_json(args.out, args, variants=results)


if __name__ == "__main__":
    main()
