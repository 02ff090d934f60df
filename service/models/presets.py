"""Architecture presets for dummy (random) weights: throughput work where weights cannot travel.

Shapes from SPEC §8 (llama architecture). The tokenizer is the embedded SmolLM2 one; generated
ids beyond its vocabulary decode to nothing, which is fine since EOS is ignored there anyway.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama

PRESETS: dict[str, dict] = {
    # Near-free compute: measures the serving overhead (scheduler, engine, gRPC) alone.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=49152,
                 tie_word_embeddings=True, rope_theta=10000.0),
    # SmolLM2's depth and vocabulary at a width that costs next to nothing: the per-step host
    # work (graph building, kernel dispatch, scheduling) of a 30-layer model, without its math.
    "thin-30": dict(hidden_size=96, num_hidden_layers=30, intermediate_size=192,
                    num_attention_heads=3, num_key_value_heads=1, vocab_size=49152,
                    tie_word_embeddings=True, rope_theta=100000.0),
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0),
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0),
}  # fmt: skip


def dummy_llama(preset: str, dtype: mx.Dtype, seed: int = 0) -> llama.Model:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    args = llama.ModelArgs(
        model_type="llama", rms_norm_eps=1e-5, max_position_embeddings=8192, **PRESETS[preset]
    )
    mx.random.seed(seed)
    model = llama.Model(args)
    # Small weights keep activations finite through the layers.
    model.update(
        _map(model.parameters(), lambda p: (mx.random.normal(p.shape) * 0.02).astype(dtype))
    )
    mx.eval(model.parameters())
    return model


def _map(tree, fn):
    from mlx.utils import tree_map

    return tree_map(fn, tree)
