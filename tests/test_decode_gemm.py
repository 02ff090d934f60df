"""service.core.models.decode_gemm: the tensor-core product kernel of CUDA decode steps. On a
CUDA host it is held to a float32 product; elsewhere nvcc compiles its source as MLX wraps it,
the wrapper's tiling is checked against a stand-in kernel, and `install` picks its layers."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from service.core.models import decode_gemm, projections
from tests.helpers import cuda_source

cuda_only = pytest.mark.skipif(not decode_gemm.available(), reason="needs MLX's CUDA backend")

# (rows, N, K): SmolLM2's q/k/v, gate/up, o, down and head at row buckets, the 8B's q/k/v.
SHAPES = [(1, 960, 576), (7, 3072, 576), (33, 576, 576), (256, 576, 1536), (64, 6144, 4096)]
# (rows, 2 * intermediate, K): SmolLM2's and the 8B's gate/up weights.
GATED_SHAPES = [(1, 3072, 576), (256, 3072, 576), (64, 28672, 4096)]


def _operands(rows: int, n: int, k: int, dtype: mx.Dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32)).astype(dtype)
    w = mx.array((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32)).astype(dtype)
    return x, w


def test_only_half_precision_tiles_take_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decode_gemm, "available", lambda: True)
    x, w = _operands(4, 128, 64, mx.bfloat16)
    assert decode_gemm.supported(x, w)
    assert decode_gemm.supported(x.astype(mx.float16), w.astype(mx.float16))
    assert not decode_gemm.supported(x.astype(mx.float32), w.astype(mx.float32))
    assert not decode_gemm.supported(x, w.astype(mx.float16))
    assert not decode_gemm.supported(*_operands(4, 96, 64, mx.bfloat16))  # N not a tile
    assert not decode_gemm.supported(*_operands(4, 128, 48, mx.bfloat16))  # K not a pass
    many = decode_gemm.MAX_ROWS + 1  # a prefill pass's rows: cuBLAS's tuned products
    assert not decode_gemm.supported(*_operands(many, 128, 64, mx.bfloat16))
    monkeypatch.setattr(decode_gemm, "available", lambda: False)
    assert not decode_gemm.supported(x, w)


def test_the_wrapper_tiles_rows_and_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A grid of (N / BN) x ceil(M / BM) blocks over x's rows flattened, the output shaped as x
    (a stand-in kernel computes the product the kernel is held to on a GPU)."""
    monkeypatch.setattr(decode_gemm, "available", lambda: True)
    calls = []

    def stand_in(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        flat, w = inputs
        calls.append((dict(template), grid, threadgroup, output_shapes[0]))
        return [(flat.astype(mx.float32) @ w.astype(mx.float32).T).astype(output_dtypes[0])]

    monkeypatch.setattr(decode_gemm, "_kernel", lambda: stand_in)
    x, w = _operands(70, 192, 128, mx.bfloat16)
    y = decode_gemm.matmul_t(x.reshape(7, 10, 128), w)
    assert y.shape == (7, 10, 192) and y.dtype == mx.bfloat16
    template, grid, threadgroup, shape = calls[0]
    assert template["N"] == 192 and template["K"] == 128
    assert threadgroup == (decode_gemm.THREADS, 1, 1) and shape == (70, 192)
    assert grid[0] == (192 // decode_gemm.BN) * 3 * decode_gemm.THREADS  # 70 rows: 3 tiles
    want = (x.astype(mx.float32) @ w.astype(mx.float32).T).astype(mx.bfloat16)
    assert mx.array_equal(y.reshape(70, 192), want)
    empty = decode_gemm.matmul_t(mx.zeros((0, 128), mx.bfloat16), w)
    assert empty.shape == (0, 192) and len(calls) == 1


def test_unsupported_operands_take_mlxs_matmul() -> None:
    x, w = _operands(5, 96, 48, mx.float32)
    assert mx.array_equal(decode_gemm.matmul_t(x, w), x @ w.T)


@cuda_only
@pytest.mark.parametrize("rows,n,k", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=["bf16", "f16"])
def test_the_kernel_is_the_product(rows: int, n: int, k: int, dtype: mx.Dtype) -> None:
    x, w = _operands(rows, n, k, dtype, seed=rows + n)
    got = decode_gemm.matmul_t(x, w)
    want = x.astype(mx.float32) @ w.astype(mx.float32).T
    assert got.shape == (rows, n) and got.dtype == dtype
    # One rounding to the half type, after float32 sums in another order: a sum of k terms in
    # any order is within k float32 roundings of the terms' magnitudes (|x| @ |w|.T), which
    # outweighs the half rounding of outputs near zero once K is in the thousands.
    eps = 2.0**-8 if dtype == mx.bfloat16 else 2.0**-11
    magnitudes = mx.abs(x.astype(mx.float32)) @ mx.abs(w.astype(mx.float32)).T
    bound = eps * mx.abs(want) + (1 + eps) * k * 2.0**-24 * magnitudes
    excess = (mx.abs(got.astype(mx.float32) - want) - bound).max().item()
    assert excess <= 0, excess


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_source_compiles_for_every_shape(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel as MLX wraps it, compiled by nvcc for the H100/H200: no error, no spill, and
    few enough registers for a block."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(decode_gemm, "available", lambda: True)
    monkeypatch.setattr(decode_gemm, "_kernel", decode_gemm._kernel.__wrapped__)
    for rows, n, k in SHAPES:
        for dtype in (mx.bfloat16, mx.float16):
            decode_gemm.matmul_t(*_operands(rows, n, k, dtype))
    for rows, n, k in GATED_SHAPES:
        decode_gemm.swiglu_t(*_operands(rows, n, k, mx.bfloat16))
    compiled = recorder.compile(tmp_path)
    launches = 2 * len(SHAPES) + len(GATED_SHAPES)
    assert len(compiled.registers) == len(recorder.launches) == launches, compiled.log
    assert compiled.spills == 0, compiled.log
    assert max(compiled.registers) * decode_gemm.THREADS <= 65536, compiled.registers


def test_install_takes_small_plain_products_only() -> None:
    """Bias-free plain `nn.Linear`s and fused groups whose half-precision weights are at most
    MAX_WEIGHT_BYTES compute through `matmul_t` (names and weights kept); biased, quantized,
    float32, large and subclassed layers stay as they are."""
    from mlx import nn

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = nn.Linear(64, 128, bias=False)
            self.k_proj = nn.Linear(64, 64, bias=False)
            self.v_proj = nn.Linear(64, 64, bias=False)
            self.o_proj = nn.Linear(128, 64, bias=False)
            self.biased = nn.Linear(64, 64, bias=True)
            self.quant = nn.QuantizedLinear(64, 64, bias=False)
            self.wide = nn.Linear(64, decode_gemm.MAX_WEIGHT_BYTES // 128 + 64, bias=False)
            self.single = nn.Linear(64, 64, bias=False)

    block = Attention()
    block.set_dtype(mx.bfloat16, lambda _: True)
    block.single.set_dtype(mx.float32)
    assert projections.fuse(block) == 1
    weight = block.o_proj.weight
    assert decode_gemm.install(block) == 2  # the q/k/v group and o_proj
    (group,) = projections.groups(block)
    assert group.matmul is decode_gemm.matmul_t
    assert isinstance(block.o_proj, decode_gemm._KernelLinear) and block.o_proj.weight is weight
    for name in ("biased", "wide", "single"):
        assert type(getattr(block, name)) is nn.Linear, name
    assert type(block.quant) is nn.QuantizedLinear
    x = mx.random.normal((3, 64)).astype(mx.bfloat16)
    # Off CUDA the kernel's layers compute MLX's product, so the model's outputs are unchanged.
    assert mx.array_equal(block.q_proj(x), x @ block.q_proj.weight.T)
    assert mx.array_equal(block.o_proj(block.q_proj(x)), block.q_proj(x) @ weight.T)


@cuda_only
@pytest.mark.parametrize("rows,n,k", GATED_SHAPES)
def test_the_gated_kernel_is_mlx_lms_swiglu(rows: int, n: int, k: int) -> None:
    """silu(x @ gate.T) * (x @ up.T) for a fused gate/up weight, against MLX's product and
    mlx-lm's swiglu: within a few roundings of the half type (the products' sums run in
    another order than cuBLAS's, and each of the half-type gate and up can round the other
    way; a lost chunk of K or a wrong column would be off by far more)."""
    from mlx_lm.models.activations import swiglu

    x, w = _operands(rows, n, k, mx.bfloat16, seed=rows + n)
    got = decode_gemm.swiglu_t(x, w)
    gate, up = mx.split(x @ w.T, [n // 2], axis=-1)
    want = swiglu(gate, up)
    assert got.shape == (rows, n // 2) and got.dtype == mx.bfloat16
    diff = mx.abs(got.astype(mx.float32) - want.astype(mx.float32))
    scale = mx.abs(want.astype(mx.float32)) + 1e-2
    assert (diff / scale).max().item() < 8 * 2.0**-8


def test_swiglu_mlps_take_the_gated_kernel_while_their_group_is_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A half-precision llama whose gate/up groups take the kernel: each MLP computes through
    `swiglu_t` (off CUDA MLX's product and swiglu) with the model's outputs unchanged (on CUDA
    within bfloat16 rounding);
    an MLP whose gate is no longer its group's member (as adapters wrap it) computes as before."""
    from mlx import nn

    from service.core.models import projections
    from tests.helpers.tiny import LAYERS, tiny_llama

    model = tiny_llama()
    model.set_dtype(mx.bfloat16)
    projections.fuse(model)
    tokens = mx.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    want = model(tokens)
    decode_gemm.install(model)
    assert all(isinstance(layer.mlp, decode_gemm.KernelSwiGLU) for layer in model.layers)
    calls = []
    gated = decode_gemm.swiglu_t
    monkeypatch.setattr(decode_gemm, "swiglu_t", lambda x, w: calls.append(w.shape) or gated(x, w))
    got = model(tokens)
    if decode_gemm.available():  # the kernel's bfloat16 products round apart from cuBLAS's
        spread = mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max()
        assert (spread <= 0.02 * mx.abs(want.astype(mx.float32)).max()).item()
    else:
        assert mx.array_equal(got, want)
    assert len(calls) == LAYERS
    mlp = model.layers[0].mlp
    mlp.gate_proj = nn.Linear(64, 128, bias=False)  # no longer the group's member
    calls.clear()
    model(tokens)
    assert len(calls) == LAYERS - 1
