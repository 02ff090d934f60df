"""Server reflection (what grpcurl uses) and grpc.health.v1 on the real server."""

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

pytestmark = pytest.mark.model

GENERATION_SERVICE = "mlxserve.v1.GenerationService"
HEALTH_SERVICE = "grpc.health.v1.Health"
SERVING = health_pb2.HealthCheckResponse.SERVING


def _reflect(channel: grpc.Channel, **request) -> reflection_pb2.ServerReflectionResponse:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10
    )
    return next(iter(responses))


def test_reflection_lists_the_services(channel) -> None:
    response = _reflect(channel, list_services="")
    names = {s.name for s in response.list_services_response.service}
    assert {GENERATION_SERVICE, HEALTH_SERVICE} <= names


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


@pytest.mark.parametrize("service", ["", GENERATION_SERVICE])
def test_health_is_serving(channel, service: str) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert answer.status == SERVING


def test_health_of_an_unknown_service_is_not_found(channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    with pytest.raises(grpc.RpcError) as info:
        health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


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
