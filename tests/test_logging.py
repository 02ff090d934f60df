"""Log set-up (service.common.logging): our loggers and other libraries' write the same JSON
lines, below the level costs nothing, an exception carries its traceback, and gRPC's per-call
debug chatter stays out."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from service.common.logging import configure_logging


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, grpc_logger = logging.getLogger(), logging.getLogger("grpc")
    handlers, level, grpc_level = root.handlers[:], root.level, grpc_logger.level
    yield
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)
    grpc_logger.setLevel(grpc_level)


def test_our_lines_and_foreign_lines_are_json_with_level_and_logger(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")
    log = structlog.get_logger("service.frontend.servicer").bind(request_id="r1")
    log.info("request queued", prompt_tokens=38)
    log.debug("not shown")
    logging.getLogger("service.core.models.loader").info("loaded %s", "weights")
    logging.getLogger("service.core.models.loader").debug("not shown either")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        log.exception("step failed")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["event"] for line in lines] == ["request queued", "loaded weights", "step failed"]
    queued, foreign, failed = lines
    assert queued["level"] == "info" and queued["logger"] == "service.frontend.servicer"
    assert queued["request_id"] == "r1" and queued["prompt_tokens"] == 38
    assert queued["timestamp"].endswith("Z")
    assert foreign["level"] == "info" and foreign["logger"] == "service.core.models.loader"
    assert failed["level"] == "error" and "ZeroDivisionError: boom" in failed["exception"]


def test_a_foreign_exception_carries_its_traceback(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("info", "json")
    try:
        raise ZeroDivisionError("boom")
    except ZeroDivisionError:
        logging.getLogger("service.core.models.loader").exception("load %s failed", "weights")
    (line,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert line["event"] == "load weights failed" and line["level"] == "error"
    assert "ZeroDivisionError: boom" in line["exception"] and "exc_info" not in line


def test_grpcs_per_call_debug_lines_stay_out_at_debug(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("debug", "json")
    logging.getLogger("grpc._cython.cygrpc").debug("[_cygrpc] Loaded running loop: id(loop)=1")
    logging.getLogger("grpc._cython.cygrpc").warning("a grpc warning")
    structlog.get_logger("service.core.scheduler").debug("prefill pass", rows=3)
    events = [json.loads(line)["event"] for line in capsys.readouterr().out.splitlines()]
    assert events == ["a grpc warning", "prefill pass"]


def test_grpcs_failed_send_to_a_call_just_ended_is_info_not_an_error(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cancellation races the servicer's next message: gRPC's error line for it is info."""
    configure_logging("info", "json")
    grpc_log = logging.getLogger("grpc._cython.cygrpc")
    try:
        raise RuntimeError('Failed "execute_batch": (<SendMessageOperation>,)')
    except RuntimeError:
        grpc_log.exception("ExecuteBatchError raised in core by servicer method [/a/B]")
        grpc_log.exception("Unexpected [RuntimeError] raised by servicer method [/a/B]")
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["level"], "exception" in line) for line in lines] == [
        ("info", False),
        ("error", True),
    ]
    configure_logging("warning", "json")
    grpc_log.error("ExecuteBatchError raised in core by servicer method [/a/B]")
    assert capsys.readouterr().out == ""


def test_the_level_filters_our_loggers(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    configure_logging("warning", "json")
    log = structlog.get_logger("service.core.loop")
    log.info("quiet")
    log.warning("loud", rows=3)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(line["event"], line["level"]) for line in lines] == [("loud", "warning")]
