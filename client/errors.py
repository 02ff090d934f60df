"""The machine-readable details of a failed call (`grpc-status-details-bin`, read with
grpcio-status): which request field was wrong, when to retry, and the server's reason.

```python
try:
    client.generate("Hi", temperature=-1)
except grpc.RpcError as err:
    details = error_details(err)
    details.field_violations  # (FieldViolation(field="sampling.temperature", ...),)
    details.retry_delay       # seconds to wait, for RESOURCE_EXHAUSTED / UNAVAILABLE
    details.reason            # e.g. "QUEUE_FULL", "DRAINING", "MODEL_LOADING"
```

`ErrorClass` sorts a failure the way the CLI's exit codes do: the request itself is wrong
(`USAGE`), the server cannot take calls now (`UNAVAILABLE`), or it refused this one
(`REJECTED`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True)
class FieldViolation:
    field: str  # the field's path in the request, e.g. "chat.messages[1].role"
    description: str


@dataclass(frozen=True)
class ErrorDetails:
    code: grpc.StatusCode
    message: str
    reason: str | None = None  # google.rpc.ErrorInfo.reason
    domain: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    field_violations: tuple[FieldViolation, ...] = ()
    retry_delay: float | None = None  # seconds (google.rpc.RetryInfo)

    @property
    def error_class(self) -> ErrorClass:
        return classify(self.code)


class ErrorClass(enum.Enum):
    USAGE = "usage"  # the request is wrong: fix it, do not retry
    UNAVAILABLE = "unavailable"  # the server cannot take calls now: retry (elsewhere) later
    REJECTED = "rejected"  # the server refused this request in its present state or limits
    FAILED = "failed"  # the server failed on it


_CLASSES = {
    grpc.StatusCode.INVALID_ARGUMENT: ErrorClass.USAGE,
    grpc.StatusCode.OUT_OF_RANGE: ErrorClass.USAGE,
    grpc.StatusCode.FAILED_PRECONDITION: ErrorClass.USAGE,
    grpc.StatusCode.UNAUTHENTICATED: ErrorClass.USAGE,
    grpc.StatusCode.PERMISSION_DENIED: ErrorClass.USAGE,
    grpc.StatusCode.UNIMPLEMENTED: ErrorClass.USAGE,
    grpc.StatusCode.NOT_FOUND: ErrorClass.USAGE,
    grpc.StatusCode.UNAVAILABLE: ErrorClass.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED: ErrorClass.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ErrorClass.REJECTED,
    grpc.StatusCode.ALREADY_EXISTS: ErrorClass.REJECTED,
    grpc.StatusCode.ABORTED: ErrorClass.REJECTED,
}


def classify(code: grpc.StatusCode) -> ErrorClass:
    return _CLASSES.get(code, ErrorClass.FAILED)


def error_details(error: grpc.RpcError) -> ErrorDetails:
    """The code, message and rich details of a failed call (sync or asyncio); the details are
    empty when the server sent none (e.g. a connection that could not be made)."""
    code = error.code()  # type: ignore[attr-defined]
    message = error.details() or ""  # type: ignore[attr-defined]
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]
    except ValueError:  # details that contradict the status itself: ignore them
        status = None
    if status is None:
        return ErrorDetails(code, message)
    reason = domain = None
    metadata: dict[str, str] = {}
    violations: list[FieldViolation] = []
    retry_delay = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            violations += [FieldViolation(v.field, v.description) for v in bad.field_violations]
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_delay = retry.retry_delay.ToTimedelta().total_seconds()
    return ErrorDetails(code, message, reason, domain, metadata, tuple(violations), retry_delay)
