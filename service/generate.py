"""`python -m service generate`: one request through the same scheduler and engine, in-process.

The server and this path build the same runtime (model, storage, engine, scheduler, prefill
plan), so in deterministic mode a greedy request gives the same tokens here and over gRPC.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys

from mlxserve.v1 import generation_pb2 as pb
from service.common.config import add_server_arguments, config_from_args
from service.common.logging import configure_logging
from service.core.runtime import Runtime
from service.core.scheduler.request import Request
from service.frontend.stream import RequestStream, push_outputs
from service.frontend.validation import (
    InvalidRequestError,
    UnknownAdapterError,
    generation_request,
)
from service.protocol import Outputs


def generate_main(argv: list[str], prog: str = "python -m service generate") -> int:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("prompt", help="the prompt (a user chat message unless --raw)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as raw text")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print token ids and text as JSON")
    parser.add_argument(
        "--use-adapter", metavar="NAME", default="", help="generate with this --adapter's NAME"
    )
    add_server_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    configure_logging("warning", "console")

    message = pb.GenerateRequest(request_id="cli")
    if args.raw:
        message.text = args.prompt
    else:
        message.chat.messages.add(role="user", content=args.prompt)
    if args.max_tokens is not None:
        message.stopping.max_tokens = args.max_tokens
    if args.temperature is not None:
        message.sampling.temperature = args.temperature
    if args.seed is not None:
        message.sampling.seed = args.seed
    message.adapter = args.use_adapter

    runtime = Runtime(config.core)
    runtime.start()
    runtime.wait_ready()
    assert runtime.loaded is not None
    tokenizer = runtime.loaded.tokenizer
    try:
        request = generation_request(
            message,
            tokenizer,
            slot_context=runtime.slot_context,
            default_max_tokens=config.frontend.default_max_tokens,
            prompt_cache_enabled=not config.kv.no_prompt_cache,
            allow_special_tokens_in_content=config.frontend.allow_special_tokens_in_content,
            adapters=[a.name for a in runtime.served_adapters],
        )
    except (InvalidRequestError, UnknownAdapterError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        runtime.shutdown()
        return 2
    # The same path as a server's front end: token ids from the core loop, text and stop
    # strings from a RequestStream.
    assert runtime.loop is not None
    sink = QueueSink()
    stream = RequestStream(request, tokenizer, runtime.eos_token_ids)
    seq = Request(request, sink)
    runtime.loop.submit(seq)
    while not stream.ended:
        if push_outputs(sink.outputs.get(), {0: stream}, {}):
            runtime.loop.cancel(seq)  # a stop string ended it here
        if not args.json:
            sys.stdout.write(stream.take().text)
            sys.stdout.flush()
    final = stream.final
    runtime.shutdown()
    assert final is not None
    if args.json:
        text = tokenizer.decode([t for t in stream.token_ids if t not in runtime.eos_token_ids])
        print(
            json.dumps({"token_ids": stream.token_ids, "text": text, "finish_reason": final.reason})
        )
    else:
        print(f"\n[{final.reason}; {final.completion_tokens} tokens]", file=sys.stderr)
    return 0 if final.error is None else 1


class QueueSink:
    """The scheduler's outputs for this one in-process request."""

    batch_key = "cli"

    def __init__(self) -> None:
        self.outputs: queue.SimpleQueue[Outputs] = queue.SimpleQueue()

    def deliver(self, outputs: Outputs) -> None:
        self.outputs.put(outputs)
