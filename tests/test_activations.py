"""The CPU SwiGLU (service.core.models.activations): accuracy against float64, the swap of a model's
MLPs, and on the real model the same tokens as mlx-lm's own activation."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from service.core.engine.kv_paged import PagedKVStorage
from service.core.models import activations
from service.core.models.loader import load_model
from service.core.models.presets import dummy_model
from tests.helpers.tiny import generate, make_engine


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
    model = dummy_model("tiny", mx.float32)[0]
    names = sorted(k for k, _ in tree_flatten(model.parameters()))
    tokens = mx.array([[5, 9, 2, 7, 1, 3, 8, 4, 6, 0, 11, 12]])  # >= FAST_MIN_ROWS: fast path
    before = model(tokens)
    assert activations.install(model) == len(model.layers)
    assert all(isinstance(layer.mlp, activations.FastSwiGLUMLP) for layer in model.layers)
    assert sorted(k for k, _ in tree_flatten(model.parameters())) == names
    np.testing.assert_allclose(np.array(model(tokens)), np.array(before), rtol=1e-5, atol=1e-5)
    assert activations.install(model) == 0  # already swapped: nothing left to do


def test_install_leaves_half_precision_models_alone():
    model = dummy_model("tiny", mx.bfloat16)[0]
    assert activations.install(model) == 0


@pytest.mark.slow
@pytest.mark.model
def test_fast_activations_give_mlx_lm_tokens_on_the_real_model():
    """The embedded model, eight prompts of different lengths decoding together (so prefill
    and decode steps take the fast path): the same greedy token ids as mlx-lm's own SwiGLU."""
    model = load_model(None, "float32").model  # loaded once: the swap keeps its weights
    outs = {}
    for fast in (False, True):
        if fast:
            assert activations.install(model) == 30  # every SmolLM2 layer
        storage = PagedKVStorage(30, 3, 64, mx.float32, num_blocks=128, block_size=16)
        engine = make_engine(model, storage)
        prompts = [[1, *range(100 + 7 * i, 110 + 11 * i)] for i in range(8)]
        outs[fast] = generate(engine, prompts, steps=16)[1]
    assert outs[True] == outs[False]


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None,
    reason="no C++ compiler: MLX runs compiled functions unfused",
)
def test_install_builds_the_fused_kernels_before_the_first_forward(tmp_path: Path) -> None:
    """MLX compiles a fused CPU kernel on its first use and caches it under $TMPDIR: from an
    empty cache, `install` builds them all, so the model's first forward (past FAST_MIN_ROWS
    rows, then one row) finds nothing left to build."""
    script = (
        "import pathlib, sys\n"
        "import mlx.core as mx\n"
        "from service.core.models import activations\n"
        "from service.core.models.presets import dummy_model\n"
        "model = dummy_model('tiny', mx.float32)[0]\n"
        "activations.install(model)\n"
        "def built(): return len(list(pathlib.Path(sys.argv[1]).rglob('*.so')))\n"
        "before = built()\n"
        "mx.eval(model(mx.array([list(range(12))] * 9)))\n"
        "mx.eval(model(mx.array([[3]])))\n"
        "print(before, built())\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    before, after = (int(n) for n in out.stdout.split())
    assert before > 0 and after == before
