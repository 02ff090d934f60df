"""Tiny seeded checkpoints of real model families, mlx-lm's greedy reference, and the
conformance run that compares our server with it.

Each family's config.json is a real checkpoint's configuration (named in `Family.source`)
shrunk in size only: widths, layer counts, vocabulary (the embedded SmolLM2 tokenizer's) and
sliding windows (to 10-16 tokens, so test prompts exceed them). Everything that changes what
the model computes stays: rope_scaling blocks, layer_types / window patterns, hybrid layer
patterns, attention sinks, MoE routing, head_dim, tying, norms, multipliers, softcaps.

The weights are mlx-lm's own model classes' initialisation under a fixed seed, with the output
head (an untied lm_head, or the final norm of a tied model) scaled so that the logits have a
fixed spread: the top-1 / top-2 gaps stay far above float noise, so a mismatch is a bug and
never a near-tie. Quantized variants go through `mlx_lm.utils.quantize_model`, and every
checkpoint is written with mlx-lm's `save_model` / `save_config`, as `mlx_lm.convert` does.

`python -m tests.helpers.model_zoo --report [FAMILY ...]` builds the checkpoints, runs the
conformance check of each against a real server and prints the summary table.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import copy
import functools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import mlx.core as mx
import mlx.nn as nn

from mlxserve.v1 import generation_pb2 as pb
from mlxserve.v1 import generation_pb2_grpc as pb_grpc
from tests.helpers.server import start_server

VOCAB_SIZE = 49152  # the embedded SmolLM2 tokenizer
EOS_ID = 2  # <|im_end|> in that tokenizer
BOS_ID = 1
LOGIT_STD = 5.0  # the logits' spread across the vocabulary after peaking
MAX_TOKENS = 20  # long enough to decode past every window
LOGPROB_TOLERANCE = 1e-4
# Below this top-1 / top-2 logprob gap a step could flip on float noise; every reference step
# must stay above it (checked), so that token mismatches are bugs.
MIN_TOP_GAP = 5e-3
SHARED_PREFIX = 34  # tokens shared by prefix_a and prefix_b: two full 16-token KV blocks + 2

# -- families ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Quantization:
    """How mlx-lm quantizes the checkpoint (what `mlx_lm.convert -q` would write)."""

    bits: int
    group_size: int
    # Keep the token embedding in float (mlx-lm quantizes it by default).
    float_embedding: bool = False
    # (path substring, bits, group_size): per-layer overrides, as mlx-lm's mixed recipes write.
    overrides: tuple[tuple[str, int, int], ...] = ()


@dataclass(frozen=True)
class Family:
    name: str
    source: str  # the real checkpoint whose config.json this is, shrunk
    config: dict[str, Any]
    # Module whose weight sets the logits' scale: an untied lm_head, else the final norm.
    head: str = "lm_head"
    norm_offset: bool = False  # Gemma's norms scale by (1 + weight)
    # A tied model's embedding, scaled down: otherwise the current token's own embedding
    # dominates the residual stream and random weights repeat one token whatever the context.
    embedding: str | None = None
    embedding_scale: float = 0.02
    window: int | None = None  # smallest sliding window of any layer (None: none)
    recurrent: bool = False  # per-sequence recurrent state beside (or instead of) attention
    quantization: Quantization | None = None
    seed: int = 0

    @property
    def model_type(self) -> str:
        return self.config["model_type"]

    @property
    def num_layers(self) -> int:
        cfg = self.config
        if "hybrid_override_pattern" in cfg:
            return len(cfg["hybrid_override_pattern"])
        return cfg["num_hidden_layers"]


def _alternating(first: str, other: str, period: int, layers: int) -> list[str]:
    """Layer types where every `period`-th layer (starting with layer 0) is `first`."""
    return [first if i % period == 0 else other for i in range(layers)]


# Phi-3.5-mini-instruct's longrope factors: 48 per list (head_dim 96); the shrunk head_dim of
# 16 takes 8, every 6th.
_PHI35_LONG_FACTOR = [
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
    1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
    3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
    7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
    24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
    50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
    58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
    62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
    63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
    64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062,
]  # fmt: skip
_PHI35_SHORT_FACTOR = [
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252,
    1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378,
    1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083,
    1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903,
    1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713,
    2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533,
]  # fmt: skip
_PHI35_LONG = _PHI35_LONG_FACTOR[::6]
_PHI35_SHORT = _PHI35_SHORT_FACTOR[::6]

LLAMA_31_8B = {
    # meta-llama/Llama-3.1-8B-Instruct: untied, llama3 RoPE (factor 8), GQA 4 : 1.
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "max_position_embeddings": 131072,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}

QWEN3_06B = {
    # Qwen/Qwen3-0.6B: tied, q/k norms, head_dim decoupled from hidden_size. Hidden 128 so
    # that every projection's input width takes group size 128.
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "max_position_embeddings": 40960,
    "attention_bias": False,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}

FAMILIES: list[Family] = [
    Family(
        "llama",
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0 (default RoPE, untied)",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 176,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "rope_scaling": None,
            "max_position_embeddings": 2048,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
    ),
    Family(
        "llama3_rope",
        "meta-llama/Llama-3.1-8B-Instruct (llama3 rope_scaling, untied)",
        LLAMA_31_8B,
        seed=301,
    ),
    Family(
        "qwen2",
        "Qwen/Qwen2.5-7B-Instruct (q/k/v bias, untied)",
        {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "hidden_size": 112,
            "num_hidden_layers": 2,
            "intermediate_size": 592,
            "num_attention_heads": 7,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "sliding_window": 131072,
            "use_sliding_window": False,
            "max_window_layers": 28,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        },
        seed=102,
    ),
    Family(
        "qwen3",
        "Qwen/Qwen3-0.6B",
        QWEN3_06B,
        head="model.norm",
        embedding="model.embed_tokens",
        seed=3,
    ),
    Family(
        "qwen3_moe",
        "Qwen/Qwen3-30B-A3B (128 experts, top 8, untied)",
        {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 192,
            "moe_intermediate_size": 24,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "rope_scaling": None,
            "max_position_embeddings": 40960,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
        seed=104,
    ),
    Family(
        "mixtral",
        "mistralai/Mixtral-8x7B-Instruct-v0.1 (8 experts, top 2)",
        {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 224,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "rms_norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "sliding_window": None,
            "tie_word_embeddings": False,
        },
        seed=5,
    ),
    Family(
        "phi3_longrope",
        "microsoft/Phi-3.5-mini-instruct (longrope, untied)",
        {
            "model_type": "phi3",
            "architectures": ["Phi3ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 176,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "long_factor": _PHI35_LONG,
                "short_factor": _PHI35_SHORT,
                "type": "longrope",
            },
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 4096,
            "sliding_window": 262144,
            "tie_word_embeddings": False,
        },
        seed=106,
    ),
    Family(
        "gemma2",
        "google/gemma-2-2b-it (softcaps, query_pre_attn_scalar; mlx-lm's gemma2 attends globally"
        " on every layer, so its sliding_window does not change the reference)",
        {
            "model_type": "gemma2",
            "architectures": ["Gemma2ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000.0,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
            "query_pre_attn_scalar": 16,
            "sliding_window": 16,
            "cache_implementation": "hybrid",
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
        head="model.norm",
        embedding="model.embed_tokens",
        norm_offset=True,
        seed=107,
    ),
    Family(
        "gemma3_text",
        "google/gemma-3-1b-it (5 local : 1 global layers, local RoPE base)",
        {
            "model_type": "gemma3_text",
            "architectures": ["Gemma3ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "intermediate_size": 384,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "rope_local_base_freq": 10000,
            "rope_scaling": None,
            "query_pre_attn_scalar": 16,
            "sliding_window": 12,
            "sliding_window_pattern": 6,
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "cache_implementation": "hybrid",
            "hidden_activation": "gelu_pytorch_tanh",
            "max_position_embeddings": 32768,
            "tie_word_embeddings": True,
        },
        head="model.norm",
        embedding="model.embed_tokens",
        norm_offset=True,
        window=12,
        seed=408,
    ),
    Family(
        "gpt_oss",
        "openai/gpt-oss-20b (sinks, alternating sliding/full layers, yarn RoPE, 32 experts top 4)",
        {
            "model_type": "gpt_oss",
            "architectures": ["GptOssForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 64,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "experts_per_token": 4,
            "rms_norm_eps": 1e-05,
            "rope_theta": 150000,
            "rope_scaling": {
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "rope_type": "yarn",
                "truncate": False,
            },
            "sliding_window": 16,
            "layer_types": _alternating("sliding_attention", "full_attention", 2, 4),
            "attention_bias": True,
            "swiglu_limit": 7.0,
            "initial_context_length": 4096,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
        window=16,
        seed=109,
    ),
    Family(
        "mistral_layer_types",
        "mistralai/Ministral-8B-Instruct-2410 (1 full : 3 sliding layers)",
        {
            "model_type": "mistral",
            "architectures": ["MistralForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 192,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000000.0,
            "sliding_window": 10,
            "layer_types": _alternating("full_attention", "sliding_attention", 4, 4),
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
        },
        window=10,
        seed=10,
    ),
    Family(
        "mamba2",
        "mistralai/Mamba-Codestral-7B-v0.1 (8 groups, untied)",
        {
            "model_type": "mamba2",
            "architectures": ["Mamba2ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "expand": 2,
            "num_heads": 16,
            "head_dim": 8,
            "state_size": 16,
            "n_groups": 8,
            "conv_kernel": 4,
            "chunk_size": 256,
            "time_step_rank": 4,
            "time_step_limit": [0.0, float("inf")],
            "time_step_min": 0.001,
            "time_step_max": 0.1,
            "layer_norm_epsilon": 1e-05,
            "rms_norm": True,
            "norm_before_gate": False,
            "residual_in_fp32": True,
            "use_bias": False,
            "use_conv_bias": True,
            "tie_word_embeddings": False,
        },
        recurrent=True,
        seed=11,
    ),
    Family(
        "lfm2",
        "LiquidAI/LFM2-350M (short convolutions with attention at 3 of 8 layers, tied)",
        {
            "model_type": "lfm2",
            "architectures": ["Lfm2ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "block_dim": 64,
            "block_ff_dim": 416,
            "block_multiple_of": 32,
            "block_ffn_dim_multiplier": 1.0,
            "block_auto_adjust_ff_dim": True,
            "conv_bias": False,
            "conv_L_cache": 3,
            "full_attn_idxs": [2, 5],
            "layer_types": [
                "conv",
                "conv",
                "full_attention",
                "conv",
                "conv",
                "full_attention",
            ],
            "norm_eps": 1e-05,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 128000,
            "tie_word_embeddings": True,
        },
        head="model.embedding_norm",
        embedding="model.embed_tokens",
        recurrent=True,
        seed=12,
    ),
    Family(
        "qwen3_next",
        "Qwen/Qwen3-Next-80B-A3B-Instruct (gated delta-net : attention 3 : 1, 512 experts top 10)",
        {
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 160,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "partial_rotary_factor": 0.25,
            "linear_num_value_heads": 4,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 16,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "rms_norm_eps": 1e-06,
            "rope_theta": 10000000,
            "rope_scaling": None,
            "attention_bias": False,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
        },
        recurrent=True,
        seed=13,
    ),
    Family(
        "nemotron_h",
        "nvidia/NVIDIA-Nemotron-Nano-9B-v2 (Mamba-2 / MLP / attention pattern, relu2 MLP)",
        {
            "model_type": "nemotron_h",
            "architectures": ["NemotronHForCausalLM"],
            "hidden_size": 64,
            # A stretch of the real pattern (M: Mamba-2, -: MLP, *: attention).
            "hybrid_override_pattern": "M-M*-M-",
            "intermediate_size": 224,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "attention_bias": False,
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "mamba_proj_bias": False,
            "ssm_state_size": 16,
            "n_groups": 4,
            "conv_kernel": 4,
            "chunk_size": 128,
            "mlp_bias": False,
            "mlp_hidden_act": "relu2",
            "layer_norm_epsilon": 1e-05,
            "use_bias": False,
            "use_conv_bias": True,
            "residual_in_fp32": False,
            "rescale_prenorm_residual": True,
            "time_step_limit": [0.0, float("inf")],
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
        },
        recurrent=True,
        seed=414,
    ),
    Family(
        "falcon_h1",
        "tiiuae/Falcon-H1-0.5B-Instruct (parallel attention + Mamba-2 in every layer, muP"
        " multipliers)",
        {
            "model_type": "falcon_h1",
            "architectures": ["FalconH1ForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "mamba_d_ssm": 96,
            "mamba_n_heads": 6,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_expand": 2,
            "mamba_chunk_size": 128,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "mamba_norm_before_gate": False,
            "mamba_rms_norm": False,
            "mamba_use_mlp": True,
            "attention_in_multiplier": 1.0,
            "attention_out_multiplier": 0.9375,
            "embedding_multiplier": 5.656854249492381,
            "key_multiplier": 0.390625,
            "lm_head_multiplier": 0.0390625,
            "mlp_multipliers": [0.8838834764831844, 0.5859375],
            "ssm_in_multiplier": 1.25,
            "ssm_multipliers": [
                0.3535533905932738,
                0.25,
                0.3535533905932738,
                0.5,
                0.3535533905932738,
            ],
            "ssm_out_multiplier": 0.23570226039551587,
            "rms_norm_eps": 1e-05,
            "rope_theta": 100000000000.0,
            "rope_scaling": None,
            "max_position_embeddings": 16384,
            "tie_word_embeddings": False,
        },
        recurrent=True,
        seed=15,
    ),
    Family(
        "llama_4bit",
        "mlx-community/Meta-Llama-3.1-8B-Instruct-4bit (affine 4-bit, group 64)",
        LLAMA_31_8B,
        quantization=Quantization(bits=4, group_size=64),
        seed=16,
    ),
    Family(
        "llama_8bit",
        "meta-llama/Llama-3.1-8B-Instruct at 8 bits, group 32, with mixed-recipe overrides"
        " (6-bit v_proj / down_proj, group 64)",
        LLAMA_31_8B,
        quantization=Quantization(
            bits=8,
            group_size=32,
            overrides=(("self_attn.v_proj", 6, 64), ("mlp.down_proj", 6, 64)),
        ),
        seed=217,
    ),
    Family(
        "qwen3_4bit",
        "Qwen/Qwen3-0.6B at 4 bits, group 128, float embedding",
        QWEN3_06B,
        head="model.norm",
        embedding="model.embed_tokens",
        quantization=Quantization(bits=4, group_size=128, float_embedding=True),
        seed=18,
    ),
    Family(
        "qwen3_8bit",
        "mlx-community/Qwen3-0.6B-8bit (affine 8-bit, group 64)",
        QWEN3_06B,
        head="model.norm",
        embedding="model.embed_tokens",
        quantization=Quantization(bits=8, group_size=64),
        seed=219,
    ),
    # -- the cheap extras ---------------------------------------------------------------
    Family(
        "llama_dynamic_rope",
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0 with transformers' dynamic NTK rope_scaling"
        " (factor 2.0); within max_position_embeddings it rotates as default RoPE, but its"
        " per-row offsets go through the dynamic class",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 176,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "rope_scaling": {"type": "dynamic", "factor": 2.0},
            "max_position_embeddings": 2048,
            "tie_word_embeddings": False,
        },
        seed=220,
    ),
    Family(
        "llama_linear_rope",
        "deepseek-ai/deepseek-coder-6.7b-instruct (linear rope_scaling, factor 4)",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 176,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-06,
            "rope_theta": 100000,
            "rope_scaling": {"type": "linear", "factor": 4.0},
            "max_position_embeddings": 16384,
            "tie_word_embeddings": False,
        },
        seed=121,
    ),
    Family(
        "llama_yarn_rope",
        "NousResearch/Yarn-Llama-2-7b-64k (yarn rope_scaling, factor 16)",
        {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 176,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "factor": 16.0,
                "finetuned": True,
                "original_max_position_embeddings": 4096,
                "type": "yarn",
            },
            "max_position_embeddings": 65536,
            "tie_word_embeddings": False,
        },
        seed=22,
    ),
    Family(
        "mamba",
        "state-spaces/mamba-130m-hf (tied)",
        {
            "model_type": "mamba",
            "architectures": ["MambaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "intermediate_size": 128,
            "state_size": 16,
            "conv_kernel": 4,
            "time_step_rank": 4,
            "use_bias": False,
            "use_conv_bias": True,
            "layer_norm_epsilon": 1e-05,
            "tie_word_embeddings": True,
        },
        head="backbone.norm_f",
        embedding="backbone.embeddings",
        recurrent=True,
        seed=23,
    ),
    Family(
        "jamba",
        "ai21labs/AI21-Jamba-Mini-1.5 (attention every 8th layer from 4, MoE every 2nd from 1)",
        {
            "model_type": "jamba",
            "architectures": ["JambaForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 8,
            "intermediate_size": 128,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "attn_layer_offset": 4,
            "attn_layer_period": 8,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "num_experts": 16,
            "num_experts_per_tok": 2,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_expand": 2,
            "mamba_dt_rank": 4,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "rms_norm_eps": 1e-06,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
        },
        recurrent=True,
        seed=24,
    ),
    Family(
        "granitemoehybrid",
        "ibm-granite/granite-4.0-h-tiny (Mamba-2 + NoPE attention, 64 experts top 6 + shared)",
        {
            "model_type": "granitemoehybrid",
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "hidden_size": 64,
            "num_hidden_layers": 4,
            "intermediate_size": 32,
            "shared_intermediate_size": 64,
            "num_local_experts": 64,
            "num_experts_per_tok": 6,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "attention_bias": False,
            "layer_types": ["mamba", "mamba", "attention", "mamba"],
            "mamba_n_heads": 8,
            "mamba_d_head": 16,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_n_groups": 1,
            "mamba_conv_bias": True,
            "mamba_proj_bias": False,
            "embedding_multiplier": 12.0,
            "attention_multiplier": 0.0078125,
            "logits_scaling": 6.0,
            "residual_multiplier": 0.22,
            "position_embedding_type": "nope",
            "rope_theta": 10000,
            "rms_norm_eps": 1e-05,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        },
        head="model.norm",
        embedding="model.embed_tokens",
        recurrent=True,
        seed=125,
    ),
]
FAMILY_BY_NAME = {f.name: f for f in FAMILIES}
# The families the server must serve (README's list); the rest are extras.
REQUIRED = [f.name for f in FAMILIES[: FAMILIES.index(FAMILY_BY_NAME["qwen3_8bit"]) + 1]]


def mlx_lm_module(family: Family) -> str:
    """The mlx-lm module that implements the family (mistral's is llama)."""
    from mlx_lm.utils import _get_classes

    return _get_classes(family.config)[0].__module__.rsplit(".", 1)[-1]


def expected_overrides(path: Path) -> int:
    """Modules of a saved checkpoint quantized differently from its default, or left float:
    the per-module entries of its quantization block, plus every 2-D float weight without
    scales (mlx-lm writes no entry for a module its predicate left unquantized)."""
    config = json.loads((path / "config.json").read_text())
    entries = sum(1 for v in config.get("quantization", {}).values() if isinstance(v, dict))
    weights = mx.load(str(path / "model.safetensors"))
    left_float = sum(
        1
        for name, w in weights.items()
        if name.endswith(".weight")
        and w.ndim == 2
        and mx.issubdtype(w.dtype, mx.floating)
        and name.removesuffix(".weight") + ".scales" not in weights
    )
    return entries + left_float


# -- building checkpoints ---------------------------------------------------------------------


@functools.cache
def _embedded_tokenizer():
    from service.common.tokenizer import tokenizer_from_gguf
    from service.core.models.gguf import read_gguf_metadata
    from service.core.models.loader import embedded_gguf_path

    return tokenizer_from_gguf(read_gguf_metadata(embedded_gguf_path()))


def save_tokenizer(path: Path) -> None:
    """The embedded SmolLM2 tokenizer as tokenizer.json + tokenizer_config.json (+ its chat
    template), which transformers' AutoTokenizer and so mlx-lm load."""
    _embedded_tokenizer()._hf.save_pretrained(path)


def _submodule(model: nn.Module, dotted: str) -> nn.Module:
    module: Any = model
    for part in dotted.split("."):
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    return module


def _peak(model: nn.Module, family: Family) -> None:
    """Scale the output head so the logits' spread across the vocabulary is LOGIT_STD."""
    from mlx_lm.models.cache import make_prompt_cache

    head = _submodule(model, family.head)
    if family.embedding is not None:
        embedding = _submodule(model, family.embedding)
        embedding.weight = embedding.weight * family.embedding_scale
        # A random final-norm gain, so the logits (embedding rows . normed state) do not
        # favour whichever token the state happens to resemble at every step.
        gain = mx.random.normal(head.weight.shape)
        head.weight = gain - 1.0 if family.norm_offset else gain
    probe = mx.array([prompt_tokens(family.seed, 24, salt=99)])
    logits = model(probe, cache=make_prompt_cache(model)).astype(mx.float32)
    spread = mx.std(logits, axis=-1).mean().item()
    factor = LOGIT_STD / spread
    if family.norm_offset:
        head.weight = (1.0 + head.weight) * factor - 1.0
    else:
        head.weight = head.weight * factor


def _quantize(
    model: nn.Module, config: dict[str, Any], quant: Quantization
) -> tuple[nn.Module, dict]:
    from mlx_lm.utils import quantize_model

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if quant.float_embedding and path.endswith("embed_tokens"):
            return False
        for part, bits, group_size in quant.overrides:
            if part in path:
                return {"bits": bits, "group_size": group_size, "mode": "affine"}
        return True

    with contextlib.redirect_stdout(sys.stderr):  # it prints bits per weight
        return quantize_model(
            model, config, quant.group_size, quant.bits, quant_predicate=predicate
        )


def build(family: Family, root: Path) -> Path:
    """Write the family's checkpoint under root (once) and return its directory."""
    from mlx_lm.utils import _get_classes, save_config, save_model

    path = root / family.name
    if (path / "config.json").exists():
        return path
    config = copy.deepcopy(family.config)
    config.update(vocab_size=VOCAB_SIZE, bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    mx.random.seed(family.seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.eval()
    mx.eval(model.parameters())
    _peak(model, family)
    if family.quantization is not None:
        model, config = _quantize(model, config, family.quantization)
    mx.eval(model.parameters())
    tmp = path.with_name(path.name + ".tmp")
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    save_tokenizer(tmp)
    tmp.rename(path)
    return path


def build_embedded_quantized(root: Path, bits: int = 4, group_size: int = 32) -> Path:
    """The embedded SmolLM2 (GGUF, loaded by our loader in float32) re-quantized with mlx-lm
    and written as an mlx-lm checkpoint, as `mlx_lm.convert -q` would write it. Group size 32
    is the GGUF's own (Q4_1): at 64 the re-quantized 135M model no longer answers sensibly."""
    return build_embedded(root, (bits, group_size))


def build_embedded(root: Path, quantize: tuple[int, int] | None = None) -> Path:
    """The embedded SmolLM2 as an mlx-lm checkpoint: its weights as our loader serves them
    (float32), or quantized with mlx-lm (bits, group size)."""
    from dataclasses import asdict

    from mlx_lm.utils import quantize_model, save_config, save_model

    from service.core.models.loader import load_embedded

    path = root / ("smollm2-135m-float32" if quantize is None else f"smollm2-135m-{quantize[0]}bit")
    if (path / "config.json").exists():
        return path
    lm = load_embedded(mx.float32)
    config = {k: v for k, v in asdict(lm.model.args).items() if v is not None}
    config.pop("layer_types", None)  # filled in by ModelArgs: all full attention
    config.update(
        architectures=["LlamaForCausalLM"],
        bos_token_id=BOS_ID,
        eos_token_id=sorted(lm.tokenizer.eos_token_ids),
    )
    model = lm.model
    if quantize is not None:
        with contextlib.redirect_stdout(sys.stderr):
            model, config = quantize_model(model, config, quantize[1], quantize[0])
    tmp = path.with_name(path.name + ".tmp")
    save_model(tmp, model)
    save_config(config, tmp / "config.json")
    save_tokenizer(tmp)
    tmp.rename(path)
    return path


# -- prompts and mlx-lm's reference -----------------------------------------------------------


def prompt_tokens(seed: int, length: int, salt: int = 0) -> list[int]:
    """Deterministic ordinary (non-special) token ids."""
    rng = random.Random(seed * 1000 + salt)
    return [rng.randrange(200, VOCAB_SIZE) for _ in range(length)]


def prompts(family: Family) -> dict[str, list[int]]:
    """The conformance prompts: phase 1 sends the first four together; phase 2 sends
    prefix_b (which shares SHARED_PREFIX tokens with prefix_a) and late together."""
    s = family.seed
    shared = prompt_tokens(s, SHARED_PREFIX, salt=1)
    return {
        "short": prompt_tokens(s, 5, salt=2),
        "medium": prompt_tokens(s, 19, salt=3),
        "long": prompt_tokens(s, 53, salt=4),  # past every window; over three KV blocks
        "prefix_a": shared + prompt_tokens(s, 6, salt=5),
        "prefix_b": shared + prompt_tokens(s, 9, salt=6),
        "late": prompt_tokens(s, 27, salt=7),
    }


PHASES = (("short", "medium", "long", "prefix_a"), ("prefix_b", "late"))


@dataclass
class Generation:
    token_ids: list[int]
    logprobs: list[float]
    # Per step, the top-1 minus top-2 logprob (references only).
    gaps: list[float] = field(default_factory=list)


def reference(path: Path, prompt_set: dict[str, list[int]], max_tokens: int = MAX_TOKENS):
    """mlx-lm's greedy generation of each prompt alone, from the saved checkpoint."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    # What mlx_lm.utils.load builds, without the tokenizer: the prompts are token ids.
    model, _ = load_model(path)
    out: dict[str, Generation] = {}
    for name, ids in prompt_set.items():
        gen = Generation([], [], [])
        steps = generate_step(
            mx.array(ids), model, max_tokens=max_tokens, sampler=lambda lp: mx.argmax(lp, -1)
        )
        for token, logprobs in steps:
            top2 = mx.topk(logprobs.astype(mx.float32), 2)
            tok = int(token)
            gen.token_ids.append(tok)
            gen.logprobs.append(float(logprobs[tok].item()))
            gen.gaps.append(float((mx.max(top2) - mx.min(top2)).item()))
        out[name] = gen
    return out


# -- the conformance run ----------------------------------------------------------------------


def request(ids: list[int], request_id: str, max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        request_id=request_id,
        token_ids=pb.TokenIdsInput(ids=ids),
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        logprobs=True,
    )


@dataclass
class Served:
    """What one request got from the server: a response, or the status it failed with."""

    response: pb.GenerateResponse | None = None
    error: str | None = None

    @property
    def generation(self) -> Generation | None:
        if self.response is None:
            return None
        return Generation(
            list(self.response.token_ids), [lp.logprob for lp in self.response.logprobs]
        )


@dataclass
class Run:
    """The server side of one family's conformance run."""

    load_error: str | None = None
    decode_line: str = ""
    model_info: pb.GetModelInfoResponse | None = None
    served: dict[str, Served] = field(default_factory=dict)
    seconds: float = 0.0


def server_flags(path: Path) -> list[str]:
    """A conformance server's flags. float32 whatever the device: the reference is mlx-lm's
    generation from the float32 checkpoint (on a GPU the server's own default is bfloat16)."""
    return ["--model", str(path), "--parallel", "4", "--dtype", "float32", "--log-format", "json"]


def _decode_line(records: list[dict[str, Any]]) -> str:
    """The start-up line naming the decode path (the server's wording where it
    logs it, else the "model loaded" record's decode_path field)."""
    for record in records:
        event = str(record.get("event", ""))
        if "decode path" in event or "clamping max_batch_size" in event:
            return event
    for record in records:
        if record.get("event") == "model loaded":
            path, storage = record.get("decode_path"), record.get("storage_backend")
            return f"decode_path={path} storage={storage}"
    return ""


def _send(stub: pb_grpc.GenerationServiceStub, names: tuple[str, ...], ids, tag: str):
    futures = {
        name: stub.Generate.future(request(ids[name], f"{tag}-{name}"), timeout=120)
        for name in names
    }
    out = {}
    for name, fut in futures.items():
        try:
            out[name] = Served(response=fut.result())
        except grpc.RpcError as exc:
            out[name] = Served(error=f"{exc.code().name}: {exc.details()}")
    return out


class ServerPrefetch:
    """Conformance servers started ahead of the run that takes them (each a subprocess, waited
    on from a thread): the next family's server starts while this family's reference and
    requests run. close() stops those never taken."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(2)
        self._starting: dict[Path, concurrent.futures.Future] = {}

    def start(self, path: Path) -> None:
        if path not in self._starting:
            self._starting[path] = self._pool.submit(start_server, *server_flags(path))

    def take(self, path: Path) -> concurrent.futures.Future:
        """The server of `path`, started now unless it was already."""
        self.start(path)
        return self._starting.pop(path)

    def close(self) -> None:
        for future in self._starting.values():
            with contextlib.suppress(Exception):
                future.result().stop()
        self._starting.clear()
        self._pool.shutdown()


def conformance(
    path: Path,
    family: Family,
    starting: concurrent.futures.Future | None = None,
    then: Callable[[], None] | None = None,
) -> tuple[dict[str, Generation], Run]:
    """mlx-lm's reference for the family's prompts, and what a real server gives for them.
    The server starts (a subprocess, waited on from a thread) while the reference runs;
    `starting`: its start already under way (ServerPrefetch.take). `then` runs once the
    reference is done, while the server may still be starting (a prefetch of the next)."""
    run = Run()
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        if starting is None:
            starting = pool.submit(start_server, *server_flags(path))
        try:
            expected = reference(path, prompts(family))
            if then is not None:
                then()
        finally:
            try:
                server = starting.result()
            except (RuntimeError, TimeoutError) as exc:
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                run.load_error = _last_error(lines)
                server = None
        if server is None:
            run.seconds = time.monotonic() - started
            return expected, run
    ids = prompts(family)
    try:
        run.decode_line = _decode_line(server.records())
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.GenerationServiceStub(channel)
            run.model_info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            for phase, names in enumerate(PHASES):
                run.served.update(_send(stub, names, ids, f"{family.name}-{phase}"))
        _attach_server_errors(run, server.records())
    finally:
        server.stop()
    run.seconds = time.monotonic() - started
    return expected, run


def _last_error(lines: list[str]) -> str:
    """The most telling line of a failed start: the last exception or error message."""
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("level") in ("error", "critical"):
                return str(record.get("exception") or record.get("event")).splitlines()[-1]
        if "Error" in line or "error" in line:
            return line.strip()
    return lines[-1] if lines else "server did not start"


def _attach_server_errors(run: Run, records: list[dict[str, Any]]) -> None:
    """Append the server's first logged exception to each failed request's status (the
    status itself only says "inference backend error")."""
    for served in run.served.values():
        if served.error is None:
            continue
        for record in records:
            exc = record.get("exception")
            if exc:
                served.error += " | " + str(exc).strip().splitlines()[-1]
                break


# -- comparison -------------------------------------------------------------------------------


def divergence(got: Generation, want: Generation) -> str | None:
    """None if equal token for token with logprobs within tolerance, else what differs first."""
    for i, (g, w) in enumerate(zip(got.token_ids, want.token_ids)):
        if g != w:
            return f"token {i}: {g} != mlx-lm {w}"
    if len(got.token_ids) != len(want.token_ids):
        return f"{len(got.token_ids)} tokens != mlx-lm {len(want.token_ids)}"
    diffs = [abs(g - w) for g, w in zip(got.logprobs, want.logprobs)]
    if len(got.logprobs) != len(want.logprobs):
        return f"{len(got.logprobs)} logprobs for {len(want.logprobs)} tokens"
    worst = max(range(len(diffs)), key=diffs.__getitem__) if diffs else 0
    if diffs and diffs[worst] > LOGPROB_TOLERANCE:
        return f"logprob {worst}: {got.logprobs[worst]:.6f} vs mlx-lm {want.logprobs[worst]:.6f}"
    return None


def outcome(run: Run, expected: dict[str, Generation], name: str) -> str | None:
    """None when prompt `name` was served exactly as mlx-lm alone, else why not."""
    served = run.served.get(name)
    if served is None:
        return run.load_error or "not sent"
    if served.error is not None:
        return served.error
    got = served.generation
    assert got is not None
    return divergence(got, expected[name])


# -- the report -------------------------------------------------------------------------------


def _cell(problem: str | None, ok: str = "yes") -> str:
    return ok if problem is None else "no: " + problem.replace("|", "/")[:110]


def report_row(family: Family, run: Run, expected: dict[str, Generation]) -> list[str]:
    problems = {name: outcome(run, expected, name) for name in prompts(family)}
    batched = next((f"{n}: {p}" for n, p in problems.items() if p is not None), None)
    long_ok = problems["long"]
    prefix = problems["prefix_b"]
    served_b = run.served.get("prefix_b")
    cached = served_b.response.usage.cached_tokens if served_b and served_b.response else 0
    window = f" (window {family.window})" if family.window else ""
    return [
        family.name if family.name in REQUIRED else f"{family.name} (extra)",
        "yes" if run.load_error is None else _cell(run.load_error),
        run.decode_line or "-",
        _cell(batched),
        _cell(long_ok) + window,
        _cell(prefix, f"yes, {cached} cached") if run.load_error is None else "-",
    ]


HEADER = [
    "family",
    "loads",
    "decode path (log)",
    "batched == mlx-lm alone",
    "long prompt",
    "prefix sharing",
]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def min_gap(expected: dict[str, Generation]) -> float:
    return min(g for gen in expected.values() for g in gen.gaps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.helpers.model_zoo", description=__doc__)
    parser.add_argument("--report", action="store_true", help="run the conformance table")
    parser.add_argument("--root", type=Path, help="where to write checkpoints (default: tmp)")
    parser.add_argument("families", nargs="*", help="family names (default: all)")
    args = parser.parse_args(argv)
    names = args.families or [f.name for f in FAMILIES]
    unknown = [n for n in names if n not in FAMILY_BY_NAME]
    if unknown:
        parser.error(f"unknown families {unknown}; known: {sorted(FAMILY_BY_NAME)}")
    with _root(args.root) as root:
        rows = []
        for name in names:
            family = FAMILY_BY_NAME[name]
            path = build(family, root)
            if not args.report:
                expected = reference(path, prompts(family))
                print(f"{name}: {path} (min top-1/top-2 gap {min_gap(expected):.3f})")
                continue
            expected, run = conformance(path, family)
            rows.append(report_row(family, run, expected))
            print(f"{name}: {run.seconds:.1f} s, min gap {min_gap(expected):.3f}", file=sys.stderr)
        if rows:
            print(markdown(rows))
    return 0


@contextlib.contextmanager
def _root(root: Path | None) -> Iterator[Path]:
    if root is not None:
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    with tempfile.TemporaryDirectory(prefix="model-zoo-") as tmp:
        yield Path(tmp)


if __name__ == "__main__":
    raise SystemExit(main())
