"""Per-step host overhead of the serving path against the raw mlx-lm loop, in one process.

Both run the same model (default: the `thin-30` preset, SmolLM2's 30 layers at a width whose math
costs next to nothing, so what is measured is graph building, dispatch and bookkeeping). For each
batch size B: the raw loop (batched KVCache, greedy, pipelined like mlx-lm's generate_step) and
our scheduler + engine + paged storage (the server's wiring, `service.runtime.Runtime`, without
gRPC), B requests submitted at once, ignore_eos. Reports the median decode step of each and the
ratio; writes JSON.

    python bench/host_overhead.py --batch 1,8,64 --steps 64 [--preset smollm2-135m]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import threading
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from service.config import ServerConfig
from service.engine import paged_attention
from service.engine.engine import StepRow
from service.engine.sampler import SamplingParams
from service.logging import configure_logging
from service.runtime import Runtime
from service.scheduler.request import GenerationRequest, Sequence


def raw_steps(model, prompt: list[int], batch: int, steps: int) -> list[float]:
    cache = make_prompt_cache(model)

    def forward(x: mx.array) -> mx.array:
        return mx.argmax(model(x, cache=cache)[:, -1, :], axis=-1)

    y = forward(mx.array([prompt] * batch))
    mx.async_eval(y)
    gaps, last = [], None
    for n in range(steps):
        nxt = forward(y[:, None]) if n + 1 < steps else None
        if nxt is not None:
            mx.async_eval(nxt)
        y.tolist()
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        y = nxt
    return gaps


def engine_steps(
    runtime: Runtime, prompt: list[int], batch: int, steps: int, overlap: bool = False
) -> list[float]:
    """The engine alone, driven as the scheduler drives it (step N+1 built before N is read;
    with overlap, also dispatched before N is read)."""
    engine = runtime.engine
    seqs = [engine.add_sequence(f"engine-{i}", SamplingParams(), prompt) for i in range(batch)]
    engine.prefill([StepRow(s, prompt) for s in seqs])
    pending = engine.submit([StepRow(s) for s in seqs])
    gaps, last = [], None
    for n in range(steps):
        nxt = engine.submit([StepRow(s) for s in seqs], dispatch=overlap) if n + 1 < steps else None
        engine.finish_rows(pending)
        if nxt is not None and not overlap:
            engine.dispatch(nxt)
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
        pending = nxt
    for s in seqs:
        engine.release(s)
    return gaps


def served_steps(runtime: Runtime, prompt: list[int], batch: int, steps: int) -> list[float]:
    done = threading.Event()
    stamps: list[float] = []  # when each tick's outputs reached the first request's sink
    finished = [0]
    lock = threading.Lock()

    def sink_for(first: bool):
        def sink(outputs) -> None:
            if first and any(o.token_ids for o in outputs):
                stamps.append(time.perf_counter())
            if any(o.finished for o in outputs):
                with lock:
                    finished[0] += 1
                    if finished[0] == batch:
                        done.set()

        return sink

    tag = time.monotonic_ns()
    for i in range(batch):
        request = GenerationRequest(
            f"overhead-{tag}-{i}",
            tuple(prompt),
            SamplingParams(),
            max_tokens=steps,
            ignore_eos=True,
            cache_prompt=False,
        )
        runtime.scheduler.submit(Sequence(request, sink_for(i == 0)))
    done.wait()
    return [b - a for a, b in itertools.pairwise(stamps)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="thin-30")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch", default="1,8,64")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]

    config = ServerConfig(
        load_format=f"dummy:{args.preset}",
        dtype=args.dtype or "auto",
        parallel=max(batches),
        max_queue_depth=max(batches),
    )
    configure_logging("warning", "console")
    runtime = Runtime(config)
    runtime.load()
    model = runtime.loaded.model
    prompt = list(range(100, 140))
    print(f"{args.preset} on {mx.default_device()}: median decode step (ms)")
    # (label, driver, direct decode attention, overlapped steps, compiled decode steps); direct
    # needs the paged pool, compiled steps direct attention.
    direct_ok = runtime.engine.direct_decode or paged_attention.install(model)
    modes = [
        ("engine:gather", "engine", False, False, False),
        ("engine:direct", "engine", True, False, False),
        ("engine:direct+overlap", "engine", True, True, False),
        ("engine:compiled+overlap", "engine", True, True, True),
        ("served", "served", runtime.engine.direct_decode, False, False),
        ("served+overlap", "served", runtime.engine.direct_decode, True, False),
        ("served+compiled+overlap", "served", runtime.engine.direct_decode, True, True),
    ]
    modes = [m for m in modes if direct_ok or not m[2]]
    if args.modes:
        modes = [m for m in modes if m[0] in args.modes.split(",")]
    graphs = {}  # one DecodeGraph (its compiled shapes) for every compiled mode
    print("B".rjust(4), "raw".rjust(8), *(m[0].rjust(22) for m in modes), " (ratio to raw)")
    results = []
    for b in batches:
        times: dict[str, list[float]] = {"raw": [], **{m[0]: [] for m in modes}}
        for repeat in range(args.repeats + 1):  # pass 0 warms this shape up and is dropped
            keep = repeat > 0
            raw = raw_steps(model, prompt, b, args.steps)
            times["raw"] += raw if keep else []
            for label, driver, direct, overlap, compiled in modes:
                runtime.engine.direct_decode = direct
                runtime.engine.overlap_steps = overlap
                if compiled and "graph" not in graphs:
                    runtime.engine.compile_decode_steps()
                    graphs["graph"] = runtime.engine.decode_graph
                runtime.engine.decode_graph = graphs["graph"] if compiled else None
                # Overlapped steps write the pool in place where the CUDA kernel runs (as the
                # runtime sets it up); elsewhere MLX copies the pool per overlapped step.
                runtime.engine.storage.write_in_place = (
                    (overlap or compiled) and direct and paged_attention.kernel_available()
                )
                if driver == "engine":
                    gaps = engine_steps(runtime, prompt, b, args.steps, overlap)
                else:
                    gaps = served_steps(runtime, prompt, b, args.steps)
                times[label] += gaps if keep else []
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        cells = [f"{med[m[0]]:8.2f} ({med[m[0]] / med['raw']:.2f}x)".rjust(22) for m in modes]
        print(f"{b:>4} {med['raw']:8.2f}", *cells, flush=True)
        results.append({"batch": b, **{f"{k}_step_ms": v for k, v in med.items()}})
    runtime.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps({"preset": args.preset, "results": results}, indent=1))


if __name__ == "__main__":
    main()
