"""gRPC errors with machine-readable details (google.rpc.Status in `grpc-status-details-bin`,
built with grpcio-status), as AIP-193 describes them:

- INVALID_ARGUMENT carries `google.rpc.BadRequest` with one field violation: the field's path in
  the request (`sampling.top_p`, `chat.messages[1].role`) and the message.
- RESOURCE_EXHAUSTED (the waiting queue is full) and UNAVAILABLE (loading, draining, the engine
  core gone) carry `google.rpc.RetryInfo`: try again after that delay, here or elsewhere.
- Every error this service makes carries `google.rpc.ErrorInfo` with a reason (below) in the
  `mlxserve` domain, so that callers need not parse messages.
"""

from __future__ import annotations

from typing import Any, NoReturn

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "mlxserve"
RETRY_AFTER_S = 1  # what a refused caller is told to wait (RetryInfo)

# ErrorInfo reasons.
INVALID_REQUEST = "INVALID_REQUEST"
QUEUE_FULL = "QUEUE_FULL"
KV_BUDGET_EXCEEDED = "KV_BUDGET_EXCEEDED"  # could never fit: no RetryInfo
REQUEST_ID_IN_USE = "REQUEST_ID_IN_USE"
MODEL_LOADING = "MODEL_LOADING"
DRAINING = "DRAINING"
ENGINE_GONE = "ENGINE_GONE"
ENGINE_NOT_ANSWERING = "ENGINE_NOT_ANSWERING"
ENGINE_ERROR = "ENGINE_ERROR"
ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"  # NOT_FOUND: metadata `adapter`, `served`
ADAPTER_EXISTS = "ADAPTER_EXISTS"  # ALREADY_EXISTS (LoadAdapter)
ADAPTER_REFUSED = "ADAPTER_REFUSED"  # INVALID_ARGUMENT (LoadAdapter): the reason in the message


def _packed(message: Any) -> any_pb2.Any:
    detail = any_pb2.Any()
    detail.Pack(message)
    return detail


def rich_status(
    code: grpc.StatusCode,
    message: str,
    *,
    reason: str,
    field: str | None = None,
    retry_after_s: float | None = None,
    metadata: dict[str, str] | None = None,
) -> grpc.Status:
    """A status whose trailing metadata holds the google.rpc.Status with its details."""
    details = [
        _packed(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata=metadata))
    ]
    if field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(field=field, description=message)
        details.append(_packed(error_details_pb2.BadRequest(field_violations=[violation])))
    if retry_after_s is not None:
        retry = error_details_pb2.RetryInfo()
        retry.retry_delay.FromMilliseconds(round(retry_after_s * 1000))
        details.append(_packed(retry))
    status = status_pb2.Status(code=code.value[0], message=message, details=details)
    return rpc_status.to_status(status)


async def abort(context: grpc.aio.ServicerContext, status: grpc.Status) -> NoReturn:
    """End the RPC with `status` (raises, like context.abort)."""
    await context.abort(status.code, status.details, status.trailing_metadata)
    raise AssertionError("unreachable: abort raises")
