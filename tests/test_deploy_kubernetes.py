"""deploy/kubernetes/ agrees with the server: the container's arguments are the server's own
flags (parsed by its parser), the ports and probes use the port those flags give, the probes
ask grpc.health.v1 for names the server sets, the grace period covers preStop, the drain and
the stop that follows, and the Service and PodDisruptionBudget select the Deployment's pods."""

from __future__ import annotations

import argparse
import os
from typing import Any

import pytest
import yaml

from service.common.config import ServerConfig, add_server_arguments, config_from_args
from service.frontend.server import DRAIN_LAST_MESSAGES_S, SERVICE_NAME
from service.launcher import CORE_STOP_TIMEOUT_S
from tests.helpers.paths import REPO_ROOT

MANIFESTS = REPO_ROOT / "deploy" / "kubernetes"
HEALTH_NAMES = {"", SERVICE_NAME}  # what the server sets SERVING / NOT_SERVING


def documents() -> dict[str, dict[str, Any]]:
    """Every manifest in deploy/kubernetes/, by kind (one of each)."""
    by_kind: dict[str, dict[str, Any]] = {}
    for path in sorted(MANIFESTS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            assert doc["kind"] not in by_kind, f"two {doc['kind']}s"
            by_kind[doc["kind"]] = doc
    return by_kind


def server_parser() -> argparse.ArgumentParser:
    """The server's flags (as `mlxserve serve` has them), each to be spelt out in full."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_server_arguments(parser)
    return parser


@pytest.fixture
def manifests() -> dict[str, dict[str, Any]]:
    docs = documents()
    assert set(docs) == {"Deployment", "Service", "PodDisruptionBudget"}
    return docs


@pytest.fixture
def container(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    (only,) = manifests["Deployment"]["spec"]["template"]["spec"]["containers"]
    return only


@pytest.fixture
def config(container: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> ServerConfig:
    """The server's configuration from the container's command line, through the server's
    own parser (an unknown or misspelt flag fails here); MLXSERVE_* variables of this
    environment must not leak into the defaults."""
    for name in list(os.environ):
        if name.startswith("MLXSERVE_"):
            monkeypatch.delenv(name)
    assert container["command"] == ["mlxserve", "serve"]
    assert not [e for e in container.get("env", []) if e["name"].startswith("MLXSERVE_")]
    return config_from_args(server_parser().parse_args(container["args"]))


def named_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def test_ports_and_probes_match_the_server(container: dict[str, Any], config: ServerConfig) -> None:
    assert config.transport.host == "0.0.0.0"  # reachable from outside the pod
    assert named_port(container, "grpc") == config.transport.port
    assert config.observability.metrics_port is not None
    assert named_port(container, "metrics") == config.observability.metrics_port
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = container[kind]["grpc"]
        assert probe["port"] == config.transport.port, kind
        assert probe["service"] in HEALTH_NAMES, kind
    # Readiness names the generation service: a replica that cannot generate takes no calls.
    assert container["readinessProbe"]["grpc"]["service"] == SERVICE_NAME


def test_grace_period_covers_the_drain(
    manifests: dict[str, dict[str, Any]], container: dict[str, Any], config: ServerConfig
) -> None:
    pod = manifests["Deployment"]["spec"]["template"]["spec"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    # After SIGTERM: the drain, the last messages of what it ended, the server's stop grace,
    # then each engine-core rank's stop, one after the other.
    stops = config.model.tensor_parallel * CORE_STOP_TIMEOUT_S
    needed = pre_stop + config.frontend.drain_timeout + 2 * DRAIN_LAST_MESSAGES_S + stops
    assert config.frontend.api_workers == 1  # more front ends add their own join time
    assert pod["terminationGracePeriodSeconds"] >= needed
    # ... and not far beyond it: the grace period is what a stuck pod costs a rollout.
    assert pod["terminationGracePeriodSeconds"] <= needed + 30


def test_service_and_budget_select_the_pods(
    manifests: dict[str, dict[str, Any]], container: dict[str, Any], config: ServerConfig
) -> None:
    deployment = manifests["Deployment"]["spec"]
    labels = deployment["template"]["metadata"]["labels"]
    assert deployment["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["replicas"] >= 2

    service = manifests["Service"]["spec"]
    assert service["clusterIP"] == "None"  # headless: DNS lists every ready replica
    assert service["selector"].items() <= labels.items()
    (port,) = service["ports"]
    assert port["port"] == config.transport.port and port["appProtocol"] == "grpc"
    assert port["targetPort"] == "grpc" and named_port(container, "grpc") == config.transport.port

    budget = manifests["PodDisruptionBudget"]["spec"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()
    assert budget["maxUnavailable"] == 1


def test_a_flag_the_server_lacks_is_caught(container: dict[str, Any]) -> None:
    """What the config fixture relies on: the server's parser, with abbreviations off,
    refuses a flag it does not have."""
    with pytest.raises(SystemExit):
        server_parser().parse_args([*container["args"], "--drain-timout=30"])
