"""Peer: the same plan through mlx-lm's `batch_generate` on the same weights, in-process.

Runs in its own process (`python -m bench.peers.mlx_lm_batch`, request JSON on stdin,
results JSON on stdout, progress on stderr) so it never shares the CPU with our server and
MLX is only imported there. Burst plans only: one `batch_generate` call per round.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.peers.raw import run_peer_module, subprocess_main
from client.bench.metrics import LevelResult
from client.bench.workload import Plan

NAME = "mlx-lm-batch"


def run_peer(
    plan: Plan,
    progress: Callable[[str], None],
    *,
    model: str | None,
    load_format: str,
    dtype: str | None,
) -> list[LevelResult]:
    args = {"model": model, "load_format": load_format, "dtype": dtype}
    levels, raw_levels = run_peer_module("bench.peers.mlx_lm_batch", NAME, plan, progress, **args)
    for level, raw in zip(levels, raw_levels, strict=True):
        level.completion_tokens_total = raw["completion_tokens"]
        level.request_count = raw["request_count"]
    return levels


class _BatchTokenizer:
    """What batch_generate reads of a tokenizer: the stop ids and decode.

    An empty eos set makes every prompt run to max_tokens (our ignore_eos).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], eos_token_ids: Sequence[int]):
        self.decode = decode
        self.eos_token_ids = list(eos_token_ids)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure(
    plan: Plan, model_name: str | None, load_format: str, dtype: str | None
) -> list[dict[str, Any]]:
    # Heavy imports live here: this function only ever runs in the peer subprocess.
    from mlx_lm.generate import batch_generate

    from service.common.tokenizer import ChatTurn
    from service.core.models.loader import load_model

    loaded = load_model(model_name, dtype, load_format)
    eos = [] if plan.workload.ignore_eos else sorted(loaded.tokenizer.eos_token_ids)
    tokenizer = _BatchTokenizer(loaded.tokenizer.decode, eos)

    def timed_batch(prompts: list[str], max_tokens: list[int]):
        # The same rendering our server applies to a chat request.
        token_prompts = [loaded.tokenizer.render_chat([ChatTurn("user", p)]) for p in prompts]
        started = time.perf_counter()
        response = batch_generate(
            loaded.model, tokenizer, token_prompts, max_tokens=max_tokens, return_token_ids=True
        )
        return time.perf_counter() - started, response.token_ids or [], response.stats

    for spec in plan.warmup:
        wall, ids, _ = timed_batch([spec.prompt], [spec.max_tokens])
        _progress(f"{NAME} warm-up: {len(ids[0])} tokens in {wall:.1f}s")
    levels = []
    for level in plan.levels:
        if level.arrival != "burst":
            _progress(f"{NAME}: skipping {level.label} ({level.arrival} arrival: burst only)")
            continue
        for warm in level.warmup:
            timed_batch([s.prompt for s in warm], [s.max_tokens for s in warm])
        wall = 0.0
        tokens = 0
        requests = 0
        lengths: set[int] = set()
        prefill_seconds = decode_seconds = 0.0
        for index, specs in enumerate(level.batches):
            round_wall, token_ids, stats = timed_batch(
                [s.prompt for s in specs], [s.max_tokens for s in specs]
            )
            round_tokens = sum(len(ids) for ids in token_ids)
            wall += round_wall
            tokens += round_tokens
            requests += len(specs)
            lengths.update(len(ids) for ids in token_ids)
            prefill_seconds += stats.prompt_time
            decode_seconds += stats.generation_time
            _progress(
                f"{NAME} {level.label} round {index + 1}/{len(level.batches)}: "
                f"{round_tokens} tokens in {round_wall:.2f}s"
                f" = {round_tokens / round_wall:.1f} tok/s"
            )
        levels.append(
            {
                "concurrency": level.concurrency,
                "wall_seconds": wall,
                "completion_tokens": tokens,
                "request_count": requests,
                "extra": {
                    "completion_lengths": sorted(lengths),
                    "prefill_seconds": prefill_seconds,
                    "decode_seconds": decode_seconds,
                },
            }
        )
    return levels


def main() -> int:
    return subprocess_main(measure)


if __name__ == "__main__":
    sys.exit(main())
