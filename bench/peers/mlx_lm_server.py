"""Peer: mlx-lm's own HTTP server (`mlx_lm.server`) on the same weights, same plan, over HTTP.

The harness starts it as `python -m bench.peers.mlx_lm_server [launcher options] --
[mlx_lm.server options]`: a thin launcher that applies two documented, measurement-only patches
before calling `mlx_lm.server.main()`:
- `--ignore-eos`: mlx-lm's server has no per-request ignore_eos, and its tokenizer wrapper always
  adds the tokenizer's EOS to the stop set; the launcher drops EOS ids from the stop sequences it
  builds (`make_stop_sequences`), so every request runs to max_tokens like ours (stop words would
  still apply; the plan sends none). Without it the harness still counts tokens from `usage`.
- `--backlog N`: `http.server` listens with a backlog of 5, so 32-64 clients connecting at once
  get connection resets; the launcher raises the listen backlog. Nothing in the request
  path changes.

Requests are OpenAI-style streaming chat completions (`stream: true`, `stream_options:
{include_usage: true}`) on one asyncio loop with raw HTTP/1.x streams; TTFT is the first SSE event
carrying text, inter-token gaps are the gaps between such events, token counts come from `usage`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.peers import REPO_ROOT, mlx_env
from client.bench.metrics import LevelResult, RequestRecord
from client.bench.runner import run_plan
from client.bench.server import ManagedProcess, free_port
from client.bench.workload import Plan, RequestSpec

NAME = "mlx-lm"
Progress = Callable[[str], None]


class MlxLmServerProcess(ManagedProcess):
    """The launcher as a subprocess; ready once GET /health answers and a request went through."""

    stop_signal = signal.SIGINT  # its serve_forever ends on KeyboardInterrupt

    def __init__(
        self,
        model_dir: Path,
        *,
        decode_concurrency: int,
        extra_args: Sequence[str] = (),
        ignore_eos: bool = True,
        log_path: Path | None = None,
        ready_timeout: float = 300.0,
    ) -> None:
        self.port = free_port()
        self.host = "127.0.0.1"
        launcher = ["--backlog", "1024"] + (["--ignore-eos"] if ignore_eos else [])
        command = [
            sys.executable,
            "-m",
            "bench.peers.mlx_lm_server",
            *launcher,
            "--",
            "--model",
            str(model_dir),
            "--host",
            self.host,
            "--port",
            str(self.port),
            # At its best, as a user tuning it would run it: both at least the largest C (its
            # prompt concurrency defaults to 8).
            "--decode-concurrency",
            str(decode_concurrency),
            "--prompt-concurrency",
            str(decode_concurrency),
            *extra_args,
        ]
        super().__init__(
            command,
            log_path=log_path,
            ready_timeout=ready_timeout,
            env=mlx_env(),
            cwd=REPO_ROOT,
        )

    def _wait_ready(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.ready_timeout
        url = f"http://{self.host}:{self.port}/health"
        while True:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"mlx_lm.server exited ({self._proc.returncode}) during start-up\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlx_lm.server not healthy after {self.ready_timeout}s")
            time.sleep(0.25)


class HttpTarget:
    """OpenAI-style streaming chat completions over plain asyncio streams (no HTTP library)."""

    def __init__(self, name: str, host: str, port: int, *, request_timeout: float = 600.0):
        self.name = name
        self.host = host
        self.port = port
        self.request_timeout = request_timeout

    def run(self, plan: Plan, progress: Progress) -> list[LevelResult]:
        async def send(spec: RequestSpec) -> RequestRecord:
            return await self.one_request(plan, spec)

        return asyncio.run(run_plan(self.name, plan, send, progress))

    async def one_request(self, plan: Plan, spec: RequestSpec) -> RequestRecord:
        record = RequestRecord(prompt=spec.prompt[:80], max_tokens=spec.max_tokens)
        started = record.start = time.perf_counter()
        try:
            await asyncio.wait_for(
                self._stream(plan, spec, record, started), timeout=self.request_timeout
            )
        except (OSError, asyncio.TimeoutError, ValueError) as err:
            record.error = f"{type(err).__name__}: {err}"
        record.latency = time.perf_counter() - started
        return record

    async def _stream(
        self, plan: Plan, spec: RequestSpec, record: RequestRecord, started: float
    ) -> None:
        body = json.dumps(
            {
                "messages": [{"role": "user", "content": spec.prompt}],
                "max_tokens": spec.max_tokens,
                "temperature": plan.workload.temperature,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(
                (
                    f"POST /v1/chat/completions HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                    "Content-Type: application/json\r\nAccept: text/event-stream\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                ).encode()
                + body
            )
            await writer.drain()
            status = await reader.readline()
            parts = status.split()
            if len(parts) < 2 or parts[1] != b"200":
                rest = await reader.read(500)
                raise ValueError(f"HTTP {status.decode(errors='replace').strip()} {rest[:200]!r}")
            chunked = False
            while True:  # headers
                line = await reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
                    chunked = True
            last_event_at: float | None = None
            events = 0
            async for payload in _sse_events(reader, chunked):
                if payload == b"[DONE]":
                    break
                message = json.loads(payload)
                usage = message.get("usage")
                if usage:
                    record.completion_tokens = int(usage.get("completion_tokens", 0))
                    record.prompt_tokens = usage.get("prompt_tokens")
                for choice in message.get("choices") or ():
                    if choice.get("finish_reason"):
                        record.finish_reason = choice["finish_reason"]
                    if (choice.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last_event_at is None:
                            record.ttft = now - started
                        else:
                            record.inter_token.append(now - last_event_at)
                        last_event_at = now
                        events += 1
            if not record.completion_tokens:
                record.completion_tokens = events  # no usage came back: count events
        finally:
            writer.close()


async def _sse_events(reader: asyncio.StreamReader, chunked: bool):
    """The `data:` payloads of a server-sent event stream (optionally chunk-encoded)."""
    buffer = b""

    async def chunks():
        if not chunked:
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                yield data
        else:
            while True:
                size_line = await reader.readline()
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    return
                data = await reader.readexactly(size + 2)
                yield data[:-2]

    async for data in chunks():
        buffer += data
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip()


def run_peer(
    plan: Plan,
    progress: Progress,
    *,
    model_dir: Path,
    decode_concurrency: int,
    log_path: Path | None,
    extra_args: Sequence[str] = (),
    ignore_eos: bool = True,
    request_timeout: float = 600.0,
) -> tuple[list[LevelResult], dict]:
    server = MlxLmServerProcess(
        model_dir,
        decode_concurrency=decode_concurrency,
        extra_args=extra_args,
        ignore_eos=ignore_eos,
        log_path=log_path,
    )
    progress(f"{NAME}: starting {' '.join(server.command)} (log {log_path})")
    server.start()
    try:
        target = HttpTarget(NAME, server.host, server.port, request_timeout=request_timeout)
        levels = target.run(plan, progress)
    finally:
        server.stop()
    meta = {
        "command": server.command,
        "model_dir": str(model_dir),
        "patches": {
            "ignore_eos": ignore_eos,
            "listen_backlog": 1024,
        },
    }
    return levels, meta


def _launch(argv: list[str]) -> int:
    """The launcher: patch, then hand the remaining arguments to mlx_lm.server."""
    ignore_eos = "--ignore-eos" in argv
    backlog = 5
    if "--backlog" in argv:
        backlog = int(argv[argv.index("--backlog") + 1])
    server_args = argv[argv.index("--") + 1 :] if "--" in argv else []

    import http.server

    from mlx_lm import server as mlx_server
    from mlx_lm.generate import StopSequences

    http.server.ThreadingHTTPServer.request_queue_size = backlog
    if ignore_eos:

        def make_stop_sequences(tokenizer, stop_words=None):
            # mlx-lm's own function minus the EOS ids (our requests set ignore_eos).
            return StopSequences(
                [tuple(tokenizer.encode(w, add_special_tokens=False)) for w in stop_words or []]
            )

        mlx_server.make_stop_sequences = make_stop_sequences
    sys.argv = ["mlx_lm.server", *server_args]
    print(f"launcher: ignore_eos={ignore_eos} backlog={backlog} pid={os.getpid()}", flush=True)
    mlx_server.main()
    return 0


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
