"""service/core/models/lora_kernel.py: the CUDA kernels against their MLX-op reference (each
token with its own adapter slot, ranks padded with zeros, float32 and bfloat16 activations), and
the reference against a plain per-token product (on any platform)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from service.core.models import lora_kernel

cuda_only = pytest.mark.skipif(
    not lora_kernel.available(), reason="the LoRA kernels run on MLX's CUDA backend only"
)


def case(tokens: int, width: int, rank: int, out: int, dtype: mx.Dtype, seed: int = 0):
    """x [T, in], y [T, out] in `dtype`; float32 stacks of 4 slots (slot 0 zeros, slot 3's
    last columns zero as rank padding); each token's slot and scale."""
    mx.random.seed(seed)
    x = mx.random.normal((tokens, width)).astype(dtype)
    y = mx.random.normal((tokens, out)).astype(dtype)
    a_t = mx.random.normal((4, rank, width)) * width**-0.5
    b = mx.random.normal((4, rank, out)) * 0.1
    a_t[0] = 0
    b[0] = 0
    a_t[3, rank // 2 :] = 0
    b[3, rank // 2 :] = 0
    idx = mx.array(np.random.default_rng(seed).integers(0, 4, tokens), dtype=mx.int32)
    scale = mx.array([0.0, 2.0, 20.0, 0.5], dtype=mx.float32)[idx]
    return x, y, a_t, b, idx, scale


def test_the_reference_is_each_tokens_own_product() -> None:
    x, y, a_t, b, idx, scale = case(7, 64, 8, 48, mx.float32)
    got = lora_kernel.reference_expand_add(
        y, lora_kernel.reference_shrink(x, a_t, idx), b, idx, scale
    )
    for t in range(7):
        s = int(idx[t].item())
        want = y[t] + scale[t] * ((x[t] @ a_t[s].T) @ b[s])
        assert mx.allclose(got[t], want, atol=1e-5), t
    base = mx.array(np.flatnonzero(np.array(idx) == 0))
    assert mx.array_equal(got[base], y[base])  # slot 0 adds exact zeros


@cuda_only
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("rank", [8, 16, 64])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["f32", "bf16"])
def test_the_kernels_match_the_reference(tokens: int, rank: int, dtype: mx.Dtype) -> None:
    x, y, a_t, b, idx, scale = case(tokens, 4096, rank, 1536, dtype, seed=tokens + rank)
    z = lora_kernel.shrink(x, a_t, idx)
    z_ref = lora_kernel.reference_shrink(x, a_t, idx)
    assert z.dtype == mx.float32
    assert mx.allclose(z, z_ref, rtol=1e-4, atol=1e-4).item()
    got = lora_kernel.expand_add(y, z, b, idx, scale)
    want = lora_kernel.reference_expand_add(y, z_ref, b, idx, scale)
    assert got.dtype == dtype
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=tol, rtol=tol).item()
    base = mx.array(np.flatnonzero(np.array(idx) == 0))
    assert mx.array_equal(got[base], y[base])


def test_a_mixed_batch_on_the_kernel_path_is_mlx_lms(tmp_path) -> None:
    """A tiny llama serving three adapters (ranks 4, 8, 16 on different projections) on the
    kernel path (the CUDA kernels on a GPU, their reference elsewhere): each row of a batch
    mixing them and the base has the logits mlx-lm's own LoRA layers give that adapter, for a
    multi-token forward and a one-token one."""
    from mlx_lm.tuner.utils import load_adapters

    from bench.multi_lora import write_adapter
    from service.core.models import lora
    from tests.helpers.tiny import VOCAB, tiny_llama

    model = tiny_llama()
    specs = {
        "all7": (4, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
        "qv": (8, ["self_attn.q_proj", "self_attn.v_proj"]),
        "mlp": (16, ["mlp.gate_proj", "mlp.down_proj"]),
    }  # fmt: skip
    aset = lora.AdapterSet(model, kernel=True)
    modules = dict(model.layers[0].named_modules())
    dims = {key: lora.linear_dims(modules[key]) for key in specs["all7"][1]}  # (in, out)
    for seed, (name, (rank, keys)) in enumerate(specs.items()):
        write_adapter(tmp_path / name, len(model.layers), dims, keys, rank, seed)
    for name in specs:
        aset.add(lora.load_adapter(name, tmp_path / name, model))
    names = [*specs, None]
    tokens = mx.array(np.random.default_rng(0).integers(3, VOCAB, (len(names), 9)), mx.int32)
    rows = aset.rows(np.array([aset.slot(n) if n else 0 for n in names], np.int32))
    for part in (tokens, tokens[:, -1:]):
        with lora.use_adapters(rows):
            got = model(part)
        for i, name in enumerate(names):
            ref = tiny_llama()
            base = ref(part[i : i + 1])[0]
            if name is not None:
                load_adapters(ref, str(tmp_path / name))
            want = ref(part[i : i + 1])[0]
            diff = mx.abs(got[i] - want).max().item()
            assert diff < 1e-4, (name, part.shape, diff)
            assert name is None or mx.abs(want - base).max().item() > 1e-2, name
