"""Fixtures and pytest hooks; the code they share with the tests is in tests/helpers/.

The tiers are marked explicitly: a test is `slow` (left out of `make test-fast`) if it starts a
process of the service (server, launcher, CLI) or nginx / Prometheus / Node, loads the
embedded model, builds or loads real model checkpoints, or builds a wheel; `model` if it reads
the embedded model's files. The hooks below check the marks where they can: a test that uses
the shared server's fixtures must be marked slow, and only a test marked slow may start a
server.
"""

from __future__ import annotations

import os

# On CUDA, MLX runs float32 matmuls as TF32 by default, and their rounding differs between batch
# sizes by more than the 1e-4 the parity tests allow on logprobs: full float32 for this process
# and the servers it starts (read by MLX at its first matmul).
os.environ.setdefault("MLX_ENABLE_TF32", "0")
os.environ.setdefault("NVIDIA_TF32_OVERRIDE", "0")

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import grpc
import pytest
import pytest_asyncio

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import server as server_helpers
from tests.helpers.certs import SECURED_TOKEN, Pki, make_pki
from tests.helpers.server import ServerProcess, running_server

# The shared server's fixtures: a test that uses one is slow.
_SERVER_FIXTURES = {
    *("server", "channel", "stub", "aio_channel", "aio_stub", "reference"),
    "embedded_lora_server",
    "one_slot_server",
    "secured_server",
}


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """Refuse a test that uses the shared server without its `slow` mark."""
    unmarked = [
        item.nodeid
        for item in items
        if _SERVER_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "tests that use the shared server must be marked slow: " + ", ".join(unmarked)
        )


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Only a test marked slow may start a server (its fixtures included)."""
    server_helpers.servers_allowed = item.get_closest_marker("slow") is not None


@pytest.fixture(scope="session")
def server() -> Iterator[ServerProcess]:
    """The shared real server: embedded SmolLM2, up to 8 rows per decode step."""
    with running_server("--max-batch-size", "8", "--log-format", "json") as s:
        yield s


@pytest.fixture(scope="session")
def channel(server: ServerProcess) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="session")
def stub(channel: grpc.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(channel)


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def aio_channel(server: ServerProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(server.target) as ch:
        yield ch


@pytest.fixture(scope="session")
def aio_stub(aio_channel: grpc.aio.Channel) -> pb_grpc.GenerationServiceStub:
    return pb_grpc.GenerationServiceStub(aio_channel)


@pytest.fixture(scope="session")
def reference(stub: pb_grpc.GenerationServiceStub) -> Callable[[pb.GenerateRequest], Any]:
    """Run a request alone on the shared server, once per distinct request (memoized):
    the expected result of the same request inside a batch."""
    cache: dict[bytes, pb.GenerateResponse] = {}

    def run(request: pb.GenerateRequest) -> pb.GenerateResponse:
        key = request.SerializeToString(deterministic=True)
        if key not in cache:
            cache[key] = stub.Generate(request, timeout=120)
        return cache[key]

    return run


@pytest.fixture(scope="session")
def one_slot_server() -> Iterator[ServerProcess]:
    """The embedded SmolLM2 with one row, preemption, prompt-lookup drafts and a 300 ms compile
    budget for response formats: the preemption tests of speculation and of structured output
    share it (one start instead of two)."""
    flags = [
        "--max-batch-size", "1", "--enable-preemption", "--draft-kind", "prompt-lookup",
        "--max-grammar-compile-ms", "300", "--log-format", "json",
    ]  # fmt: skip
    with running_server(*flags) as s:
        yield s


@pytest.fixture(scope="session")
def secured_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[ServerProcess, Pki]]:
    """The embedded SmolLM2 behind mutual TLS (certificates of the returned Pki) and one bearer
    token (tests.helpers.certs.SECURED_TOKEN): the CLI's and the README's TLS tests share it."""
    directory = tmp_path_factory.mktemp("secured")
    pki = make_pki(directory)
    (directory / "tokens.txt").write_text(f"{SECURED_TOKEN}\n")
    flags = [*pki.server_flags(mutual=True), "--auth-token-file", str(directory / "tokens.txt")]
    with running_server(*flags, credentials=pki.channel_credentials(client_cert=True)) as s:
        yield s, pki


@pytest.fixture(scope="session")
def tiny_adapters(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The tiny seeded bases and every adapter of tests/helpers/adapters.SPECS, trained once in
    this session by mlx-lm's trainer (each with its own seed, so the same whichever test asks
    first): root/<base>, root/adapters/<name>. Read only: a test that edits one copies it."""
    from tests.helpers.adapters import train_all

    return train_all(tmp_path_factory.mktemp("tiny-lora"))


@pytest.fixture(scope="session")
def embedded_lora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """The embedded SmolLM2 as an mlx-lm checkpoint and a tiny LoRA adapter trained on it in
    this session (tests/helpers/adapters.embedded_adapter): (checkpoint, adapter)."""
    from tests.helpers.adapters import embedded_adapter

    return embedded_adapter(tmp_path_factory.mktemp("embedded-lora"))


@pytest.fixture(scope="session")
def embedded_lora_server(embedded_lora: tuple[Any, Any]) -> Iterator[ServerProcess]:
    """The embedded SmolLM2 serving the session's adapter trained on it (embedded_lora) as
    `sql` (the README's name for it), up to 8 rows per decode step. Tests may load other
    adapters at run time but leave `sql` served."""
    _, adapter = embedded_lora
    with running_server("--adapter", f"sql={adapter}", "--max-batch-size", "8") as s:
        yield s
