"""client.Balancing: client-side round_robin over two real replicas, with grpc.health.v1
health checking and a retry policy for UNAVAILABLE.

Calls spread over both replicas (each replica's log names the calls it queued). While one
replica drains (SIGTERM, a running stream keeps it draining) and after it has exited, it
admits no new call and no call fails: the health-checked client sends it none, and a client
without health checking has the calls the draining replica refuses (UNAVAILABLE before any
reply) retried on the other one, which the draining replica's rejection counter shows.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from client import Balancing, GenerationClient
from tests.helpers.requests import chat_request
from tests.helpers.server import ServerProcess, free_port, running_replicas, start_draining

pytestmark = [pytest.mark.slow, pytest.mark.model]

DEADLINE_S = 60.0
CALLS = 4


def queued_ids(server: ServerProcess) -> set[str]:
    return {r["request_id"] for r in server.records() if r.get("event") == "request queued"}


def unavailable_rejections(metrics_port: int) -> float:
    """mlxserve_rejections_total{reason="unavailable"} of one replica, over its model labels:
    calls it refused because it was loading or draining."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "mlxserve_rejections_total"
        and sample.labels.get("reason") == "unavailable"
    )


def call_all(client: GenerationClient, prefix: str) -> list[str]:
    """CALLS short Generate calls one after another; every one must succeed."""
    ids = [f"{prefix}-{i}" for i in range(CALLS)]
    for request_id in ids:
        reply = client.generate(
            chat_request("Say hi.", max_tokens=1, request_id=request_id), timeout=DEADLINE_S
        )
        assert reply.request_id == request_id and reply.token_ids
    return ids


def test_balancing_options() -> None:
    config = Balancing().service_config()
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "mlxserve.v1.GenerationService"}
    (method,) = config["methodConfig"]
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert "healthCheckConfig" not in Balancing(health_service=None).service_config()
    with pytest.raises(ValueError, match="max_attempts"):
        Balancing(max_attempts=6)


def test_round_robin_spreads_calls_and_spares_a_draining_replica() -> None:
    flags = ("--log-format", "json", "--drain-timeout", "120")
    metrics = [free_port(), free_port()]
    with running_replicas(*[(*flags, "--metrics-port", str(port)) for port in metrics]) as (a, b):
        target = f"ipv4:{a.target},{b.target}"
        with (
            GenerationClient(target, balancing=Balancing()) as checked,
            GenerationClient(target, balancing=Balancing(health_service=None)) as unchecked,
            grpc.insecure_channel(a.target) as direct,
        ):
            # Both clients spread their calls over both replicas.
            for client, prefix in ((checked, "spread"), (unchecked, "spread-unchecked")):
                ids = call_all(client, prefix)
                on_a, on_b = set(ids) & queued_ids(a), set(ids) & queued_ids(b)
                assert on_a | on_b == set(ids)
                assert on_a and on_b, (on_a, on_b)

            # A stream keeps replica a draining (its drain timeout is long) while we look.
            long = start_draining(direct, a, 2 * DEADLINE_S)
            health = health_pb2_grpc.HealthStub(direct).Check(
                health_pb2.HealthCheckRequest(service="mlxserve.v1.GenerationService"), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING

            refused_before = unavailable_rejections(metrics[0])
            draining = call_all(checked, "drain")
            refused_checked = unavailable_rejections(metrics[0]) - refused_before
            draining += call_all(unchecked, "drain-unchecked")
            refused_unchecked = unavailable_rejections(metrics[0]) - refused_before
            refused_unchecked -= refused_checked
            assert next(long).token_ids, "the draining replica's running stream stopped"
            long.cancel()  # the last running request: replica a ends its drain and exits
            assert a.wait(30) == 0

            down = call_all(checked, "down") + call_all(unchecked, "down-unchecked")

    # Replica a admitted none of the calls made while it drained or after it exited; none
    # failed (call_all checks every reply). The health-checked client sent it none at all;
    # the other had the calls it refused retried on replica b.
    assert not (set(draining) | set(down)) & queued_ids(a)
    assert set(draining) | set(down) <= queued_ids(b)
    assert refused_checked == 0
    assert refused_unchecked >= 1
    print(
        f"\nwhile replica a drained: {CALLS} calls with health checking, none sent to it; "
        f"{CALLS} without, {refused_unchecked:.0f} refused by it and retried on replica b; "
        f"after it exited: {2 * CALLS} calls, all on replica b; no call failed"
    )
