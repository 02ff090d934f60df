"""Server reflection (v1 and v1alpha: what grpcurl, buf curl and Postman use) and
grpc.health.v1 (every method it advertises) on the real server."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from client.errors import error_details
from service.frontend.introspection import HealthServicer

GENERATION_SERVICE = "mlxserve.v1.GenerationService"
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
REFLECTION_V1ALPHA = "grpc.reflection.v1alpha.ServerReflection"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _reflect(channel: grpc.Channel, **request) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10
    )
    return next(iter(responses))


def _reflect_v1(channel: grpc.Channel, **request) -> reflection_pb2.ServerReflectionResponse:
    """A call on the v1 path. v1 and v1alpha messages are the same on the wire (same fields,
    same numbers), so v1alpha's classes encode and decode it."""
    call = channel.stream_stream(
        f"/{REFLECTION_V1}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10)))


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("reflect", [_reflect, _reflect_v1], ids=["v1alpha", "v1"])
def test_reflection_lists_the_services(channel, reflect) -> None:
    response = reflect(channel, list_services="")
    names = {s.name for s in response.list_services_response.service}
    assert {GENERATION_SERVICE, HEALTH_SERVICE, REFLECTION_V1, REFLECTION_V1ALPHA} <= names


@pytest.mark.slow
@pytest.mark.model
def test_reflection_v1_serves_the_file_descriptors(channel) -> None:
    """Through v1: the API's file, and v1's own file (so tools can describe the v1 service)."""
    response = _reflect_v1(channel, file_containing_symbol=GENERATION_SERVICE)
    packages = {
        descriptor_pb2.FileDescriptorProto.FromString(raw).package
        for raw in response.file_descriptor_response.file_descriptor_proto
    }
    assert "mlxserve.v1" in packages

    response = _reflect_v1(channel, file_containing_symbol=REFLECTION_V1)
    (raw,) = response.file_descriptor_response.file_descriptor_proto
    v1 = descriptor_pb2.FileDescriptorProto.FromString(raw)
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    (method,) = v1.service[0].method
    assert method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
    assert method.client_streaming and method.server_streaming
    fields = {m.name: {f.name: (f.number, f.type_name) for f in m.field} for m in v1.message_type}
    assert fields["ServerReflectionResponse"]["list_services_response"] == (
        6,
        ".grpc.reflection.v1.ListServiceResponse",
    )


@pytest.mark.slow
@pytest.mark.model
def test_reflection_v1_unknown_symbol_is_not_found(channel) -> None:
    response = _reflect_v1(channel, file_containing_symbol="no.such.Symbol")
    assert response.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


@pytest.mark.slow
@pytest.mark.model
def test_reflection_serves_the_file_descriptor(channel) -> None:
    response = _reflect(channel, file_containing_symbol=GENERATION_SERVICE)
    protos = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    by_package = {p.package: p for p in protos}
    assert "mlxserve.v1" in by_package
    services = {s.name: s for s in by_package["mlxserve.v1"].service}
    methods = {m.name: m for m in services["GenerationService"].method}
    assert {"Generate", "StreamGenerate", "CacheStats"} <= set(methods)
    assert methods["StreamGenerate"].server_streaming
    assert not methods["Generate"].server_streaming


@pytest.mark.slow
@pytest.mark.model
def test_descriptor_pool_from_reflection(channel) -> None:
    """What a generic client does with no .proto at hand: build descriptors by reflection."""
    database = ProtoReflectionDescriptorDatabase(channel)
    assert GENERATION_SERVICE in set(database.get_services())
    pool = DescriptorPool(database)
    service = pool.FindServiceByName(GENERATION_SERVICE)
    generate = service.methods_by_name["Generate"]
    assert generate.input_type.full_name == "mlxserve.v1.GenerateRequest"
    assert generate.output_type.full_name == "mlxserve.v1.GenerateResponse"
    request = pool.FindMessageTypeByName("mlxserve.v1.GenerateRequest")
    assert {"request_id", "text", "token_ids", "chat", "sampling", "stopping"} <= set(
        request.fields_by_name
    )
    sampling = pool.FindMessageTypeByName("mlxserve.v1.SamplingParams")
    assert {"temperature", "top_p", "top_k", "min_p", "seed", "logit_bias"} <= set(
        sampling.fields_by_name
    )


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("service", ["", GENERATION_SERVICE])
def test_health_is_serving(channel, service: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert answer.status == SERVING


@pytest.mark.slow
@pytest.mark.model
def test_health_of_an_unknown_service_is_not_found(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.slow
@pytest.mark.model
def test_health_was_not_serving_while_the_model_loaded(server) -> None:
    """The shared server's start was watched from the moment the process existed (health
    polled every ~20 ms with fast reconnects): the port opens before the model loads, so the
    first answers are NOT_SERVING, then SERVING. A Generate sent meanwhile was UNAVAILABLE."""
    history = server.health_history
    assert history[0] == "NOT_SERVING", history
    assert history[-1] == "SERVING"
    assert set(history) == {"NOT_SERVING", "SERVING"}
    assert history.index("SERVING") == len(history) - 1  # never back to NOT_SERVING
    assert server.probe_while_loading == grpc.StatusCode.UNAVAILABLE
    # ... with RetryInfo: come back shortly.
    details = error_details(server.probe_error)
    assert details.reason == "MODEL_LOADING" and details.retry_delay == 1.0


@pytest.mark.slow
@pytest.mark.model
def test_health_list_reports_every_service(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    answer = health.List(health_pb2.HealthListRequest(), timeout=5)
    assert {name: s.status for name, s in answer.statuses.items()} == {
        "": SERVING,
        GENERATION_SERVICE: SERVING,
    }


@pytest.mark.slow
@pytest.mark.model
def test_every_advertised_health_method_answers(channel) -> None:
    """Each method of grpc.health.v1.Health (as the server's reflection lists them) is
    implemented: none answers UNIMPLEMENTED."""
    response = _reflect(channel, file_containing_symbol=HEALTH_SERVICE)
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    (service,) = [s for f in files for s in f.service if s.name == "Health"]
    advertised = {m.name for m in service.method}
    assert advertised == {"Check", "Watch", "List"}

    health = health_pb2_grpc.HealthStub(channel)
    calls = {
        "Check": lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=5).status,
        "Watch": lambda: next(health.Watch(health_pb2.HealthCheckRequest(), timeout=5)).status,
        "List": lambda: health.List(health_pb2.HealthListRequest(), timeout=5).statuses[""].status,
    }
    assert {name: calls[name]() for name in advertised} == dict.fromkeys(advertised, SERVING)


async def test_health_list_follows_set_and_graceful_shutdown() -> None:
    servicer = HealthServicer()
    await servicer.set("", NOT_SERVING)
    await servicer.set(GENERATION_SERVICE, SERVING)

    def listed(answer: health_pb2.HealthListResponse) -> dict[str, int]:
        return {name: s.status for name, s in answer.statuses.items()}

    answer = await servicer.List(health_pb2.HealthListRequest(), None)
    assert listed(answer) == {"": NOT_SERVING, GENERATION_SERVICE: SERVING}
    await servicer.enter_graceful_shutdown()
    await servicer.set(GENERATION_SERVICE, SERVING)  # ignored while shutting down, as Check does
    answer = await servicer.List(health_pb2.HealthListRequest(), None)
    assert listed(answer) == {"": NOT_SERVING, GENERATION_SERVICE: NOT_SERVING}
    check = await servicer.Check(health_pb2.HealthCheckRequest(service=GENERATION_SERVICE), None)
    assert check.status == NOT_SERVING
