"""service.core.models.residual_norm: a layer's residual add and the RMSNorm after it as one
kernel. On the CPU, the swapped layers' chaining (each layer's closing sum computed with the next
layer's norm) against mlx-lm's model; on a CUDA host, the kernel against MLX's two ops; with
nvcc, the kernel's source as MLX wraps it."""

from __future__ import annotations

import gc
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import qwen3

from service.core.engine.kernel_source import compact
from service.core.models import lora, lora_kernel, residual_norm
from tests.helpers import cuda_source
from tests.helpers.arrays import assert_same
from tests.helpers.tiny import LAYERS, tiny_llama

cuda_only = pytest.mark.skipif(not residual_norm.available(), reason="needs MLX's CUDA backend")


def _tiny_qwen3() -> nn.Module:
    mx.random.seed(3)
    args = qwen3.ModelArgs(
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=3,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=256,
        max_position_embeddings=512,
        rope_theta=1000000.0,
        head_dim=16,
        tie_word_embeddings=False,
    )
    model = qwen3.Model(args)
    mx.eval(model.parameters())
    return model


@pytest.mark.parametrize("make", [tiny_llama, _tiny_qwen3], ids=["llama", "qwen3"])
def test_fused_layers_give_the_models_own_outputs(make, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layer's adds go through add_rms_norm (the first layer's input norm excepted:
    2 * layers - 1 calls a forward) and the logits are the model's own: bit for bit on the CPU
    (MLX's operations), to float32 roundings on CUDA (the kernel sums the squares in another
    order than MLX's RMSNorm)."""
    model = make()
    tokens = mx.array([[5, 9, 2, 7, 1], [3, 3, 8, 0, 4]])
    want = model(tokens)
    layers = len(model.layers)
    assert residual_norm.install(model) == layers
    calls = []
    fused = residual_norm.add_rms_norm

    def counted(*args):
        calls.append(args[0].shape)
        return fused(*args)

    monkeypatch.setattr(residual_norm, "add_rms_norm", counted)
    got = model(tokens)
    assert len(calls) == 2 * layers - 1
    if mx.cuda.is_available():
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
    else:
        assert mx.array_equal(got, want)
    first = model.layers[0]
    assert type(first).__name__ == "FusedTransformerBlock"
    assert isinstance(first, type(make().layers[0]))  # names, weights and class kept


def test_a_kept_sum_goes_with_its_array() -> None:
    """What a layer keeps for the next one lives as long as the sum it returned, no longer."""
    model = tiny_llama()
    residual_norm.install(model)
    kept = residual_norm._PER_THREAD.sum
    x = mx.random.normal((1, 3, 64))
    out = model.layers[0](x)
    parts = kept.payload_of(out)
    assert parts is not None and mx.array_equal(parts[0] + parts[1], out)
    assert kept.payload_of(x) is None
    del out, parts
    gc.collect()
    assert kept.held is None
    mx.eval(model(mx.array([[1, 2, 3]])))  # a whole forward: its last sum is gone with it
    gc.collect()
    assert kept.held is None


def test_only_plain_llama_family_layers_are_swapped() -> None:
    model = tiny_llama()
    model.layers[0].post_attention_layernorm = nn.LayerNorm(64)  # not the fused pattern
    assert residual_norm.install(model) == LAYERS - 1
    assert type(model.layers[0]).__name__ == "TransformerBlock"
    assert residual_norm.install(nn.Sequential(nn.Linear(4, 4))) == 0


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("width", [64, 576, 4096])
def test_the_kernel_is_mlxs_add_and_rms_norm(dtype: mx.Dtype, width: int) -> None:
    mx.random.seed(width)
    x = mx.random.normal((3, 5, width)).astype(dtype)
    r = mx.random.normal((3, 5, width)).astype(dtype)
    weight = (1.0 + 0.1 * mx.random.normal((width,))).astype(dtype)
    assert residual_norm.supported(x, r, weight)
    h, y = residual_norm.add_rms_norm(x, r, weight, 1e-5)
    want_h = x + r
    want_y = mx.fast.rms_norm(want_h, weight, 1e-5)
    assert mx.array_equal(h, want_h)
    # The sum of squares in another order can move the inner rounding T(x * n) by an ulp, which
    # the outer w * (.) rounding can make two: at most two roundings of y apart.
    ulp = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-22}[dtype]
    diff = mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32))
    assert (diff <= 2 * ulp * mx.abs(want_y.astype(mx.float32)) + 1e-6).all().item()


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_source_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel as MLX wraps it, for three dtypes and SmolLM2's, the 8B's and a tiny width:
    no error, no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(residual_norm, "available", lambda: True)
    monkeypatch.setattr(residual_norm, "_kernel", residual_norm._kernel.__wrapped__)
    cases = [(mx.bfloat16, 576), (mx.float16, 4096), (mx.float32, 64)]
    for dtype, width in cases:
        x = mx.zeros((2, 1, width), dtype)
        residual_norm.add_rms_norm(x, x, mx.ones((width,), dtype), 1e-5)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == len(cases), compiled.log
    assert compiled.spills == 0, compiled.log


# -- a deferred LoRA update made in the add after it ---------------------------------------------


def _adapted(tmp_path: Path):
    """A tiny llama on the LoRA kernel path with two random adapters (rank 8 on all seven
    projections; rank 4 on o_proj and down_proj), and rows of both and of none."""
    from bench.multi_lora import ALL_PROJECTIONS, write_adapter

    model = tiny_llama()
    aset = lora.AdapterSet(model, kernel=True)
    modules = dict(model.layers[0].named_modules())
    dims = {key: lora.linear_dims(modules[key]) for key in ALL_PROJECTIONS}
    specs = [("all7", 8, ALL_PROJECTIONS), ("od", 4, ["self_attn.o_proj", "mlp.down_proj"])]
    for seed, (name, rank, keys) in enumerate(specs):
        write_adapter(tmp_path / name, LAYERS, dims, keys, rank, seed)
        aset.add(lora.load_adapter(name, tmp_path / name, model))
    slots = [aset.slot("all7"), lora.NO_ADAPTER, aset.slot("od"), aset.slot("all7")]
    return model, aset.rows(np.asarray(slots, np.int32))


@pytest.fixture
def folds(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The output widths of the updates made by residual adds (`add_update_rms_norm`'s calls)
    while the test runs."""
    made: list[int] = []
    real = residual_norm.add_update_rms_norm

    def counted(x, update, weight, eps):
        made.append(update.part.width)
        return real(x, update, weight, eps)

    monkeypatch.setattr(residual_norm, "add_update_rms_norm", counted)
    return made


def test_a_deferred_lora_update_is_made_in_the_add_after_it(
    tmp_path: Path, folds: list[int]
) -> None:
    """One token a row (a decode step): every layer's o_proj update and every down_proj update
    but the last layer's (whose sum the model's final norm reads) are made by the residual add
    after them, and the logits are those of each update's own kernel followed by the add: bit
    for bit on the CPU (MLX ops both ways), to float32 roundings on CUDA (the norm's sum of
    squares in the kernel's order). Several tokens a row (prefill) defer nothing."""
    model, rows = _adapted(tmp_path)
    step = mx.array([[5], [9], [2], [7]])
    prompt = mx.array([[5, 1, 4], [9, 9, 2], [2, 0, 3], [7, 6, 5]])
    with lora.use_adapters(rows):
        want_step, want_prompt = model(step), model(prompt)
        assert residual_norm.install(model) == LAYERS
        got_prompt = model(prompt)
        assert folds == []
        got_step = model(step)
    assert len(folds) == 2 * LAYERS - 1
    for got, want in [(got_step, want_step), (got_prompt, want_prompt)]:
        if mx.cuda.is_available():
            assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item()
        else:
            assert mx.array_equal(got, want)


def test_a_deferred_update_is_made_in_the_add_of_a_compiled_step(
    tmp_path: Path, folds: list[int]
) -> None:
    """The server's CUDA decode steps replay a graph that mx.compile traced, with the rows' slots
    an input of it (service.core.engine.compiled_decode): the deferral follows the traced arrays
    as it follows eager ones, the trace makes the updates in the adds once, and its replays give
    the eager step's logits (bit for bit on the CPU)."""
    model, rows = _adapted(tmp_path)
    step = mx.array([[5], [9], [2], [7]])
    with lora.use_adapters(rows):
        want = model(step)
    assert residual_norm.install(model) == LAYERS

    def forward(tokens: mx.array, slots: mx.array) -> mx.array:
        with lora.use_adapters(lora.RowAdapters(slots)):
            return model(tokens)

    compiled = mx.compile(forward)
    got = [compiled(step, rows.slots) for _ in range(2)]
    assert len(folds) == 2 * LAYERS - 1
    for out in got:
        if mx.cuda.is_available():
            assert mx.allclose(out, want, rtol=1e-5, atol=1e-5).item()
        else:
            assert mx.array_equal(out, want)


def test_an_update_is_deferred_to_its_own_output_only() -> None:
    """A deferral goes with the very array the projection returned, lives as long as it, and a
    later one replaces it."""
    x = mx.ones((2, 1, 8))
    part = lora_kernel.Part(
        mx.ones((2, 1, 8)), mx.zeros((2, 4, 8)), mx.zeros((2, 4, 8)), mx.zeros((2,), mx.int32)
    )
    update = lora_kernel.Deferred(x, part, mx.ones((2,)))
    out = x + 1
    residual_norm.defer(out, update)
    held = residual_norm._PER_THREAD.update
    assert held.payload_of(out) is update and held.payload_of(x + 1) is None
    other = x + 2
    residual_norm.defer(other, update)
    assert held.payload_of(out) is None and held.payload_of(other) is update
    del other
    gc.collect()
    assert held.held is None


def _fold_case(rows: int, width: int, inner: int, rank: int, dtype: mx.Dtype, wide: bool):
    """x, the deferred update (a base output [rows, 1, width] or the columns [16, 16 + width) of
    a wider one; float32 stacks of 4 slots, slot 0 zeros; each row's slot and scale) and the
    norm's weight."""
    mx.random.seed(width + inner)
    x = mx.random.normal((rows, 1, width)).astype(dtype)
    lx = mx.random.normal((rows, 1, inner)).astype(dtype)
    y = mx.random.normal((rows, 1, width + (48 if wide else 0))).astype(dtype)
    a_t = mx.random.normal((4, rank, inner)) * inner**-0.5
    b = mx.random.normal((4, rank, width)) * 0.1
    a_t[0] = 0
    b[0] = 0
    idx = mx.array(np.random.default_rng(width).integers(0, 4, rows), dtype=mx.int32)
    scale = mx.array([0.0, 2.0, 20.0, 0.5], dtype=mx.float32)[idx]
    part = lora_kernel.Part(y, a_t, b, idx, 16 if wide else 0)
    weight = (1.0 + 0.1 * mx.random.normal((width,))).astype(dtype)
    return x, lora_kernel.Deferred(lx, part, scale), weight


FOLD_CASES = [  # width, inner (the projection's input), rank, base output wider than the row
    (576, 1536, 16, False),
    (4096, 14336, 16, False),
    (4096, 4096, 64, False),
    (64, 100, 8, True),
]


def _rows(x: mx.array, update: lora_kernel.Deferred, rows: list[int]):
    """x and the update for the given rows only."""
    part = update.part
    take = mx.array(rows)
    sub = lora_kernel.Part(part.y[take], part.a_t, part.b, part.idx[take], part.start)
    return x[take], lora_kernel.Deferred(update.x[take], sub, update.scale[take])


@cuda_only
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
@pytest.mark.parametrize("width,inner,rank,wide", FOLD_CASES)
def test_the_fold_kernel_is_the_updates_kernel_then_the_adds(
    dtype: mx.Dtype, width: int, inner: int, rank: int, wide: bool
) -> None:
    """`add_update_rms_norm`'s kernel against `fused_add`'s then `add_rms_norm`'s, rows with no
    adapter among them: h within a rounding of the update, of r and of h (z is summed in slices,
    so in another order), the norm `add_rms_norm`'s of that h bit for bit, and rows without an
    adapter x + base exactly."""
    _check_fold(9, dtype, width, inner, rank, wide)


@cuda_only
def test_a_fold_larger_than_the_gpu_holds_completes() -> None:
    """Thousands of rows at the 8B's down_proj: more blocks than the GPU holds at once, those of
    a tile meeting twice at its count (tickets keep a waiting block from holding a place its
    tile's others need). The launch ends, its numbers are the separate kernels' as above, and
    the fold and `fused_add` beside it (no data between them, so they may run at once) each
    meet at counts of their own."""
    _check_fold(2048, mx.bfloat16, 4096, 14336, 16, False)


def _check_fold(rows: int, dtype: mx.Dtype, width: int, inner: int, rank: int, wide: bool) -> None:
    """The fold of `_fold_case(rows, ...)` against `fused_add` then `add_rms_norm`."""
    x, update, weight = _fold_case(rows, width, inner, rank, dtype, wide)
    assert residual_norm.foldable(x, update, weight)
    h, y = residual_norm.add_update_rms_norm(x, update, weight, 1e-5)
    (r,) = lora_kernel.fused_add(update.x, [update.part], update.scale)
    want_h, _ = residual_norm.add_rms_norm(x, r, weight, 1e-5)
    eps = 1e-5 if dtype == mx.float32 else 2.0**-6
    got, want = h.astype(mx.float32), want_h.astype(mx.float32)
    r32 = r.astype(mx.float32).reshape(want.shape)
    update_size = mx.abs(r32 - update.part.base().astype(mx.float32))
    bound = eps * (mx.abs(want) + mx.abs(r32) + update_size) + 1e-5
    assert (mx.abs(got - want) - bound).max().item() <= 0
    assert_same(y, residual_norm.add_rms_norm(h, mx.zeros_like(h), weight, 1e-5)[1], "y")
    base = update.part.base()
    for row in np.nonzero(np.array(update.part.idx) == 0)[0].tolist():
        assert_same(h[row], (x[row] + base[row]).astype(dtype), ("base row", row))


@cuda_only
@pytest.mark.parametrize("width,inner,rank,wide", FOLD_CASES[:2])
def test_a_folded_rows_numbers_are_the_same_whatever_shares_its_batch(
    width: int, inner: int, rank: int, wide: bool
) -> None:
    """A row's h and norm from the fold are those it gets alone, bit for bit, whatever rows share
    its tile; and launch after launch (tiles of other counts between), the same batch gives the
    same numbers."""
    x, update, weight = _fold_case(21, width, inner, rank, mx.bfloat16, wide)
    h, y = residual_norm.add_update_rms_norm(x, update, weight, 1e-5)
    mx.eval(h, y)
    for row in range(21):
        hx, hu = _rows(x, update, [row])
        h1, y1 = residual_norm.add_update_rms_norm(hx, hu, weight, 1e-5)
        assert_same(h1, h[row : row + 1], ("h", row))
        assert_same(y1, y[row : row + 1], ("y", row))
    for rows in ([0, 5, 9, 13, 20], list(range(20, -1, -1))):
        sx, su = _rows(x, update, rows)
        hs, ys = residual_norm.add_update_rms_norm(sx, su, weight, 1e-5)
        assert_same(hs, h[mx.array(rows)], ("h", rows))
        assert_same(ys, y[mx.array(rows)], ("y", rows))
        again = residual_norm.add_update_rms_norm(x, update, weight, 1e-5)
        assert_same(again[0], h, "h again")
        assert_same(again[1], y, "y again")


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_fold_source_compiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold kernel as MLX wraps it, for the 8B's o_proj and down_proj (bf16 activations,
    bf16 and float32 stacks), SmolLM2's in float16 at rank 64, and a tiny float32 width with a
    wider base output: no error, no spill, a block's registers within the SM's."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(residual_norm, "available", lambda: True)
    monkeypatch.setattr(lora_kernel, "available", lambda: True)
    monkeypatch.setattr(residual_norm, "_fold_kernel", residual_norm._fold_kernel.__wrapped__)
    cases = [
        (4096, 4096, 16, mx.bfloat16, mx.bfloat16, False),
        (4096, 14336, 16, mx.bfloat16, mx.float32, False),
        (576, 1536, 64, mx.float16, mx.float16, False),
        (64, 100, 8, mx.float32, mx.float32, True),
    ]
    for width, inner, rank, act, stacks, wide in cases:
        y = mx.zeros((3, 1, width + (48 if wide else 0)), act)
        part = lora_kernel.Part(
            y,
            mx.zeros((2, rank, inner), stacks),
            mx.zeros((2, rank, width), stacks),
            mx.zeros((3,), mx.int32),
            16 if wide else 0,
        )
        x = mx.zeros((3, 1, width), act)
        update = lora_kernel.Deferred(mx.zeros((3, 1, inner), act), part, mx.zeros((3,)))
        residual_norm.add_update_rms_norm(x, update, mx.ones((width,), act), 1e-5)
    assert {launch.source for launch in recorder.launches} == {compact(residual_norm._FOLD_SOURCE)}
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == len(cases), compiled.log
    assert compiled.spills == 0, compiled.log
    assert max(compiled.registers) * residual_norm.FOLD_WARPS * 32 <= 65536, compiled.registers
