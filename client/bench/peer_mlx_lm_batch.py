"""Peer: the same workload through mlx-lm's `batch_generate` on the same weights.

Runs in its own process (`python -m client.bench.peer_mlx_lm_batch`, workload JSON on stdin,
results JSON on stdout, progress on stderr) so it never shares the CPU with our server and
MLX is only imported there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from client.bench.metrics import LevelResult
from client.bench.server import REPO_ROOT, mlx_env
from client.bench.workload import Workload

NAME = "mlx-lm-batch"


def run_peer(
    workload: Workload, progress: Callable[[str], None], *, model: str | None = None
) -> list[LevelResult]:
    """Measure the peer in a subprocess; returns one LevelResult per concurrency level."""
    progress(f"{NAME}: starting a subprocess (loads the model, then sweeps)")
    payload = json.dumps({"workload": workload.to_dict(), "model": model})
    proc = subprocess.Popen(
        [sys.executable, "-m", "client.bench.peer_mlx_lm_batch"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO_ROOT,
        env=mlx_env(),
        text=True,
    )
    assert proc.stdin and proc.stdout and proc.stderr
    proc.stdin.write(payload)
    proc.stdin.close()
    # Read stdout on a thread so neither pipe can fill up and stall the child.
    stdout_chunks: list[str] = []
    reader = threading.Thread(target=lambda: stdout_chunks.append(proc.stdout.read()))
    reader.start()
    for line in proc.stderr:  # the child's progress, shown through ours as it comes
        progress(line.rstrip())
    reader.join()
    if proc.wait() != 0:
        raise RuntimeError(f"{NAME} subprocess failed with exit code {proc.returncode}")
    results = json.loads("".join(stdout_chunks).splitlines()[-1])
    return [
        LevelResult(
            target=NAME,
            concurrency=level["concurrency"],
            wall_seconds=level["wall_seconds"],
            completion_tokens_total=level["completion_tokens"],
            request_count=level["requests"],
            extra=level["extra"],
        )
        for level in results["levels"]
    ]


class _BatchTokenizer:
    """What batch_generate reads of a tokenizer: the stop ids and decode.

    An empty eos set makes every prompt run to max_tokens (our ignore_eos).
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], eos_token_ids: Sequence[int]):
        self.decode = decode
        self.eos_token_ids = list(eos_token_ids)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def measure(workload: Workload, model_name: str | None) -> list[dict[str, Any]]:
    # Heavy imports live here: this function only ever runs in the peer subprocess.
    from mlx_lm.generate import batch_generate

    from service.models.loader import load_model
    from service.models.tokenizer import ChatTurn

    loaded = load_model(model_name)
    eos = [] if workload.ignore_eos else sorted(loaded.tokenizer.eos_token_ids)
    tokenizer = _BatchTokenizer(loaded.tokenizer.decode, eos)

    def chat_prompt(text: str) -> list[int]:
        # The same rendering our server applies to a chat request.
        return loaded.tokenizer.render_chat([ChatTurn("user", text)])

    def timed_batch(prompts: list[str]) -> tuple[float, list[list[int]], Any]:
        token_prompts = [chat_prompt(p) for p in prompts]
        started = time.perf_counter()
        response = batch_generate(
            loaded.model,
            tokenizer,
            token_prompts,
            max_tokens=workload.max_tokens,
            return_token_ids=True,
        )
        return time.perf_counter() - started, response.token_ids or [], response.stats

    warm_wall, warm_ids, _ = timed_batch(workload.prompts[:1])
    _progress(f"{NAME} warm-up: {len(warm_ids[0])} tokens in {warm_wall:.1f}s")
    levels = []
    for concurrency in workload.concurrency:
        wall = 0.0
        tokens = 0
        lengths: set[int] = set()
        prefill_seconds = decode_seconds = 0.0
        for round_index in range(workload.rounds):
            round_wall, token_ids, stats = timed_batch(
                workload.prompts_for(concurrency, round_index)
            )
            round_tokens = sum(len(ids) for ids in token_ids)
            wall += round_wall
            tokens += round_tokens
            lengths.update(len(ids) for ids in token_ids)
            prefill_seconds += stats.prompt_time
            decode_seconds += stats.generation_time
            _progress(
                f"{NAME} C={concurrency} round {round_index + 1}/{workload.rounds}: "
                f"{round_tokens} tokens in {round_wall:.1f}s"
                f" = {round_tokens / round_wall:.1f} tok/s"
            )
        levels.append(
            {
                "concurrency": concurrency,
                "wall_seconds": wall,
                "completion_tokens": tokens,
                "requests": concurrency * workload.rounds,
                "extra": {
                    "completion_lengths": sorted(lengths),
                    "prefill_seconds": prefill_seconds,
                    "decode_seconds": decode_seconds,
                },
            }
        )
    return levels


def main() -> int:
    request = json.loads(sys.stdin.read())
    results_out, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the JSON
    levels = measure(Workload.from_dict(request["workload"]), request.get("model"))
    results_out.write(json.dumps({"levels": levels}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
