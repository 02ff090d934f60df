"""Architecture presets for dummy (random) weights: throughput work where weights cannot travel.

Each preset is the `config.json` of the checkpoint it is named after (architecture, shapes,
RoPE scaling, sliding windows, tying, quantization), so a dummy model runs exactly the code path
the real checkpoint would; only the weights are random. The tokenizer is the embedded SmolLM2
one: generated ids beyond its vocabulary decode to nothing, which is fine since EOS is ignored
for dummy models anyway.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

_LLAMA3_ROPE_1B = {  # Llama 3.2 1B / 3B
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA3_ROPE_8B = {  # Llama 3.1 8B / 70B
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}
_LLAMA_3_1_8B = dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
    rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_8B, max_position_embeddings=131072,
    tie_word_embeddings=False,
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # Near-free compute: measures the serving overhead (scheduler, engine, gRPC) alone.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                 rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=10000.0),
    # The serving stack alone: one narrow layer and a 512-token vocabulary, so a decode step's
    # math (the LM head included) is next to free and the scheduler, the engine's host work, the
    # core/front-end IPC and gRPC dominate (bench/serving_overhead.py). Prompts must be token
    # ids below 512: text encodes to ids outside this vocabulary. The embedded tokenizer spells
    # every id below 512, so generated tokens detokenize.
    "tiny-vocab": dict(model_type="llama", hidden_size=64, num_hidden_layers=1,
                       intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
                       vocab_size=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       rope_theta=10000.0, max_position_embeddings=4096),
    # SmolLM2's depth and vocabulary at a width that costs next to nothing: the per-step host
    # work (graph building, kernel dispatch, scheduling) of a 30-layer model, without its math.
    "thin-30": dict(model_type="llama", hidden_size=96, num_hidden_layers=30,
                    intermediate_size=192, num_attention_heads=3, num_key_value_heads=1,
                    vocab_size=49152, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_theta=100000.0),
    # The same code paths at a size that costs nothing (harness tests on the CPU).
    "tiny-qwen3": dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2,
                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, vocab_size=49152, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       max_position_embeddings=4096, tie_word_embeddings=False),
    "tiny-gemma3": dict(model_type="gemma3_text", hidden_size=64, num_hidden_layers=6,
                        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, vocab_size=49152, rms_norm_eps=1e-6, sliding_window=32,
                        sliding_window_pattern=6, max_position_embeddings=4096),
    "tiny-4bit": dict(model_type="llama", hidden_size=128, num_hidden_layers=2,
                      intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      vocab_size=49152, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_8B,
                      quantization={"group_size": 64, "bits": 4}),
    # HuggingFaceTB/SmolLM2-135M-Instruct
    "smollm2-135m": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                         intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         vocab_size=49152, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192),
    # the same at 4 bits, group 64 (as `mlx_lm.convert -q` writes it)
    "smollm2-135m-4bit": dict(model_type="llama", hidden_size=576, num_hidden_layers=30,
                              intermediate_size=1536, num_attention_heads=9,
                              num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5,
                              tie_word_embeddings=True, rope_theta=100000.0,
                              max_position_embeddings=8192,
                              quantization={"group_size": 64, "bits": 4}),
    # meta-llama/Llama-3.2-1B-Instruct
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16,
                         intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, vocab_size=128256, rms_norm_eps=1e-5,
                         rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE_1B,
                         max_position_embeddings=131072, tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B-Instruct, and its 4-bit mlx-community conversion
    "llama-3.1-8b": _LLAMA_3_1_8B,
    "llama-3.1-8b-4bit": dict(_LLAMA_3_1_8B, quantization={"group_size": 64, "bits": 4}),
    # meta-llama/Llama-3.1-70B-Instruct (141 GB in bf16: more than one H200 holds)
    "llama-3.1-70b": dict(_LLAMA_3_1_8B, hidden_size=8192, num_hidden_layers=80,
                          intermediate_size=28672, num_attention_heads=64),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                     intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, tie_word_embeddings=False),
    # google/gemma-3-12b-it (text part): 5 sliding-window layers per global one
    "gemma-3-12b": dict(model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48,
                        intermediate_size=15360, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=256, vocab_size=262208, rms_norm_eps=1e-6,
                        rope_theta=1000000.0, rope_local_base_freq=10000.0,
                        rope_scaling={"factor": 8.0, "rope_type": "linear"},
                        query_pre_attn_scalar=256, sliding_window=1024,
                        sliding_window_pattern=6, max_position_embeddings=131072),
}  # fmt: skip


def preset_config(preset: str) -> dict[str, Any]:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    return dict(PRESETS[preset])


def dummy_model(preset: str, dtype: mx.Dtype, seed: int = 0) -> tuple[nn.Module, dict]:
    """Random weights in a preset's architecture (quantized as its config says); returns the
    model and its config."""
    config = preset_config(preset)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    # Small weights keep activations finite through the layers.
    model.update(
        tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype), model.parameters())
    )
    quantization = config.get("quantization")
    if quantization:
        nn.quantize(model, group_size=quantization["group_size"], bits=quantization["bits"])
    mx.eval(model.parameters())
    return model, config
