"""Is a decode step bound by the GPU or by the host? The GPU's own record of a burst, beside the
step's wall time (a benchmark, not a test; needs MLX's CUDA backend and PyTorch, whose profiler
reads CUPTI's kernel records for the whole process, MLX's kernels included).

For each path (`raw`: mlx-lm's batched loop; `core`: our engine core, scheduler and loop, no
gRPC; both from bench/step_anatomy.py) it runs a warm-up round, then a traced one, and reports
over the traced round's kernels: the span from the first kernel's start to the last one's end,
the time the GPU ran any kernel (the union of their intervals), the busy share, kernels per
decode step and the kernels that took the most time. A busy share near 1 says the step waits
for the GPU, where kernel work is what to cut; a low one says the GPU waits for the host (MLX's
per-op host work, our Python). Prints a table and writes JSON (`--out`):

    python3 bench/cuda_timeline.py --preset smollm2-135m --batch 256 --core-tokens 128 \\
        --paths raw,core --out timeline.json

With --adapters N the core serves N random adapters of rank --rank on every projection (as
bench/multi_lora.py writes them) and traces two rounds: `core` (no row names an adapter) and
`core+lora` (rows cycling through the adapters and the base model, one batch). Tracing adds host
work to every kernel, so a traced round's step is longer than an untraced one's: compare its
busy time and kernel times, and step times only between rounds traced alike.

    python3 bench/cuda_timeline.py --preset llama-3.1-8b --batch 64 --paths core --adapters 8 \\
        --rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def kernel_intervals(trace: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every GPU kernel in a Chrome trace of torch's profiler."""
    out = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            start = float(event["ts"])
            out.append((start, start + float(event.get("dur", 0.0)), str(event.get("name", ""))))
    return sorted(out)


def summarize(kernels: list[tuple[float, float, str]], steps: int, top: int = 24) -> dict:
    """Span, busy time (the union of the kernels' intervals), busy share, kernels per step and
    the `top` kernels by total time."""
    if not kernels:
        return {"kernels": 0}
    busy, end = 0.0, kernels[0][0]
    for start, stop, _ in kernels:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = max(stop for _, stop, _ in kernels) - kernels[0][0]
    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for start, stop, name in kernels:
        totals[name] += stop - start
        counts[name] += 1
    return {
        "kernels": len(kernels),
        "span_ms": span / 1e3,
        "busy_ms": busy / 1e3,
        "busy_share": busy / span if span else 0.0,
        "kernels_per_step": len(kernels) / steps,
        "busy_ms_per_step": busy / 1e3 / steps,
        "top": [
            {"name": name[:160], "total_ms": t / 1e3, "count": counts[name]}
            for name, t in totals.most_common(top)
        ],
    }


def traced(run: Any) -> tuple[Any, list[tuple[float, float, str]]]:
    """run()'s result and the GPU kernels it launched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()  # CUPTI's records need a CUDA context; MLX's is the same primary one
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run()
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(path))
    return result, kernel_intervals(json.loads(path.read_text()))


def served_adapters(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """--adapters random adapters of --rank on every projection, written to a temporary
    directory: (name, path) pairs for ModelConfig."""
    if not args.adapters:
        return ()
    from bench.multi_lora import ALL_PROJECTIONS, model_dims, write_adapter

    layers, dims = model_dims(None, f"dummy:{args.preset}")
    root = Path(tempfile.mkdtemp())
    out = []
    for i in range(args.adapters):
        write_adapter(root / f"a{i}", layers, dims, ALL_PROJECTIONS, args.rank, seed=i)
        out.append((f"a{i}", str(root / f"a{i}")))
    return tuple(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=128, help="the raw loop's decode steps")
    parser.add_argument("--core-tokens", type=int, default=128, help="tokens a core row makes")
    parser.add_argument("--paths", default="raw,core")
    parser.add_argument("--adapters", type=int, default=0, help="LoRA adapters the core serves")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    try:
        import torch  # noqa: F401
    except ImportError:
        raise SystemExit("needs PyTorch (its profiler reads CUPTI's kernel records)") from None
    import mlx.core as mx
    import step_anatomy

    from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
    from service.common.logging import configure_logging
    from service.core.models.loader import parse_dtype
    from service.core.models.presets import dummy_model
    from service.core.runtime import Runtime

    configure_logging("warning", "console")
    paths = args.paths.split(",")
    rows: list[dict[str, Any]] = []
    if "raw" in paths:
        model, _ = dummy_model(args.preset, parse_dtype(args.dtype))
        mx.eval(model.parameters())
        step_anatomy.raw_round(model, args.batch, args.steps)
        wall, kernels = traced(lambda: step_anatomy.raw_round(model, args.batch, args.steps))
        rows.append({"path": "raw", **wall, **summarize(kernels, args.steps)})
        del model
    if "core" in paths:
        adapters = served_adapters(args)
        config = CoreConfig(
            model=ModelConfig(
                load_format=f"dummy:{args.preset}", dtype=args.dtype, adapters=adapters
            ),
            scheduling=SchedulingConfig(max_batch_size=args.batch, max_queue_depth=4096),
        )
        runtime = Runtime(config)
        runtime.start()
        runtime.wait_ready()
        rounds = {"core": ("",)}
        if adapters:
            rounds["core+lora"] = (*(name for name, _ in adapters), "")
        for path, names in rounds.items():
            step_anatomy.core_round(runtime, args.batch, args.core_tokens, 0, names)
            wall, kernels = traced(
                lambda names=names: step_anatomy.core_round(
                    runtime, args.batch, args.core_tokens, 1, names
                )
            )
            rows.append({**wall, "path": path, **summarize(kernels, args.core_tokens)})
        runtime.shutdown()
    for row in rows:
        print(
            f"{row['path']:>9} B={args.batch}: step {row['step_ms']:.2f} ms; GPU busy "
            f"{row.get('busy_ms_per_step', 0):.2f} ms a step ({row.get('busy_share', 0):.0%} of "
            f"the kernels' span), {row.get('kernels_per_step', 0):.0f} kernels a step"
        )
        for k in row.get("top", [])[:16]:
            print(f"        {k['total_ms']:8.2f} ms  x{k['count']:<6} {k['name'][:110]}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out)}, "rows": rows}, indent=1)
        )
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
