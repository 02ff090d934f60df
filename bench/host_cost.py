"""What MLX's host work costs per primitive, in pipelined compiled steps as a decode loop runs
them (build step N + 1 and `mx.async_eval` it while step N runs, then wait for N).

Two measurements, each alternated over --reps replicates in one process:

- `layouts`: a decode-like step of SmolLM2-135M's shapes (30 layers of seven projections, heads
  split and joined, a SwiGLU-like combine) in four forms: activations [B, 1, D] (as mlx-lm's
  models carry them, so MLX folds the batch into a matmul's rows and back: a Flatten and an
  Unflatten per matmul) or [B, D]; weights used as `W.T` (mlx-lm's `nn.Linear`: a Transpose per
  matmul) or stored pre-transposed. The four differ by view primitives only: no device work,
  all host work. A fifth is mlx-lm's layout with q/k/v and gate/up each one matmul, split
  (service.core.models.projections): four matmuls a layer instead of seven.
- `per_op`: a chain of N ops, per op: a trivial custom kernel (alone, with seven more inputs it
  never reads, after a matmul, with three outputs, with the LoRA kernel's header), the LoRA
  kernel's launch for one module and for three (its blocks only copying y: `bench/lora_kernel.py
  --floor`), MLX's RMSNorm (alone, with four view primitives around it, after a matmul), a
  matmul.

Prints milliseconds per step (wall) and the host's share (building the step and queuing it);
`--out` writes JSON.

    python bench/host_cost.py --batch 64,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

D, KV, FF, LAYERS = 576, 192, 1536, 30  # SmolLM2-135M
PROJECTIONS = [(D, D), (D, KV), (D, KV), (D, D), (D, FF), (D, FF), (FF, D)]  # (in, out)


def layout_steps(batch: int, dtype: mx.Dtype, layers: int = LAYERS) -> dict[str, tuple]:
    """name -> (step, its input): the layouts of one decode-like step (not compiled)."""
    mx.random.seed(0)
    # Each layer its own weights: `mx.compile` would merge the repeated `W.T` of shared ones.
    weights = [
        [(mx.random.normal((o, i)) * 0.02).astype(dtype) for i, o in PROJECTIONS]
        for _ in range(layers)
    ]
    transposed = [[mx.contiguous(w.T) for w in layer] for layer in weights]
    # q/k/v and gate/up as one matrix each (service.core.models.projections).
    fused = [[mx.concatenate(w[0:3]), w[3], mx.concatenate(w[4:6]), w[6]] for w in weights]
    mx.eval(weights, transposed, fused)

    def attend(x: mx.array, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
        # Heads split and joined as an attention does (a reshape of a slice copies).
        lead = q.shape[:-1]
        q, k, v = q.reshape(*lead, 9, 64), k.reshape(*lead, 3, 64), v.reshape(*lead, 3, 64)
        return (q + mx.concatenate([k, v, k], axis=-2)).reshape(*lead, D)

    def make(pre: bool) -> Callable[[mx.array], mx.array]:
        stack = transposed if pre else weights

        def mm(a: mx.array, w: mx.array) -> mx.array:
            return a @ w if pre else a @ w.T

        def step(x: mx.array) -> mx.array:
            for ws in stack:
                h = x + mm(attend(x, mm(x, ws[0]), mm(x, ws[1]), mm(x, ws[2])), ws[3])
                g, u = mm(h, ws[4]), mm(h, ws[5])
                x = h + mm(mx.sigmoid(g) * g * u, ws[6])
            return x

        return step

    def step_fused(x: mx.array) -> mx.array:
        for ws in fused:
            q, k, v = mx.split(x @ ws[0].T, [D, D + KV], axis=-1)
            h = x + attend(x, q, k, v) @ ws[1].T
            g, u = mx.split(h @ ws[2].T, [FF], axis=-1)
            x = h + (mx.sigmoid(g) * g * u) @ ws[3].T
        return x

    out = {}
    rows = (mx.random.normal((batch, D)) * 0.1).astype(dtype)
    for two_d in (False, True):
        x = rows if two_d else mx.contiguous(rows[:, None])
        mx.eval(x)
        for pre in (False, True):
            out[f"{'[B, D]' if two_d else '[B, 1, D]'} {'W pre-transposed' if pre else 'W.T'}"] = (
                make(pre),
                x,
            )
        if not two_d:
            out["[B, 1, D] W.T, siblings fused"] = (step_fused, x)
    return out


def op_chains(batch: int, dtype: mx.Dtype, n: int) -> dict[str, tuple]:
    """name -> (chain of n ops, its input) (not compiled)."""
    weight = (mx.random.normal((D, D)) * D**-0.5).astype(dtype)
    mx.eval(weight)

    def rms_norm(x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, None, 1e-5)

    chains: dict[str, Callable[[mx.array], mx.array]] = {
        "RMSNorm": rms_norm,
        "RMSNorm + 4 views": lambda x: rms_norm(x.reshape(batch, 1, D).reshape(batch, D).T.T),
        "matmul": lambda x: x @ weight,
        "matmul + RMSNorm": lambda x: rms_norm(x @ weight),
    }
    if mx.cuda.is_available():
        # Arrays a kernel takes and never reads (as the LoRA kernel takes its adapter stacks).
        extra = tuple(mx.zeros((8, 16, 4096), dtype) for _ in range(7))
        mx.eval(extra)
        from service.core.engine.kernel_source import cuda_kernel
        from service.core.models import lora_kernel

        def make(unread: int, outputs: int, header: str = "") -> Callable[..., list[mx.array]]:
            """A kernel scaling x into each of its outputs, taking `unread` more inputs."""
            writes = "".join(
                f"out{o}[e] = static_cast<T>(static_cast<float>(x[e]) * 0.999f);"
                for o in range(outputs)
            )
            kernel = cuda_kernel(
                name=f"host_cost_scale_{unread}_{outputs}_{len(header)}",
                input_names=["x", *(f"unread{i}" for i in range(unread))],
                output_names=[f"out{o}" for o in range(outputs)],
                source="const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;\n"
                f"if (e < (size_t)x_shape[0] * x_shape[1]) {{ {writes} }}\n",
                header=header,
            )

            def call(x: mx.array, *more: mx.array) -> list[mx.array]:
                return kernel(
                    inputs=[x, *more],
                    template=[("T", x.dtype)],
                    grid=(x.size, 1, 1),
                    threadgroup=(256, 1, 1),
                    output_shapes=[x.shape] * outputs,
                    output_dtypes=[x.dtype] * outputs,
                )

            return call

        # What a launch's outputs and its source's length cost (MLX hashes a custom kernel's
        # whole source at each launch to find its compiled module); sources compacted as the
        # service's are (kernel_source.cuda_kernel).
        plain, wide, three = make(0, 1), make(len(extra), 1), make(0, 3)
        long_source = make(0, 1, lora_kernel.kernel_header())

        def custom(x: mx.array, unread: tuple[mx.array, ...] = ()) -> mx.array:
            return (wide if unread else plain)(x, *unread)[0]

        # The LoRA kernel's launches with every block only copying y (bench/lora_kernel.py
        # --floor): what a call of one module and one of three cost the host.
        from bench.lora_kernel import copy_floor

        floor = copy_floor()
        a_t = mx.zeros((9, 16, D), mx.float32)
        b = mx.zeros((9, 16, D), mx.float32)
        idx = mx.ones((batch,), mx.int32)
        scale = mx.ones((batch,), mx.float32)
        mx.eval(a_t, b, idx, scale)

        def lora_floor(x: mx.array, parts: int) -> mx.array:
            return floor(x, [lora_kernel.Part(x, a_t, b, idx) for _ in range(parts)], scale)[0]

        chains = {
            "custom kernel": custom,
            "custom kernel, 7 more inputs": lambda x: custom(x, extra),
            "matmul + custom kernel": lambda x: custom(x @ weight),
            "custom kernel, 3 outputs": lambda x: three(x)[0],
            "custom kernel, LoRA's header": lambda x: long_source(x)[0],
            "LoRA kernel, launch only, 1 module": lambda x: lora_floor(x, 1),
            "LoRA kernel, launch only, 3 modules": lambda x: lora_floor(x, 3),
            **chains,
        }

    def chain(op: Callable[[mx.array], mx.array]) -> Callable[[mx.array], mx.array]:
        def run(x: mx.array) -> mx.array:
            for _ in range(n):
                x = op(x)
            return x

        return run

    x = mx.random.normal((batch, D)).astype(dtype)
    mx.eval(x)
    return {name: (chain(op), x) for name, op in chains.items()}


def pipelined(fn: Callable[[mx.array], mx.array], x: mx.array, steps: int) -> tuple[float, float]:
    """(wall, host) seconds per step of `steps` steps, each fed the step before's output."""
    mx.eval(fn(x))  # trace and warm
    host = 0.0
    start = time.perf_counter()
    current = fn(x)
    mx.async_eval(current)
    for _ in range(steps):
        t = time.perf_counter()
        following = fn(current * 0.5)
        mx.async_eval(following)
        host += time.perf_counter() - t
        mx.eval(current)
        current = following
    mx.eval(current)
    return (time.perf_counter() - start) / steps, host / steps


def measure(cases: dict[str, tuple], reps: int, steps: int) -> dict[str, dict[str, float]]:
    """Each case compiled; its median (and range) of wall and host seconds per step, the cases
    alternating."""
    compiled = {name: (mx.compile(fn), x) for name, (fn, x) in cases.items()}
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
    for _ in range(reps):
        for name, (fn, x) in compiled.items():
            runs[name].append(pipelined(fn, x, steps))
    return {
        name: {
            "wall": statistics.median(w for w, _ in r),
            "wall_min": min(w for w, _ in r),
            "wall_max": max(w for w, _ in r),
            "host": statistics.median(h for _, h in r),
        }
        for name, r in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="64,256", help="comma-separated batch sizes")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--chain", type=int, default=120, help="ops per chain in per_op")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    dtype = getattr(mx, args.dtype)
    result: dict[str, dict] = {"args": vars(args) | {"out": str(args.out)}}
    for batch in (int(b) for b in args.batch.split(",")):
        layouts = measure(layout_steps(batch, dtype), args.reps, args.steps)
        per_op = measure(op_chains(batch, dtype, args.chain), args.reps, args.steps)
        result[f"B={batch}"] = {"layouts": layouts, "per_op": per_op}
        print(f"B={batch}, a step of {LAYERS} layers: ms per step (range), host ms")
        for name, r in layouts.items():
            print(
                f"  {name:28s} {r['wall'] * 1e3:7.3f} ({r['wall_min'] * 1e3:.3f}-"
                f"{r['wall_max'] * 1e3:.3f})  host {r['host'] * 1e3:.3f}"
            )
        print(f"B={batch}, per op of a {args.chain}-op chain: us per op, host us")
        for name, r in per_op.items():
            scale = 1e6 / args.chain
            print(f"  {name:28s} {r['wall'] * scale:7.2f}  host {r['host'] * scale:.2f}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
