"""Prefill stalls with and without the stall bound (a benchmark, not a test).

A server on the embedded model (`--max-batch-size 5`) runs 4 greedy chat streams (ignore_eos);
once they decode steadily, a prompt of exactly `--prompt-tokens` token ids (default 8191: the
whole context but the one token it generates) arrives. Per setting of `--max-prefill-stall-ms`
(`default`: no flag, 4x the running median decode step; `0`: off, 512-token chunks while rows
decode; or a number of ms) it measures:

* the streams' inter-token gaps while the prompt prefills (every gap between two consecutive
  tokens of a stream that overlaps the window from the prompt's arrival to its first token,
  pooled over the streams): max, p95, p50; and their p50 just before the arrival;
* the prompt's time to first token (client-measured, and the server's own figure);
* from the server's debug log, the prompt's prefill passes: how many, the largest measured and
  its predicted time, and the stall bound and pass budget the scheduler used;
* the 1-minute load average before and after (the CPU may be shared).

Settings alternate over `--rounds` (order reversed every other round); the table shows medians
over rounds. Prints it and writes JSON to bench/out/.

    .venv/bin/python bench/prefill_stall.py                        # default and 0, 2 rounds
    .venv/bin/python bench/prefill_stall.py --configs default,1000,0 --rounds 1

From a git worktree whose editable install points elsewhere, put the worktree first:
`PYTHONPATH=. .venv/bin/python bench/prefill_stall.py` (the server runs from the tree that
`client` is imported from).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from client.bench.server import ServerProcess
from client.client import AsyncGenerationClient, build_request

OUT_DIR = Path(__file__).resolve().parent / "out"
PARAGRAPH = (
    "The old harbour town grew rich on the spice trade. Merchants came from distant lands "
    "with cloth, copper and salt, and every spring the quays filled with ships and sailors. "
)
STREAM_PROMPTS = [
    "Tell me a long story about a dragon.",
    "Describe a walk through a forest in autumn.",
    "Write a letter to a friend about your holiday.",
    "Explain how a steam engine works.",
]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def flags_of(config: str) -> list[str]:
    return [] if config == "default" else ["--max-prefill-stall-ms", config]


async def prompt_ids(target: str, n: int) -> list[int]:
    """Exactly n token ids of repeated English text."""
    async with AsyncGenerationClient(target) as client:
        ids: list[int] = []
        repeats = 1
        while len(ids) < n:
            repeats *= 2
            ids = list((await client.tokenize(PARAGRAPH * repeats)).token_ids)
        return ids[:n]


async def measure(target: str, ids: list[int], streams: int, baseline_s: float) -> dict[str, Any]:
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    async with AsyncGenerationClient(target) as client:
        await client.generate(build_request(chat=[("user", "Hi")], max_tokens=4))  # warm-up

        async def decode(i: int) -> None:
            prompt = STREAM_PROMPTS[i % len(STREAM_PROMPTS)]
            request = build_request(
                chat=[("user", prompt)], max_tokens=8000, ignore_eos=True, request_id=f"dec-{i}"
            )
            async for message in client.stream(request, timeout=7200):
                if message.token_ids:
                    arrivals[i].append(time.monotonic())

        tasks = [asyncio.ensure_future(decode(i)) for i in range(streams)]
        try:
            while not all(len(a) >= 5 for a in arrivals):
                await asyncio.sleep(0.02)
            await asyncio.sleep(baseline_s)
            sent = time.monotonic()
            first = None
            server_ttft = float("nan")
            prompt_tokens = 0
            request = build_request(token_ids=ids, max_tokens=1, request_id="long")
            async for message in client.stream(request, timeout=7200):
                if message.token_ids and first is None:
                    first = time.monotonic()
                if message.finish_reason:
                    server_ttft = message.timing.time_to_first_token_seconds
                    prompt_tokens = message.usage.prompt_tokens
            await asyncio.sleep(1.0)  # the streams' tokens of the tick that ended the prefill
            ended_early = sum(t.done() for t in tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert first is not None, "the long request produced no token"

    during: list[float] = []
    before: list[float] = []
    for times in arrivals:
        gaps = list(itertools.pairwise(times))
        during += [b - a for a, b in gaps if b > sent and a < first]
        before += [b - a for a, b in gaps if b <= sent]
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_s": first - sent,
        "server_ttft_s": server_ttft,
        "itl_before_p50_s": percentile(before[-40:], 50),
        "gap_p50_s": percentile(during, 50),
        "gap_p95_s": percentile(during, 95),
        "gap_max_s": max(during) if during else float("nan"),
        "gap_samples": len(during),
        "streams_ended_early": ended_early,
    }


def prefill_passes(log_path: Path) -> dict[str, Any]:
    """The long prompt's prefill passes from the server's debug log."""
    passes = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "prefill pass" and "long" in record.get("request_ids", []):
            passes.append(record)
    if not passes:
        return {"passes": 0}
    slowest = max(passes, key=lambda r: r["ms"])
    bounded = [r for r in passes if r.get("budget_ms") is not None]
    return {
        "passes": len(passes),
        "tokens_first_last": [passes[0]["tokens"][0], passes[-1]["tokens"][0]],
        "slowest_pass_ms": slowest["ms"],
        "slowest_pass_predicted_ms": slowest.get("predicted_ms"),
        "slowest_pass_tokens": slowest["tokens"][0],
        "bound_ms_last": bounded[-1].get("bound_ms") if bounded else None,
        "budget_ms_last": bounded[-1]["budget_ms"] if bounded else None,
        "passes_over_budget": sum(r["ms"] > r["budget_ms"] for r in bounded),
    }


def run_config(config: str, args: argparse.Namespace, ids: list[int] | None) -> dict[str, Any]:
    flags = ["--max-batch-size", "5", *flags_of(config), "--log-format", "json"]
    flags += ["--log-level", "debug"]
    log_path = Path(args.log_dir) / f"prefill_stall-{config}.server.log"
    with ServerProcess(flags, log_path=log_path) as server:
        if ids is None:
            ids = asyncio.run(prompt_ids(server.target, args.prompt_tokens))
        load_before = os.getloadavg()[0]
        result = asyncio.run(measure(server.target, ids, args.streams, args.baseline))
        result["loadavg_1m_before"] = load_before
        result["loadavg_1m_after"] = os.getloadavg()[0]
    result.update(prefill_passes(log_path))
    result["config"] = config
    result["flags"] = flags
    result["ids"] = ids
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--configs", default="default,0", help="--max-prefill-stall-ms settings: default, 0, ms"
    )
    parser.add_argument("--prompt-tokens", type=int, default=8191)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--baseline", type=float, default=3.0, help="seconds of decode first")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--log-dir", default="/tmp", help="where the server logs go")
    parser.add_argument("--out", default=None, help="JSON path (default bench/out/...)")
    args = parser.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    for name in names:
        if name != "default":
            try:
                float(name)
            except ValueError:
                parser.error(f"--configs: {name!r} is not default or a number of ms")

    runs: list[dict[str, Any]] = []
    ids: list[int] | None = None
    for round_no in range(args.rounds):
        for name in names if round_no % 2 == 0 else names[::-1]:
            started = time.monotonic()
            result = run_config(name, args, ids)
            ids = result.pop("ids")
            result["round"] = round_no
            runs.append(result)
            print(
                f"[round {round_no}] {name:>8}: TTFT {result['ttft_s']:.1f} s, gap max "
                f"{result['gap_max_s']:.2f} s, p95 {result['gap_p95_s']:.2f} s, "
                f"{result['passes']} passes, load {result['loadavg_1m_before']:.1f}->"
                f"{result['loadavg_1m_after']:.1f} ({time.monotonic() - started:.0f} s)",
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["config"] == name)

    print()
    print(
        f"{args.streams} streams decoding (max-batch-size 5), then a {runs[0]['prompt_tokens']}"
        f"-token prompt arrives; medians over {args.rounds} round(s)"
    )
    header = (
        f"{'stall ms':>9} | {'ITL before p50':>14} | {'gap p50':>8} | {'gap p95':>8} | "
        f"{'gap max':>8} | {'new TTFT':>9} | {'passes':>6}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for name in names:
        row = {
            "config": name,
            "itl_before_p50_s": median(name, "itl_before_p50_s"),
            "gap_p50_s": median(name, "gap_p50_s"),
            "gap_p95_s": median(name, "gap_p95_s"),
            "gap_max_s": median(name, "gap_max_s"),
            "ttft_s": median(name, "ttft_s"),
            "passes": median(name, "passes"),
        }
        summary.append(row)
        print(
            f"{name:>9} | {row['itl_before_p50_s'] * 1000:11.0f} ms | "
            f"{row['gap_p50_s']:6.2f} s | {row['gap_p95_s']:6.2f} s | {row['gap_max_s']:6.2f} s |"
            f" {row['ttft_s']:7.1f} s | {row['passes']:6.0f}"
        )
    print("(gaps: the streams' inter-token gaps from the prompt's arrival to its first token)")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = Path(args.out) if args.out else OUT_DIR / f"prefill_stall-{stamp}.json"
    payload = {
        "benchmark": "prefill_stall",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "note": "shared CPU: see loadavg_1m_* per run",
        },
        "streams": args.streams,
        "max_batch_size": 5,
        "prompt_tokens": runs[0]["prompt_tokens"],
        "rounds": args.rounds,
        "summary": summary,
        "runs": runs,
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
