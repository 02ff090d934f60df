"""Every family, engine level: rows of different lengths decoding together give mlx-lm's own
greedy generation of each prompt alone, token for token, logprobs within 1e-4.

Tiny seeded random models built from mlx-lm's classes with the features of their real
configurations (RoPE scaling, sliding windows, hybrid layers, MoE, quantization) and peaked
logits (an untied head scaled up, so near-ties cannot hide a bug). The engine runs the decode
path this platform resolves to (on CUDA: the paged kernel, in-place writes, overlapped and
compiled steps; elsewhere MLX ops), with steps pipelined as the scheduler pipelines them.
The same models through the real gRPC server: tests/test_conformance.py.
"""

from __future__ import annotations

import random
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.generate import generate_step
from mlx_lm.utils import _get_classes

from service.core.engine.config import resolve
from service.core.engine.paged_attention import kernel_available, kernel_supports
from service.core.engine.runner import ModelRunner
from service.core.engine.sampler import SamplingParams
from service.core.engine.storage import PoolShape, make_storage
from service.core.models import decode_gemm, norms, projections, quantized, residual_norm, rope
from service.core.models.families import family
from service.core.models.layout import probe_layout
from service.core.models.loader import float_dtype, materialize, model_family
from tests.helpers.quantized import quantized_product_inputs
from tests.helpers.tiny import Driven, StepRow

V = 512
LLAMA3_ROPE = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
ATTN = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=V)
CONFIGS: dict[str, dict] = {
    "llama3": dict(ATTN, model_type="llama", num_hidden_layers=2, intermediate_size=256,
                   rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                   max_position_embeddings=131072, tie_word_embeddings=False),
    "llama-dynamic-ntk": dict(ATTN, model_type="llama", num_hidden_layers=2,
                              intermediate_size=256, rms_norm_eps=1e-5,
                              max_position_embeddings=24, tie_word_embeddings=False,
                              rope_scaling={"factor": 2.0, "type": "dynamic"}),
    "llama-yarn": dict(ATTN, model_type="llama", num_hidden_layers=2, intermediate_size=256,
                       rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_scaling={"factor": 4.0, "rope_type": "yarn",
                                     "original_max_position_embeddings": 4096}),
    "mistral-layer-types": dict(ATTN, model_type="mistral", num_hidden_layers=4,
                                intermediate_size=256, rms_norm_eps=1e-5,
                                tie_word_embeddings=False, sliding_window=8,
                                layer_types=["sliding_attention", "full_attention"] * 2),
    "qwen2": dict(ATTN, model_type="qwen2", num_hidden_layers=2, intermediate_size=256,
                  rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": dict(ATTN, model_type="qwen3", num_hidden_layers=2, intermediate_size=256,
                  head_dim=32, rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False,
                  max_position_embeddings=4096),
    "qwen3_moe": dict(ATTN, model_type="qwen3_moe", num_hidden_layers=2, intermediate_size=256,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6,
                      head_dim=32, rope_theta=1e6, tie_word_embeddings=False,
                      max_position_embeddings=4096, norm_topk_prob=True),
    "mixtral": dict(ATTN, model_type="mixtral", num_hidden_layers=2, intermediate_size=256,
                    num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
                    rope_theta=1e6, tie_word_embeddings=False),
    "phi3-longrope": dict(ATTN, model_type="phi3", num_hidden_layers=2, intermediate_size=256,
                          rms_norm_eps=1e-5, max_position_embeddings=131072,
                          original_max_position_embeddings=4096,
                          rope_scaling={"type": "longrope", "long_factor": [1.5] * 16,
                                        "short_factor": [1.0] * 16,
                                        "original_max_position_embeddings": 4096}),
    "gemma2": dict(ATTN, model_type="gemma2", num_hidden_layers=2, intermediate_size=256,
                   head_dim=32, rms_norm_eps=1e-6, query_pre_attn_scalar=32),
    "gemma3_text": dict(ATTN, model_type="gemma3_text", num_hidden_layers=6,
                        intermediate_size=256, head_dim=32, rms_norm_eps=1e-6,
                        sliding_window=8, sliding_window_pattern=3),
    "gpt_oss": dict(ATTN, model_type="gpt_oss", num_hidden_layers=4, num_local_experts=4,
                    num_experts_per_tok=2, intermediate_size=128, head_dim=32,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2),
    "mamba": dict(model_type="mamba", vocab_size=V, hidden_size=64, intermediate_size=128,
                  state_size=16, num_hidden_layers=2, conv_kernel=4, use_bias=False,
                  use_conv_bias=True, time_step_rank=8, tie_word_embeddings=False),
    "mamba2": dict(model_type="mamba2", vocab_size=V, hidden_size=64, intermediate_size=128,
                   state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-5, conv_kernel=4,
                   use_bias=False, use_conv_bias=True, time_step_limit=(0.0, float("inf")),
                   time_step_rank=8, num_heads=8, head_dim=16, n_groups=1,
                   residual_in_fp32=True, tie_word_embeddings=False, chunk_size=32),
    "lfm2": dict(ATTN, model_type="lfm2", num_hidden_layers=4, max_position_embeddings=4096,
                 norm_eps=1e-5, conv_bias=False, conv_L_cache=3, block_dim=128,
                 block_ff_dim=256, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
                 block_auto_adjust_ff_dim=False, full_attn_idxs=[1, 3]),
    "qwen3_next": dict(ATTN, model_type="qwen3_next", num_hidden_layers=4,
                       intermediate_size=256, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16,
                       linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4,
                       num_experts_per_tok=2, decoder_sparse_step=1,
                       shared_expert_intermediate_size=64, mlp_only_layers=[],
                       moe_intermediate_size=64, rms_norm_eps=1e-6, rope_theta=1e6,
                       partial_rotary_factor=0.25, max_position_embeddings=4096, head_dim=32,
                       full_attention_interval=2),
    "nemotron_h": dict(ATTN, model_type="nemotron_h", intermediate_size=256,
                       max_position_embeddings=4096, attention_bias=False, mamba_num_heads=4,
                       mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16,
                       conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                       use_bias=False, use_conv_bias=True, head_dim=32,
                       hybrid_override_pattern=["M", "*", "M", "-"],
                       time_step_limit=(0.0, float("inf"))),
    "falcon_h1": dict(ATTN, model_type="falcon_h1", head_dim=32, intermediate_size=256,
                      mamba_d_conv=4, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16,
                      mamba_n_heads=4, mamba_chunk_size=32, num_hidden_layers=2,
                      tie_word_embeddings=False),
    "jamba": dict(ATTN, model_type="jamba", intermediate_size=256, num_hidden_layers=4,
                  attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
                  expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
                  num_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-6,
                  max_position_embeddings=4096, tie_word_embeddings=False),
    "granitemoehybrid": dict(ATTN, model_type="granitemoehybrid", intermediate_size=256,
                             num_hidden_layers=4, max_position_embeddings=4096,
                             attention_bias=False, embedding_multiplier=12.0,
                             attention_multiplier=0.03125, logits_scaling=4.0,
                             residual_multiplier=0.22,
                             layer_types=["mamba", "attention", "mamba", "attention"],
                             rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, mamba_n_heads=4, mamba_d_head=16,
                             mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4,
                             mamba_n_groups=1, mamba_conv_bias=True, tie_word_embeddings=False),
}  # fmt: skip
QUANTIZED = {
    "llama3-4bit": ("llama3", 4, 64),
    "qwen3-8bit": ("qwen3", 8, 32),
    "qwen3_moe-4bit": ("qwen3_moe", 4, 32),  # the experts quantized too (QuantizedSwitchLinear)
}


def model_family_of(config: dict) -> str:
    model_class, _ = _get_classes(config)
    return model_class.__module__.rsplit(".", 1)[-1]


def build(name: str, dtype: mx.Dtype = mx.float32) -> nn.Module:
    base, bits, group = QUANTIZED.get(name, (name, 0, 0))
    config = CONFIGS[base]
    model_class, args_class = _get_classes(config)
    mx.random.seed(3)
    model = model_class(args_class.from_dict(config))
    model.update(
        tree_map(
            lambda p: mx.random.normal(p.shape) * 0.1 if mx.issubdtype(p.dtype, mx.floating) else p,
            model.parameters(),
        )
    )
    if "lm_head" in model:  # peaked logits: a wide margin between the first two tokens
        model.lm_head.weight = model.lm_head.weight * 8
    if bits:
        nn.quantize(model, group_size=group, bits=bits)
    if dtype != mx.float32:
        model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def alone(
    name: str, prompt: list[int], steps: int, dtype: mx.Dtype = mx.float32
) -> list[tuple[int, float]]:
    """mlx-lm's own greedy generation of one prompt, on a fresh copy of the model."""
    out = []
    stream = generate_step(
        mx.array(prompt),
        build(name, dtype),
        max_tokens=steps,
        sampler=lambda x: mx.argmax(x, axis=-1),
    )
    for token, logprobs in stream:
        out.append((int(token), logprobs[int(token)].item()))
    return out


def serve(
    name: str,
    prompts: list[list[int]],
    steps: int,
    paged: bool = True,
    direct: bool = False,
    fused: bool | None = None,
    folded: bool | None = None,
    dequantized: bool = False,
    dtype: mx.Dtype = mx.float32,
):
    """Our engine: prefill the prompts (together unless the model keeps recurrent state, which
    prefills one row per forward), then decode every row together, pipelined as the scheduler
    does (step N+1 queued before N is read where the platform overlaps steps). `direct`: decode
    attention read from the pool, through the MLX-ops reference of the CUDA kernel; `fused`:
    sibling projections as one matmul (None: where the platform fuses them, as the server);
    `folded`: quantized projections fold the rows into one product (None: as the platform);
    `dequantized`: quantized layers made float at load (the CPU server's form); `dtype`: the
    model's (bfloat16: the GPU server's)."""
    model = build(name, dtype)
    if dequantized:
        assert quantized.dequantize(model) > 0
    rope.install(model)
    materialize(model)
    layout = probe_layout(model)
    fam = family(model_family(model))
    heads = getattr(model.args, "num_attention_heads", 0) or 0
    config = resolve(
        fam,
        layout,
        paged=paged,
        batched=True,
        head_dim_supported=kernel_supports(layout.head_dim),
        # As the runtime: a float32 model's mirrored steps (CPU) compute their own attention.
        float32=float_dtype(model) == mx.float32,
        grouped_heads=heads > layout.kv_heads,
        compilable=not rope.reads_offsets_on_host(model),
    )
    if direct:  # as CUDA: RoPE left to the write and the attention; adds and norms fused
        config = replace(
            config,
            decode_attention="direct",
            fast_mirror_attention=False,
            rope_in_kernels=True,
            shared_rope_angles=False,
            fused_add_norm=True,
        )
    if config.shared_rope_angles:  # as the runtime: the CPU's layers share RoPE's angles
        rope.share_angles(model)
    if config.rope_in_kernels:  # as the runtime: direct steps' RoPE left to the decode kernels
        rope.defer(model)
    if config.compiled_norms:  # and normalize with compiled chains
        norms.install(model)
    if config.fused_projections if fused is None else fused:
        projections.fuse(model)
    if config.decode_gemm:
        decode_gemm.install(model)
    if config.fused_add_norm:
        residual_norm.install(model)
    if config.fold_quantized_rows if folded is None else folded:
        quantized.fold_rows(model)
    storage = make_storage(config, model, layout, PoolShape(num_blocks=256))
    runner = ModelRunner(
        model,
        storage,
        layout,
        config,
        max_rows=len(prompts),
        max_blocks_per_row=256,
        split_head=fam.split_head,
    )
    engine = Driven(runner)
    seqs = [
        engine.add_sequence(f"r{i}", SamplingParams(), p, want_logprobs=True)
        for i, p in enumerate(prompts)
    ]
    out: list[list[tuple[int, float]]] = [[] for _ in prompts]

    def take(results):
        for r in results:
            assert r.error is None, r.error
            out[seqs.index(r.seq)].append((r.token_id, r.logprob))

    if config.single_row_prefill:
        for s, p in zip(seqs, prompts):
            take(engine.prefill([StepRow(s, p)]))
    else:
        take(engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)]))
    pending = engine.submit([StepRow(s) for s in seqs])
    for n in range(steps - 1):
        nxt = None
        if n < steps - 2:
            nxt = engine.submit([StepRow(s) for s in seqs], dispatch=config.overlap_steps)
        take(engine.finish_rows(pending))
        if nxt is not None and not config.overlap_steps:
            engine.dispatch(nxt)
        pending = nxt
    for s in seqs:
        engine.release(s)
    return engine, out


def prompts_for() -> list[list[int]]:
    """Four prompts of different lengths, two longer than the sliding windows (8)."""
    rnd = random.Random(1)
    return [[rnd.randrange(1, V) for _ in range(n)] for n in (5, 23, 9, 31)]


def assert_same(want: list[list[tuple[int, float]]], got: list[list[tuple[int, float]]]):
    for i, (w, g) in enumerate(zip(want, got)):
        assert [t for t, _ in g] == [t for t, _ in w], f"row {i}"
        worst = max(abs(a - b) for (_, a), (_, b) in zip(w, g))
        assert worst < 1e-4, f"row {i}: logprobs differ by {worst}"


@pytest.mark.parametrize("name", [*CONFIGS, *QUANTIZED])
def test_batched_rows_give_mlx_lm_alone(name):
    prompts = prompts_for()
    steps = 12
    want = [alone(name, p, steps) for p in prompts]
    engine, got = serve(name, prompts, steps)
    assert_same(want, got)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks  # nothing left behind
    if engine.states is not None:
        assert engine.states.live_sequences == 0


@pytest.mark.skipif(kernel_available(), reason="the CUDA path reads the pool directly already")
@pytest.mark.parametrize(
    "name", [n for n, c in CONFIGS.items() if family(model_family_of(c)).direct_decode]
)
def test_direct_decode_reference_gives_mlx_lm_alone(name, monkeypatch: pytest.MonkeyPatch):
    """The families the CUDA kernel serves, through the kernel's MLX-ops reference here, with
    their RoPE deferred to the pool write and the attention as on CUDA (where the family's
    RoPE is one the kernels apply)."""
    taken = []
    take = rope.take

    def counted(x: mx.array) -> rope.Rotation | None:
        rotation = take(x)
        if rotation is not None:
            taken.append(rotation)
        return rotation

    monkeypatch.setattr(rope, "take", counted)
    prompts = prompts_for()
    want = [alone(name, p, 8) for p in prompts]
    engine, got = serve(name, prompts, 8, direct=True)
    assert engine.config.decode_attention == "direct" and engine.config.rope_in_kernels
    assert_same(want, got)
    deferred = [m for m in engine.engine.model.modules() if isinstance(m, rope.DeferredRoPE)]
    assert bool(taken) == bool(deferred)


@pytest.mark.skipif(not kernel_available(), reason="the CUDA path's bfloat16 kernels")
@pytest.mark.parametrize("name", ["llama3", "qwen3", "mistral-layer-types"])
def test_bfloat16_cuda_path_follows_mlx_lm(name):
    """In bfloat16 every product, norm and attention of the CUDA path is a kernel of ours
    (decode_gemm, its gated SwiGLU, the add+RMSNorm, the attention that rotates and stores),
    rounding where MLX's do but summing in other orders, so tokens may part from mlx-lm's
    once two logits come within a rounding. With the peaked head they almost never do: the
    rows' tokens up to their first difference must cover most of them (a wrong kernel leaves
    next to none)."""
    prompts = prompts_for()
    steps = 8
    want = [alone(name, p, steps, mx.bfloat16) for p in prompts]
    _, got = serve(name, prompts, steps, dtype=mx.bfloat16)
    agreed = 0
    for w, g in zip(want, got):
        for (a, _), (b, _) in zip(w, g):
            if a != b:
                break
            agreed += 1
    assert agreed >= 0.75 * steps * len(prompts), (agreed, want, got)


@pytest.mark.parametrize("name", [*CONFIGS, *QUANTIZED])
def test_fused_projections_give_mlx_lm_alone(name):
    """q/k/v and gate/up as one matmul each (the CUDA path's; here on the CPU too): mlx-lm's
    tokens, and no group gave up on the family's way of calling its projections."""
    prompts = prompts_for()
    want = [alone(name, p, 8) for p in prompts]
    engine, got = serve(name, prompts, 8, fused=True)
    assert_same(want, got)
    groups = projections.groups(engine.engine.model)
    assert all(g.enabled for g in groups)
    if name not in ("mamba", "mamba2", "phi3-longrope"):  # no projections; phi3's come fused
        assert groups, "no sibling projections fused"


@pytest.mark.parametrize(
    ("fused", "dequantize_rows"),
    [(False, None), (True, None), (True, 16)],
    ids=["alone", "fused", "wide-dequantized"],
)
@pytest.mark.parametrize("name", QUANTIZED)
def test_folded_quantized_rows_give_mlx_lm_alone(name, fused, dequantize_rows, monkeypatch):
    """Quantized projections (and a tied quantized head) taking the batch's rows as one
    product (the CUDA path's; here on the CPU too): mlx-lm's tokens, and in a decode-shaped
    forward every quantized product sees a 2-D input. `dequantize_rows`: products of that
    many rows (here the prefill passes) run on the dequantized weight."""
    if dequantize_rows is not None:
        monkeypatch.setattr(quantized, "DEQUANTIZE_ROWS", dequantize_rows)
    prompts = prompts_for()
    want = [alone(name, p, 8) for p in prompts]
    engine, got = serve(name, prompts, 8, fused=fused, folded=True)
    assert_same(want, got)
    with quantized_product_inputs() as seen:
        mx.eval(engine.engine.model(mx.array([[5], [6], [7]], dtype=mx.int32)))
    dims = {len(shape) for shape in seen}
    assert seen and dims == {2}, f"quantized products saw inputs of {dims} dims"
    if dequantize_rows is not None:
        with quantized_product_inputs() as seen:
            rows = mx.arange(5, 5 + dequantize_rows, dtype=mx.int32)[:, None]
            mx.eval(engine.engine.model(rows))
        assert seen == [], "a forward of that many rows ran a quantized product"


@pytest.mark.parametrize("name", QUANTIZED)
def test_dequantized_weights_give_mlx_lm_alone(name):
    """The CPU server's form of a quantized checkpoint (float layers holding the dequantized
    weights) against mlx-lm running the quantized model: mlx-lm's tokens."""
    prompts = prompts_for()
    want = [alone(name, p, 8) for p in prompts]
    assert_same(want, serve(name, prompts, 8, dequantized=True)[1])


@pytest.mark.parametrize("name", ["gemma3_text", "falcon_h1"])
def test_dense_storage_gives_mlx_lm_alone(name):
    prompts = prompts_for()
    want = [alone(name, p, 8) for p in prompts]
    assert_same(want, serve(name, prompts, 8, paged=False)[1])
