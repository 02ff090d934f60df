"""LoRA adapters through the real server: adapters trained here with mlx-lm's trainer on a tiny
seeded llama (and one on the embedded SmolLM2), served with --adapter, chosen per request; each
request gets what `mlx_lm generate --adapter-path` gives, alone and batched with others; the
prefix cache, preemption, cancellation, speculation, metrics and run-time loading keep working;
what cannot be served is refused at start, with the reason."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from client.errors import error_details
from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import adapters as trained
from tests.helpers.adapters import Reference, mlx_lm_generate
from tests.helpers.metrics import metric, scrape_metrics
from tests.helpers.paths import REPO_ROOT
from tests.helpers.requests import to_stream
from tests.helpers.server import ServerProcess, free_port, running_server, wait_idle, wait_until

pytestmark = [pytest.mark.slow]

NAMES = ("all7", "qv_head", "dora_mlp")
STEPS = 8


@pytest.fixture(scope="module")
def work(tiny_adapters: Path) -> Path:
    """The session's tiny bases and adapters (conftest.tiny_adapters)."""
    return tiny_adapters


@pytest.fixture(scope="module")
def server(work: Path) -> Iterator[ServerProcess]:
    flags = [f"--adapter={n}={work / 'adapters' / n}" for n in NAMES]
    with running_server(
        "--model", str(work / "f"), *flags, "--max-batch-size", "4", "--enable-preemption",
        "--draft-kind", "prompt-lookup", "--metrics-port", str(free_port()),
        "--log-format", "json", "--dtype", "float32",
    ) as s:  # fmt: skip
        yield s


@pytest.fixture(scope="module")
def stub(server: ServerProcess) -> Iterator[pb_grpc.GenerationServiceStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.GenerationServiceStub(channel)


def request(
    ids: list[int], adapter: str = "", max_tokens: int = STEPS, **fields
) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIdsInput(ids=ids),
        adapter=adapter,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        logprobs=True,
        **fields,
    )


def reference(work: Path, adapter: str, ids: list[int], steps: int = STEPS) -> Reference:
    return mlx_lm_generate(work / "f", work / "adapters" / adapter if adapter else None, ids, steps)


def assert_is(response: pb.GenerateResponse, ref: Reference, what: object = "") -> None:
    """mlx-lm's tokens, and its logprobs to float tolerance."""
    assert list(response.token_ids) == ref.tokens, what
    want = [float(ref.logprobs[i, t].item()) for i, t in enumerate(ref.tokens)]
    got = [lp.logprob for lp in response.logprobs]
    assert np.allclose(got, want, atol=1e-4), (what, np.abs(np.subtract(got, want)).max())


def test_each_adapter_alone_is_mlx_lm_with_that_adapter(work: Path, stub) -> None:
    prompt = trained.prompts(1, seed=31, length=9)[0]
    base = reference(work, "", prompt)
    for name in (*NAMES, ""):
        ref = reference(work, name, prompt)
        if name:
            assert ref.tokens != base.tokens, f"{name} does not change greedy output"
        assert_is(stub.Generate(request(prompt, name), timeout=60), ref, name)


def test_requests_of_several_adapters_share_decode_steps(work: Path, stub) -> None:
    """Eight concurrent requests over three adapters and the base: the batch holds rows of
    several adapters at once (CacheStats' slots say so), and each request gets mlx-lm's
    output for its adapter."""
    names = [*NAMES, ""] * 2
    prompts = [trained.prompts(1, seed=40 + i, length=4 + 2 * i)[0] for i in range(len(names))]
    futures = [
        stub.Generate.future(request(p, n, max_tokens=24, request_id=f"mix{i}"), timeout=120)
        for i, (n, p) in enumerate(zip(names, prompts))
    ]

    def mixed() -> bool:
        slots = stub.CacheStats(pb.CacheStatsRequest(), timeout=5).slots
        return len({s.adapter for s in slots if s.state == pb.SLOT_STATE_DECODING}) >= 3

    wait_until(mixed, "rows of three adapters decoding together", timeout=60)
    for i, (future, name, prompt) in enumerate(zip(futures, names, prompts)):
        assert_is(future.result(), reference(work, name, prompt, 24), (i, name))


def test_streaming_with_an_adapter(work: Path, stub) -> None:
    prompt = trained.prompts(1, seed=7)[0]
    message = to_stream(request(prompt, "dora_mlp"))
    tokens = [t for m in stub.StreamGenerate(message, timeout=60) for t in m.token_ids]
    assert tokens == reference(work, "dora_mlp", prompt).tokens


def test_an_unknown_adapter_is_refused_naming_the_served_ones(stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Generate(request([5, 6, 7], "nope", request_id="unknown"), timeout=30)
    details = error_details(caught.value)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "'nope' is not served; served adapters: all7, qv_head, dora_mlp" in details.message
    assert details.reason == "ADAPTER_NOT_FOUND"


def test_model_info_lists_the_adapters(stub) -> None:
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    adapters = {a.name: a for a in info.adapters}
    assert list(adapters) == list(NAMES)
    assert [adapters[n].rank for n in NAMES] == [8, 4, 16]
    assert adapters["dora_mlp"].fine_tune_type == "dora"
    assert list(adapters["qv_head"].target_modules) == sorted(trained.ATTENTION_HEAD)
    assert adapters["qv_head"].num_layers == 1 and adapters["all7"].num_layers == 2
    assert all(a.memory_bytes > 0 and a.path.endswith(a.name) for a in adapters.values())


def test_prefix_cache_blocks_are_shared_only_under_the_same_adapter(work: Path, stub) -> None:
    prompt = trained.prompts(1, seed=50, length=40)[0]
    cached = {}
    for label, name in [("all7", "all7"), ("base", ""), ("qv", "qv_head"), ("all7 again", "all7")]:
        response = stub.Generate(request(prompt, name), timeout=60)
        cached[label] = response.usage.cached_tokens
        assert_is(response, reference(work, name, prompt), label)
    assert cached["all7"] == cached["base"] == cached["qv"] == 0
    assert cached["all7 again"] >= 32  # two 16-token blocks of all7's own


def test_preempted_rows_resume_with_their_adapters(work: Path, stub) -> None:
    before = stub.CacheStats(pb.CacheStatsRequest(), timeout=5).preemptions
    names = [*NAMES, "all7"]
    prompts = [trained.prompts(1, seed=60 + i, length=6)[0] for i in range(4)]
    low = [
        stub.Generate.future(request(p, n, max_tokens=40, priority=0), timeout=120)
        for n, p in zip(names, prompts)
    ]
    wait_until(
        lambda: len(stub.CacheStats(pb.CacheStatsRequest(), timeout=5).slots) == 4,
        "four rows running",
    )
    urgent_prompt = trained.prompts(1, seed=70)[0]
    urgent = stub.Generate(request(urgent_prompt, "qv_head", priority=5), timeout=120)
    assert_is(urgent, reference(work, "qv_head", urgent_prompt), "urgent")
    for future, name, prompt in zip(low, names, prompts):
        assert_is(future.result(), reference(work, name, prompt, 40), name)
    assert stub.CacheStats(pb.CacheStatsRequest(), timeout=5).preemptions > before


def test_speculation_verifies_drafts_with_the_rows_adapter(work: Path, stub) -> None:
    """A prompt that repeats the adapter's own continuation: prompt-lookup drafts it, the
    verification forward (with the row's adapter) accepts it, and the tokens stay mlx-lm's."""
    wait_idle(stub)
    # A prompt whose repeat the model (by mlx-lm) continues as it did the first time, for the
    # first token (sampled by the prefill) and the second (the first draft's first): which seeds
    # do depends on the CPU's rounding, so take the first of a few.
    for seed in range(80, 90):
        prompt = trained.prompts(1, seed=seed, length=6)[0]
        continuation = reference(work, "all7", prompt, 12).tokens
        repeating = [*prompt, *continuation, *prompt]
        if reference(work, "all7", repeating, 12).tokens[:2] == continuation[:2]:
            break
    else:
        pytest.fail("no prompt's repeat continues like the prompt")
    response = stub.Generate(request(repeating, "all7", max_tokens=12), timeout=60)
    assert response.usage.drafted_tokens > 0 and response.usage.accepted_tokens > 0
    assert_is(response, reference(work, "all7", repeating, 12), "speculated")


def test_metrics_count_requests_and_tokens_by_adapter(server: ServerProcess, stub) -> None:
    port = next(
        r["address"].rsplit(":", 1)[1] for r in server.records() if r.get("event") == "metrics on"
    )
    stub.Generate(request([9, 8, 7], "qv_head", max_tokens=3), timeout=60)
    with pytest.raises(grpc.RpcError):
        stub.Generate(request([9, 8, 7], "nope"), timeout=60)
    samples = scrape_metrics(f"http://127.0.0.1:{port}/metrics")
    model = "f"
    done = metric(
        samples,
        "mlxserve_adapter_requests_total",
        model=model,
        adapter="qv_head",
        finish_reason="length",
    )
    assert done >= 1
    tokens = metric(
        samples, "mlxserve_adapter_generation_tokens_total", model=model, adapter="qv_head"
    )
    assert tokens >= 3
    assert metric(samples, "mlxserve_rejections_total", model=model, reason="adapter_not_found")


def test_an_adapter_loaded_at_run_time_serves_and_unloads_after_its_requests(
    work: Path, stub
) -> None:
    """LoadAdapter; a stream with it; UnloadAdapter while it runs (one pending request, new
    requests refused); the stream ends with the adapter's tokens; then it is gone, and a cancelled
    request leaves nothing pending."""
    path = str(work / "adapters" / "qv_head")
    loaded = stub.LoadAdapter(pb.LoadAdapterRequest(name="extra", path=path), timeout=60).adapter
    assert (loaded.name, loaded.rank, loaded.path) == ("extra", 4, path)
    assert "extra" in [a.name for a in stub.GetModelInfo(pb.GetModelInfoRequest()).adapters]
    with pytest.raises(grpc.RpcError) as exists:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="extra", path=path), timeout=60)
    assert exists.value.code() == grpc.StatusCode.ALREADY_EXISTS
    prompt = trained.prompts(1, seed=90)[0]
    stream = stub.StreamGenerate(
        to_stream(request(prompt, "extra", max_tokens=30)),
        timeout=120,
    )
    tokens = list(next(stream).token_ids)
    unloading = stub.UnloadAdapter(pb.UnloadAdapterRequest(name="extra"), timeout=30)
    assert unloading.pending_requests == 1
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(request(prompt, "extra"), timeout=30)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    tokens += [t for m in stream for t in m.token_ids]
    assert tokens == reference(work, "qv_head", prompt, 30).tokens
    assert "extra" not in [a.name for a in stub.GetModelInfo(pb.GetModelInfoRequest()).adapters]
    # Loaded again (into the freed slot), cancelled mid-stream: nothing left to wait for.
    stub.LoadAdapter(pb.LoadAdapterRequest(name="extra", path=path), timeout=60)
    stream = stub.StreamGenerate(
        to_stream(request(prompt, "extra", max_tokens=200)),
        timeout=120,
    )
    next(stream)
    stream.cancel()
    wait_idle(stub)
    assert stub.UnloadAdapter(pb.UnloadAdapterRequest(name="extra")).pending_requests == 0
    with pytest.raises(grpc.RpcError) as gone:
        stub.UnloadAdapter(pb.UnloadAdapterRequest(name="extra"), timeout=30)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_load_that_cannot_be_served_is_refused_with_the_reason(
    work: Path, stub, tmp_path
) -> None:
    full = trained.copy_adapter(
        work / "adapters" / "all7",
        tmp_path / "full",
        config_edit=lambda c: c.update(fine_tune_type="full"),
    )
    with pytest.raises(grpc.RpcError) as caught:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="full", path=str(full)), timeout=60)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "full fine-tune" in caught.value.details()
    with pytest.raises(grpc.RpcError) as bad_name:
        stub.LoadAdapter(pb.LoadAdapterRequest(name="a b", path=str(full)), timeout=60)
    assert bad_name.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- refused at start ----------------------------------------------------------------------------


def refused_at_start(*flags: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "service", "--port", str(free_port()), *flags],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    return result.stderr.strip().splitlines()[-1]


def test_adapters_that_cannot_be_served_are_refused_at_start(work: Path, tmp_path: Path) -> None:
    full = trained.copy_adapter(
        work / "adapters" / "all7",
        tmp_path / "full",
        config_edit=lambda c: c.update(fine_tune_type="full"),
    )
    line = refused_at_start("--model", str(work / "f"), "--adapter", f"ft={full}")
    assert line.startswith("error: adapter 'ft'") and "full fine-tune" in line
    # Trained on another base: the embedding is wider.
    wide = trained.build_base(tmp_path / "wide", trained.TINY_LLAMA | {"hidden_size": 96})
    data = trained.dataset(tmp_path / "data", seed=2)
    settings = {"num_layers": 1, "lora_parameters": {"rank": 4, "scale": 10.0, "dropout": 0.0}}
    other = trained.train(wide, data, tmp_path / "other", settings, iters=1)
    line = refused_at_start("--model", str(work / "f"), "--adapter", f"other={other}")
    assert "does not fit the served model" in line and "(96, 4) does not match (64, 4)" in line
    line = refused_at_start("--model", str(work / "f"), "--adapter", f"x={tmp_path / 'none'}")
    assert "no such directory" in line


# -- the embedded model --------------------------------------------------------------------------


@pytest.mark.model
def test_an_adapter_trained_on_the_embedded_model(embedded_lora, embedded_lora_server) -> None:
    """SmolLM2 (no --model) with an adapter trained on it in this session: the server's greedy
    output is mlx-lm's with the adapter, on the same weights; the base rows beside it are
    mlx-lm's without."""
    checkpoint, adapter = embedded_lora
    from mlx_lm import load

    _, tokenizer = load(str(checkpoint))
    prompts = [tokenizer.encode(t) for t in ("the cat sat on a mat and the dog", "old men read")]
    with grpc.insecure_channel(embedded_lora_server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        futures = [
            (name, p, stub.Generate.future(request(p, name, max_tokens=10), timeout=300))
            for p in prompts
            for name in ("sql", "")
        ]
        for name, p, future in futures:
            ref = mlx_lm_generate(checkpoint, adapter if name else None, p, 10)
            assert_is(future.result(), ref, (name, p))
    with_adapter = mlx_lm_generate(checkpoint, adapter, prompts[0], 10).tokens
    assert with_adapter != mlx_lm_generate(checkpoint, None, prompts[0], 10).tokens


@pytest.mark.model
def test_structured_output_with_an_adapter(embedded_lora, embedded_lora_server) -> None:
    """A response format and an adapter on one request, in a batch with other kinds of rows:
    a choice of one-character options is the option mlx-lm's logits with that adapter rank first
    (and the base's without), a regex reply full-matches, and the free adapter row beside them
    is still mlx-lm's."""
    import re

    checkpoint, adapter = embedded_lora
    from mlx_lm import load

    _, tokenizer = load(str(checkpoint))
    prompt = tokenizer.encode("the cat sat on a mat and the dog")
    # One character each: no shorter token spells a prefix, so the first step allows exactly
    # the options' tokens and the greedy pick is their argmax.
    options = [str(d) for d in range(10)]
    option_ids = [tokenizer.encode(o) for o in options]
    assert all(len(ids) == 1 for ids in option_ids), option_ids
    choice = pb.ResponseFormat(choice=pb.ChoiceList(options=options))
    pattern = "[0-9]{2}-[a-z]{3}"
    regex = pb.ResponseFormat(regex=pattern)

    def expected_choice(name: str) -> str:
        first = mlx_lm_generate(checkpoint, adapter if name else None, prompt, 1).logprobs[0]
        scores = [float(first[ids[0]].item()) for ids in option_ids]
        return options[int(np.argmax(scores))]

    with grpc.insecure_channel(embedded_lora_server.target) as channel:
        stub = pb_grpc.GenerationServiceStub(channel)
        rows = [
            ("sql", choice),
            ("", choice),
            ("sql", regex),
            ("", regex),
            ("sql", None),
        ]
        futures = [
            stub.Generate.future(
                request(prompt, name, max_tokens=12, response_format=fmt)
                if fmt is not None
                else request(prompt, name, max_tokens=12),
                timeout=300,
            )
            for name, fmt in rows
        ]
        replies = [f.result() for f in futures]
        for (name, fmt), reply in zip(rows, replies):
            if fmt is choice:
                assert reply.text == expected_choice(name), (name, reply.text)
                assert reply.finish_reason == pb.FINISH_REASON_STOP
            elif fmt is regex:
                assert re.fullmatch(pattern, reply.text), (name, reply.text)
                assert reply.finish_reason == pb.FINISH_REASON_STOP
            else:
                assert_is(reply, mlx_lm_generate(checkpoint, adapter, prompt, 12), name)
        # Each constrained row alone gives what it gave in the batch.
        for (name, fmt), reply in zip(rows[:4], replies):
            alone = stub.Generate(request(prompt, name, max_tokens=12, response_format=fmt))
            assert list(alone.token_ids) == list(reply.token_ids), (name, fmt)


def test_the_cli_chooses_lists_loads_and_unloads_adapters(
    work: Path, server: ServerProcess
) -> None:
    def cli(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "client", "--target", server.target, *argv],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    prompt = trained.prompts(1, seed=3)[0]
    text = " ".join(f"w{t}" for t in prompt)
    done = cli(
        "generate",
        "--raw",
        text,
        "--adapter",
        "all7",
        "--max-tokens",
        "4",
        "--ignore-eos",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["token_ids"] == reference(work, "all7", prompt, 4).tokens
    refused = cli("generate", "--raw", text, "--adapter", "nope")
    assert refused.returncode == 2 and "NOT_FOUND" in refused.stderr
    assert "qv_head" in cli("info").stdout
    path = str(work / "adapters" / "dora_mlp")
    loaded = cli("load-adapter", "cli", path)
    assert loaded.returncode == 0 and "dora" in loaded.stdout
    unloaded = cli("unload-adapter", "cli")
    assert unloaded.returncode == 0 and "0 running" in unloaded.stdout


def test_loading_and_unloading_need_the_token_when_one_is_set(work: Path, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens.txt"
    tokens.write_text("lora-token\n")
    path = str(work / "adapters" / "qv_head")
    auth = [("authorization", "Bearer lora-token")]
    with (
        running_server("--model", str(work / "f"), "--auth-token-file", str(tokens)) as server,
        grpc.insecure_channel(server.target) as channel,
    ):
        stub = pb_grpc.GenerationServiceStub(channel)
        for call in (
            lambda m: stub.LoadAdapter(pb.LoadAdapterRequest(name="q", path=path), metadata=m),
            lambda m: stub.UnloadAdapter(pb.UnloadAdapterRequest(name="q"), metadata=m),
        ):
            with pytest.raises(grpc.RpcError) as caught:
                call(None)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            call(auth)


def test_generate_in_process_with_an_adapter(work: Path) -> None:
    prompt = trained.prompts(1, seed=12)[0]
    adapter = work / "adapters" / "qv_head"
    done = subprocess.run(
        [sys.executable, "-m", "service", "generate", "--model", str(work / "f"),
         "--adapter", f"qv={adapter}", "--use-adapter", "qv", "--raw", "--json",
         "--max-tokens", "6", " ".join(f"w{t}" for t in prompt)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])["token_ids"]
    assert tokens == mlx_lm_generate(work / "f", adapter, prompt, 6).tokens
