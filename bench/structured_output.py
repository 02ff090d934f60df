"""Structured output's cost: C concurrent greedy requests constrained by a JSON Schema against
the same requests unconstrained, on the engine core in this process (scheduler, runner,
loop; no gRPC), with the time spent filling token masks.

Each replicate runs both, in alternating order (drift hits both), C requests submitted at once,
every one generating exactly --max-tokens tokens (the unconstrained ones ignore EOS; the
schema asks for more items than that many tokens can hold, so no document ends early). Prints
tokens/s (median and range over the replicates), the constrained/unconstrained ratio per
replicate, the process's CPU time per token (steadier than wall time on a shared machine) and the
engine loop thread's (the serial host work of a step: what a host-bound GPU step pays), and
the mask time per step and per row-step (p50, p99 over all the constrained steps), and checks
every constrained completion against the schema token by token (exit 1 if one left it); writes JSON
with the git commit and the machine's load. With --phases, also the wall time per loop turn
spent in each part of the step (building, dispatching, joining the masks, sampling under them,
the update beside the dispatch), free and constrained apart: where a constrained step's extra
time goes on a host-bound device.

    env $(.venv/bin/python -m service.common.blas --env) .venv/bin/python \\
        bench/structured_output.py --concurrency 8 --max-tokens 128 --replicates 3 \\
        --out bench/out/structured_output.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.inprocess import Collect
from service.common.config import CoreConfig, ModelConfig, SchedulingConfig
from service.common.tokenizer import ChatTurn
from service.core.runtime import Runtime
from service.core.scheduler.request import Request
from service.protocol import GenerationRequest, ResponseFormat, SamplingParams

SCHEMA = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0},
            "name": {"type": "string", "maxLength": 24},
            "price": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
            "in_stock": {"type": "boolean"},
        },
        "required": ["id", "name", "price", "tags", "in_stock"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    "List the products of a grocery store as a JSON array.",
    "Give the catalogue of a bookshop as JSON.",
    "Describe the items sold by a hardware store, as a JSON list.",
    "Write the inventory of a toy shop in JSON.",
]


class Phases:
    """Wall time per loop turn in the step's parts, by run kind: the loop's, the runner's and
    the scheduler's methods are wrapped on their instances (this bench's runtime only)."""

    PARTS = (
        ("loop", ("turn", "_update_beside", "_finish_inflight")),
        ("runner", ("submit", "dispatch", "stage_masks", "sample")),
        ("scheduler", ("schedule", "decode_masks")),
    )

    def __init__(self, runtime: Runtime) -> None:
        self.kind = "warm-up"
        self.seconds: dict[str, dict[str, list[float]]] = {}
        for owner, names in self.PARTS:
            obj = getattr(runtime, owner)
            for name in names:
                setattr(obj, name, self._timed(f"{owner}.{name}", getattr(obj, name)))

    def _timed(self, label: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                bucket = self.seconds.setdefault(self.kind, {})
                bucket.setdefault(label, []).append(time.perf_counter() - started)

        return timed

    def per_turn_ms(self) -> dict[str, dict[str, float]]:
        out = {}
        for kind, parts in self.seconds.items():
            turns = len(parts.get("loop.turn", [])) or 1
            out[kind] = {label: 1000 * sum(v) / turns for label, v in sorted(parts.items())}
            out[kind]["turns"] = turns
        return out


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def engine_cpu_clock() -> int:
    """The CPU clock of the engine core's loop thread: its own host work per token is what a
    host-bound GPU step pays for."""
    (engine,) = [t for t in threading.enumerate() if t.name == "engine"]
    assert engine.ident is not None
    return time.pthread_getcpuclockid(engine.ident)


def run(runtime: Runtime, args: argparse.Namespace, constrained: bool, tag: str) -> dict:
    """C requests at once; tokens/s over the wall time until the last one finished."""
    assert runtime.loop is not None and runtime.loaded is not None
    engine_clock = engine_cpu_clock()
    tok = runtime.loaded.tokenizer
    fmt = ResponseFormat("json_schema", json.dumps(SCHEMA))
    cache = runtime.grammar
    assert cache is not None
    sink = Collect(args.concurrency)
    seqs = []
    started, cpu_started = time.perf_counter(), time.process_time()
    engine_started = time.clock_gettime(engine_clock)
    for i in range(args.concurrency):
        prompt = tok.render_chat([ChatTurn("user", PROMPTS[i % len(PROMPTS)])])
        request = GenerationRequest(
            f"{tag}-{i}",
            tuple(prompt),
            SamplingParams(),
            max_tokens=args.max_tokens,
            ignore_eos=not constrained,
            cache_prompt=False,
        )
        seq = Request(request, sink, rid=i)
        if constrained:  # per request, as the server's core asks its cache
            seq.grammar = cache.compile(fmt)
        seqs.append(seq)
        runtime.loop.submit(seq)
    if not sink.wait(600):
        raise TimeoutError(f"{tag}: {len(sink.finals)} of {args.concurrency} finished")
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu_started
    engine_cpu = time.clock_gettime(engine_clock) - engine_started
    reasons = sorted(set(sink.finals.values()))
    # Every constrained completion must be a prefix the schema allows, token for token.
    violations = 0
    for seq in seqs if constrained else []:
        assert seq.grammar is not None
        tokens = seq.output_token_ids
        if seq.grammar.matcher().validate(tokens) != len(tokens):
            violations += 1
    return {
        "grammar_violations": violations,
        "tok_s": sink.tokens / seconds,
        "tokens": sink.tokens,
        "cpu_ms_per_token": 1000 * cpu / sink.tokens,
        "engine_cpu_ms_per_token": 1000 * engine_cpu / sink.tokens,
        "finish": reasons,
    }


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--replicates", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/out/structured_output.json"))
    ap.add_argument(
        "--load-format", default="auto", help="auto (the embedded model) or dummy:PRESET"
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--phases", action="store_true", help="time the parts of each loop turn")
    ap.add_argument(
        "--lexers",
        type=int,
        default=0,
        help="originals of the format the rows copy, each with its own lexer (default: the "
        "core's own choice, one per mask thread; 1: every row shares one lexer)",
    )
    args = ap.parse_args()

    config = CoreConfig(
        model=ModelConfig(dtype=args.dtype, load_format=args.load_format),
        scheduling=SchedulingConfig(max_batch_size=args.concurrency),
    )
    runtime = Runtime(config)
    runtime.start()
    runtime.wait_ready(300)
    assert runtime.scheduler is not None and runtime.scheduler.constraints is not None
    assert runtime.grammar is not None
    if args.lexers:
        runtime.grammar.lexers = args.lexers  # before the format's first compile
    stats = runtime.scheduler.constraints.stats
    load = [os.getloadavg()[0]]
    phases = Phases(runtime) if args.phases else None
    run(runtime, args, False, "warm-free")  # compiles, first shapes, the grammar tokenizer
    run(runtime, args, True, "warm-json")
    stats.recent.clear()
    replicates = []
    for r in range(args.replicates):
        order = [False, True] if r % 2 == 0 else [True, False]
        result: dict[str, Any] = {}
        for constrained in order:
            name = "json_schema" if constrained else "free"
            if phases is not None:
                phases.kind = name
            result[name] = run(runtime, args, constrained, f"{name}-{r}")
            load.append(os.getloadavg()[0])
        result["ratio"] = result["json_schema"]["tok_s"] / result["free"]["tok_s"]
        result["cpu_ratio"] = (
            result["json_schema"]["cpu_ms_per_token"] / result["free"]["cpu_ms_per_token"]
        )
        result["engine_cpu_ratio"] = (
            result["json_schema"]["engine_cpu_ms_per_token"]
            / result["free"]["engine_cpu_ms_per_token"]
        )
        replicates.append(result)
        print(
            f"replicate {r + 1}: free {result['free']['tok_s']:.1f} tok/s, json_schema "
            f"{result['json_schema']['tok_s']:.1f} tok/s, ratio {result['ratio']:.3f}, "
            f"completions off the schema {result['json_schema']['grammar_violations']}",
            flush=True,
        )
    steps = list(stats.recent)
    per_step = [s for s, _ in steps]
    per_row = [s / n for s, n in steps for _ in range(n)]
    runtime.shutdown()
    violations = sum(r["json_schema"]["grammar_violations"] for r in replicates)

    def summary(values: list[float]) -> dict[str, float]:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    out = {
        "commit": git_commit(),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "replicates": replicates,
        "free_tok_s": summary([r["free"]["tok_s"] for r in replicates]),
        "json_schema_tok_s": summary([r["json_schema"]["tok_s"] for r in replicates]),
        "ratio": summary([r["ratio"] for r in replicates]),
        "cpu_per_token_ratio": summary([r["cpu_ratio"] for r in replicates]),
        "engine_cpu_per_token_ratio": summary([r["engine_cpu_ratio"] for r in replicates]),
        "mask_step_seconds": percentiles(per_step),
        "mask_row_step_seconds": percentiles(per_row),
        "masked_steps": len(per_step),
        "load_average_1m": load,
        "cpus": os.cpu_count(),
        "lexers": runtime.grammar.lexers,
    }
    if phases is not None:
        out["phase_ms_per_turn"] = phases.per_turn_ms()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")

    def row(label: str, s: dict[str, float], unit: str = "", scale: float = 1.0) -> str:
        return (
            f"| {label} | {s['median'] * scale:.3g}{unit} | "
            f"{s['min'] * scale:.3g} – {s['max'] * scale:.3g}{unit} |"
        )

    print(f"\ncommit {out['commit']}, C={args.concurrency}, {args.max_tokens} tokens each")
    print("| | median | range |\n|---|---:|---:|")
    print(row("unconstrained tok/s", out["free_tok_s"]))
    print(row("json_schema tok/s", out["json_schema_tok_s"]))
    print(row("ratio (tok/s)", out["ratio"], "×"))
    print(row("CPU per token, json_schema / free", out["cpu_per_token_ratio"], "×"))
    print(row("engine thread CPU per token, ditto", out["engine_cpu_per_token_ratio"], "×"))
    ms, mr = out["mask_step_seconds"], out["mask_row_step_seconds"]
    print(
        f"mask time per step: p50 {ms['p50'] * 1e6:.0f} µs, p99 {ms['p99'] * 1e6:.0f} µs; "
        f"per row-step: p50 {mr['p50'] * 1e6:.0f} µs, p99 {mr['p99'] * 1e6:.0f} µs "
        f"({len(per_step)} steps)"
    )
    for kind, parts in out.get("phase_ms_per_turn", {}).items():
        if kind != "warm-up":
            shown = ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if k != "turns")
            print(f"{kind}, ms per loop turn ({parts['turns']:.0f} turns): {shown}")
    print(f"load average (1 min) during the runs: {', '.join(f'{x:.1f}' for x in load)}")
    print(f"wrote {args.out}")
    if violations:
        print(f"{violations} constrained completions left the schema", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
