"""A shared-prefix workload: KV memory with and without sharing, TTFT adopting vs cold.

Eight chat requests share a ~1000-token system prompt. With the prefix cache on, one request
warms the cache, then the eight run together and adopt its blocks; with `cache_prompt: false`
each stores and prefills the prompt itself. Reported: the KV bytes in use while all eight
decode (CacheStats.used_bytes), and TTFT of each request alone, cold vs adopting.

    env $(.venv/bin/python -m service.common.blas --env) .venv/bin/python bench/prefix_sharing.py
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import grpc

from client.bench.server import ServerProcess
from client.client import GenerationClient, build_request, to_stream_request
from mlxserve.v1 import generation_pb2_grpc as pb_grpc

SYSTEM = " ".join(
    f"Rule {i}: answer politely, keep facts straight, and cite the section number {i}."
    for i in range(60)
)
QUESTIONS = [
    "What is the capital of France?", "Name a primary color.", "What is two plus two?",
    "Which planet is closest to the sun?", "What do bees make?", "What is the opposite of hot?",
    "How many legs does a spider have?", "What color is the sky on a clear day?",
]  # fmt: skip


def request(i: int, cache: bool, max_tokens: int = 400):
    return build_request(
        chat=[("system", SYSTEM), ("user", QUESTIONS[i % len(QUESTIONS)])],
        max_tokens=max_tokens,
        ignore_eos=True,
        cache_prompt=cache,
        request_id=f"share-{cache}-{i}-{time.monotonic_ns()}",
    )


def bytes_while_all_decode(client: GenerationClient, cache: bool) -> int:
    """Start 8 streams (each once the previous decodes), read used KV bytes, cancel them."""
    stub = pb_grpc.GenerationServiceStub(grpc.insecure_channel(client.target))
    streams = []
    for i in range(8):
        stream = stub.StreamGenerate(to_stream_request(request(i, cache)), timeout=600)
        first = threading.Event()

        def drain(s=stream, ev=first) -> None:
            try:
                for _ in s:
                    ev.set()
            except Exception:
                ev.set()

        threading.Thread(target=drain, daemon=True).start()
        first.wait(300)
        streams.append(stream)
    used = client.cache_stats().used_bytes
    for s in streams:
        s.cancel()
    while client.cache_stats().active_sequences:
        time.sleep(0.1)
    return used


def ttft(client: GenerationClient, i: int, cache: bool) -> float:
    response = client.generate(request(i, cache, max_tokens=1), timeout=300)
    return response.timing.time_to_first_token_seconds


def main() -> None:
    with ServerProcess(["--max-batch-size", "8"]) as server, GenerationClient(server.target) as c:
        c.generate(request(0, True, max_tokens=1))  # warm the prefix cache and the model
        with_sharing = bytes_while_all_decode(c, cache=True)
        without_sharing = bytes_while_all_decode(c, cache=False)
        cold = [ttft(c, i, cache=False) for i in range(1, 5)]
        adopting = [ttft(c, i, cache=True) for i in range(1, 5)]
        stats = c.cache_stats()
    result = {
        "system_prompt_tokens_approx": 1000,
        "kv_bytes_8_requests_shared": with_sharing,
        "kv_bytes_8_requests_unshared": without_sharing,
        "saved_bytes": without_sharing - with_sharing,
        "ttft_cold_s": cold,
        "ttft_adopting_s": adopting,
        "prefix_hits": stats.prefix_hits,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
    }
    mib = 1 << 20
    print(
        f"KV in use, 8 requests decoding: shared {with_sharing / mib:.1f} MiB, "
        f"unshared {without_sharing / mib:.1f} MiB "
        f"(saved {(without_sharing - with_sharing) / mib:.1f} MiB)"
    )
    print(
        f"TTFT alone: cold {sum(cold) / len(cold) * 1000:.0f} ms, "
        f"adopting {sum(adopting) / len(adopting) * 1000:.0f} ms (mean of 4)"
    )
    out = Path("bench/out")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"prefix_sharing-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
