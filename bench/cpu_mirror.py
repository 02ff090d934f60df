"""A/B of the CPU decode path's contiguous K/V copy (service.core.engine.kv_mirror) against
gathering each step's K/V from the paged pool, in one process (scheduler + engine, no gRPC).

Two runtimes on the same model differ only in the engine configuration's `decode_attention`
("mirror", what the CPU path resolves to, against "gather"). Each pair runs the same burst of
B greedy requests (EOS ignored) on both, the order alternating; the ratio per pair is mirror's
decode tok/s over gather's. Prints every pair and the median with its range; writes JSON.

    env $(python -m service.common.blas --env) python bench/cpu_mirror.py --batch 8,16 --pairs 5
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import subprocess
from pathlib import Path

import service.core.runtime as runtime_module
from bench.inprocess import run_batch
from service.common.config import CoreConfig, SchedulingConfig
from service.common.logging import configure_logging
from service.core.runtime import Runtime


def build(decode_attention: str, parallel: int) -> Runtime:
    resolve = runtime_module.resolve

    def forced(*args, **kwargs):
        config = resolve(*args, **kwargs)
        if config.decode_attention not in ("mirror", "gather"):
            raise SystemExit(f"this platform resolves {config.decode_attention!r}: CPU only")
        mirror = decode_attention == "mirror"
        return dataclasses.replace(
            config,
            decode_attention=decode_attention,
            fast_mirror_attention=mirror and config.fast_mirror_attention,
        )

    runtime_module.resolve = forced
    try:
        runtime = Runtime(
            CoreConfig(
                scheduling=SchedulingConfig(max_batch_size=parallel, max_queue_depth=parallel)
            )
        )
        runtime.start()  # loads and serves on its engine thread, as the engine core does
        runtime.wait_ready()
    finally:
        runtime_module.resolve = resolve
    return runtime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="8,16", help="comma-separated batch sizes")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default="bench/out/cpu_mirror.json")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    configure_logging("warning", "console")
    runtimes = {mode: build(mode, max(batches)) for mode in ("mirror", "gather")}
    vocab = runtimes["mirror"].loaded.vocab_size
    results = []
    for batch in batches:
        # Distinct prompts of equal length: every row decodes over the same context size.
        prompts = [
            [
                (7919 * (r * args.prompt_tokens + t)) % (vocab - 1000) + 500
                for t in range(args.prompt_tokens)
            ]
            for r in range(batch)
        ]
        for runtime in runtimes.values():  # warm up this batch's shapes
            run_batch(runtime, prompts, 4, f"warm-{batch}")
        ratios = []
        for pair in range(args.pairs):
            order = ("mirror", "gather") if pair % 2 == 0 else ("gather", "mirror")
            tok_s = {}
            for mode in order:
                seconds, sink = run_batch(
                    runtimes[mode], prompts, args.max_tokens, f"{mode}-{pair}"
                )
                tok_s[mode] = sink.tokens / seconds
            ratios.append(tok_s["mirror"] / tok_s["gather"])
            print(
                f"B={batch} pair {pair}: mirror {tok_s['mirror']:.1f} tok/s, gather "
                f"{tok_s['gather']:.1f} tok/s, ratio {ratios[-1]:.3f}",
                flush=True,
            )
            results.append({"batch": batch, "pair": pair, **tok_s})
        print(
            f"B={batch}: mirror/gather median {statistics.median(ratios):.3f} "
            f"(range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} pairs)",
            flush=True,
        )
    for runtime in runtimes.values():
        runtime.shutdown()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {"commit": commit, "machine": platform.machine(), "args": vars(args), "runs": results},
            indent=1,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
