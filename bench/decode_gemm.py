"""The tensor-core product kernel (service.core.models.decode_gemm.py) against MLX's matmul, in a
chain of a decode step's products (a benchmark, not a test; needs MLX's CUDA backend).

Per layer, four products, each feeding the next as a fused decoder layer's do: q/k/v, o,
gate/up and down (the widths of `--preset`, with M = `--rows`; o and down read a new array of
their input width, as attention's and SwiGLU's outputs are), then the LM head. The chain is
one compiled function per variant. It is timed serially (built, evaluated, waited for, one step
at a time) and overlapped (each step queued while the last one runs, as the engine runs them,
with the host's share), in alternating replicates. Before timing, each shape's product is checked
against a float32 product.

    python3 bench/decode_gemm.py --preset smollm2-135m --rows 256 [--layers 30] [--out FILE]

Every product takes the kernel here, whatever its weight's size; the service routes only weights up
to decode_gemm.MAX_WEIGHT_BYTES to it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.host_cost import pipelined  # noqa: E402
from bench.lora_kernel import time_step  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.shapes import projections  # noqa: E402
from service.core.models import decode_gemm  # noqa: E402
from service.core.models.presets import preset_config  # noqa: E402

Product = Callable[[mx.array, mx.array], mx.array]


def widths(preset: str) -> tuple[int, int, int, int]:
    """(hidden, q/k/v out, intermediate, vocabulary) of a preset."""
    cfg = preset_config(preset)
    shapes = projections(cfg)
    qkv_out = sum(shapes[m][1] for m in ("q", "k", "v"))
    return cfg["hidden_size"], qkv_out, cfg["intermediate_size"], cfg["vocab_size"]


def chain(layers: list[list[mx.array]], head: mx.array, product: Product) -> Callable:
    def step(x: mx.array) -> mx.array:
        for qkv, o, gate_up, down in layers:
            hidden, inter = o.shape[0], down.shape[1]
            # What reaches o and down is a new array, as attention's output and SwiGLU's are;
            # halved residual sums keep a chain of steps (each fed the last one's output) finite.
            x = (product(product(x, qkv)[..., :hidden] * 0.5, o) + x) * 0.5
            y = product(x, gate_up)
            x = (product(y[..., :inter] * y[..., inter:], down) + x) * 0.5
        return product(x, head)[:, : x.shape[1]]

    return mx.compile(step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--layers", type=int, default=0, help="0: the preset's")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not decode_gemm.available():
        raise SystemExit("needs MLX's CUDA backend")
    dtype = getattr(mx, args.dtype)
    hidden, qkv_out, inter, vocab = widths(args.preset)
    depth = args.layers or preset_config(args.preset)["num_hidden_layers"]
    mx.random.seed(0)

    def weight(n: int, k: int) -> mx.array:
        return (mx.random.normal((n, k)) / k**0.5).astype(dtype)

    # Per layer: q/k/v, o (over the attention's width, here q's), gate/up, down.
    layers = [
        [
            weight(qkv_out, hidden),
            weight(hidden, hidden),
            weight(2 * inter, hidden),
            weight(hidden, inter),
        ]
        for _ in range(depth)
    ]
    head = weight(vocab, hidden)
    mx.eval(layers, head)
    checks = {}
    for w in [*layers[0], head]:
        x = mx.random.normal((args.rows, w.shape[1])).astype(dtype)
        got = decode_gemm.matmul_t(x, w).astype(mx.float32)
        want = x.astype(mx.float32) @ w.astype(mx.float32).T
        checks[f"{w.shape[0]}x{w.shape[1]}"] = {
            "kernel": decode_gemm.supported(x, w),
            "max_rel": (mx.abs(got - want).max() / mx.abs(want).max()).item(),
        }
    for shape, check in checks.items():
        print(
            f"check {shape}: kernel {check['kernel']}, max error / max |y| {check['max_rel']:.2e}"
        )
    steps = {
        "mlx matmul": chain(layers, head, lambda x, w: x @ w.T),
        "decode_gemm": chain(layers, head, decode_gemm.matmul_t),
    }
    x = (mx.random.normal((args.rows, hidden)) * 0.1).astype(dtype)
    serial: dict[str, list[float]] = {name: [] for name in steps}
    piped: dict[str, list[list[float]]] = {name: [] for name in steps}
    for r in range(args.replicates):
        for name, fn in steps.items():
            serial[name].append(time_step(fn, x, args.steps))
            piped[name].append([t * 1e3 for t in pipelined(fn, x, args.steps)])
        print(f"replicate {r + 1}: " + ", ".join(f"{n} {v[-1]:.2f} ms" for n, v in serial.items()))
    print(f"{args.preset}, {args.rows} rows, {depth} layers ({4 * depth + 1} products):")
    for name in steps:
        over = [p[0] for p in piped[name]]
        host = [p[1] for p in piped[name]]
        print(
            f"  {name:<12} serial {statistics.median(serial[name]):7.2f} ms "
            f"({min(serial[name]):.2f}-{max(serial[name]):.2f}), overlapped "
            f"{statistics.median(over):7.2f} ms ({min(over):.2f}-{max(over):.2f}), host "
            f"{statistics.median(host):.2f} ms of it"
        )
    write_json(args.out, args, checks=checks, serial_ms=serial, overlapped=piped)


if __name__ == "__main__":
    main()
