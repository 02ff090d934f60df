"""Cost of the dense KV storage's per-row write + gather for one decode step, alone.

`DenseKVStorage.write_and_gather` (service/engine/kv_dense.py) runs once per layer per step and
issues a handful of MLX ops per ROW (slice update of K and V into the row's own array, slices,
maybe a pad) plus a stack; a plain mlx-lm `KVCache` issues a few ops per layer whatever the batch
size. This times that part alone for the SmolLM2 shape (30 layers, 3 KV heads, head_dim 64,
~100 cached tokens): Python graph building and evaluation, per step and per row per layer.

    .venv/bin/python bench/kv_write_gather_micro.py
"""

from __future__ import annotations

import time

import mlx.core as mx

from service.engine.batch_view import StepLayout
from service.engine.kv_dense import DenseKVStorage

LAYERS, KV_HEADS, HEAD_DIM, CACHED = 30, 3, 64, 100


def main() -> None:
    for batch in (1, 8, 16, 64):
        storage = DenseKVStorage(LAYERS, KV_HEADS, HEAD_DIM, mx.float32)
        seqs = [storage.new_sequence() for _ in range(batch)]
        prefill = StepLayout(seqs, [0] * batch, [CACHED] * batch)
        k = mx.zeros((batch, KV_HEADS, CACHED, HEAD_DIM))
        for layer in range(LAYERS):
            storage.write_and_gather(layer, prefill, k, k)
        mx.eval([s.keys for s in seqs], [s.values for s in seqs])
        new = mx.ones((batch, KV_HEADS, 1, HEAD_DIM))
        mx.eval(new)
        builds, evals = [], []
        for step in range(20):
            layout = StepLayout(seqs, [CACHED + step] * batch, [1] * batch)
            t0 = time.perf_counter()
            outs = [storage.write_and_gather(layer, layout, new, new) for layer in range(LAYERS)]
            t1 = time.perf_counter()
            mx.eval(outs)
            builds.append(t1 - t0)
            evals.append(time.perf_counter() - t1)
        build = sorted(builds)[len(builds) // 2] * 1000
        run = sorted(evals)[len(evals) // 2] * 1000
        per = (build + run) / batch / LAYERS * 1000
        print(
            f"B={batch:3d}: KV write+gather, {LAYERS} layers: graph build {build:6.2f} ms, "
            f"eval {run:6.2f} ms per step; {per:5.1f} us per row per layer"
        )


if __name__ == "__main__":
    main()
