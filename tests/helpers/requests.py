"""Request builders shared by the gRPC tests."""

from __future__ import annotations

from typing import Any

from mlxserve.v1 import generation_pb2 as pb


def chat_request(
    content: str,
    *,
    max_tokens: int | None = None,
    request_id: str = "",
    system: str | None = None,
    **fields: Any,
) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role="system", content=system)] if system else []
    messages.append(pb.ChatMessage(role="user", content=content))
    stopping = fields.pop("stopping", None) or pb.StoppingCriteria()
    if max_tokens is not None and not stopping.HasField("max_tokens"):
        stopping.max_tokens = max_tokens
    return pb.GenerateRequest(
        request_id=request_id,
        chat=pb.ChatInput(messages=messages),
        stopping=stopping,
        **fields,
    )


def to_stream(request: pb.GenerateRequest) -> pb.StreamGenerateRequest:
    """The same request for StreamGenerate (the two messages share field names and numbers)."""
    return pb.StreamGenerateRequest.FromString(request.SerializeToString())


def with_id(request: pb.GenerateRequest, request_id: str) -> pb.GenerateRequest:
    copy = pb.GenerateRequest()
    copy.CopyFrom(request)
    copy.request_id = request_id
    return copy
