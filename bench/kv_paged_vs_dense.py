"""Micro-benchmark: batched decode tokens/s with dense vs paged KV storage (not a test).

Loads the embedded SmolLM2 model, prefills `--batch` sequences of each `--contexts` length,
then times greedy decode steps three ways:

- sync:       engine.step() — each step is read before the next is built;
- pipelined:  the scheduler's pattern — step N+1 is submitted before step N is read;
- pipe+wait:  pipelined, but each dispatch first waits for the previous step (its graph is
              still built while the previous one runs). MLX updates an array in place
              (`a[idx] = x`) only if no queued task still holds its buffer at dispatch, so
              plain pipelining makes every layer's K/V write copy the whole cache array.

Paged storage runs with a pool just big enough ("paged") and with a large pool
("paged-big", --big-pool-tokens) to show what a copy of the pool costs.

    env $(.venv/bin/python -m service.blas --env) .venv/bin/python bench/kv_paged_vs_dense.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import service.engine.engine as engine_module
from service.engine.batch_view import StepLayout
from service.engine.engine import Engine, StepRow
from service.engine.kv_dense import DenseKVStorage
from service.engine.kv_paged import PagedKVStorage
from service.engine.sampler import SamplingParams
from service.models.loader import load_model

OUT_DIR = Path(__file__).resolve().parent / "out"


class _WaitThenDispatch:
    """Stands in for `mx` inside the engine module: async_eval first waits for the previous
    dispatch, so the previous step's tasks no longer hold the K/V buffers."""

    def __init__(self) -> None:
        self.last: tuple[Any, ...] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(mx, name)

    def async_eval(self, *args: Any) -> None:
        if self.last is not None:
            mx.eval(*self.last)
        mx.async_eval(*args)
        self.last = args


def make_storage(kind: str, lm: Any, tokens_needed: int, args: argparse.Namespace):
    if kind == "dense":
        return DenseKVStorage(lm.num_layers, lm.kv_heads, lm.head_dim, lm.dtype)
    pool_tokens = tokens_needed if kind == "paged" else max(tokens_needed, args.big_pool_tokens)
    num_blocks = -(-pool_tokens // args.block_size) + args.batch
    return PagedKVStorage(
        lm.num_layers, lm.kv_heads, lm.head_dim, lm.dtype, num_blocks, args.block_size
    )


def prefill(engine: Engine, seqs: list, prompts: list[list[int]], chunk: int) -> None:
    for seq, p in zip(seqs, prompts):
        for start in range(0, len(p), chunk):
            last = start + chunk >= len(p)
            engine.prefill([StepRow(seq, p[start : start + chunk], sample=last)])


def copy_prefill(src_engine: Engine, src_storage, src_seqs: list, engine: Engine, seqs: list):
    """Give seqs the K/V and next input of src_seqs (prefilled on another storage)."""
    for src, dst in zip(src_seqs, seqs):
        n = src.num_cached
        if hasattr(engine.storage, "ensure_reserved"):
            assert engine.storage.ensure_reserved(dst.kv, n)
        layout = StepLayout([dst.kv], [0], [n])
        for layer in range(src_engine.num_layers):
            if isinstance(src_storage, PagedKVStorage):
                k, v = src_storage.gather(src.kv, layer, n)
            else:
                k, v = src.kv.keys[layer][:, :n], src.kv.values[layer][:, :n]
            out = engine.storage.write_and_gather(layer, layout, k[None], v[None])
            mx.eval(out)
        dst.num_cached = n
        dst.next_input = src.next_input


def time_mode(engine: Engine, seqs: list, mode: str, steps: int, warmup: int) -> list[float]:
    """Seconds per decode iteration (one step's tokens read), after warmup iterations."""
    rows = [StepRow(s) for s in seqs]
    times: list[float] = []

    def run(n: int) -> None:
        if mode == "sync":
            for _ in range(n):
                t0 = time.perf_counter()
                engine.step(rows)
                times.append(time.perf_counter() - t0)
            return
        pending = engine.submit(rows)
        t0 = time.perf_counter()
        for _ in range(n - 1):
            nxt = engine.submit(rows)
            engine.finish_rows(pending)
            pending = nxt
            times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
        engine.finish_rows(pending)

    shim = _WaitThenDispatch() if mode == "pipe+wait" else None
    if shim is not None:
        engine_module.mx = shim
    try:
        run(warmup)
        mx.synchronize()
        del times[:]
        run(steps + (mode != "sync"))
    finally:
        engine_module.mx = mx
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4, help="timed iterations per run")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=4, help="runs per storage and mode")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=1024)
    parser.add_argument("--big-pool-tokens", type=int, default=32768)
    parser.add_argument("--storages", nargs="+", default=["dense", "paged", "paged-big"])
    parser.add_argument("--modes", nargs="+", default=["sync", "pipelined", "pipe+wait"])
    args = parser.parse_args()

    lm = load_model(None)
    results = []
    for ctx in args.contexts:
        prompts = [[(17 * i + 31 * r) % 1000 + 10 for i in range(ctx)] for r in range(args.batch)]
        decode_tokens = args.repeats * len(args.modes) * (args.steps + args.warmup + 1) + 4
        runs = {}
        for kind in args.storages:
            storage = make_storage(kind, lm, args.batch * (ctx + decode_tokens), args)
            engine = Engine(lm.model, storage, lm.num_layers)
            seqs = [
                engine.add_sequence(f"r{r}", SamplingParams(), p) for r, p in enumerate(prompts)
            ]
            if not runs:
                prefill(engine, seqs, prompts, args.prefill_chunk)
            else:  # the same prompt K/V, copied rather than recomputed (prefill is slow here)
                copy_prefill(*next(iter(runs.values())), engine, seqs)
            runs[kind] = (engine, storage, seqs)
        # Storages take turns in short runs, so that load from elsewhere on the machine hits
        # them alike; tokens/s is from the median iteration time over all repeats.
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):
            for mode in args.modes:
                for kind, (engine, _, seqs) in runs.items():
                    got = time_mode(engine, seqs, mode, args.steps, args.warmup)
                    times.setdefault((kind, mode), []).extend(got)
        best = {key: args.batch / statistics.median(ts) for key, ts in times.items()}
        fastest = {key: args.batch / min(ts) for key, ts in times.items()}
        for mode in args.modes:
            for kind, (_, storage, _) in runs.items():
                row = {
                    "context": ctx,
                    "storage": kind,
                    "mode": mode,
                    "batch": args.batch,
                    "tokens_per_s": round(best[kind, mode], 2),
                    "tokens_per_s_fastest_step": round(fastest[kind, mode], 2),
                    "iterations": len(times[kind, mode]),
                    "kv_reserved_mib": round(storage.reserved_bytes / 2**20, 1),
                }
                results.append(row)
                print(
                    f"ctx {ctx:5d}  {kind:9s}  {mode:9s}  {row['tokens_per_s']:8.1f} tok/s"
                    f"  (KV arrays {row['kv_reserved_mib']} MiB)",
                    flush=True,
                )
        for engine, _, seqs in runs.values():
            for s in seqs:
                engine.release(s)
        del runs, engine, seqs
        mx.clear_cache()

    print(f"\n{'context':>7}  {'mode':9s}" + "".join(f"  {k:>10s}" for k in args.storages))
    for ctx in args.contexts:
        for mode in args.modes:
            cells = {
                r["storage"]: r["tokens_per_s"]
                for r in results
                if r["context"] == ctx and r["mode"] == mode
            }
            line = "".join(f"  {cells.get(k, float('nan')):10.1f}" for k in args.storages)
            print(f"{ctx:7d}  {mode:9s}{line}")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = OUT_DIR / f"kv_paged_vs_dense-{time.strftime('%Y%m%d-%H%M%S')}.json"
    meta = {
        "model": lm.model_id,
        "dtype": str(lm.dtype),
        "device": str(mx.default_device()),
        "block_size": args.block_size,
        "steps": args.steps,
        "repeats": args.repeats,
        "big_pool_tokens": args.big_pool_tokens,
    }
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
