"""Start-up time and the first burst after it (a benchmark, not a test).

Starts our server (`--server-args`, e.g. a 4-bit model whose matmul kernels MLX compiles on
first use), times it from the process's start until health says SERVING, then sends a burst of
`--concurrency` streams at once (token-id prompts of varied lengths, so the prefill passes take
many shapes; greedy, ignore_eos), and a second burst like it once the first has finished. For
each burst: TTFT p50 and max (and the server's own p50, from a request's arrival in the
engine core), and the inter-token gaps pooled over the streams (p50, p99, max).
A first burst that meets a shape the start-up did not build stalls where the second does not:
compare their worst gaps and TTFTs. The server's log gives how many prefill pass shapes the
start-up built and how many it left to first use. Prints one line per burst and writes JSON:

    python bench/first_burst.py --server-args "--load-format dummy:llama-3.1-8b-4bit \\
        --dtype bfloat16 --max-batch-size 64" --concurrency 64 --out first_burst.json

From a git worktree whose editable install points elsewhere, put the worktree first
(`PYTHONPATH=. python bench/first_burst.py ...`): the server runs from the tree that `client` is
imported from.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shlex
import statistics
import time
from pathlib import Path
from typing import Any

from client.bench.cli import git_state
from client.bench.metrics import percentile
from client.bench.server import ServerProcess
from client.client import AsyncGenerationClient, build_request

NAN = float("nan")


def _percentile(values: list[float], q: float) -> float:
    """client.bench.metrics.percentile, NaN for no values (the JSON keeps a number)."""
    value = percentile(values, q)
    return NAN if value is None else value


def prompts(count: int, shortest: int, longest: int, vocab: int, seed: int) -> list[list[int]]:
    """Token-id prompts with lengths spread evenly over [shortest, longest]."""
    rng = random.Random(seed)
    lengths = [shortest + (longest - shortest) * i // max(count - 1, 1) for i in range(count)]
    rng.shuffle(lengths)
    return [[rng.randrange(17, vocab) for _ in range(n)] for n in lengths]


async def burst(
    target: str, ids: list[list[int]], max_tokens: int, channels: int, tag: str
) -> dict[str, Any]:
    """Every prompt at once over `channels` gRPC channels; each stream's token arrival times."""
    arrivals: list[list[float]] = [[] for _ in ids]
    in_core: list[float] = []  # the server's own TTFT (from the request's arrival in the core)
    queued: list[float] = []  # from arrival in the core to admission into the batch
    failures: list[str] = []

    async def one(i: int) -> None:
        request = build_request(
            token_ids=ids[i], max_tokens=max_tokens, ignore_eos=True, request_id=f"{tag}-{i}"
        )
        try:
            async for message in clients[i % channels].stream(request, timeout=3600):
                if message.token_ids:
                    now = time.monotonic()
                    arrivals[i].extend([now] * len(message.token_ids))
                if message.finish_reason:
                    in_core.append(message.timing.time_to_first_token_seconds)
                    queued.append(message.timing.queue_seconds)
        except Exception as exc:  # counted and reported, never hidden
            failures.append(f"{tag}-{i}: {exc}")

    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(AsyncGenerationClient(target)) for _ in range(channels)
        ]
        sent = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(len(ids))))
    done = time.monotonic()
    ttfts = [times[0] - sent for times in arrivals if times]
    gaps = [b - a for times in arrivals for a, b in itertools.pairwise(times) if b > a]
    tokens = sum(len(times) for times in arrivals)
    return {
        "burst": tag,
        "streams": len(ids),
        "failed": len(failures),
        "failures": failures[:5],
        "tokens": tokens,
        "seconds": done - sent,
        "tok_s": tokens / (done - sent),
        "ttft_p50_s": _percentile(ttfts, 50),
        "ttft_max_s": max(ttfts, default=NAN),
        "ttft_in_core_p50_s": _percentile(in_core, 50),
        "queue_in_core_p50_s": _percentile(queued, 50),
        "gap_p50_s": _percentile(gaps, 50),
        "gap_p99_s": _percentile(gaps, 99),
        "gap_max_s": max(gaps, default=NAN),
    }


def start_up_log(log_path: Path) -> dict[str, Any]:
    """What the server's log says about the prefill pass shapes the start-up built."""
    out: dict[str, Any] = {"shapes_left_to_first_use": 0}
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event", "").startswith("prefill pass shapes left to build"):
            out["shapes_built"] = record.get("built")
            out["shapes_left_to_first_use"] = record.get("left")
    return out


def run(args: argparse.Namespace, round_no: int) -> dict[str, Any]:
    flags = [*shlex.split(args.server_args), "--log-format", "json"]
    log_path = Path(args.log_dir) / f"first_burst-{round_no}.server.log"
    started = time.monotonic()
    with ServerProcess(flags, log_path=log_path, ready_timeout=args.ready_timeout) as server:
        start_s = time.monotonic() - started
        print(f"[round {round_no}] SERVING after {start_s:.1f} s", flush=True)
        bursts = []
        for n, tag in enumerate(("first", "second")):
            ids = prompts(
                args.concurrency, args.shortest, args.longest, args.vocab, 1000 * round_no + n
            )
            row = asyncio.run(burst(server.target, ids, args.max_tokens, args.channels, tag))
            bursts.append(row)
            print(
                f"[round {round_no}] {tag:>6} burst: TTFT p50 {row['ttft_p50_s'] * 1e3:.0f} ms, "
                f"max {row['ttft_max_s'] * 1e3:.0f} ms, in the core p50 "
                f"{row['ttft_in_core_p50_s'] * 1e3:.0f} ms; "
                f"gap p50 {row['gap_p50_s'] * 1e3:.1f} ms, p99 {row['gap_p99_s'] * 1e3:.1f} ms, "
                f"max {row['gap_max_s'] * 1e3:.0f} ms; "
                f"{row['tok_s']:.0f} tok/s; {row['failed']} failed",
                flush=True,
            )
    return {"round": round_no, "start_s": start_s, "bursts": bursts, **start_up_log(log_path)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server-args", default="", help="the server's flags, one string")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=8, help="prompt tokens")
    parser.add_argument("--longest", type=int, default=600, help="prompt tokens")
    parser.add_argument("--vocab", type=int, default=500, help="prompt ids stay below it")
    parser.add_argument("--channels", type=int, default=4, help="gRPC channels")
    parser.add_argument("--rounds", type=int, default=1, help="server starts")
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    parser.add_argument("--log-dir", default="/tmp", help="where the server logs go")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rounds = [run(args, r) for r in range(args.rounds)]
    summary = {
        "start_s_median": statistics.median(r["start_s"] for r in rounds),
        "first_gap_max_s_median": statistics.median(r["bursts"][0]["gap_max_s"] for r in rounds),
        "second_gap_max_s_median": statistics.median(r["bursts"][1]["gap_max_s"] for r in rounds),
        "failed": sum(b["failed"] for r in rounds for b in r["bursts"]),
    }
    print(json.dumps(summary))
    if args.out:
        report = {"args": vars(args) | {"out": str(args.out)}, **git_state()}
        args.out.write_text(json.dumps(report | {"rounds": rounds, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
