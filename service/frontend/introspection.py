"""grpc.health.v1 with every advertised method, and server reflection in both versions.

grpcio-health-checking's servicer advertises `Health/List` (it is in the health.proto it
ships) but leaves it UNIMPLEMENTED; `HealthServicer` adds it. grpcio-reflection serves only
`grpc.reflection.v1alpha`, while current tools (grpcurl >= 1.9, buf curl, Postman) ask for
`grpc.reflection.v1` first. The two protocols are the same messages with the same field
numbers in another package, so the v1alpha servicer answers v1 calls unchanged; a v1 file
descriptor derived from the v1alpha one makes the v1 service itself reflectable.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1ALPHA_SERVICE = reflection.SERVICE_NAME
V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class HealthServicer(health.aio.HealthServicer):
    """The library's asyncio servicer plus `List` (a snapshot of every registered status)."""

    def __init__(self) -> None:
        super().__init__()
        # The library seeds "" as SERVING; mirror what it holds without reading its private map.
        self._statuses: dict[str, health_pb2.HealthCheckResponse.ServingStatus] = {
            "": health_pb2.HealthCheckResponse.SERVING
        }
        self._shutting_down = False

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        await super().set(service, status)
        if not self._shutting_down:  # the library ignores updates once shutting down
            self._statuses[service] = status

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._shutting_down = True
        for service in self._statuses:
            self._statuses[service] = health_pb2.HealthCheckResponse.NOT_SERVING

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in self._statuses.items()
            }
        )


def _register_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Add grpc/reflection/v1/reflection.proto to `pool`: v1alpha's file in the v1 package."""
    try:
        pool.FindFileByName(_V1_FILE)
        return  # a newer grpcio-reflection may have registered it already
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name.startswith(old):
                field.type_name = new + field.type_name[len(old) :]
    for service in proto.service:
        for method in service.method:
            method.input_type = new + method.input_type[len(old) :]
            method.output_type = new + method.output_type[len(old) :]
    pool.Add(proto)


def enable_server_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection v1 and v1alpha for `service_names` (both reflection services are
    listed too)."""
    _register_v1_descriptor(descriptor_pool.Default())
    names = (*service_names, V1_SERVICE, V1ALPHA_SERVICE)
    servicer = reflection.aio.ReflectionServicer(names)
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for service in (V1_SERVICE, V1ALPHA_SERVICE):
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {"ServerReflectionInfo": handler}),)
        )
