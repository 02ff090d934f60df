"""bench/host_cost.py: the layouts compute the same step and differ as named; the timing runs."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from bench import host_cost
from bench.decode_primitives import primitives
from service.core.engine.kernel_source import compact
from service.core.models import lora_kernel
from tests.helpers import cuda_source

VIEWS = {"Transpose", "Flatten", "Unflatten", "Reshape"}


def test_the_layouts_compute_the_same_step_and_differ_as_named() -> None:
    """The four plain layouts differ by view primitives only; the fused one has four matmuls a
    layer."""
    steps = host_cost.layout_steps(batch=3, dtype=mx.float32, layers=2)
    fused_fn, fused_x = steps.pop("[B, 1, D] W.T, siblings fused")
    fused = fused_fn(fused_x)
    assert primitives(fused)["Matmul"] == 2 * 4  # four a layer
    outs = {name: fn(x) for name, (fn, x) in steps.items()}
    counts = {name: primitives(out) for name, out in outs.items()}  # before evaluating them
    values = [np.array(out).reshape(3, host_cost.D) for out in outs.values()]
    fused_value = np.array(fused).reshape(3, host_cost.D)
    np.testing.assert_allclose(fused_value, values[0], rtol=1e-4, atol=1e-5)
    for value in values[1:]:
        np.testing.assert_allclose(value, values[0], rtol=1e-4, atol=1e-5)
    work = [{k: n for k, n in c.items() if k not in VIEWS} for c in counts.values()]
    assert all(w == work[0] for w in work)
    views = {name: sum(n for k, n in c.items() if k in VIEWS) for name, c in counts.items()}
    assert views["[B, D] W pre-transposed"] == 2 * 4  # the heads split and joined (2 layers)
    assert views["[B, 1, D] W.T"] > views["[B, 1, D] W pre-transposed"] > 0
    assert views["[B, 1, D] W.T"] > views["[B, D] W.T"] > 0


def test_measure_reports_wall_and_host_time_per_step() -> None:
    chains = host_cost.op_chains(batch=2, dtype=mx.float32, n=3)
    result = host_cost.measure(chains, reps=2, steps=2)
    assert set(result) == set(chains) >= {"RMSNorm", "RMSNorm + 4 views", "matmul + RMSNorm"}
    for r in result.values():
        assert 0 < r["wall_min"] <= r["wall"] <= r["wall_max"]
        assert r["host"] > 0


def test_the_cuda_cases_launch_what_they_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Off CUDA, with MLX's kernel factory recorded: the custom-kernel cases launch one kernel an
    op with the outputs, inputs and header they are named after, and (where nvcc is) compile."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    chains = host_cost.op_chains(batch=2, dtype=mx.float32, n=1)
    names = ["custom kernel", "custom kernel, 7 more inputs", "custom kernel, 3 outputs"]
    names.append("custom kernel, LoRA's header")
    for name in names:
        fn, x = chains[name]
        assert fn(x).shape == x.shape
    launches = recorder.launches
    assert [len(launch.inputs) for launch in launches] == [1, 8, 1, 1]
    assert [len(launch.output_names) for launch in launches] == [1, 1, 3, 1]
    assert [launch.header for launch in launches[:3]] == ["", "", ""]
    assert launches[3].header == compact(lora_kernel.kernel_header())
    if cuda_source.nvcc() is not None:
        compiled = recorder.compile(tmp_path)
        assert len(compiled.registers) == 4, compiled.log
