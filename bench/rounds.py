"""Per-round figures of a `bench.compare` JSON: each burst round's tokens/s for ours and each peer,
and ours over a peer round by round, as median (range) per level. GPU hosts vary between calls
and within one, so ratios of rounds run side by side are what the results README reports.

    python -m bench.rounds OUT/smollm2-135m-TAG.json \\
        [--peer raw] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def round_rates(requests: list[dict[str, Any]], concurrency: int) -> list[float]:
    """Tokens/s of each round: the requests in order, C to a round (burst plans)."""
    rates = []
    for i in range(0, len(requests), concurrency):
        chunk = requests[i : i + concurrency]
        begin = min(r["start"] for r in chunk)
        end = max(r["start"] + r["latency"] for r in chunk)
        rates.append(sum(r["completion_tokens"] for r in chunk) / (end - begin))
    return rates


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(document: dict[str, Any], peer: str) -> list[dict[str, Any]]:
    peers = {p["summary"]["concurrency"]: p for p in document["peers"].get(peer, [])}
    levels = []
    for level in document["ours"]:
        c = level["summary"]["concurrency"]
        ours = round_rates(level["requests"], c)
        row: dict[str, Any] = {
            "concurrency": c,
            "ours_tok_s": spread(ours),
            "ttft_p50_ms": 1e3 * level["summary"]["ttft_p50"],
        }
        if "server_ttft_p50" in level["summary"]:
            # Of it in the engine core: from a request's arrival there (the server's Timing).
            row["server_ttft_p50_ms"] = 1e3 * level["summary"]["server_ttft_p50"]
        if "server_queue_p50" in level["summary"]:
            # Of that, before admission (the rest: waiting for and running its prefill pass).
            row["server_queue_p50_ms"] = 1e3 * level["summary"]["server_queue_p50"]
        if c in peers:
            theirs = round_rates(peers[c]["requests"], c)
            row[f"{peer}_tok_s"] = spread(theirs)
            row[f"{peer}_ttft_p50_ms"] = 1e3 * peers[c]["summary"]["ttft_p50"]
            row[f"ours_over_{peer}"] = spread([a / b for a, b in zip(ours, theirs)])
        levels.append(row)
    return levels


def fmt(s: dict[str, float], digits: int = 0) -> str:
    return f"{s['median']:.{digits}f} ({s['min']:.{digits}f}–{s['max']:.{digits}f})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("result", type=Path)
    parser.add_argument("--peer", default="raw")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    levels = summarize(json.loads(args.result.read_text()), args.peer)
    for row in levels:
        line = f"C={row['concurrency']:>4}  ours {fmt(row['ours_tok_s'])}"
        if f"ours_over_{args.peer}" in row:
            line += (
                f"  {args.peer} {fmt(row[f'{args.peer}_tok_s'])}"
                f"  ratio {fmt(row[f'ours_over_{args.peer}'], 2)}"
                f"  TTFT p50 {row['ttft_p50_ms']:.0f}/{row[f'{args.peer}_ttft_p50_ms']:.0f} ms"
            )
        if "server_ttft_p50_ms" in row:
            queued = row.get("server_queue_p50_ms")
            line += f" (ours in the core {row['server_ttft_p50_ms']:.0f} ms"
            line += f", queued {queued:.0f})" if queued is not None else ")"
        print(line)
    if args.json:
        args.json.write_text(json.dumps(levels, indent=1))


if __name__ == "__main__":
    main()
