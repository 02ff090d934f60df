"""Every model family served through real gRPC gives mlx-lm's own greedy tokens.

For each family of tests/helpers/model_zoo.py (a tiny seeded checkpoint shrunk from a real
config.json), one real server runs with --parallel 4 and gets two phases of concurrent greedy
requests: four prompts of different lengths (one longer than every sliding window, one that
leaves a cached prefix), then a prompt sharing that prefix (over two KV blocks) beside a fresh
one. Each answer must equal mlx-lm's greedy generation of the same prompt alone, token for
token, with logprobs within 1e-4. GetModelInfo must describe the checkpoint (family,
quantization, float dtype).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
from collections.abc import Iterator

import grpc
import mlx.core as mx
import pytest

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers import model_zoo
from tests.helpers.model_zoo import FAMILIES, Family
from tests.helpers.requests import chat_request
from tests.helpers.server import running_server

pytestmark = [pytest.mark.slow, pytest.mark.model]


def _param(family: Family):
    return pytest.param(family, id=family.name)


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("model-zoo")


@pytest.fixture(scope="session")
def zoo_servers() -> Iterator[model_zoo.ServerPrefetch]:
    prefetch = model_zoo.ServerPrefetch()
    yield prefetch
    prefetch.close()


def _next_family(request: pytest.FixtureRequest) -> Family | None:
    """The family of the test that runs next, if it is this same test (another family)."""
    items = request.session.items
    index = items.index(request.node)
    if index + 1 < len(items) and items[index + 1].originalname == request.node.originalname:
        return items[index + 1].callspec.params["family"]
    return None


@pytest.mark.parametrize("family", [_param(f) for f in FAMILIES])
def test_batched_greedy_equals_mlx_lm_alone(
    family: Family, zoo_root, zoo_servers, request: pytest.FixtureRequest
) -> None:
    path = model_zoo.build(family, zoo_root)
    prompts = model_zoo.prompts(family)
    upcoming = _next_family(request)

    def prefetch_next() -> None:
        # The next family's server starts while this one's requests run: a server start
        # leaves part of the CPU idle. Its own test builds it again if this fails.
        if upcoming is not None:
            with contextlib.suppress(Exception):
                zoo_servers.start(model_zoo.build(upcoming, zoo_root))

    expected, run = model_zoo.conformance(path, family, zoo_servers.take(path), prefetch_next)
    # The harness itself: a near-tie in the reference could flip on float noise.
    gap = model_zoo.min_gap(expected)
    assert gap >= model_zoo.MIN_TOP_GAP, f"reference near-tie ({gap:.2e}): change the seed"

    assert run.load_error is None, f"server did not start: {run.load_error}"

    info = run.model_info
    assert info is not None
    assert info.model_id == path.name
    assert info.architecture == family.model_type
    assert info.vocab_size == model_zoo.VOCAB_SIZE
    assert info.num_layers == family.num_layers
    assert info.family == model_zoo.mlx_lm_module(family)
    assert info.dtype == "float32"  # the checkpoints' float parameters, never a packed weight
    quant = family.quantization
    if quant is None:
        assert info.quantization.mode == ""
    else:
        assert (info.quantization.mode, info.quantization.bits) == ("affine", quant.bits)
        # The CPU serves it as float weights (MLX's CPU quantized matmul runs a row at a time).
        assert info.quantization.dequantized == (mx.default_device() == mx.cpu)
        assert info.quantization.group_size == quant.group_size
    assert list(info.eos_token_ids) == [model_zoo.EOS_ID]
    assert info.max_batch_size == 4
    assert info.decode_path == "native batched forward"
    assert run.decode_line == f"Model {path.name} decode path: native batched forward"
    assert info.storage_backend in ("paged", "dense")

    problems = {name: model_zoo.outcome(run, expected, name) for name in prompts}
    failed = {name: problem for name, problem in problems.items() if problem is not None}
    assert not failed, f"differs from mlx-lm alone: {failed}"
    for name, served in run.served.items():
        assert served.response is not None
        usage = served.response.usage
        assert usage.prompt_tokens == len(prompts[name])
        assert usage.completion_tokens == model_zoo.MAX_TOKENS
    cached = run.served["prefix_b"].response.usage.cached_tokens
    if not family.recurrent:
        # Two full 16-token blocks of the shared prefix were adopted, not recomputed.
        assert cached >= 32, f"prefix_b adopted {cached} cached tokens"
    if quant is not None:
        assert info.quantization.overrides == model_zoo.expected_overrides(path)


@pytest.mark.parametrize(
    "family", [pytest.param(f, id=f.name) for f in FAMILIES if f.window is not None]
)
def test_long_prompt_depends_on_the_window(family: Family, zoo_root, tmp_path) -> None:
    """The harness can see a window bug: without its window, mlx-lm itself gives the long
    prompt other logprobs (the same weights: the window is no parameter)."""
    windowless = dataclasses.replace(family, config={**family.config, "sliding_window": 4096})
    long = {"long": model_zoo.prompts(family)["long"]}
    windowed = model_zoo.reference(model_zoo.build(family, zoo_root), long)["long"]
    unwindowed = model_zoo.reference(model_zoo.build(windowless, tmp_path), long)["long"]
    assert model_zoo.divergence(unwindowed, windowed) is not None


QUESTION = "What is the capital of France?"
CHAT_TOKENS = 8  # "The capital of France is Paris,"


def test_embedded_model_quantized_by_mlx_lm_answers_paris(zoo_root) -> None:
    from mlx_lm.utils import load

    path = model_zoo.build_embedded_quantized(zoo_root)
    request = chat_request(
        QUESTION,
        max_tokens=CHAT_TOKENS,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(ignore_eos=True),
        logprobs=True,
    )

    def served() -> tuple[pb.TokenizeResponse, pb.GenerateResponse]:
        flags = model_zoo.server_flags(path)
        with running_server(*flags) as s, grpc.insecure_channel(s.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            tokenized = stub.Tokenize(pb.TokenizeRequest(chat=request.chat), timeout=10)
            return tokenized, stub.Generate(request, timeout=120)

    # The server starts and answers on a thread while mlx-lm's reference runs here: the
    # quantized matmuls of each keep one core busy.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        serving = pool.submit(served)
        _, tokenizer = load(str(path))
        messages = [{"role": "user", "content": QUESTION}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        expected = model_zoo.reference(path, {"chat": prompt}, max_tokens=CHAT_TOKENS)["chat"]
        assert "Paris" in tokenizer.decode(expected.token_ids)  # mlx-lm's own answer
        mx.clear_cache()
        tokenized, response = serving.result()
    assert list(tokenized.token_ids) == prompt
    assert "Paris" in response.text
    got = model_zoo.Generation(list(response.token_ids), [lp.logprob for lp in response.logprobs])
    assert model_zoo.divergence(got, expected) is None, model_zoo.divergence(got, expected)


# Llama 4's chunked attention keeps a `ChunkedKVCache` our views do not serve: the model runs
# one sequence at a time on mlx-lm's own caches. Shrunk from
# meta-llama/Llama-4-Scout-17B-16E-Instruct's text_config (chunk 8192 -> 8, 48 -> 4 layers).
LLAMA4 = Family(
    name="llama4_chunked",
    source="meta-llama/Llama-4-Scout-17B-16E-Instruct",
    config={
        "model_type": "llama4",
        "text_config": {
            "model_type": "llama4_text",
            "attention_bias": False,
            "attention_chunk_size": 8,
            "head_dim": 16,
            "hidden_size": 64,
            "interleave_moe_layer_step": 1,
            "intermediate_size": 64,
            "intermediate_size_mlp": 128,
            "max_position_embeddings": 4096,
            "num_attention_heads": 4,
            "num_experts_per_tok": 1,
            "num_hidden_layers": 4,
            "num_key_value_heads": 2,
            "num_local_experts": 2,
            "rms_norm_eps": 1e-5,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
            "rope_theta": 500000.0,
            "use_qk_norm": True,
            "vocab_size": model_zoo.VOCAB_SIZE,
        },
    },
    head="language_model.lm_head",
)


def test_a_model_the_views_cannot_serve_runs_one_sequence_at_a_time(zoo_root) -> None:
    """Clamp, never fail: the server says so at start, reports batch size 1, and concurrent
    requests (one past the attention chunk) each get mlx-lm's tokens alone, and its logprobs
    bit for bit: the same forwards on the same caches (the prompt's last token alone, as
    mlx-lm prefills; on a GPU a product's rounding depends on its row count)."""
    path = model_zoo.build(LLAMA4, zoo_root)
    prompts = {k: v for k, v in model_zoo.prompts(LLAMA4).items() if k in ("short", "long")}
    expected = model_zoo.reference(path, prompts)
    with running_server(*model_zoo.server_flags(path)) as s:
        line = s.wait_for_record(lambda r: "does not support batched decode" in r["event"])
        assert "clamping max_batch_size from 4 to 1" in line["event"]
        assert "ChunkedKVCache" in line["reason"]
        with grpc.insecure_channel(s.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.max_batch_size == 1 and info.storage_backend == "native"
            assert info.decode_path.startswith("batch size 1")
            futures = {
                name: stub.Generate.future(model_zoo.request(ids, name), timeout=120)
                for name, ids in prompts.items()
            }
            for name, future in futures.items():
                got = future.result()
                assert list(got.token_ids) == expected[name].token_ids, name
                assert [a.logprob for a in got.logprobs] == expected[name].logprobs, name
            assert stub.CacheStats(pb.CacheStatsRequest(), timeout=10).active_sequences == 0
