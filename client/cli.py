"""Command-line client: `python -m client [--target HOST:PORT] COMMAND ...`.

Commands: generate, stream, stats, info, tokenize, bench. A failed call prints
`error: CODE: details` on stderr, then what the server attached to it (the request field at
fault, its reason, how long to wait before retrying); with --json, one JSON object instead.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from client.client import (
    DEFAULT_TARGET,
    TOKEN_ENV,
    GenerationClient,
    TLSConfig,
    build_request,
    response_format,
)
from client.errors import ErrorClass, ErrorDetails, error_details
from mlxserve.v1 import generation_pb2 as pb

TARGET_ENV = "MLXSERVE_TARGET"

# Exit statuses, by what went wrong (also in the --help epilog and the README).
EXIT_OK = 0
EXIT_FAILED = 1  # the server failed on the request (INTERNAL, UNKNOWN, ...), or the client did
EXIT_USAGE = 2  # the command or the request is wrong: bad flags, INVALID_ARGUMENT, UNAUTHENTICATED
EXIT_UNAVAILABLE = 3  # no server to take it now: UNAVAILABLE, DEADLINE_EXCEEDED; retry later
EXIT_REJECTED = 4  # the server refused it as things stand: RESOURCE_EXHAUSTED, ALREADY_EXISTS
EXIT_INTERRUPTED = 130
EXIT_CODES = {
    ErrorClass.USAGE: EXIT_USAGE,
    ErrorClass.UNAVAILABLE: EXIT_UNAVAILABLE,
    ErrorClass.REJECTED: EXIT_REJECTED,
    ErrorClass.FAILED: EXIT_FAILED,
}
EXIT_STATUS_HELP = """exit status:
  0    success
  1    the server failed on the request (INTERNAL, UNKNOWN, ...)
  2    usage: bad arguments, or the server found the request invalid (INVALID_ARGUMENT, the
       field named), UNAUTHENTICATED, PERMISSION_DENIED
  3    unavailable: UNAVAILABLE (not started, loading, draining, restarting) or
       DEADLINE_EXCEEDED; retrying later (or elsewhere) can succeed
  4    rejected: RESOURCE_EXHAUSTED (queue full, KV budget), ALREADY_EXISTS
  130  interrupted"""


def _metadata_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.lower(), value  # gRPC metadata keys must be lower case


_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")


def _traceparent(text: str) -> str:
    value = text.strip().lower()
    if not _TRACEPARENT.fullmatch(value):
        raise argparse.ArgumentTypeError(
            f"expected a W3C traceparent VERSION-TRACEID(32 hex)-SPANID(16 hex)-FLAGS, got {text!r}"
        )
    return value


def add_connection_arguments(parser: argparse.ArgumentParser, *, defaults: bool) -> None:
    """--tls, --tls-ca, --tls-cert, --tls-key and --token. With `defaults` False (the copies
    accepted after a command name) they default to SUPPRESS, which keeps a value given before
    the command from being overwritten."""

    def default(value: Any) -> Any:
        return value if defaults else argparse.SUPPRESS

    a = parser.add_argument
    a(
        "--tls",
        action="store_true",
        default=default(False),
        help="connect with TLS, trusting the system's root certificates (implied by --tls-ca)",
    )
    a("--tls-ca", default=default(None), metavar="PEM", help="CA certificate(s) to trust: TLS")
    a(
        "--tls-cert",
        default=default(None),
        metavar="PEM",
        help="client certificate for mutual TLS (with --tls-key)",
    )
    a("--tls-key", default=default(None), metavar="PEM", help="private key of --tls-cert")
    a(
        "--token",
        default=default(os.environ.get(TOKEN_ENV) or None),
        help=f"bearer token, sent as `authorization: Bearer TOKEN` (env {TOKEN_ENV}, which "
        "keeps it out of the process list)",
    )


def connection_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """GenerationClient's `tls` and `token` arguments from add_connection_arguments' flags."""
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    tls = None
    if args.tls or args.tls_ca or args.tls_cert:
        tls = TLSConfig(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key)
    return {"tls": tls, "token": args.token}


def _rpc_options() -> argparse.ArgumentParser:
    """Options every RPC command takes (also accepted after the command name)."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS keeps a --target given before the command from being overwritten here.
    common.add_argument("--target", default=argparse.SUPPRESS, help="server address host:port")
    add_connection_arguments(common, defaults=False)
    common.add_argument("--timeout", type=float, default=None, help="RPC deadline in seconds")
    common.add_argument("--json", action="store_true", help="print responses as JSON")
    common.add_argument(
        "--metadata",
        type=_metadata_pair,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="gRPC metadata to send (repeatable)",
    )
    common.add_argument(
        "--traceparent",
        type=_traceparent,
        default=None,
        help="W3C trace context to continue (sent as `traceparent` metadata); without it, an "
        "active OpenTelemetry span of the caller is propagated",
    )
    return common


def _generation_options() -> argparse.ArgumentParser:
    gen = argparse.ArgumentParser(add_help=False)
    gen.add_argument("prompt", nargs="?", help="prompt text; read from stdin when omitted")
    gen.add_argument(
        "--raw", action="store_true", help="send the prompt as raw text, not as a user chat turn"
    )
    gen.add_argument("--system", help="a system chat turn before the prompt (chat mode)")
    gen.add_argument("--max-tokens", type=int)
    gen.add_argument("--temperature", type=float)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int)
    gen.add_argument("--min-p", type=float)
    gen.add_argument("--repetition-penalty", type=float)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--priority", type=int, default=0, help="higher is more urgent")
    gen.add_argument("--logprobs", action="store_true")
    gen.add_argument("--top-logprobs", type=int, default=0)
    gen.add_argument("--request-id", default="")
    gen.add_argument(
        "--no-cache-prompt", action="store_true", help="bypass the server's prompt-prefix cache"
    )
    formats = gen.add_mutually_exclusive_group()
    formats.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="structured output: a JSON Schema (JSON text, or @FILE)",
    )
    formats.add_argument("--json-object", action="store_true", help="the reply is a JSON object")
    formats.add_argument("--regex", help="the reply matches this regular expression in full")
    formats.add_argument(
        "--grammar", help="the reply follows this grammar (llguidance's Lark syntax, or @FILE)"
    )
    formats.add_argument(
        "--choice", action="append", help="the reply is exactly one of these (repeatable)"
    )
    gen.add_argument("--adapter", default="", help="a LoRA adapter the server serves (see `info`)")
    return gen


def build_parser(prog: str = "python -m client") -> argparse.ArgumentParser:
    from client.bench.cli import add_bench_arguments, checkout_peers

    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        epilog=EXIT_STATUS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
        help=f"server address host:port (env {TARGET_ENV}; default {DEFAULT_TARGET})",
    )
    add_connection_arguments(parser, defaults=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    rpc, gen = _rpc_options(), _generation_options()
    commands.add_parser("generate", parents=[rpc, gen], help="one unary Generate call")
    commands.add_parser("stream", parents=[rpc, gen], help="StreamGenerate, printing as it goes")
    stats = commands.add_parser(
        "stats", parents=[rpc], help="KV cache and batch state (CacheStats)"
    )
    stats.add_argument(
        "--watch", type=float, metavar="SECONDS", help="print again every SECONDS until Ctrl-C"
    )
    commands.add_parser("info", parents=[rpc], help="the loaded model (GetModelInfo)")
    load = commands.add_parser(
        "load-adapter", parents=[rpc], help="serve an mlx-lm LoRA adapter (LoadAdapter)"
    )
    load.add_argument("name", help="what requests will call it")
    load.add_argument("path", help="the adapter's directory on the server")
    unload = commands.add_parser(
        "unload-adapter", parents=[rpc], help="stop serving an adapter (UnloadAdapter)"
    )
    unload.add_argument("name")
    tokenize = commands.add_parser("tokenize", parents=[rpc], help="prompt token ids (Tokenize)")
    tokenize.add_argument("prompt", nargs="?", help="text; read from stdin when omitted")
    tokenize.add_argument("--raw", action="store_true", help="raw text instead of a chat turn")
    tokenize.add_argument("--system", help="a system chat turn before the prompt (chat mode)")
    bench = commands.add_parser(
        "bench", help="load generator: concurrency sweep with TTFT/ITL (peers from a checkout)"
    )
    bench.add_argument("--target", default=argparse.SUPPRESS, help="server address host:port")
    add_connection_arguments(bench, defaults=False)
    add_bench_arguments(bench, checkout_peers())
    return parser


# -- request building and output --------------------------------------------------------------


def _read_prompt(args: argparse.Namespace) -> str:
    return args.prompt if args.prompt is not None else sys.stdin.read()


def _chat_turns(args: argparse.Namespace, prompt: str) -> list[tuple[str, str]]:
    turns = [("system", args.system)] if args.system else []
    return [*turns, ("user", prompt)]


def _text_or_file(value: str | None) -> str | None:
    if value is not None and value.startswith("@"):
        return Path(value[1:]).read_text()
    return value


def _response_format(args: argparse.Namespace) -> pb.ResponseFormat | None:
    schema, grammar = _text_or_file(args.json_schema), _text_or_file(args.grammar)
    if not (schema is not None or args.json_object or args.regex or grammar or args.choice):
        return None
    return response_format(
        json_schema=schema,
        json_object=args.json_object,
        regex=args.regex,
        grammar=grammar,
        choice=args.choice,
    )


def request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    prompt = _read_prompt(args)
    # Default to chat: the embedded model is an instruct model and answers chats, not raw text.
    prompt_or_chat: dict[str, Any] = (
        {"prompt": prompt} if args.raw else {"chat": _chat_turns(args, prompt)}
    )
    return build_request(
        **prompt_or_chat,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        priority=args.priority,
        logprobs=args.logprobs,
        top_logprobs=args.top_logprobs,
        request_id=args.request_id,
        cache_prompt=False if args.no_cache_prompt else None,
        response_format=_response_format(args),
        adapter=args.adapter,
    )


def to_json(message: Message, *, indent: int | None = 2) -> str:
    return json_format.MessageToJson(
        message, preserving_proto_field_name=True, indent=indent, ensure_ascii=False
    )


def finish_reason_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def usage_line(request_id: str, finish_reason: int, usage: pb.Usage, timing: pb.Timing) -> str:
    """One line of what the server reports about a finished request."""
    decode_seconds = timing.total_seconds - timing.time_to_first_token_seconds
    # The first token comes from prefill; the rest are decode steps.
    decode_rate = (
        f" decode={(usage.completion_tokens - 1) / decode_seconds:.1f}tok/s"
        if usage.completion_tokens > 1 and decode_seconds > 0
        else ""
    )
    return (
        f"[{request_id} finish={finish_reason_name(finish_reason)}"
        f" prompt={usage.prompt_tokens} completion={usage.completion_tokens}"
        f" cached={usage.cached_tokens} queue={timing.queue_seconds:.3f}s"
        f" ttft={timing.time_to_first_token_seconds:.3f}s"
        f" total={timing.total_seconds:.3f}s{decode_rate}]"
    )


def _field_text(message: Message, field: FieldDescriptor) -> str:
    value = getattr(message, field.name)
    if field.message_type is not None:
        if isinstance(value, Message):
            return to_json(value, indent=None)
        return ", ".join(to_json(v, indent=None) for v in value)  # repeated messages
    # Repeated fields come back as containers; show them comma-separated.
    values = [value] if isinstance(value, bool | int | float | str) else list(value)
    if field.enum_type is not None:
        values = [field.enum_type.values_by_number[v].name for v in values]
    return ", ".join(str(v) for v in values)


def key_value_lines(message: Message, skip: Sequence[str] = ()) -> list[str]:
    """All fields in declaration order (zeros included), as aligned `key: value` lines."""
    fields = [f for f in message.DESCRIPTOR.fields if f.name not in skip]
    width = max((len(f.name) for f in fields), default=0)
    return [f"{f.name + ':':<{width + 1}} {_field_text(message, f)}" for f in fields]


def slots_table(slots: Sequence[pb.SlotInfo]) -> list[str]:
    header = ("request_id", "state", "priority", "generated", "context", "adapter")
    rows = [
        (
            s.request_id,
            pb.SlotState.Name(s.state).removeprefix("SLOT_STATE_").lower(),
            str(s.priority),
            str(s.generated_tokens),
            str(s.context_tokens),
            s.adapter or "-",
        )
        for s in slots
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(
            cell.ljust(w) if i < 2 or i == 5 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in [header, *rows]
    ]


# -- commands ---------------------------------------------------------------------------------


def _call_options(args: argparse.Namespace) -> dict[str, Any]:
    metadata = list(args.metadata)
    if args.traceparent:
        metadata.append(("traceparent", args.traceparent))
    return {"timeout": args.timeout, "metadata": metadata or None}


def cmd_generate(client: GenerationClient, args: argparse.Namespace) -> int:
    response = client.generate(request_from_args(args), **_call_options(args))
    if args.json:
        print(to_json(response))
        return 0
    print(response.text)
    print(
        usage_line(response.request_id, response.finish_reason, response.usage, response.timing),
        file=sys.stderr,
    )
    return 0


def cmd_stream(client: GenerationClient, args: argparse.Namespace) -> int:
    final: pb.StreamGenerateResponse | None = None
    for message in client.stream(request_from_args(args), **_call_options(args)):
        if args.json:
            print(to_json(message, indent=None), flush=True)  # one JSON object per line
        elif message.text:
            sys.stdout.write(message.text)
            sys.stdout.flush()
        if message.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            final = message
    if not args.json:
        print()
        if final is not None:
            print(
                usage_line(final.request_id, final.finish_reason, final.usage, final.timing),
                file=sys.stderr,
            )
    return 0


def cmd_stats(client: GenerationClient, args: argparse.Namespace) -> int:
    while True:
        stats = client.cache_stats(**_call_options(args))
        if args.json:
            print(to_json(stats, indent=None if args.watch else 2), flush=True)
        else:
            print("\n".join(key_value_lines(stats, skip=("slots",))))
            if stats.slots:
                print()
                print("\n".join(slots_table(stats.slots)))
        if not args.watch:
            return 0
        if not args.json:
            print(flush=True)
        time.sleep(args.watch)


def cmd_info(client: GenerationClient, args: argparse.Namespace) -> int:
    info = client.model_info(**_call_options(args))
    print(to_json(info) if args.json else "\n".join(key_value_lines(info)))
    return 0


def cmd_tokenize(client: GenerationClient, args: argparse.Namespace) -> int:
    prompt = _read_prompt(args)
    if args.raw:
        response = client.tokenize(prompt, **_call_options(args))
    else:
        response = client.tokenize(chat=_chat_turns(args, prompt), **_call_options(args))
    if args.json:
        print(to_json(response))
    else:
        print(" ".join(str(t) for t in response.token_ids))
        print(f"[{len(response.token_ids)} tokens] {list(response.tokens)!r}", file=sys.stderr)
    return 0


def cmd_load_adapter(client: GenerationClient, args: argparse.Namespace) -> int:
    adapter = client.load_adapter(args.name, args.path, **_call_options(args))
    print(to_json(adapter) if args.json else "\n".join(key_value_lines(adapter)))
    return 0


def cmd_unload_adapter(client: GenerationClient, args: argparse.Namespace) -> int:
    pending = client.unload_adapter(args.name, **_call_options(args))
    if args.json:
        print(to_json(pb.UnloadAdapterResponse(pending_requests=pending)))
    else:
        print(f"{args.name}: unloaded once {pending} running request(s) have finished")
    return 0


COMMANDS = {
    "generate": cmd_generate,
    "stream": cmd_stream,
    "stats": cmd_stats,
    "info": cmd_info,
    "tokenize": cmd_tokenize,
    "load-adapter": cmd_load_adapter,
    "unload-adapter": cmd_unload_adapter,
}


def error_lines(details: ErrorDetails) -> list[str]:
    """What the CLI prints for a failed call."""
    lines = [f"error: {details.code.name}: {details.message}"]
    for violation in details.field_violations:
        if violation.description in ("", details.message):
            lines.append(f"  field: {violation.field}")
        else:
            lines.append(f"  field: {violation.field}: {violation.description}")
    if details.reason:
        lines.append(f"  reason: {details.reason}")
    if details.retry_delay is not None:
        lines.append(f"  retry after: {details.retry_delay:g}s")
    return lines


def error_json(details: ErrorDetails) -> str:
    import json

    return json.dumps(
        {
            "code": details.code.name,
            "message": details.message,
            "reason": details.reason,
            "field_violations": [
                {"field": v.field, "description": v.description} for v in details.field_violations
            ],
            "retry_delay_seconds": details.retry_delay,
        }
    )


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "bench":
        from client.bench.cli import checkout_peers, run_bench

        peers = checkout_peers()
        return run_bench(args, peers.PEERS if peers else None)
    with GenerationClient(args.target, **connection_kwargs(args)) as client:
        return COMMANDS[args.command](client, args)


def exit_status(call: Callable[[], int], *, json_errors: bool = False) -> int:
    """Runs a command; a failure becomes its message on stderr and the exit status above."""
    try:
        return call()
    except grpc.RpcError as err:
        details = error_details(err)
        if json_errors:
            print(error_json(details), file=sys.stderr)
        else:
            print("\n".join(error_lines(details)), file=sys.stderr)
        return EXIT_CODES[details.error_class]
    except (ValueError, OSError) as err:  # bad arguments: an unreadable --tls-ca, ...
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None, prog: str = "python -m client") -> int:
    args = build_parser(prog).parse_args(argv)
    return exit_status(lambda: _dispatch(args), json_errors=getattr(args, "json", False))


def console_main() -> int:
    """The `mlxserve-client` console script."""
    return main(prog="mlxserve-client")
