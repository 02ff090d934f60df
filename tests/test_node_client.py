"""A client in another language: `buf generate` (buf.gen.yaml) makes JavaScript/TypeScript code
from the .proto, and a Node program on it (connect-es over gRPC) streams from the real server,
cancels a stream mid-way and sees the cancellation in CacheStats."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from google.protobuf import json_format

from mlxserve.v1 import generation_pb2 as pb
from tests.helpers.requests import chat_request

ROOT = Path(__file__).resolve().parent.parent
NODE_MODULES = ROOT / ".tools" / "node_modules"
NODE_PACKAGES = (
    "@bufbuild/buf",
    "@bufbuild/protoc-gen-es",
    "@bufbuild/protobuf",
    "@connectrpc/connect",
    "@connectrpc/connect-node",
)


def _missing() -> str | None:
    if shutil.which("node") is None or shutil.which("npm") is None:
        return "node/npm not found: the Node client test needs Node 20 and npm"
    absent = [p for p in NODE_PACKAGES if not (NODE_MODULES / p / "package.json").exists()]
    if absent:
        return f"{', '.join(absent)} not in .tools/node_modules (make install brings them)"
    return None


pytestmark = [
    pytest.mark.slow,
    pytest.mark.model,
    pytest.mark.skipif(_missing() is not None, reason=str(_missing())),
]


def _generate(out: Path) -> Path:
    """`buf generate` with the repository's buf.gen.yaml into `out`; returns the es folder."""
    env = {**os.environ, "PATH": f"{NODE_MODULES / '.bin'}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        [str(NODE_MODULES / ".bin" / "buf"), "generate", "--output", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out / "gen" / "es"


def test_buf_gen_yaml_makes_typescript_and_javascript(tmp_path: Path) -> None:
    es = _generate(tmp_path) / "mlxserve" / "v1"
    assert sorted(p.name for p in es.iterdir()) == ["generation_pb.d.ts", "generation_pb.js"]
    declarations = (es / "generation_pb.d.ts").read_text()
    for rpc in ("generate", "streamGenerate", "cacheStats", "getModelInfo", "tokenize"):
        assert f"{rpc}: {{" in declarations


def test_node_client_streams_and_cancels(server, stub, tmp_path: Path) -> None:
    _generate(tmp_path)
    # The generated code imports @bufbuild/protobuf: Node finds packages by walking up from
    # the importing file, so the run folder gets the installed node_modules beside gen/.
    (tmp_path / "node_modules").symlink_to(NODE_MODULES, target_is_directory=True)
    shutil.copy(Path(__file__).parent / "node" / "generation_client.mjs", tmp_path)
    result = subprocess.run(
        ["node", "generation_client.mjs", server.target],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)

    def stats(name: str) -> pb.CacheStatsResponse:
        return json_format.ParseDict(report[name], pb.CacheStatsResponse())

    before, during, after = stats("before"), stats("during"), stats("after")

    # The streamed generation is what the Python stub gets for the same request.
    streamed = report["streamed"]
    expected = stub.Generate(chat_request("What is the capital of France?", max_tokens=12))
    assert streamed["text"] == expected.text
    assert streamed["tokenIds"] == list(expected.token_ids)
    assert streamed["finishReason"] == pb.FinishReason.Name(expected.finish_reason).removeprefix(
        "FINISH_REASON_"
    )
    assert streamed["completionTokens"] == len(expected.token_ids)
    assert streamed["messages"] >= 2  # a stream, not one message

    # The abort reached the server: the client saw CANCELLED, the sequence ended as
    # cancelled long before its 400 tokens, and it left its slot.
    cancelled = report["cancelled"]
    assert cancelled["code"] == "Canceled"
    assert 3 <= cancelled["tokens"] < 400
    assert "node-cancel" in {s.request_id for s in during.slots}
    assert during.active_blocks > 0
    record = server.finished_record("node-cancel")
    assert record["finish_reason"] == "cancelled"
    assert record["completion_tokens"] < 400
    assert "node-cancel" not in {s.request_id for s in after.slots}
    assert after.active_sequences == 0
    assert after.total_completed == before.total_completed + 2  # the stream and the cancelled
    # No leaked KV blocks: nothing holds a block once both sequences are done.
    assert after.active_blocks == before.active_blocks == 0
