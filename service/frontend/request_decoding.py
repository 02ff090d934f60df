"""Requests whose bytes do not decode get INVALID_ARGUMENT, not grpc's UNKNOWN.

grpc.aio decodes a request with the handler's `request_deserializer` before the servicer runs;
a protobuf DecodeError there (corrupt wire format, or a string field that is not UTF-8) becomes
UNKNOWN "Unexpected <class 'DecodeError'>" plus a logged traceback. `DecodeErrorInterceptor`
swaps in a deserializer that returns an `Undecodable` marker instead of raising, and wraps the
method so that a marker is answered with INVALID_ARGUMENT (a BadRequest field violation when a
string field is not UTF-8) and one log line. It works on the handlers of any service (the
generated registration code stays as generated).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Awaitable, Callable
from functools import cache
from typing import Any

import grpc
import structlog
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, FileDescriptor
from google.protobuf.message import DecodeError, Message

from service.frontend import errors

log = structlog.get_logger(__name__)


class Undecodable:
    """What the lenient deserializer returns for bytes that are not the request message."""

    __slots__ = ("field", "message")

    def __init__(self, message: str, field: str | None = None) -> None:
        self.message = message
        self.field = field  # the string field that is not UTF-8, when that is the trouble


def explain_decode_error(data: bytes, message_type: Descriptor, error: DecodeError) -> Undecodable:
    field = _non_utf8_field(data, message_type)
    if field is not None:
        return Undecodable(f"{field} is not valid UTF-8 (protobuf string fields must be)", field)
    reason = str(error).rpartition(": ")[2] or "it does not parse"
    return Undecodable(
        f"the request body is not a valid {message_type.full_name} message ({reason})"
    )


def _non_utf8_field(data: bytes, message_type: Descriptor) -> str | None:
    """Parse `data` with the message's string fields read as bytes; the path of the first one
    that is not UTF-8 (e.g. `chat.messages[0].content`), or None if it does not parse either
    (corrupt wire format, or a bad string map key)."""
    shadow = _bytes_for_strings(message_type.file).FindMessageTypeByName(message_type.full_name)
    try:
        parsed = message_factory.GetMessageClass(shadow).FromString(data)
    except DecodeError:
        return None
    return _first_non_utf8(parsed, message_type, "")


def _first_non_utf8(parsed: Message, original: Descriptor, prefix: str) -> str | None:
    for field, value in parsed.ListFields():
        real = original.fields_by_name[field.name]
        name = prefix + field.name
        if real.message_type is not None and real.message_type.GetOptions().map_entry:
            value_field = real.message_type.fields_by_name["value"]
            for key, item in value.items():
                found = _bad_in_value(value_field, item, f"{name}[{key!r}]")
                if found is not None:
                    return found
            continue
        repeated = real.is_repeated
        items = list(value) if repeated else [value]
        for i, item in enumerate(items):
            found = _bad_in_value(real, item, f"{name}[{i}]" if repeated else name)
            if found is not None:
                return found
    return None


def _bad_in_value(field: FieldDescriptor, value: Any, where: str) -> str | None:
    if field.message_type is not None:
        return _first_non_utf8(value, field.message_type, where + ".")
    return where if _is_bad_string(field, value) else None


def _is_bad_string(field: FieldDescriptor, value: object) -> bool:
    if field.type != FieldDescriptor.TYPE_STRING or not isinstance(value, bytes):
        return False
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@cache
def _bytes_for_strings(file: FileDescriptor) -> descriptor_pool.DescriptorPool:
    """A private descriptor pool holding `file` with every string field turned into bytes
    (same numbers, same wire format, no UTF-8 check), and the files it depends on."""
    pool = descriptor_pool.DescriptorPool()
    _add_with_dependencies(pool, file, set(), shadow=True)
    return pool


def _add_with_dependencies(
    pool: descriptor_pool.DescriptorPool, file: FileDescriptor, added: set[str], shadow: bool
) -> None:
    for dependency in file.dependencies:
        if dependency.name not in added:
            _add_with_dependencies(pool, dependency, added, shadow=False)
    proto = descriptor_pb2.FileDescriptorProto()
    file.CopyToProto(proto)
    if shadow:
        _strings_to_bytes(proto.message_type)
    pool.Add(proto)
    added.add(file.name)


def _strings_to_bytes(messages: Any) -> None:
    for message in messages:
        for field in message.field:
            # A map key may not be bytes: a bad string key is left to the generic message.
            is_key = message.options.map_entry and field.name == "key"
            if field.type == FieldDescriptor.TYPE_STRING and not is_key:
                field.type = FieldDescriptor.TYPE_BYTES
        _strings_to_bytes(message.nested_type)


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Answers undecodable requests of unary-request methods with INVALID_ARGUMENT.

    Put it last among the server's interceptors (innermost): the others, e.g. tracing, then
    wrap the refusal like any other RPC's outcome. Request-streaming methods (reflection) are
    left as they are."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        # The registered handlers live as long as the server: each is wrapped once, not per
        # call (a wrap costs more than the rest of this interceptor's share of an RPC).
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None or wrapped[0] is not handler:
            wrapped = self._wrapped[method] = (handler, _lenient(method, handler))
        return wrapped[1]


def _lenient(method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """`handler` with a deserializer that never raises and a method that refuses what did not
    decode."""
    deserialize = handler.request_deserializer
    message_type = _request_type(method)

    def lenient(data: bytes) -> Any:
        try:
            return deserialize(data)
        except DecodeError as exc:
            if message_type is None:
                return Undecodable(f"the request body does not decode: {exc}")
            return explain_decode_error(data, message_type, exc)

    async def refuse(request: Undecodable, context: grpc.aio.ServicerContext) -> None:
        log.warning(
            "request rejected",
            code=grpc.StatusCode.INVALID_ARGUMENT.name,
            field=request.field,
            request_id=None,  # the body that would name it does not decode
            rpc=method,
            reason=request.message,
        )
        status = errors.rich_status(
            grpc.StatusCode.INVALID_ARGUMENT,
            request.message,
            reason=errors.INVALID_REQUEST,
            field=request.field,
        )
        await errors.abort(context, status)

    if handler.unary_unary is not None:
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await refuse(request, context)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary_unary, lenient, handler.response_serializer
        )
    inner_stream = handler.unary_stream
    if inspect.isasyncgenfunction(inner_stream):

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await refuse(request, context)
            async with contextlib.aclosing(inner_stream(request, context)) as responses:
                async for response in responses:
                    yield response

    else:  # writes its responses with context.write

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await refuse(request, context)
            return await inner_stream(request, context)

    return grpc.unary_stream_rpc_method_handler(unary_stream, lenient, handler.response_serializer)


def _request_type(method: str) -> Descriptor | None:
    """The request message of "/package.Service/Method", from the default descriptor pool
    (where every imported generated module registers its file); None if not found there."""
    service, _, name = method.lstrip("/").partition("/")
    try:
        return descriptor_pool.Default().FindMethodByName(f"{service}.{name}").input_type
    except KeyError:
        return None
