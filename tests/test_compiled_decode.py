"""Decode steps replayed from compiled graphs (service.engine.compiled_decode). On the CPU the
replay writes the pool functionally; the in-place CUDA variant is exercised, overlapped, by
tests/test_paged_attention.py where MLX's CUDA backend is present."""

from __future__ import annotations

import mlx.core as mx
import pytest

from service.engine import engine as engine_module
from service.engine.engine import Engine, StepRow
from tests.test_kv_paged import LAYERS, PROMPTS, generate, paged, tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def test_compiled_decode_steps_give_the_logits_of_the_op_by_op_forward(model, monkeypatch):
    """Rows of different lengths decoding together, then a row leaving (a new batch shape):
    every step's logits from the replayed compiled graph match the op-by-op forward's."""
    seen: list[mx.array] = []
    original = engine_module.sample

    def recording_sample(logits, states):
        seen.append(logits)
        return original(logits, states)

    monkeypatch.setattr(engine_module, "sample", recording_sample)
    logits = {}
    for compiled in (False, True):
        seen.clear()
        engine = Engine(model, paged(), LAYERS, direct_decode=True, compile_decode=compiled)
        seqs, _ = generate(engine, PROMPTS, steps=12, tag=f"c{compiled}")
        engine.release(seqs[0])
        for _ in range(6):
            engine.step([StepRow(s) for s in seqs[1:]])
        logits[compiled] = [mx.array(x) for x in seen]
    assert len(logits[True]) == len(logits[False]) == 1 + 12 + 6
    for got, want in zip(logits[True], logits[False]):
        assert got.shape == want.shape
        assert mx.abs(got - want).max().item() < 1e-4


def test_compiled_decode_needs_direct_decode(model):
    with pytest.raises(ValueError, match="direct decode"):
        Engine(model, paged(), LAYERS, compile_decode=True)
