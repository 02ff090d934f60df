"""Prompt-lookup speculative decoding, on against off, through the real server.

Workloads: "summarize" (the prompt is a text the answer repeats spans of) and "chat" (short
questions, nothing to look up). For each replicate, a server without and a server with
`--draft-kind prompt-lookup` are started in turn (alternating, so drift hits both) and each runs
every workload at each concurrency: rounds of C concurrent greedy requests. Prints a table of
median tokens/s (with the range) and acceptance, and writes JSON.

    env $(.venv/bin/python -m service.common.blas --env) .venv/bin/python bench/speculative.py \\
        --concurrency 1,8 --replicates 3 --out bench/out/speculative.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from client.bench.server import ServerProcess
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc

ARTICLE = (
    "The river begins as snowmelt high in the mountains, where it gathers into a clear stream "
    "that runs past pine forests and granite cliffs. Lower down it widens, turning the wheel of "
    "an old stone mill before it reaches the town, where a stone bridge built in 1820 carries "
    "the market road across it. Below the town the river slows, meanders through farmland and "
    "marshes full of herons, and finally meets the sea at a wide sandy estuary."
)
WORKLOADS = {
    "summarize": [
        f"Summarize this text, reusing its wording: {ARTICLE}",
        f"Rewrite this text with the same sentences: {ARTICLE}",
        f"List the places the river passes, quoting the text: {ARTICLE}",
    ],
    "chat": [
        "What is the capital of France?",
        "Name three fruits.",
        "Write a haiku about the sea.",
        "Why is the sky blue?",
    ],
}


def run_level(stub, prompts: list[str], concurrency: int, rounds: int, max_tokens: int) -> dict:
    def one(i: int) -> pb.GenerateResponse:
        request = pb.GenerateRequest(
            chat=pb.ChatInput(
                messages=[pb.ChatMessage(role="user", content=prompts[i % len(prompts)])]
            ),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens),
            cache_prompt=False,
        )
        return stub.Generate(request, timeout=600)

    tokens = drafted = accepted = 0
    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        for r in range(rounds):
            for reply in pool.map(one, range(r * concurrency, (r + 1) * concurrency)):
                tokens += reply.usage.completion_tokens
                drafted += reply.usage.drafted_tokens
                accepted += reply.usage.accepted_tokens
    seconds = time.monotonic() - started
    return {
        "tok_s": tokens / seconds,
        "tokens": tokens,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance": accepted / drafted if drafted else 0.0,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--replicates", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--server-args", default="")
    parser.add_argument("--out", type=Path, default=Path("bench/out/speculative.json"))
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    results: list[dict] = []
    for rep in range(args.replicates):
        for mode in ("off", "on"):
            flags = ["--parallel", str(max(levels)), *args.server_args.split()]
            if mode == "on":
                flags += ["--draft-kind", "prompt-lookup"]
            with ServerProcess(flags) as server, grpc.insecure_channel(server.target) as ch:
                stub = pb_grpc.GenerationServiceStub(ch)
                run_level(stub, WORKLOADS["chat"], 1, 1, 8)  # warm-up
                for workload, prompts in WORKLOADS.items():
                    for c in levels:
                        r = run_level(stub, prompts, c, args.rounds, args.max_tokens)
                        r.update(replicate=rep, mode=mode, workload=workload, concurrency=c)
                        results.append(r)
                        print(
                            f"rep {rep} {mode:3} {workload:9} C={c:<3} {r['tok_s']:7.1f} tok/s"
                            f"  accepted {r['accepted']}/{r['drafted']}",
                            flush=True,
                        )
    print("\nworkload   C   off tok/s (range)        on tok/s (range)         on/off  acceptance")
    table = []
    for workload in WORKLOADS:
        for c in levels:
            off = [
                r["tok_s"]
                for r in results
                if (r["workload"], r["concurrency"], r["mode"]) == (workload, c, "off")
            ]
            on = [
                r
                for r in results
                if (r["workload"], r["concurrency"], r["mode"]) == (workload, c, "on")
            ]
            on_tok = [r["tok_s"] for r in on]
            ratio = statistics.median(on_tok) / statistics.median(off)
            acc = sum(r["accepted"] for r in on) / max(1, sum(r["drafted"] for r in on))
            row = {
                "workload": workload,
                "concurrency": c,
                "off_median": statistics.median(off),
                "off_range": [min(off), max(off)],
                "on_median": statistics.median(on_tok),
                "on_range": [min(on_tok), max(on_tok)],
                "on_over_off": ratio,
                "acceptance": acc,
            }
            table.append(row)
            print(
                f"{workload:9} {c:3}  {row['off_median']:6.1f} ({min(off):.1f}-{max(off):.1f})"
                f"   {row['on_median']:6.1f} ({min(on_tok):.1f}-{max(on_tok):.1f})"
                f"   {ratio:5.2f}x  {acc:.2f}"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"runs": results, "table": table}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
