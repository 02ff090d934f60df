"""Tensor parallel on the CPU: the ring backend's local processes, served through gRPC.

A tiny seeded llama with 4 heads and 2 K/V heads at TP=2, and the embedded SmolLM2 (9 heads,
3 K/V heads) at TP=3: concurrent greedy requests (one with a response format) give the tokens
of one rank (mlx-lm alone for the tiny model, a TP=1 server for SmolLM2), with the logprob
margin reported; cancellation and preemption behave as with one rank; a killed rank ends the
open RPCs with UNAVAILABLE and the server exits non-zero; impossible sizes are refused at start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import adapters, model_zoo
from tests.helpers.paths import REPO_ROOT
from tests.helpers.processes import children
from tests.helpers.requests import chat_request, to_stream
from tests.helpers.server import ServerProcess, free_port, running_server, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.model]

TP_LLAMA = model_zoo.Family(
    "llama_tp",
    "TinyLlama/TinyLlama-1.1B-Chat-v1.0, with 4 heads and 2 K/V heads (splits 2 ways)",
    {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 176,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
    },
    seed=5,
)


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory):
    return model_zoo.build(TP_LLAMA, tmp_path_factory.mktemp("tp"))


@pytest.fixture(scope="module")
def tp2_server(tp_model) -> Iterator[ServerProcess]:
    """The tiny llama at TP=2, up to 4 rows: the batched test's, then the killed rank's (which
    ends it: the test right after)."""
    with running_server(
        "--model", str(tp_model), "--tensor-parallel", "2", "--parallel", "4",
        "--log-format", "json", "--dtype", "float32",
    ) as server:  # fmt: skip
        yield server


def test_tp2_batched_greedy_equals_one_rank(tp_model, tp2_server: ServerProcess) -> None:
    """Concurrent requests give one rank's tokens; then a prompt sharing prefix_a's first two
    blocks adopts them on every rank (rank 0's block tables travel with each step) and still
    gives one rank's tokens."""
    everything = model_zoo.prompts(TP_LLAMA)
    want = model_zoo.reference(tp_model, everything, max_tokens=12)
    prompts = {k: v for k, v in everything.items() if k != "prefix_b"}
    server = tp2_server
    sharded = [r for r in server.records() if r.get("event") == "model sharded"]
    assert {r["rank"] for r in sharded} == {0, 1}
    assert all(r["kv_heads_per_rank"] == 1 for r in sharded)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        futures = {
            name: stub.Generate.future(model_zoo.request(ids, name, 12), timeout=120)
            for name, ids in prompts.items()
        }
        margin = 0.0
        for name, future in futures.items():
            got = future.result()
            assert list(got.token_ids) == want[name].token_ids, name
            margin = max(
                margin,
                *(abs(a.logprob - b) for a, b in zip(got.logprobs, want[name].logprobs)),
            )
        print(f"TP=2 vs one rank: tokens equal, largest logprob difference {margin:.2e}")
        assert margin < 1e-4
        adopting = stub.Generate(
            model_zoo.request(everything["prefix_b"], "prefix_b", 12), timeout=120
        )
        assert adopting.usage.cached_tokens == 32
        assert list(adopting.token_ids) == want["prefix_b"].token_ids
        stats = stub.CacheStats(pb.CacheStatsRequest(), timeout=10)
        assert stats.active_sequences == 0 and stats.active_blocks == 0


def test_a_killed_rank_ends_the_rpcs_and_the_server(tp2_server: ServerProcess) -> None:
    """The last test on tp2_server: SIGKILL its follower rank mid-stream; the stream ends with
    UNAVAILABLE at once and the server exits 3."""
    server = tp2_server
    ranks = [c for c in children(server.proc.pid) if "libmlx" in _maps(c)]
    assert len(ranks) == 2
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        request = to_stream(model_zoo.request(list(range(300, 320)), "tp-kill", 2000))
        call = stub.StreamGenerate(request, timeout=60)
        next(call)
        follower = max(ranks)  # started after rank 0
        os.kill(follower, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - started < 15
    assert server.wait(30) == 3


def test_tp2_cancellation_and_preemption(tp_model) -> None:
    """A cancelled stream frees its slot on every rank (the next requests still match); a
    high-priority request preempts a running one, which resumes and still gets its tokens."""
    prompts = model_zoo.prompts(TP_LLAMA)
    want = model_zoo.reference(tp_model, {"long": prompts["long"]}, max_tokens=150)["long"]
    with (
        running_server(
            "--model", str(tp_model), "--tensor-parallel", "2", "--max-batch-size", "1",
            "--enable-preemption", "--log-format", "json", "--dtype", "float32",
        ) as server,
        grpc.insecure_channel(server.target) as channel,
    ):  # fmt: skip
        stub = pb_grpc.GenerationServiceStub(channel)
        stream_request = to_stream(model_zoo.request(prompts["short"], "tp-cancel", 200))
        call = stub.StreamGenerate(stream_request, timeout=60)
        next(call)
        call.cancel()
        wait_idle(stub, 10)  # the cancelled row has left
        low = stub.StreamGenerate(
            to_stream(model_zoo.request(prompts["long"], "tp-low", 150)),
            timeout=120,
        )
        first = next(low)  # running
        high = model_zoo.request(prompts["late"], "tp-high", 4)
        high.priority = 5
        assert len(stub.Generate(high, timeout=120).token_ids) == 4
        got = [t for m in [first, *low] for t in m.token_ids]
        assert got == want.token_ids
        assert stub.CacheStats(pb.CacheStatsRequest(), timeout=10).preemptions >= 1


def test_tp2_serves_lora_adapters_sharded_like_their_layers(tiny_adapters) -> None:
    """Adapters trained with mlx-lm on a 4-head llama (LoRA on every projection, on q/v and the
    LM head; DoRA on the MLP and o_proj, whose input is sharded) at TP=2: concurrent requests of
    every adapter and none get mlx-lm's tokens for their adapter (one rank), and an adapter
    loaded at run time is loaded on both ranks."""
    names = ("all7", "qv_head", "dora_mlp")
    work = tiny_adapters
    prompts = [adapters.prompts(1, seed=10 + i, length=6 + i)[0] for i in range(8)]
    rows = [(name, prompts[i]) for i, name in enumerate([*names, ""] * 2)]
    flags = [f"--adapter={n}={work / 'adapters' / n}" for n in names]
    with (
        running_server(
            "--model", str(work / "f"), "--tensor-parallel", "2", "--max-batch-size", "4",
            *flags, "--dtype", "float32",
        ) as server,
        grpc.insecure_channel(server.target) as channel,
    ):  # fmt: skip
        stub = pb_grpc.GenerationServiceStub(channel)

        def request(name: str, ids: list[int]) -> pb.GenerateRequest:
            message = model_zoo.request(ids, f"{name}-{len(ids)}", 10)
            message.adapter = name
            return message

        futures = [stub.Generate.future(request(n, p), timeout=180) for n, p in rows]
        margin = 0.0
        for (name, ids), future in zip(rows, futures):
            path = work / "adapters" / name if name else None
            want = adapters.mlx_lm_generate(work / "f", path, ids, 10)
            got = future.result()
            assert list(got.token_ids) == want.tokens, name
            chosen = [float(want.logprobs[i, t].item()) for i, t in enumerate(want.tokens)]
            margin = max(margin, *(abs(a.logprob - b) for a, b in zip(got.logprobs, chosen)))
        assert margin < 1e-3
        stub.LoadAdapter(
            pb.LoadAdapterRequest(name="late", path=str(work / "adapters" / "qv_head")),
            timeout=120,
        )
        want = adapters.mlx_lm_generate(work / "f", work / "adapters" / "qv_head", prompts[0], 10)
        assert list(stub.Generate(request("late", prompts[0]), timeout=120).token_ids) == (
            want.tokens
        )
    print(f"TP=2 with adapters: max |logprob - mlx-lm| = {margin:.2g}")


def test_smollm2_tp3_gives_the_tokens_of_one_rank(stub) -> None:
    """The embedded model's 9 heads and 3 K/V heads, one of each per rank; a request with a
    response format beside the free ones (rank 0 fills the masks, every rank applies them)."""
    questions = ["What is the capital of France?", "Name a primary color."]
    requests = [chat_request(q, max_tokens=4, cache_prompt=False) for q in questions]
    questions.append("Describe a person as JSON.")
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    # As long as the free rows: its first tokens (the document's forced opening) are where the
    # masks decide the most, and where a rank that skipped or mistimed them would diverge.
    requests.append(
        chat_request(
            questions[-1],
            max_tokens=4,
            cache_prompt=False,
            response_format=pb.ResponseFormat(json_schema=json.dumps(schema)),
        )
    )
    want = [stub.Generate(r, timeout=120) for r in requests]  # the shared TP=1 server
    with (
        running_server("--tensor-parallel", "3", "--log-format", "json") as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        tp = pb_grpc.GenerationServiceStub(channel)
        futures = [tp.Generate.future(r, timeout=300) for r in requests]
        for question, future, w in zip(questions, futures, want):
            assert list(future.result().token_ids) == list(w.token_ids), question


def _maps(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/maps") as f:
            return f.read()
    except OSError:
        return ""


def _refused(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service", "--port", str(free_port()), *flags],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--tensor-parallel", "3"), "do not split 3 ways"),
        (("--distributed-backend", "nccl", "--tensor-parallel", "2"), "GPU(s) are visible"),
    ],
)
def test_impossible_sizes_are_refused_at_start(tp_model, flags, message) -> None:
    env_gpus = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "service", "--port", str(free_port()), "--model", str(tp_model),
         *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180, env=env_gpus,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr.splitlines()[-1]


def test_a_family_without_sharding_is_refused(tmp_path) -> None:
    gemma = dataclasses.replace(next(f for f in model_zoo.FAMILIES if f.name == "gemma3_text"))
    path = model_zoo.build(gemma, tmp_path)
    result = _refused("--model", str(path), "--tensor-parallel", "2")
    assert result.returncode == 2
    assert "no tensor-parallel sharding" in result.stderr.splitlines()[-1]
