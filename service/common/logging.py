"""structlog set-up: JSON lines when stdout is not a terminal, console rendering when it is."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import NoReturn, TextIO

import structlog

from service.common.trace_ids import add_trace_ids


class _NamedWriteLogger(structlog.WriteLogger):
    """Writes each rendered line to a file; `name` is the module's, for the `logger` field."""

    def __init__(self, file: TextIO, name: str) -> None:
        super().__init__(file)
        self.name = name


def configure_logging(level: str = "info", fmt: str = "auto") -> None:
    """Our own loggers (structlog's) render and write their lines directly, and a level they
    are below costs a no-op call: a request logs on the event loop and the engine thread, where
    the standard library's record, caller lookup and handler chain cost more than the line.
    Other libraries' logging goes through the root handler, rendered the same way."""
    fmt = fmt.lower()
    use_json = fmt == "json" or (fmt == "auto" and not sys.stdout.isatty())
    renderer = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=sys.stdout.isatty())
    )
    shared = [
        structlog.contextvars.merge_contextvars,
        add_trace_ids,  # trace_id / span_id of the request's RPC span, when tracing is on
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if use_json:
        shared.append(structlog.processors.format_exc_info)
    out = sys.stdout
    structlog.configure(
        processors=[*shared, renderer],
        logger_factory=lambda name="", *_: _NamedWriteLogger(out, name),
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.addFilter(_ClientGoneWrite())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processor=renderer,
            foreign_pre_chain=shared,  # a foreign record's message comes formatted already
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Library chatter (e.g. transformers' missing-PyTorch notice) stays out of our logs.
    for noisy in ("transformers", "httpx", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    # gRPC's own debug lines come once per call ("Loaded running loop"): at --log-level debug
    # they would outnumber ours and slow every RPC; its warnings and errors still show.
    logging.getLogger("grpc").setLevel(max(root.level, logging.INFO))


class _ClientGoneWrite(logging.Filter):
    """gRPC logs a send that fails because the call has just ended (the client cancelled, or
    its deadline passed, before the server heard of it) as an error with a traceback. That race
    comes with cancellations and loses nothing the client still wanted: info, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.startswith("grpc") and record.getMessage().startswith(
            "ExecuteBatchError raised in core"
        ):
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
            return logging.getLogger().isEnabledFor(logging.INFO)
        return True


def exit_now(code: int) -> NoReturn:
    """End this process with `code` once the log and stdio are flushed, without the
    interpreter's finalization: tearing down MLX, gRPC and every imported module takes longer
    than a stop's own work, and by now nothing is left to do (the children are joined, the
    telemetry exported, the run directory removed)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
