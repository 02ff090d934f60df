"""service/core/models/lora_kernel.py: the CUDA kernels against their MLX-op reference (each
token with its own adapter slot, ranks padded with zeros, float32 and bfloat16 activations), and
the reference against a plain per-token product (on any platform); the kernel path of
service/core/models/lora.py against mlx-lm, and its projections that share one kernel
(`_Group`) against the same projections one kernel each."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.multi_lora import ALL_PROJECTIONS
from service.core.models import lora, lora_kernel, projections, residual_norm
from tests.helpers import cuda_source
from tests.helpers.arrays import assert_same

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


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused"])
def test_a_mixed_batch_on_the_kernel_path_is_mlx_lms(tmp_path: Path, fused: bool) -> None:
    """A tiny llama serving three adapters (ranks 4, 8, 16 on different projections) on the
    kernel path (the CUDA kernels on a GPU, their reference elsewhere): each row of a batch
    mixing them and the base has the logits mlx-lm's own LoRA layers give that adapter, for a
    multi-token forward and a one-token one; also over sibling projections fused into one
    matmul first, as the server runs them on CUDA."""
    from mlx_lm.tuner.utils import load_adapters

    from bench.multi_lora import write_adapter
    from tests.helpers.tiny import VOCAB, tiny_llama

    model = tiny_llama()
    if fused:
        assert projections.fuse(model) == 2 * len(model.layers)
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
    assert all(g.enabled for g in projections.groups(model))


# -- the fused kernel ------------------------------------------------------------------------------


def fused_case(
    tokens: int,
    width: int,
    outs: list[int],
    rank: int,
    dtype: mx.Dtype,
    seed: int = 0,
    row_tokens: int = 1,
) -> tuple[mx.array, list[lora_kernel.Part], mx.array, np.ndarray]:
    """x [T, in] and each part's y [T, out] in `dtype`; float32 stacks (as the trainer saves
    them) of 5 local slots per part, local slot 0 zeros as in every stack, the last part's slot
    4 of half the rank (zero padding); 6 global slots over the tokens (0: no adapter), mapped to
    local slots per part (a part's 0: an adapter that does not target it); the tokens' scales
    and global slots. The update is of y's size, so that a wrong index shows above rounding.
    `row_tokens`: consecutive tokens in rows of this many share a slot (a prefill pass's)."""
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    x = mx.random.normal((tokens, width)).astype(dtype)
    glob = rng.integers(0, 6, tokens // row_tokens).astype(np.int32)
    head = min(len(glob), 6)
    glob[:head] = (np.arange(head) + 1) % 6  # every slot (0: no adapter), an adapter first
    glob = np.repeat(glob, row_tokens)
    scale = mx.array([0.0, 1.0, 2.0, 0.5, 1.5, 1.0], dtype=mx.float32)[mx.array(glob)]
    maps = [[0, 1, 2, 3, 4, 4], [0, 2, 1, 0, 3, 4], [0, 4, 0, 1, 2, 3]]
    parts = []
    for p, out in enumerate(outs):
        a_t = mx.random.normal((5, rank, width)) * width**-0.5
        b = mx.random.normal((5, rank, out)) * rank**-0.5
        a_t[0] = 0
        b[0] = 0
        if p == len(outs) - 1:
            a_t[4, rank // 2 :] = 0
            b[4, rank // 2 :] = 0
        idx = mx.array(np.array(maps[p % 3], np.int32)[glob])
        y = mx.random.normal((tokens, out)).astype(dtype)
        parts.append(lora_kernel.Part(y, a_t, b, idx))
    return x, parts, scale, glob


def test_the_fused_reference_is_each_parts_own_update() -> None:
    """Each part's output is y + scale * ((x @ A[s]) @ B[s]) with its own local slot s, for a
    flat input and a [B, L, in] one; rows of no adapter (local slot 0) are y exactly."""
    x, parts, scale, _ = fused_case(7, 64, [48, 16, 16], 8, mx.float32)
    got = lora_kernel.reference_fused_add(x, parts, scale)
    for part, out in zip(parts, got):
        assert out.shape == part.y.shape
        for t in range(7):
            s = int(part.idx[t].item())
            want = part.y[t] + scale[t] * ((x[t] @ part.a_t[s].T) @ part.b[s])
            assert mx.allclose(out[t], want, atol=1e-5), t
            if s == 0:
                assert mx.array_equal(out[t], part.y[t])
    batched = [lora_kernel.Part(p.y[:6].reshape(2, 3, -1), p.a_t, p.b, p.idx[:6]) for p in parts]
    again = lora_kernel.reference_fused_add(x[:6].reshape(2, 3, -1), batched, scale[:6])
    for out, flat in zip(again, got):
        assert mx.array_equal(out.reshape(6, -1), flat[:6])


def kernel_tiles(slots: np.ndarray) -> list[tuple[int, list[int]]]:
    """The tiles `fused_add`'s blocks find, in block order, as the kernel finds them: a token
    leads a tile when the tokens of its slot before it are a multiple of TILE; the tile is the
    leader and the next TILE - 1 tokens of its slot."""
    tiles = []
    for t, s in enumerate(slots):
        if np.count_nonzero(slots[:t] == s) % lora_kernel.TILE == 0:
            same = [u for u in range(t, len(slots)) if slots[u] == s]
            tiles.append((int(s), same[: lora_kernel.TILE]))
    return tiles


@given(
    st.integers(1, 9).flatmap(
        lambda n: st.lists(st.integers(0, n - 1), min_size=1, max_size=300).map(
            lambda s: (n, np.array(s, np.int32))
        )
    )
)
@settings(max_examples=200, deadline=None)
def test_the_tiles_take_every_token_once_within_the_grid(case: tuple[int, np.ndarray]) -> None:
    """Every token is in exactly one tile, of its own slot, of at most TILE tokens, and there are
    never more tiles than the grid holds (`tiles`, from the tokens and the stack's slots)."""
    stack, slots = case
    found = kernel_tiles(slots)
    assert len(found) <= lora_kernel.tiles(len(slots), stack)
    members = sorted(t for _, tokens in found for t in tokens)
    assert members == list(range(len(slots)))
    for slot, tokens in found:
        assert 1 <= len(tokens) <= lora_kernel.TILE and all(slots[t] == slot for t in tokens)


@pytest.mark.parametrize(
    "width", [128256, 28672, 14336, 5000, 4096, 2049, 2048, 1024, 576, 192, 100, 36, 16, 3]
)
def test_a_tiles_blocks_share_a_row_once_each(width: int) -> None:
    """The blocks of a tile (`blocks(width)`: one for each BLOCK_OUTPUTS outputs, at least
    MIN_BLOCKS, over which z is split) take `share(width)` outputs each, in order: every output
    once, and each share whole vector loads where the width allows them (the last ones may be
    short, or empty where the row is narrow)."""
    share, vec = lora_kernel.share(width), lora_kernel.vector(width)
    count = lora_kernel.blocks(width)
    assert count == max(lora_kernel.MIN_BLOCKS, -(-width // lora_kernel.BLOCK_OUTPUTS))
    taken = [range(r * share, min((r + 1) * share, width)) for r in range(count)]
    assert [e for block in taken for e in block] == list(range(width))
    assert len(taken[0]) > 0 and share <= lora_kernel.BLOCK_OUTPUTS
    assert share % vec == 0 and width % vec == 0
    assert vec == (lora_kernel.VEC if width % lora_kernel.VEC == 0 else 1)


def assert_close_rounded(got: mx.array, want: mx.array, y: mx.array, dtype: mx.Dtype) -> None:
    """float32: to 1e-5 relative. bfloat16: within one rounding of the update and one of the
    sum (the kernels sum in another order, so either may land on the neighbouring value)."""
    g, w = got.astype(mx.float32), want.astype(mx.float32)
    eps = 1e-5 if dtype == mx.float32 else 2.0**-6
    bound = eps * (mx.abs(w) + mx.abs(w - y.astype(mx.float32))) + 1e-5
    excess = (mx.abs(g - w) - bound).max().item()
    assert excess <= 0, excess


SHAPES = {  # (in, outs) of modules that read one input
    "llama8b-qkv": (4096, [4096, 1024, 1024]),
    "llama8b-gate-up": (4096, [14336, 14336]),
    "llama8b-o": (4096, [4096]),
    "llama8b-down": (14336, [4096]),
    "smol-qkv": (576, [576, 192, 192]),
    "smol-gate-up": (576, [1536, 1536]),
}


@cuda_only
@pytest.mark.parametrize("tokens", [1, 7, 64, 300])
@pytest.mark.parametrize("rank", [8, 16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_the_fused_kernel_matches_the_reference(
    shape: str, rank: int, tokens: int, dtype: mx.Dtype
) -> None:
    """`fused_add` on CUDA: every part's outputs are the reference's (float32 A and B, rows of
    every adapter and of none), rows of no adapter are y exactly, and a part's outputs do not
    depend on the other parts of the call."""
    width, outs = SHAPES[shape]
    x, parts, scale, _ = fused_case(tokens, width, outs, rank, dtype, seed=tokens + rank)
    got = lora_kernel.fused_add(x, parts, scale)
    want = lora_kernel.reference_fused_add(x, parts, scale)
    for i, (g, w, part) in enumerate(zip(got, want, parts)):
        assert g.shape == part.y.shape and g.dtype == dtype
        assert_close_rounded(g, w, part.y, dtype)
        base = mx.array(np.flatnonzero(np.array(part.idx) == 0))
        assert_same(g[base], part.y[base], (i, "rows of no adapter"))
        (alone,) = lora_kernel.fused_add(x, [part], scale)
        assert_same(alone, g, (i, "alone"))


SLOT_PATTERNS = {  # tokens -> each token's local slot, over stacks of 9 slots
    "one adapter": lambda t: np.full(t, 3),
    "every row its own": lambda t: np.arange(t) % 9,
    "runs": lambda t: np.repeat(np.arange(9), -(-t // 9))[:t],
    "base and one": lambda t: (np.arange(t) % 3 == 0) * 5,
    "random": lambda t: np.random.default_rng(t).integers(0, 9, t),
}


def slot_stacks(slots: int, rank: int, width: int, out: int) -> tuple[mx.array, mx.array]:
    """Random float32 stacks A (as [slots, rank, width]) and B, slot 0 zeros (no adapter)."""
    a_t = mx.random.normal((slots, rank, width)) * width**-0.5
    b = mx.random.normal((slots, rank, out)) * rank**-0.5
    a_t[0] = 0
    b[0] = 0
    return a_t, b


@cuda_only
@pytest.mark.parametrize("tokens", [1, 9, 17, 64, 130])
@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
def test_a_tokens_update_is_the_same_whatever_shares_its_batch(pattern: str, tokens: int) -> None:
    """`fused_add` on CUDA takes the tokens of one slot in tiles (`TILE` at most): every
    token's outputs are exactly those it gets alone, whatever the other tokens' slots (one
    adapter for all, each its own, runs, base rows between) and however many share its tile,
    and they match the reference; rows of no adapter are y exactly."""
    width, outs, rank = 576, [576, 192, 192], 16
    mx.random.seed(tokens)
    x = mx.random.normal((tokens, width)).astype(mx.bfloat16)
    slots = SLOT_PATTERNS[pattern](tokens).astype(np.int32)
    scale = mx.array(np.linspace(0.5, 2.0, tokens, dtype=np.float32))
    parts = []
    for out in outs:
        a_t, b = slot_stacks(9, rank, width, out)
        y = mx.random.normal((tokens, out)).astype(mx.bfloat16)
        parts.append(lora_kernel.Part(y, a_t, b, mx.array(slots)))
    got = lora_kernel.fused_add(x, parts, scale)
    for g, w, part in zip(got, lora_kernel.reference_fused_add(x, parts, scale), parts):
        assert_close_rounded(g, w, part.y, mx.bfloat16)
    for t in range(tokens):
        one = [lora_kernel.Part(p.y[t : t + 1], p.a_t, p.b, p.idx[t : t + 1]) for p in parts]
        alone = lora_kernel.fused_add(x[t : t + 1], one, scale[t : t + 1])
        for g, a, part in zip(got, alone, parts):
            assert_same(g[t : t + 1], a, (t, int(slots[t])))
            if slots[t] == 0:
                assert_same(a, part.y[t : t + 1], t)


@cuda_only
def test_a_grid_larger_than_the_gpu_holds_completes() -> None:
    """Thousands of tokens over every slot at the 8B's gate/up widths: more blocks than the GPU
    holds at once, those of a tile meeting at its count (tickets keep a waiting block from
    holding a place its tile's others need). The launch ends and matches the reference; so do
    two launches with no data between them, evaluated together (they may run at once), given
    their counts by one `Counts` or each its own."""
    tokens, width, outs, rank = 2048, 4096, [14336, 14336], 16
    mx.random.seed(3)
    x = mx.random.normal((tokens, width)).astype(mx.bfloat16)
    slots = np.random.default_rng(3).integers(0, 9, tokens).astype(np.int32)
    scale = mx.full((tokens,), 2.0, mx.float32)
    y = mx.random.normal((tokens, sum(outs))).astype(mx.bfloat16)
    parts = []
    for p, out in enumerate(outs):
        a_t, b = slot_stacks(9, rank, width, out)
        parts.append(lora_kernel.Part(y, a_t, b, mx.array(slots), p * outs[0]))
    got = lora_kernel.fused_add(x, parts, scale)
    want = lora_kernel.reference_fused_add(x, parts, scale)
    for g, w, part in zip(got, want, parts):
        assert_close_rounded(g, w, part.base(), mx.bfloat16)
    counts = lora_kernel.Counts()
    apart = [lora_kernel.fused_add(x, [part], scale, counts) for part in parts]
    apart += [lora_kernel.fused_add(x, [part], scale) for part in parts]
    mx.eval(apart)
    for (g,), w, part in zip(apart, want + want, parts + parts):
        assert_close_rounded(g, w, part.base(), mx.bfloat16)


def test_a_forwards_counts_are_zeros_each_launch_its_own() -> None:
    """`Counts` gives each launch of a forward its own stretch of zeros, from one fill until it
    is used up; a launch without one fills its own."""
    counts = lora_kernel.Counts()
    first, second = counts.take(100), counts.take(lora_kernel.Counts.CHUNK - 100)
    assert first.shape == (100,) and first.dtype == mx.int32
    assert not np.array(first).any() and not np.array(second).any()
    third = counts.take(7)  # past the first fill's CHUNK: a new one
    assert third.shape == (7,) and not np.array(third).any()
    assert counts.take(lora_kernel.Counts.CHUNK * 2).shape == (lora_kernel.Counts.CHUNK * 2,)
    own = lora_kernel.take_counts(None, 9)
    assert own.size >= 9 and own.dtype == mx.int32 and not np.array(own).any()
    with pytest.raises(TypeError, match="Counts, not an array"):
        lora_kernel.take_counts(own, 9)


def test_fills_stay_apart_in_a_compiled_graph(tmp_path: Path) -> None:
    """mx.compile merges identical operations of a trace, two fills of one length into one
    array: each fill (a launch's own, or a `Counts` chunk) has a length unlike the fills before
    it, so that a compiled forward's launches never share counts."""
    lengths = {lora_kernel.zeros(8).size for _ in range(lora_kernel.FILLS)}
    assert len(lengths) == lora_kernel.FILLS

    def forward(x: mx.array) -> list[mx.array]:
        counts = lora_kernel.Counts()
        chunks = [counts.take(lora_kernel.Counts.CHUNK) for _ in range(3)]
        own = [lora_kernel.take_counts(None, 4)[:4] for _ in range(3)]
        return [x + c[:4] for c in chunks + own]

    x = mx.zeros((4,), mx.int32)
    mx.eval(x)
    outs = mx.compile(forward)(x)
    dot = tmp_path / "graph.dot"
    mx.export_to_dot(str(dot), *outs)
    assert dot.read_text().count('label ="Full"') == 6
    assert not any(np.array(o).any() for o in outs)


def test_a_launchs_counts_cover_its_blocks() -> None:
    """A `fused_add` launch's words: its ticket counter and a count for each of its blocks
    (tiles times each part's blocks), then a z slice a block (TILE tokens by the largest rank);
    a fold's the same with SLICES blocks a tile. A decode step of the 8B's shape at 64 rows fits
    one fill: per layer the q/k/v and gate/up launches, and o's and down's `fused_add` (taken, then
    replaced by the fold) and fold."""
    parts = [
        lora_kernel.Part(
            mx.zeros((64, 6144)), mx.zeros((9, rank, 8)), mx.zeros((9, rank, w)), mx.zeros(64)
        )
        for w, rank in ((4096, 16), (1024, 8), (1024, 16))
    ]
    tiles = lora_kernel.tiles(64, 9)
    assert tiles == -(-64 // lora_kernel.TILE) + 8
    block_count = tiles * sum(lora_kernel.blocks(w) for w in (4096, 1024, 1024))
    words = 1 + lora_kernel.TILE * 16  # a block's count and z slice, at the largest rank
    assert lora_kernel.fused_counts(64, parts) == 1 + block_count * words
    assert lora_kernel.fused_counts(64, parts[1:2]) == 1 + tiles * lora_kernel.blocks(1024) * (
        1 + lora_kernel.TILE * 8
    )
    fold_blocks = tiles * residual_norm.SLICES
    assert residual_norm.fold_counts(64, parts[0]) == 1 + fold_blocks * words
    gate_up = tiles * 2 * lora_kernel.blocks(14336)
    one_part = tiles * lora_kernel.blocks(4096)
    launches = (block_count, gate_up, one_part, fold_blocks, one_part, fold_blocks)
    assert 32 * sum(1 + b * words for b in launches) <= lora_kernel.Counts.CHUNK


@cuda_only
def test_the_fused_kernel_takes_batched_inputs() -> None:
    """x [B, L, in] and y [B, L, out] as the projections see them: the flat call's numbers."""
    x, parts, scale, _ = fused_case(12, 576, [576, 192], 16, mx.bfloat16)
    flat = lora_kernel.fused_add(x, parts, scale)
    batched = [lora_kernel.Part(p.y.reshape(3, 4, -1), p.a_t, p.b, p.idx) for p in parts]
    for out, want in zip(lora_kernel.fused_add(x.reshape(3, 4, -1), batched, scale), flat):
        assert out.shape[:2] == (3, 4)
        assert_same(out.reshape(want.shape), want)


def side_by_side(parts: list[lora_kernel.Part]) -> list[lora_kernel.Part]:
    """The same parts reading their base outputs as columns of one y (a fused projection's
    whole product), in part order."""
    whole = mx.concatenate([p.y for p in parts], axis=-1)
    starts = [0, *np.cumsum([p.width for p in parts])[:-1].tolist()]
    return [lora_kernel.Part(whole, p.a_t, p.b, p.idx, start) for p, start in zip(parts, starts)]


def test_the_reference_reads_a_parts_columns_of_a_shared_y() -> None:
    """Parts whose base outputs are columns of one y give what they give with their own y."""
    x, parts, scale, _ = fused_case(9, 64, [48, 16, 16], 8, mx.float32)
    own = lora_kernel.reference_fused_add(x, parts, scale)
    shared = lora_kernel.reference_fused_add(x, side_by_side(parts), scale)
    for a, b, part in zip(own, shared, parts):
        assert b.shape == part.y.shape and mx.array_equal(a, b)


@cuda_only
@pytest.mark.parametrize("shape", ["llama8b-qkv", "llama8b-gate-up", "smol-qkv"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
def test_the_fused_kernel_reads_columns_of_a_shared_y(shape: str, dtype: mx.Dtype) -> None:
    """`fused_add` with the parts' base outputs as columns of one y, as over fused projections:
    bit for bit the outputs of the parts with their own y, for flat and batched inputs."""
    width, outs = SHAPES[shape]
    x, parts, scale, _ = fused_case(24, width, outs, 16, dtype, seed=5)
    own = lora_kernel.fused_add(x, parts, scale)
    shared = side_by_side(parts)
    for i, (a, b) in enumerate(zip(own, lora_kernel.fused_add(x, shared, scale))):
        assert_same(b, a, i)
    batched = [lora_kernel.Part(p.y.reshape(4, 6, -1), p.a_t, p.b, p.idx, p.start) for p in shared]
    got = lora_kernel.fused_add(x.reshape(4, 6, -1), batched, scale)
    for i, (a, b) in enumerate(zip(own, got)):
        assert b.shape == (4, 6, a.shape[-1])
        assert_same(b.reshape(a.shape), a, (i, "batched"))


# -- projections that read one input: one kernel ---------------------------------------------------

SEVEN = list(ALL_PROJECTIONS)  # the seven projections of a llama layer


def adapted_llama(tmp_path: Path, specs: dict[str, tuple[int, list[str]]]):
    """A tiny llama on the kernel path with random adapters: name -> (rank, keys)."""
    from bench.multi_lora import write_adapter
    from tests.helpers.tiny import tiny_llama

    model = tiny_llama()
    aset = lora.AdapterSet(model, kernel=True)
    modules = dict(model.layers[0].named_modules())
    dims = {key: lora.linear_dims(modules[key]) for key in SEVEN}
    for seed, (name, (rank, keys)) in enumerate(specs.items()):
        path = tmp_path / name
        if not path.exists():
            write_adapter(path, len(model.layers), dims, keys, rank, seed)
        aset.add(lora.load_adapter(name, path, model))
    return model, aset


@contextmanager
def one_kernel_each(aset: lora.AdapterSet) -> Iterator[None]:
    """The wrappers without their groups: each projection's update from a kernel of its own."""
    held = {name: w._shared for name, w in aset.wrappers.items()}
    for w in aset.wrappers.values():
        w._shared = None
    try:
        yield
    finally:
        for name, w in aset.wrappers.items():
            w._shared = held[name]


@contextmanager
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The number of parts of each `fused_add` call made meanwhile."""
    calls: list[int] = []
    real = lora_kernel.fused_add

    def spy(x: mx.array, parts, scale: mx.array, counts=None) -> list[mx.array]:
        calls.append(len(parts))
        return real(x, parts, scale, counts)

    with monkeypatch.context() as patch:
        patch.setattr(lora_kernel, "fused_add", spy)
        yield calls


GROUPINGS = {
    # adapters (rank, keys) -> the parts of each layer's kernels, in call order
    "all": (
        {
            "all7": (4, SEVEN),
            "qv": (8, ["self_attn.q_proj", "self_attn.v_proj"]),
            "mlp": (16, ["mlp.gate_proj", "mlp.down_proj"]),
        },
        [3, 1, 2, 1],
    ),
    # k not adapted: q and v still share a kernel; k runs its base layer alone.
    "qv": ({"qv": (8, ["self_attn.q_proj", "self_attn.v_proj"])}, [2]),
    # a projection with no adapted sibling: a kernel of its own.
    "lone": ({"qd": (8, ["self_attn.q_proj", "mlp.down_proj"])}, [1, 1]),
}


@pytest.mark.parametrize("grouping", GROUPINGS)
def test_projections_that_read_one_input_share_one_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grouping: str
) -> None:
    """q, k, v and gate, up of a layer take one kernel per group of those adapted, and every
    row's logits are the ones a kernel per projection gives, bit for bit (the reference's
    numbers on the CPU), in a one-token forward and a compiled one. A forward of several tokens
    a row (prefill) takes no kernel: its products are mlx-lm's, grouped by slot."""
    specs, per_layer = GROUPINGS[grouping]
    model, aset = adapted_llama(tmp_path, specs)
    names = [*specs, None, *specs]
    rows = aset.rows(np.array([aset.slot(n) if n else 0 for n in names], np.int32))
    tokens = mx.array(np.random.default_rng(1).integers(3, 200, (len(names), 5)), mx.int32)
    for part in (tokens, tokens[:, -1:]):
        one = part.shape[1] == 1
        with lora.use_adapters(rows), kernel_calls(monkeypatch) as calls:
            got = model(part)
        assert calls == (per_layer * len(model.layers) if one else [])
        with lora.use_adapters(rows), one_kernel_each(aset), kernel_calls(monkeypatch) as calls:
            want = model(part)
        assert calls == ([1] * sum(per_layer) * len(model.layers) if one else [])
        assert mx.array_equal(got, want), part.shape

    def forward(tokens: mx.array, slots: mx.array) -> mx.array:
        with lora.use_adapters(lora.RowAdapters(slots)):
            return model(tokens)

    assert rows is not None
    compiled = mx.compile(forward)
    assert mx.allclose(compiled(tokens, rows.slots), forward(tokens, rows.slots), atol=1e-5)
    assert all(w._shared is None or w._shared.enabled for w in aset.wrappers.values())


def test_a_projection_left_without_adapters_leaves_its_group(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unloading the only adapter of k leaves q and v sharing a kernel, with the numbers of a
    kernel each."""
    model, aset = adapted_llama(
        tmp_path, {"all7": (4, SEVEN), "qv": (8, ["self_attn.q_proj", "self_attn.v_proj"])}
    )
    aset.remove("all7")
    rows = aset.rows(np.array([aset.slot("qv"), 0], np.int32))
    tokens = mx.array([[7], [10]], mx.int32)  # decode: the kernels serve one-token rows
    with lora.use_adapters(rows), kernel_calls(monkeypatch) as calls:
        got = model(tokens)
    assert calls == [2] * len(model.layers)
    with lora.use_adapters(rows), one_kernel_each(aset):
        assert mx.array_equal(got, model(tokens))


def adapted_qkv(tmp_path: Path):
    """Layer 0's q, k, v of a fresh model (groups start on), with two adapters' rows."""
    model, aset = adapted_llama(
        tmp_path, {"all7": (4, SEVEN), "qv": (8, ["self_attn.q_proj", "self_attn.v_proj"])}
    )
    attn = model.layers[0].self_attn
    rows = aset.rows(np.array([aset.slot("all7"), aset.slot("qv"), 0], np.int32))
    return aset, (attn.q_proj, attn.k_proj, attn.v_proj), rows


def alone(aset: lora.AdapterSet, module, x: mx.array, rows) -> mx.array:
    with lora.use_adapters(rows), one_kernel_each(aset):
        return module(x)


def test_held_outputs_serve_the_same_input_only(tmp_path: Path) -> None:
    """The group's outputs go to the members called with the very input array the first one
    had, in any order; a member called with another input (equal values, another array)
    computes anew, and after two such calls in a row the group turns itself off; later calls
    are per projection too."""
    x = mx.random.normal((3, 1, 64))
    aset, (q, k, v), rows = adapted_qkv(tmp_path)
    with lora.use_adapters(rows):
        got = {"k": k(x), "q": q(x), "v": v(x)}
    for name, m in zip("qkv", (q, k, v)):
        assert mx.array_equal(got[name], alone(aset, m, x, rows)), name
    assert q._shared is not None and q._shared.enabled

    copy = x + 0  # the same values, another array
    with lora.use_adapters(rows):
        outs = [q(x), k(copy), v(x)]
    assert not q._shared.enabled
    for m, out, inp in zip((q, k, v), outs, (x, copy, x)):
        assert mx.array_equal(out, alone(aset, m, inp, rows))
    other = mx.random.normal((3, 1, 64))
    with lora.use_adapters(rows):
        outs = [q(other), k(x), v(other)]
    for m, out, inp in zip((q, k, v), outs, (other, x, other)):
        assert mx.array_equal(out, alone(aset, m, inp, rows))


def test_held_outputs_serve_the_same_rows_only(tmp_path: Path) -> None:
    """A member called with the first one's input but under other rows computes its own."""
    x = mx.random.normal((3, 1, 64))
    aset, (q, k, _), rows = adapted_qkv(tmp_path)
    swapped = aset.rows(np.array([aset.slot("qv"), 0, aset.slot("all7")], np.int32))
    with lora.use_adapters(rows):
        q(x)
    with lora.use_adapters(swapped):
        got = k(x)
    assert mx.array_equal(got, alone(aset, k, x, swapped))
    assert not mx.array_equal(got, alone(aset, k, x, rows))


def test_a_member_never_called_turns_the_group_off(tmp_path: Path) -> None:
    """A family that calls q and v but not k on an input (as layers that reuse another layer's
    K/V do): the next computations find k's output untaken, and after two the group stops;
    every output is still the per-projection one."""
    x, later = mx.random.normal((3, 1, 64)), mx.random.normal((3, 1, 64))
    aset, (q, k, v), rows = adapted_qkv(tmp_path)
    with lora.use_adapters(rows):
        first = [q(x), v(x)]
        second = [q(later), v(later)]
        third = [q(x), k(x), v(x)]
    assert q._shared is not None and not q._shared.enabled
    for m, out in zip((q, v), first):
        assert mx.array_equal(out, alone(aset, m, x, rows))
    for m, out in zip((q, v), second):
        assert mx.array_equal(out, alone(aset, m, later, rows))
    for m, out in zip((q, k, v), third):
        assert mx.array_equal(out, alone(aset, m, x, rows))


def test_a_forward_cut_short_leaves_the_group_on(tmp_path: Path) -> None:
    """q alone (the forward failed after it), then a whole forward: the group computes anew,
    serves it and stays on."""
    x, later = mx.random.normal((3, 1, 64)), mx.random.normal((3, 1, 64))
    aset, (q, k, v), rows = adapted_qkv(tmp_path)
    with lora.use_adapters(rows):
        q(x)
        outs = [q(later), k(later), v(later)]
    assert q._shared is not None and q._shared.enabled
    for m, out in zip((q, k, v), outs):
        assert mx.array_equal(out, alone(aset, m, later, rows))


def test_fused_projections_take_one_kernel_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """phi3's fused qkv_proj and gate_up_proj read one input each: no groups, a kernel per
    adapted module in a one-token forward (none in a prompt's, which takes mlx-lm's products
    grouped by slot), and each row has mlx-lm's logits with its adapter either way."""
    from mlx_lm.models import phi3
    from mlx_lm.tuner.utils import load_adapters

    from bench.multi_lora import write_adapter

    def tiny_phi3() -> phi3.Model:
        mx.random.seed(3)
        args = phi3.ModelArgs(
            model_type="phi3",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            vocab_size=256,
        )
        m = phi3.Model(args)
        m.set_dtype(mx.float32)
        mx.eval(m.parameters())
        return m

    keys = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
    model = tiny_phi3()
    modules = dict(model.layers[0].named_modules())
    dims = {key: lora.linear_dims(modules[key]) for key in keys}
    write_adapter(tmp_path / "a", len(model.layers), dims, keys, 8, 0)
    aset = lora.AdapterSet(model, kernel=True)
    aset.add(lora.load_adapter("a", tmp_path / "a", model))
    assert all(w._shared is None for w in aset.wrappers.values())
    rows = aset.rows(np.array([aset.slot("a"), 0], np.int32))
    tokens = mx.array([[5, 6, 7, 8], [9, 10, 11, 12]], mx.int32)
    got = {}
    for part in (tokens, tokens[:, -1:]):
        with lora.use_adapters(rows), kernel_calls(monkeypatch) as calls:
            got[part.shape[1]] = model(part)
        one = part.shape[1] == 1
        assert calls == ([1] * len(keys) * len(model.layers) if one else [])
    ref = tiny_phi3()
    for part in (tokens, tokens[:, -1:]):
        assert mx.abs(got[part.shape[1]][1] - ref(part[1:])[0]).max().item() < 1e-4
    load_adapters(ref, str(tmp_path / "a"))
    for part in (tokens, tokens[:, -1:]):
        assert mx.abs(got[part.shape[1]][0] - ref(part[:1])[0]).max().item() < 1e-4


def test_the_gathered_per_rank_products_are_each_rows_own(tmp_path: Path) -> None:
    """The MLX-op path's prefill over a stack of several ranks (a product per rank, of the
    stack's rank slices) adds each row's own update, as plain products of its slot's matrices
    give it. On CUDA this is what the eager side of the compiled-decode test stands on: MLX's
    CUDA gather_mm read a rank slice of B with the wrong batch stride and lost the update of
    every adapter below the stack's largest rank."""
    from bench.multi_lora import write_adapter
    from tests.helpers.tiny import tiny_llama

    model = tiny_llama()
    aset = lora.AdapterSet(model)
    modules = dict(model.layers[0].named_modules())
    dims = {key: lora.linear_dims(modules[key]) for key in SEVEN}
    specs = {"r4": (4, SEVEN), "r8": (8, SEVEN[:1]), "r16": (16, SEVEN[:1])}
    for seed, (name, (rank, keys)) in enumerate(specs.items()):
        write_adapter(tmp_path / name, len(model.layers), dims, keys, rank, seed)
        aset.add(lora.load_adapter(name, tmp_path / name, model))
    q = model.layers[0].self_attn.q_proj
    stack = q._stack
    assert stack is not None and len(stack.by_rank) == 3
    slots = np.array([aset.slot("r4"), 0, aset.slot("r16"), aset.slot("r8"), aset.slot("r4")])
    rows = aset.rows(slots.astype(np.int32))
    assert rows is not None
    x = mx.random.normal((len(slots), 6, q.linear.weight.shape[1]), key=mx.random.key(3))
    with lora.use_adapters(rows):
        got = q(x) - q.linear(x)
    local = stack.local_of(rows.slots)
    scales = rows.scales(q._scales, mx.float32)
    for i in range(len(slots)):
        s = local[i].item()
        want = scales[i].item() * ((x[i] @ stack.a[s]) @ stack.b[s])
        size = mx.abs(want).max().item()
        assert (size > 0) == (slots[i] != 0)
        assert mx.abs(got[i] - want).max().item() <= 1e-3 * max(size, 1e-6), i


@cuda_only
@pytest.mark.parametrize("mode", ["as served", "small fills", "no fold"])
def test_compiled_decode_steps_with_adapters_give_the_eager_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The CUDA decode path (steps replayed from a compiled graph with the rows' slots as an
    input, one kernel per group of projections over q/k/v and gate/up fused into one matmul
    each, o_proj's and down_proj's updates inside the residual adds, K/V written in place)
    gives the greedy tokens of the same rows stepped op by op on the gathered MLX-op path, rows
    of three adapters (of different targets and ranks) and of none in one batch. So it does
    when the forward's counts take a fill at nearly every launch (fills of one compiled trace
    stay apart), and when no update is folded (o's and down's kernels run)."""
    if mode == "small fills":
        monkeypatch.setattr(lora_kernel.Counts, "CHUNK", 64)
    if mode == "no fold":
        monkeypatch.setattr(residual_norm, "foldable", lambda *_: False)
    from bench.multi_lora import write_adapter
    from service.core.engine.config import EngineConfig
    from service.core.engine.kv_paged import PagedKVStorage
    from service.protocol import SamplingParams
    from tests.helpers.tiny import LAYERS, StepRow, make_engine, tiny_llama

    specs = {
        "all7": (4, SEVEN),
        "qv": (8, ["self_attn.q_proj", "self_attn.v_proj"]),
        "mlp": (16, ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]),
    }
    prompts = [[(7 * r + 3 * i) % 250 + 3 for i in range(5 + 3 * r)] for r in range(6)]
    names = ["all7", "qv", None, "mlp", "all7", None]
    outs = {}
    for cuda in (False, True):
        model = tiny_llama(hidden_size=128, heads=2, kv_heads=1, seed=11)  # head_dim 64
        if cuda:
            # As runtime.load does, before the adapters wrap them: the o_proj and down_proj
            # updates are then made by the residual adds after them.
            projections.fuse(model)
            residual_norm.install(model)
        modules = dict(model.layers[0].named_modules())
        dims = {key: lora.linear_dims(modules[key]) for key in SEVEN}
        aset = lora.AdapterSet(model, kernel=cuda)
        for seed, (name, (rank, keys)) in enumerate(specs.items()):
            path = tmp_path / name
            if not path.exists():
                write_adapter(path, len(model.layers), dims, keys, rank, seed)
            aset.add(lora.load_adapter(name, path, model))
        direct = "direct" if cuda else "gather"
        storage = PagedKVStorage(
            LAYERS, 1, 64, mx.float32, 64, 8, decode_attention=direct, in_place=cuda
        )
        config = EngineConfig(
            decode_attention=direct,
            in_place_writes=cuda,
            compile_decode=cuda,
            lora_kernel=cuda,
        )
        engine = make_engine(model, storage, config, adapters=aset)
        seqs = [
            engine.add_sequence(
                f"r{i}", SamplingParams(), p, adapter=aset.slot(n) if n else lora.NO_ADAPTER
            )
            for i, (n, p) in enumerate(zip(names, prompts))
        ]
        out = [[r.token_id] for r in engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)])]
        for _ in range(16):
            for i, r in enumerate(engine.step([StepRow(s) for s in seqs])):
                out[i].append(r.token_id)
        outs[cuda] = out
        assert all(g.enabled for g in projections.groups(model))
    assert outs[True] == outs[False]


# -- the source, compiled without a GPU -------------------------------------------------------

NVCC_CASES = [  # tokens, in, outs, rank, activations, stacks
    (64, 4096, [4096, 1024, 1024], 16, mx.bfloat16, mx.bfloat16),
    (7, 4096, [14336, 14336], 8, mx.bfloat16, mx.float32),
    (300, 14336, [4096], 16, mx.float32, mx.float32),
    (5, 100, [36, 60], 16, mx.bfloat16, mx.float32),  # element-by-element loads
    (3, 576, [576, 192, 192], 64, mx.float16, mx.float16),
    (2, 4096, [4096], 256, mx.bfloat16, mx.bfloat16),  # ranks in passes of 32
]


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_fused_source_compiles_for_every_shape_and_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fused_add`'s launches (its template values and grid, computed by its own host code),
    wrapped as MLX wraps a custom kernel and compiled by nvcc for the H100/H200 architecture:
    no error, no register spill, and few enough registers that a block of FUSED_WARPS warps
    can launch at all."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(lora_kernel, "available", lambda: True)
    monkeypatch.setattr(lora_kernel, "_fused", lora_kernel._fused.__wrapped__)
    for tokens, width, outs, rank, act, stacks in NVCC_CASES:
        x = mx.zeros((tokens, width), act)
        parts = [
            lora_kernel.Part(
                mx.zeros((tokens, out), act),
                mx.zeros((5, rank, width), stacks),
                mx.zeros((5, rank, out), stacks),
                mx.zeros((tokens,), mx.int32),
            )
            for out in outs
        ]
        lora_kernel.fused_add(x, parts, mx.zeros((tokens,), mx.float32))
    for launch, (tokens, _, outs, _, _, _) in zip(recorder.launches, NVCC_CASES, strict=True):
        threads = launch.threadgroup[0]
        assert threads == lora_kernel.FUSED_WARPS * 32
        tiles = lora_kernel.tiles(tokens, 5)
        assert launch.grid[0] == threads * tiles * sum(lora_kernel.blocks(out) for out in outs)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == len(NVCC_CASES), compiled.log
    assert compiled.spills == 0, compiled.log
    assert max(compiled.registers) * lora_kernel.FUSED_WARPS * 32 <= 65536, compiled.registers


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_tensor_parallel_kernels_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`shrink` and `expand_add` (a sharded-to-all layer's update under tensor parallel), from
    their own host code, compiled by nvcc as MLX wraps them: no error, no spill."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(lora_kernel, "available", lambda: True)
    monkeypatch.setattr(lora_kernel, "_shrink", lora_kernel._shrink.__wrapped__)
    monkeypatch.setattr(lora_kernel, "_expand_add", lora_kernel._expand_add.__wrapped__)
    for act, stacks in [(mx.bfloat16, mx.bfloat16), (mx.float32, mx.float32)]:
        idx = mx.zeros((9,), mx.int32)
        z = lora_kernel.shrink(mx.zeros((9, 512), act), mx.zeros((3, 16, 512), stacks), idx)
        y, b = mx.zeros((9, 300), act), mx.zeros((3, 16, 300), stacks)
        lora_kernel.expand_add(y, z, b, idx, mx.zeros((9,), mx.float32))
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == 4, compiled.log
    assert compiled.spills == 0, compiled.log


def test_the_kernel_pair_gives_the_fused_update() -> None:
    """`shrink_expand_add` (`bench/lora_kernel.py --pair`): `shrink` then `expand_add` per
    module gives `fused_add`'s outputs (on the CPU both are their MLX-op references; on CUDA
    within rounding), for parts with their own y and for parts reading columns of one y."""
    x, parts, scale, _ = fused_case(9, 64, [48, 16, 16], 8, mx.float32)
    for case in (parts, side_by_side(parts)):
        want = lora_kernel.fused_add(x, case, scale)
        for got, w, part in zip(lora_kernel.shrink_expand_add(x, case, scale), want, case):
            assert got.shape == w.shape
            assert_close_rounded(got, w, part.base(), mx.float32)


def test_the_benchs_launch_floor_is_the_kernel_with_every_block_copying() -> None:
    """`bench/lora_kernel.py --floor` rewrites this revision's kernel: the zero-update branch
    taken by every block, under a kernel name of its own. It stops with a message once the
    kernel's source no longer has that branch, rather than timing something else."""
    from bench import lora_kernel as bench_kernel

    floor = bench_kernel.floor_source(Path(lora_kernel.__file__).read_text())
    assert floor.count("  if (true) {") == 1 and "if (s == 0)" not in floor
    assert 'name=f"lora_floor{parts}"' in floor
    assert callable(bench_kernel.copy_floor())
    with pytest.raises(SystemExit, match="zero-update branch"):
        bench_kernel.floor_source("no such branch")


def test_the_benchs_kernel_times_sum_each_calls_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench/lora_kernel.py --kernel-times`: for each form and each call a layer makes, the GPU
    time of a call is the sum of its kernels' records (median over the calls), and a form whose
    outputs differ from this revision's kernel's is marked as such."""
    import argparse

    from bench import cuda_timeline
    from bench import lora_kernel as bench_kernel

    def traced(run):  # two kernels a call, of 1 and 2 µs
        run()
        return None, [(10.0 * i, 10.0 * i + 1 + i % 2, "k") for i in range(2 * 3)]

    monkeypatch.setattr(cuda_timeline, "traced", traced)
    args = argparse.Namespace(
        preset="smollm2-135m", layers=1, adapters=2, rank=4, adapter_dtype="float32"
    )
    layers, shapes = bench_kernel.build(args)
    idx = mx.array([0, 1, 2, 1], mx.int32)
    scale = mx.ones((4,), mx.float32)

    def shifted(x, parts, scale):  # other numbers than the kernel's
        return [out + 1 for out in lora_kernel.fused_add(x, parts, scale)]

    forms = {"base": None, "kernel": lora_kernel.fused_add, "shifted": shifted}
    times, same = bench_kernel.kernel_times(layers, shapes, forms, idx, scale, 4, calls=3)
    assert set(times) == {"kernel", "shifted"}
    assert list(times["kernel"]) == ["q/k/v", "o", "gate/up", "down"]
    assert all(us == 3.0 for row in times.values() for us in row.values())
    assert all(same["kernel"].values()) and not any(same["shifted"].values())


# -- passes of many tokens a row -------------------------------------------------------------------


def rows_case(
    rows: int,
    length: int,
    width: int,
    outs: list[int],
    rank: int,
    dtype: mx.Dtype,
    per_token: bool = False,
) -> tuple[mx.array, list[lora_kernel.Part], mx.array]:
    """`fused_case`'s x, parts and scales as [rows, length, ...], with one adapter a row (a
    prefill pass's prompts) or, with `per_token`, one a token."""
    tokens = rows * length
    x, parts, scale, _ = fused_case(
        tokens, width, outs, rank, dtype, row_tokens=1 if per_token else length
    )
    shaped = [lora_kernel.Part(p.y.reshape(rows, length, -1), p.a_t, p.b, p.idx) for p in parts]
    return x.reshape(rows, length, width), shaped, scale


def test_the_row_kernels_give_the_fused_update_in_rows_shape() -> None:
    """`rows_add` (a prefill pass's form, `bench/lora_kernel.py --prefill`): each part's output
    in [rows, length, out], equal to the reference's, also for parts reading columns of one y
    (on the CPU both are the MLX-op reference; the kernels are held to it on CUDA below)."""
    x, parts, scale = rows_case(3, 5, 64, [48, 16, 16], 8, mx.float32)
    for case in (parts, side_by_side(parts)):
        want = lora_kernel.reference_fused_add(x, case, scale)
        for got, w, part in zip(lora_kernel.rows_add(x, case, scale, 5), want, case):
            assert got.shape == w.shape == (3, 5, part.width)
            assert_close_rounded(got, w, part.base(), mx.float32)


def test_the_staged_input_chunks_fit_float4_reads() -> None:
    """`shrink_rows` reads its staged inputs four at a time: every rank's chunk is a multiple
    of 4, between 16 and 128."""
    for rank in range(1, 513):
        chunk = lora_kernel.input_chunk(rank)
        assert chunk % 4 == 0 and 16 <= chunk <= 128, rank


@cuda_only
@pytest.mark.parametrize("rows,length", [(4, 32), (3, 21), (5, 1), (1, 40)])
@pytest.mark.parametrize("shape", ["llama8b-qkv", "smol-gate-up", "odd"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("per_token", [False, True], ids=["rows", "tokens"])
def test_the_row_kernels_match_the_reference(
    rows: int, length: int, shape: str, dtype: mx.Dtype, per_token: bool
) -> None:
    """`shrink_rows` and `expand_add_rows` against the MLX-op reference: rows of one adapter
    (tiles sharing A and B), rows whose length is no multiple of a tile, one-token rows, and
    tokens of different slots within a row (each token's own slot); base outputs as columns of
    one y too; widths with and without vector loads."""
    width, outs = {**SHAPES, "odd": (100, [36, 60])}[shape]
    for rank in (8, 48):
        x, parts, scale = rows_case(rows, length, width, outs, rank, dtype, per_token)
        for case in (parts, side_by_side(parts)):
            want = lora_kernel.reference_fused_add(x, case, scale)
            for got, w, part in zip(lora_kernel.rows_add(x, case, scale, length), want, case):
                assert got.shape == w.shape
                assert_close_rounded(got, w, part.base(), dtype)


@pytest.mark.skipif(cuda_source.nvcc() is None, reason="no nvcc on this machine")
def test_the_row_kernels_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`shrink_rows` and `expand_add_rows`, from their own host code, compiled by nvcc as MLX
    wraps them, for ranks from 8 to 256 and widths with and without vector loads: no error, no
    spill, and few enough registers for a block of TILE_THREADS."""
    recorder = cuda_source.Recorder(monkeypatch)
    monkeypatch.setattr(lora_kernel, "available", lambda: True)
    monkeypatch.setattr(lora_kernel, "_shrink_rows", lora_kernel._shrink_rows.__wrapped__)
    monkeypatch.setattr(lora_kernel, "_expand_add_rows", lora_kernel._expand_add_rows.__wrapped__)
    cases = [
        (mx.bfloat16, mx.float32, 4096, 14336, 16),
        (mx.bfloat16, mx.bfloat16, 14336, 4096, 8),
        (mx.float32, mx.float32, 576, 100, 64),
        (mx.float16, mx.float16, 100, 576, 256),
        (mx.bfloat16, mx.float32, 4096, 1024, 48),
    ]
    for act, stacks, width, out, rank in cases:
        idx = mx.zeros((64,), mx.int32)
        z = lora_kernel.shrink_rows(
            mx.zeros((64, width), act), mx.zeros((3, rank, width), stacks), idx, 32
        )
        y, b = mx.zeros((64, out), act), mx.zeros((3, rank, out), stacks)
        lora_kernel.expand_add_rows(y, z, b, idx, mx.zeros((64,), mx.float32), 32)
    compiled = recorder.compile(tmp_path)
    assert len(compiled.registers) == len(recorder.launches) == 2 * len(cases), compiled.log
    assert compiled.spills == 0, compiled.log
    assert max(compiled.registers) * lora_kernel.TILE_THREADS <= 65536, compiled.registers
