"""bench/cuda_timeline.py's reading of a profiler trace: which events are GPU kernels, and how
busy the GPU was over their span (overlapping kernels counted once); the adapters it serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx
import pytest

from bench.cuda_timeline import kernel_intervals, served_adapters, summarize
from service.core.models.presets import preset_config


def test_only_kernel_events_are_read_in_start_order() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "b", "ts": 30.0, "dur": 5.0},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 1.0, "dur": 2.0},
            {"ph": "X", "cat": "kernel", "name": "a", "ts": 10.0, "dur": 10.0},
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 12.0},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 50.0, "dur": 1.0},
        ]
    }
    assert kernel_intervals(trace) == [(10.0, 20.0, "a"), (30.0, 35.0, "b")]
    assert kernel_intervals({}) == []


def test_busy_time_is_the_union_of_the_kernels_intervals() -> None:
    # 0-10 and 5-15 overlap (15 µs busy), 12-14 lies inside them, 20-30 after a gap:
    # 25 µs busy over a 30 µs span.
    kernels = [(0.0, 10.0, "mm"), (5.0, 15.0, "mm"), (12.0, 14.0, "rope"), (20.0, 30.0, "attn")]
    got = summarize(kernels, steps=2)
    assert got["kernels"] == 4 and got["kernels_per_step"] == 2
    assert got["span_ms"] == pytest.approx(0.030)
    assert got["busy_ms"] == pytest.approx(0.025)
    assert got["busy_share"] == pytest.approx(25 / 30)
    assert got["busy_ms_per_step"] == pytest.approx(0.0125)
    assert [(k["name"], k["count"]) for k in got["top"]] == [("mm", 2), ("attn", 1), ("rope", 1)]
    assert got["top"][0]["total_ms"] == pytest.approx(0.020)
    assert summarize([], steps=3) == {"kernels": 0}


def test_the_served_adapters_are_mlx_lm_adapters_on_every_projection() -> None:
    """--adapters: each is a directory as `mlx_lm lora` writes it, of --rank on the seven
    projections of every layer of the preset, each with its own weights."""
    assert served_adapters(argparse.Namespace(adapters=0, rank=4, preset="smollm2-135m")) == ()
    pairs = served_adapters(argparse.Namespace(adapters=2, rank=4, preset="smollm2-135m"))
    assert [name for name, _ in pairs] == ["a0", "a1"]
    cfg = preset_config("smollm2-135m")
    weights = []
    for _, path in pairs:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["rank"] == 4
        assert len(config["lora_parameters"]["keys"]) == 7
        tensors = mx.load(str(Path(path) / "adapters.safetensors"))
        assert len(tensors) == cfg["num_hidden_layers"] * 7 * 2
        q = tensors["model.layers.0.self_attn.q_proj.lora_a"]
        assert q.shape == (cfg["hidden_size"], 4)
        weights.append(q)
    assert not mx.array_equal(weights[0], weights[1])
