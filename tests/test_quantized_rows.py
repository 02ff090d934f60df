"""bench/quantized_rows.py: the chain computes the product in order for each form; the run
writes a row per shape and batch with the three timings."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np

from bench import quantized_rows


def test_the_chain_gives_the_product_of_its_input_each_time() -> None:
    w = mx.random.normal((6, 8))
    x = mx.random.normal((3, 8))
    out = quantized_rows.chain(lambda v: v @ w.T, x, 4)()
    assert out.shape == (4, 3, 6)
    for step in np.array(out):
        np.testing.assert_allclose(step, np.array(x @ w.T), rtol=1e-5, atol=1e-5)


def test_a_run_writes_each_shape_and_batch(tmp_path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--batch", "1,3", "--shapes", "64x64", "--dtype", "float32", "--group-size", "32"]
    assert quantized_rows.main([*argv, "--chain", "2", "--reps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [(r["out"], r["in"], r["batch"]) for r in results] == [(64, 64, 1), (64, 64, 3)]
    for r in results:
        assert set(r["ms"]) == {"rows_3d", "rows_2d", "dequantized", "dense"}
        assert all(ms > 0 for ms in r["ms"].values())
