"""Chunked prefill trade-off on this machine (SPEC §3, issue 4; a benchmark, not a test).

For each prefill chunk setting (`--prefill-chunk-size 0`, `512`, `2048`, and the adaptive default:
2048 idle / 512 while a batch decodes) a server is started with `--max-batch-size 5`; 4 greedy
chat streams (ignore_eos, long max_tokens) decode; once they are in steady state a ~2000-token
prompt arrives. Measured per setting:

* the 4 streams' inter-token latency (ITL) during the long request's prefill: every gap between
  two consecutive tokens of a stream that overlaps the window from the long request's arrival to
  its first token (pooled over the 4 streams): p50, p95 and max;
* the same streams' ITL p50 just before the arrival (the undisturbed decode step);
* the new request's time to first token (client-measured, and the server's own figure).

Prints a table and writes JSON to bench/out/. Chunk-size runs alternate over `--rounds`; the
table shows medians over rounds.

    .venv/bin/python bench/chunked_prefill.py            # ~1 minute per setting and round
    .venv/bin/python bench/chunked_prefill.py --configs 0,512 --prompt-tokens 1500
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
CONFIGS: dict[str, list[str]] = {
    "0": ["--prefill-chunk-size", "0"],
    "512": ["--prefill-chunk-size", "512"],
    "2048": ["--prefill-chunk-size", "2048"],
    "adaptive": [],
}
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


async def long_prompt_text(target: str, want_tokens: int) -> tuple[str, int]:
    """A repeated paragraph as a user message of at most (about) `want_tokens` chat tokens."""
    async with AsyncGenerationClient(target) as client:

        async def count(repeats: int) -> int:
            chat = [("user", PARAGRAPH * repeats)]
            return len((await client.tokenize(chat=chat)).token_ids)

        one, two = await count(1), await count(2)
        per, overhead = two - one, 2 * one - two
        repeats = max(1, (want_tokens - overhead) // per)
        while repeats > 1 and await count(repeats) > want_tokens:
            repeats -= 1
        return PARAGRAPH * repeats, await count(repeats)


async def measure(target: str, long_text: str, streams: int, baseline_s: float) -> dict[str, Any]:
    """One run: `streams` decoding streams, then the long prompt; timings from the client."""
    arrivals: list[list[float]] = [[] for _ in range(streams)]
    async with AsyncGenerationClient(target) as client:
        # Warm-up: the first forwards of a fresh process are slower.
        await client.generate(build_request(chat=[("user", "Hi")], max_tokens=4))

        async def decode(i: int) -> None:
            prompt = STREAM_PROMPTS[i % len(STREAM_PROMPTS)]
            request = build_request(
                chat=[("user", prompt)], max_tokens=4000, ignore_eos=True, request_id=f"dec-{i}"
            )
            async for message in client.stream(request, timeout=900):
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
            request = build_request(chat=[("user", long_text)], max_tokens=1, request_id="long")
            async for message in client.stream(request, timeout=900):
                if message.token_ids and first is None:
                    first = time.monotonic()
                if message.finish_reason:
                    server_ttft = message.timing.time_to_first_token_seconds
                    prompt_tokens = message.usage.prompt_tokens
            # Let the streams deliver the tokens of the tick that ended the prefill.
            await asyncio.sleep(0.5)
            ended_early = sum(t.done() for t in tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    assert first is not None, "the long request produced no token"

    during: list[float] = []
    before: list[float] = []
    tokens_during = []
    for times in arrivals:
        gaps = list(itertools.pairwise(times))
        during += [b - a for a, b in gaps if b > sent and a < first]
        before += [b - a for a, b in gaps if b <= sent]
        tokens_during.append(sum(1 for t in times if sent < t < first))
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_s": first - sent,
        "server_ttft_s": server_ttft,
        "itl_before_p50_s": percentile(before[-40:], 50),
        "itl_p50_s": percentile(during, 50),
        "itl_p95_s": percentile(during, 95),
        "itl_max_s": max(during) if during else float("nan"),
        "itl_samples": len(during),
        "stream_tokens_during_prefill": tokens_during,
        "streams_ended_early": ended_early,
    }


def run_config(name: str, args: argparse.Namespace, long_text: str | None) -> dict[str, Any]:
    flags = ["--max-batch-size", "5", *CONFIGS[name], "--log-format", "json"]
    log_path = Path(args.log_dir) / f"chunked_prefill-{name}.server.log"
    with ServerProcess(flags, log_path=log_path) as server:
        if long_text is None:
            long_text, n = asyncio.run(long_prompt_text(server.target, args.prompt_tokens))
            print(f"long prompt: {n} chat tokens", flush=True)
        load_before = os.getloadavg()[0]
        result = asyncio.run(measure(server.target, long_text, args.streams, args.baseline))
        result["loadavg_1m_before"] = load_before
        result["loadavg_1m_after"] = os.getloadavg()[0]
    result["config"] = name
    result["flags"] = flags
    result["long_text"] = long_text
    return result


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1000:8.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="0,512,2048,adaptive", help="chunk settings to run")
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="long prompt size")
    parser.add_argument("--streams", type=int, default=4, help="decoding streams")
    parser.add_argument("--baseline", type=float, default=2.0, help="seconds of decode first")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--log-dir", default="/tmp", help="where the server logs go")
    parser.add_argument("--out", default=None, help="JSON path (default bench/out/...)")
    args = parser.parse_args()
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(names) - set(CONFIGS)
    if unknown:
        parser.error(f"unknown configs {sorted(unknown)}; choose from {list(CONFIGS)}")

    runs: list[dict[str, Any]] = []
    long_text: str | None = None
    for round_no in range(args.rounds):
        order = names if round_no % 2 == 0 else names[::-1]
        for name in order:
            started = time.monotonic()
            result = run_config(name, args, long_text)
            long_text = result["long_text"]
            result["round"] = round_no
            runs.append(result)
            print(
                f"[round {round_no}] chunk {name:>8}: TTFT {result['ttft_s']:.2f} s, "
                f"ITL p95 {result['itl_p95_s'] * 1000:.0f} ms, max {result['itl_max_s'] * 1000:.0f}"
                f" ms ({time.monotonic() - started:.0f} s)",
                flush=True,
            )

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["config"] == name)

    prompt_tokens = runs[0]["prompt_tokens"]
    print()
    print(
        f"{args.streams} streams decoding (max-batch-size 5), then a {prompt_tokens}-token prompt"
        f" arrives; medians over {args.rounds} round(s)"
    )
    header = (
        f"{'chunk':>9} | {'ITL before p50':>14} | {'ITL p50':>8} | {'ITL p95':>8} | "
        f"{'ITL max':>8} | {'new TTFT':>9} | {'tokens/stream in window':>23}"
    )
    print(header)
    print("-" * len(header))
    summary = []
    for name in names:
        row = {
            "config": name,
            "itl_before_p50_s": median(name, "itl_before_p50_s"),
            "itl_p50_s": median(name, "itl_p50_s"),
            "itl_p95_s": median(name, "itl_p95_s"),
            "itl_max_s": median(name, "itl_max_s"),
            "ttft_s": median(name, "ttft_s"),
        }
        summary.append(row)
        during = next(r["stream_tokens_during_prefill"] for r in runs if r["config"] == name)
        print(
            f"{name:>9} | {fmt_ms(row['itl_before_p50_s'])} ms    | {fmt_ms(row['itl_p50_s'])}"
            f" | {fmt_ms(row['itl_p95_s'])} | {fmt_ms(row['itl_max_s'])} | "
            f"{row['ttft_s']:7.2f} s | {during!s:>23}"
        )
    print("(ITL in ms, over the window from the long request's arrival to its first token)")

    OUT_DIR.mkdir(parents=True, exist_ok=True)
    out = (
        Path(args.out)
        if args.out
        else OUT_DIR / time.strftime("chunked_prefill-%Y%m%d-%H%M%S.json")
    )
    payload = {
        "benchmark": "chunked_prefill",
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "note": "shared CPU: see loadavg_1m_* per run",
        },
        "streams": args.streams,
        "max_batch_size": 5,
        "prompt_tokens": prompt_tokens,
        "rounds": args.rounds,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k != "long_text"} for r in runs],
    }
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
