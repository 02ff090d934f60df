"""In-process soak: the server's runtime serves short distinct chat requests; prints RSS beside
MLX's active and cached memory and the paged pool's reserved bytes, to tell the pool arrays,
MLX's buffer cache and freed-but-kept heap memory apart.

    env $(python -m service.common.blas --env) python bench/memory_soak.py [--requests 316] [--trim]

--trim calls glibc's malloc_trim(0) before each reading: what it removes from RSS was freed
memory the C library's heap still held.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import queue
from pathlib import Path

import mlx.core as mx

from mlxserve.v1 import generation_pb2 as pb
from service.common.config import CoreConfig
from service.core.runtime import Runtime
from service.core.scheduler.request import Request
from service.frontend.validation import generation_request
from service.protocol import Outputs


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class Sink:
    """Puts the request's index on `done` when it finishes."""

    def __init__(self, index: int, done: queue.SimpleQueue[int]) -> None:
        self.batch_key = index
        self.index, self.done = index, done

    def deliver(self, outputs: Outputs) -> None:
        if outputs.finals:
            self.done.put(self.index)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=316)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--trim", action="store_true")
    args = parser.parse_args()
    runtime = Runtime(CoreConfig())
    runtime.start()
    runtime.wait_ready()
    done: queue.SimpleQueue[int] = queue.SimpleQueue()

    def submit(i: int) -> None:
        message = pb.GenerateRequest(stopping=pb.StoppingCriteria(max_tokens=args.max_tokens))
        message.chat.messages.add(role="user", content=f"Fact {i}?")
        request = generation_request(
            message,
            runtime.loaded.tokenizer,
            slot_context=runtime.slot_context,
            default_max_tokens=args.max_tokens,
            prompt_cache_enabled=True,
        )

        runtime.loop.submit(Request(request, Sink(i, done)))

    def report(n: int) -> None:
        if args.trim:
            ctypes.CDLL(None).malloc_trim(0)
        storage = runtime.engine.storage
        print(
            json.dumps(
                {
                    "requests": n,
                    "rss_mb": round(rss_mb()),
                    "mlx_active_mb": round(mx.get_active_memory() / 2**20),
                    "mlx_cache_mb": round(mx.get_cache_memory() / 2**20),
                    "pool_reserved_mib": round(storage.reserved_bytes / 2**20, 1),
                }
            ),
            flush=True,
        )

    submit(-1)  # warm: the first request's buffers are not a leak
    done.get()
    report(0)
    sent = 0
    for _ in range(min(args.concurrency, args.requests)):
        submit(sent)
        sent += 1
    for finished in range(1, args.requests + 1):
        done.get()
        if sent < args.requests:
            submit(sent)
            sent += 1
        if finished % 40 == 0 or finished == args.requests:
            report(finished)
    runtime.shutdown()


if __name__ == "__main__":
    main()
