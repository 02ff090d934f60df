"""Load a llama-architecture GGUF file into mlx-lm's llama model.

`mx.load` reads GGUF directly: quantized tensors come back as MLX affine
quantization triples (weight, scales, biases; group size 32). We rename the
tensors to the Hugging Face layout mlx-lm expects, dequantize them to the
serving dtype, and undo llama.cpp's row permutation of the Q/K projections.
"""

from __future__ import annotations

import re
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import llama

_GGUF_GROUP_SIZE = 32
LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def _scalar(metadata: dict, key: str) -> int | float:
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def llama_args_from_gguf(metadata: dict, tensor_names: set[str]) -> llama.ModelArgs:
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only 'llama')")
    heads = int(_scalar(metadata, "llama.attention.head_count"))
    hidden = int(_scalar(metadata, "llama.embedding_length"))
    vocab = metadata.get("llama.vocab_size")
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden,
        num_hidden_layers=int(_scalar(metadata, "llama.block_count")),
        intermediate_size=int(_scalar(metadata, "llama.feed_forward_length")),
        num_attention_heads=heads,
        num_key_value_heads=int(_scalar(metadata, "llama.attention.head_count_kv")),
        rms_norm_eps=float(_scalar(metadata, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab.item())
        if vocab is not None
        else len(metadata["tokenizer.ggml.tokens"]),
        rope_theta=float(_scalar(metadata, "llama.rope.freq_base")),
        max_position_embeddings=int(_scalar(metadata, "llama.context_length")),
        head_dim=hidden // heads,
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _dequantize(tensors: dict[str, mx.array], base: str, dtype: mx.Dtype) -> mx.array:
    weight = tensors[f"{base}.weight"]
    scales = tensors.get(f"{base}.scales")
    if scales is None:
        return weight.astype(dtype)
    in_features = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = weight.shape[-1] * 32 // in_features
    # GGUF stores the scales (and Q4_1's minimums) as float16 and `mx.load` returns them so;
    # dequantizing in float16 would round most weights. In float32 the result is exactly the
    # file's values (checked against the `gguf` package's dequantization).
    full = mx.dequantize(
        weight,
        scales.astype(mx.float32),
        tensors[f"{base}.biases"].astype(mx.float32),
        group_size=_GGUF_GROUP_SIZE,
        bits=bits,
    )
    return full.astype(dtype)


def _unpermute_rope_rows(w: mx.array, n_heads: int) -> mx.array:
    """Invert llama.cpp's per-head interleaving of Q/K rows (its RoPE layout)."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf_metadata(path: Path) -> dict:
    return mx.load(str(path), return_metadata=True)[1]


def load_gguf_llama(path: Path, dtype: mx.Dtype) -> tuple[llama.Model, dict]:
    tensors, metadata = read_gguf(path)
    return llama_from_gguf(tensors, metadata, dtype), metadata


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict]:
    """The file's tensors (quantized ones as MLX triples) and its metadata."""
    return mx.load(str(path), return_metadata=True)


def llama_from_gguf(tensors: dict[str, mx.array], metadata: dict, dtype: mx.Dtype) -> llama.Model:
    """mlx-lm's llama with the tensors renamed, dequantized to `dtype` and evaluated."""
    bases = {name.rsplit(".", 1)[0] for name in tensors}
    args = llama_args_from_gguf(metadata, set(tensors))
    weights: dict[str, mx.array] = {}
    for base in sorted(bases):
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
        if match:
            layer, kind = match.groups()
            if kind not in LAYER_NAMES:
                continue
            name = f"model.layers.{layer}.{LAYER_NAMES[kind]}"
        elif base in TOP_NAMES:
            name, kind = TOP_NAMES[base], base
        else:
            continue  # e.g. rope_freqs: mlx-lm computes its own
        w = _dequantize(tensors, base, dtype)
        if kind == "attn_q":
            w = _unpermute_rope_rows(w, args.num_attention_heads)
        elif kind == "attn_k":
            w = _unpermute_rope_rows(w, args.num_key_value_heads)
        weights[f"{name}.weight"] = w
    model = llama.Model(args)
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    return model
