"""Peer: the raw mlx-lm forward loop, no server: the upper bound of tokens/s at each batch size.

For each level C (= batch size B): B prompts of the plan (rendered chat token ids, cut or padded
to one common length, the plan's median prompt length, so one plain batched `KVCache` holds
them), one batched prefill forward, then greedy batched decode of max_tokens - 1 steps over a
`[B, 1]` input, pipelined as mlx-lm's `generate_step` does (step N+1 queued with
`mx.async_eval` before step N's tokens are read back to the host). Nothing else: no sampling
options, no detokenization, no scheduling, no RPC.

Runs in its own process (`python -m bench.peers.raw`, request JSON on stdin, results JSON
on stdout, progress on stderr). Burst plans only: one timed batch per round.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.peers import REPO_ROOT, mlx_env
from client.bench.metrics import LevelResult, RequestRecord
from client.bench.workload import Plan

NAME = "raw"


def run_subprocess_peer(
    module: str, name: str, payload: dict[str, Any], progress: Callable[[str], None]
) -> dict[str, Any]:
    """Run `python -m module` with payload on stdin; its last stdout line is the JSON result."""
    progress(f"{name}: starting a subprocess (loads the model, then sweeps)")
    proc = subprocess.Popen(
        [sys.executable, "-m", module],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=mlx_env(),
        text=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    proc.stdin.write(json.dumps(payload))
    proc.stdin.close()
    # Read stdout on a thread so neither pipe can fill up and stall the child.
    stdout_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stdout_chunks.append(proc.stdout.read()))
    reader.start()
    try:
        for line in proc.stderr:  # the child's progress, shown through ours as it comes
            progress(line.rstrip())
        reader.join()
    finally:
        if proc.poll() is None and reader.is_alive():  # we are being stopped: stop the child
            proc.kill()
    if proc.wait() != 0:
        raise RuntimeError(f"{name} subprocess failed with exit code {proc.returncode}")
    return json.loads("".join(stdout_chunks).splitlines()[-1])


def run_peer_module(
    module: str,
    name: str,
    plan: Plan,
    progress: Callable[[str], None],
    *,
    model: str | None,
    load_format: str,
    dtype: str | None,
) -> tuple[list[LevelResult], list[dict[str, Any]]]:
    """Run a peer module in its own process on the plan; its levels, and the raw JSON levels."""
    payload = {"plan": plan.to_dict(), "model": model, "load_format": load_format, "dtype": dtype}
    raw = run_subprocess_peer(module, name, payload, progress)["levels"]
    return [levels_from_json(name, level) for level in raw], raw


def run_peer(
    plan: Plan,
    progress: Callable[[str], None],
    *,
    model: str | None,
    load_format: str,
    dtype: str | None,
) -> list[LevelResult]:
    args = {"model": model, "load_format": load_format, "dtype": dtype}
    return run_peer_module("bench.peers.raw", NAME, plan, progress, **args)[0]


def levels_from_json(name: str, level: dict[str, Any]) -> LevelResult:
    return LevelResult(
        target=name,
        concurrency=level["concurrency"],
        wall_seconds=level["wall_seconds"],
        requests=[RequestRecord(**r) for r in level.get("requests", [])],
        extra=level["extra"],
    )


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure(plan: Plan, model_name: str | None, load_format: str, dtype: str | None):
    # Heavy imports live here: this function only ever runs in the peer subprocess.
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from service.common.tokenizer import ChatTurn
    from service.core.models.loader import load_model

    loaded = load_model(model_name, dtype, load_format)
    model = loaded.model
    _progress(f"{NAME}: loaded {loaded.model_id} ({loaded.dtype}) on {mx.default_device()}")
    generation_stream = mx.new_stream(mx.default_device())

    lengths = [
        len(loaded.tokenizer.render_chat([ChatTurn("user", s.prompt)]))
        for lv in plan.levels
        for s in lv.requests
    ]
    prompt_len = int(statistics.median(lengths)) if lengths else 32

    def prompt_ids(text: str) -> list[int]:
        ids = loaded.tokenizer.render_chat([ChatTurn("user", text)])
        if len(ids) >= prompt_len:
            return ids[-prompt_len:]
        return [ids[0]] * (prompt_len - len(ids)) + ids

    def timed_batch(texts: list[str], max_tokens: int) -> dict[str, Any]:
        batch = mx.array([prompt_ids(t) for t in texts])
        cache = make_prompt_cache(model)

        def forward(inputs: mx.array) -> mx.array:
            with mx.stream(generation_stream):
                logits = model(inputs, cache=cache)[:, -1, :]
                return mx.argmax(logits, axis=-1)

        started = time.perf_counter()
        y = forward(batch)
        mx.async_eval(y)
        first: list[int] = []
        gaps: list[float] = []
        last = started
        prefill = 0.0
        for n in range(max_tokens):
            if n + 1 < max_tokens:
                next_y = forward(y[:, None])
                mx.async_eval(next_y)
            tokens = y.tolist()  # the host reads step n while step n+1 runs
            now = time.perf_counter()
            if n == 0:
                prefill = now - started
                first = tokens
            else:
                gaps.append(now - last)
            last = now
            if n + 1 < max_tokens:
                y = next_y
        wall = time.perf_counter() - started
        mx.clear_cache()
        return {"wall": wall, "prefill": prefill, "gaps": gaps, "first": first}

    levels = []
    for level in plan.levels:
        if level.arrival != "burst":
            _progress(f"{NAME}: skipping {level.label} ({level.arrival} arrival: burst only)")
            continue
        for warm in level.warmup:
            timed_batch([s.prompt for s in warm], max(s.max_tokens for s in warm))
        wall = decode = 0.0
        tokens = 0
        records: list[dict[str, Any]] = []
        for index, specs in enumerate(level.batches):
            max_tokens = max(s.max_tokens for s in specs)
            run = timed_batch([s.prompt for s in specs], max_tokens)
            wall += run["wall"]
            decode += run["wall"] - run["prefill"]
            tokens += len(specs) * max_tokens
            for row, spec in enumerate(specs):
                records.append(
                    {
                        "prompt": spec.prompt[:80],
                        "max_tokens": max_tokens,
                        "completion_tokens": max_tokens,
                        "prompt_tokens": prompt_len,
                        "ttft": run["prefill"],
                        # The batch's step gaps once (every row saw the same ones).
                        "inter_token": run["gaps"] if row == 0 else [],
                        "latency": run["wall"],
                        "finish_reason": "length",
                    }
                )
            _progress(
                f"{NAME} {level.label} round {index + 1}/{len(level.batches)}: "
                f"{len(specs) * max_tokens} tokens in {run['wall']:.2f}s = "
                f"{len(specs) * max_tokens / run['wall']:.1f} tok/s "
                f"(prefill {run['prefill'] * 1000:.0f} ms, step "
                f"{statistics.median(run['gaps']) * 1000 if run['gaps'] else 0:.2f} ms)"
            )
        steps = sum(len(r["inter_token"]) for r in records)
        levels.append(
            {
                "concurrency": level.concurrency,
                "wall_seconds": wall,
                "requests": records,
                "extra": {
                    "prompt_len": prompt_len,
                    "decode_seconds": decode,
                    # Decode alone (prefill excluded): the steady-state step rate times B.
                    "decode_tokens_per_second": (
                        (level.concurrency or 1) * steps / decode if decode > 0 else None
                    ),
                },
            }
        )
    return levels


def subprocess_main(measure_levels: Callable[..., list[dict[str, Any]]]) -> int:
    """A peer process's entry point: the request JSON on stdin, the levels JSON on stdout."""
    request = json.loads(sys.stdin.read())
    results_out, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the JSON
    plan = Plan.from_dict(request["plan"])
    levels = measure_levels(
        plan, request.get("model"), request["load_format"], request.get("dtype")
    )
    results_out.write(json.dumps({"levels": levels}) + "\n")
    return 0


def main() -> int:
    return subprocess_main(measure)


if __name__ == "__main__":
    sys.exit(main())
