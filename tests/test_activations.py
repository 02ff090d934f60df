"""The CPU SwiGLU (service.models.activations): accuracy against float64, the swap of a model's
MLPs, and on the real model through gRPC the same tokens as mlx-lm's own activation."""

from __future__ import annotations

import json

import grpc
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from service.models import activations
from service.models.presets import dummy_llama
from tests.conftest import ServerProcess, chat_request, running_server


def test_fast_exp_is_within_an_ulp_over_the_float32_range():
    x = np.linspace(-87.0, 88.0, 400_001, dtype=np.float32)
    want = np.exp(x.astype(np.float64))
    got = np.array(activations.fast_exp(mx.array(x))).astype(np.float64)
    assert np.max(np.abs(got - want) / want) < 2.5e-7  # float32 epsilon is 1.2e-7


def test_fast_exp_clamps_instead_of_overflowing():
    got = np.array(activations.fast_exp(mx.array([-1e4, -200.0, 200.0, 1e4])))
    assert np.all(np.isfinite(got)) and got[0] > 0 and got[0] < 1e-37 and got[-1] > 1e38


def test_fast_swiglu_matches_silu_times_up():
    gate = mx.array(np.linspace(-120.0, 120.0, 100_001, dtype=np.float32))
    up = mx.random.normal(gate.shape)
    want = np.array(nn.silu(gate) * up)
    got = np.array(activations.fast_swiglu(gate, up))
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_install_swaps_float32_mlps_and_keeps_the_weights_and_the_output():
    model = dummy_llama("tiny", mx.float32)
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    tokens = mx.array([[5, 9, 2, 7, 1, 3, 8, 4, 6, 0, 11, 12]])  # >= FAST_MIN_ROWS: fast path
    before = model(tokens)
    assert activations.install(model) == len(model.layers)
    assert all(isinstance(layer.mlp, activations.FastSwiGLUMLP) for layer in model.layers)
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names
    np.testing.assert_allclose(np.array(model(tokens)), np.array(before), rtol=1e-5, atol=1e-5)
    assert activations.install(model) == 0  # already swapped: nothing left to do


def test_install_leaves_half_precision_models_alone():
    model = dummy_llama("tiny", mx.bfloat16)
    assert activations.install(model) == 0


@pytest.mark.model
def test_fast_activations_give_mlx_lm_tokens_on_the_real_model(
    server: ServerProcess, stub: pb_grpc.GenerationServiceStub
):
    """The default server (fast SwiGLU on the CPU) and one run with `--activations mlx`:
    three requests decoding together, greedy, the same token ids."""
    loaded = next(json.loads(x) for x in server.lines if '"model loaded"' in x)
    assert loaded["fast_swiglu_layers"] == 30  # every SmolLM2 layer
    questions = ["What is the capital of France?", "Name a primary color.", "What do bees make?"]
    requests = [chat_request(q, max_tokens=24, cache_prompt=False) for q in questions]
    fast = [stub.Generate(r, timeout=120) for r in requests]
    with running_server("--activations", "mlx", "--log-format", "json") as other_server:
        loaded = next(json.loads(x) for x in other_server.lines if '"model loaded"' in x)
        assert loaded["fast_swiglu_layers"] == 0
        with grpc.insecure_channel(other_server.target) as channel:
            other = pb_grpc.GenerationServiceStub(channel)
            futures = [other.Generate.future(r, timeout=120) for r in requests]
            for question, future, want in zip(questions, futures, fast):
                assert list(future.result().token_ids) == list(want.token_ids), question
