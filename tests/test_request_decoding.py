"""Undecodable request bodies: the reason names the string field that is not UTF-8."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from mlxserve.v1 import generation_pb2 as pb
from service.frontend.request_decoding import explain_decode_error


def _reason(message_class, data: bytes) -> str:
    with pytest.raises(DecodeError) as info:
        message_class.FromString(data)
    return explain_decode_error(data, message_class.DESCRIPTOR, info.value).message


def _corrupt_string(message, value: str) -> bytes:
    data = message.SerializeToString()
    good = value.encode()
    assert data.count(good) == 1
    return data.replace(good, b"\xc3" + good[1:])  # a lead byte without its continuation


def test_names_a_nested_repeated_string_field() -> None:
    request = pb.GenerateRequest(request_id="r")
    request.chat.messages.add(role="user", content="first")
    request.chat.messages.add(role="user", content="second")
    reason = _reason(pb.GenerateRequest, _corrupt_string(request, "second"))
    assert reason.startswith("chat.messages[1].content is not valid UTF-8")


@pytest.mark.parametrize(
    ("message", "value", "field"),
    [
        (pb.GenerateRequest(request_id="the-id", text="x"), "the-id", "request_id"),
        (pb.GenerateRequest(text="prompt"), "prompt", "text"),
        (pb.GenerateRequest(stopping=pb.StoppingCriteria(stop=["a", "stop"])), "stop", "stop"),
    ],
)
def test_names_the_field(message, value: str, field: str) -> None:
    reason = _reason(pb.GenerateRequest, _corrupt_string(message, value))
    expected = "stopping.stop[1]" if field == "stop" else field
    assert reason.startswith(f"{expected} is not valid UTF-8")


def test_corrupt_wire_format_names_the_message_type() -> None:
    reason = _reason(pb.TokenizeRequest, b"\x0a\x05ab")  # a length past the end
    assert reason.startswith("the request body is not a valid mlxserve.v1.TokenizeRequest")


def test_other_services_messages_too() -> None:
    data = _corrupt_string(health_pb2.HealthCheckRequest(service="svc"), "svc")
    assert _reason(health_pb2.HealthCheckRequest, data).startswith("service is not valid UTF-8")
