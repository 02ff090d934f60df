"""Per architecture (the mlx-lm module that implements a model), which fast paths it takes.

The one place that says so: the engine configuration (service.core.engine.config) reads it when it
resolves how a loaded model is served.

- `verified`: batched greedy output equals mlx-lm's generation of each prompt alone, shown by
  tests/test_conformance.py on a tiny model of the family built from a real configuration.
  `--decode-storage-backend auto` serves verified families natively batched over the paged
  pool; others run each row alone over dense storage, which is exactly a lone mlx-lm forward.
- `split_head`: the model's `__call__` is its trunk (`model.model`) followed by the LM head,
  so a prefill projects only each row's last position to the vocabulary.
- `direct_decode`: attention is mlx-lm's `scaled_dot_product_attention(q, k, v, cache=,
  scale=, mask=)` right after `cache.update_and_fetch`, without attention sinks or logit
  soft-capping, so on CUDA a decode step can read the paged pool through each row's slots
  (service.core.engine.paged_attention) instead of gathering it, and on the CPU a float32
  decode step over the K/V mirror can compute its attention itself (kv_mirror.attend).
- `tensor_parallel`: mlx-lm's model has `shard(group)` (heads and MLP split over ranks).
- `grouped_mask`: attention is computed by hand over [B, kv_heads, repeats, N, T] scores, so a
  batched step's mask needs that rank ([B, 1, 1, N, T]) when heads share K/V heads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    verified: bool = False
    split_head: bool = False
    direct_decode: bool = False
    grouped_mask: bool = False
    tensor_parallel: bool = False


_PLAIN = Family(verified=True, split_head=True, direct_decode=True)
_PLAIN_TP = Family(verified=True, split_head=True, direct_decode=True, tensor_parallel=True)

FAMILIES: dict[str, Family] = {
    # mlx-lm serves mistral (and its `layer_types` sliding windows) through llama.py.
    "llama": _PLAIN_TP,
    "qwen2": _PLAIN_TP,
    "qwen3": _PLAIN_TP,
    "qwen3_moe": _PLAIN_TP,
    "mixtral": _PLAIN,
    "phi3": _PLAIN,
    "gemma3_text": _PLAIN,
    # Logit soft-capping in attention and on the head: only the gathering path.
    "gemma2": Family(verified=True, grouped_mask=True),
    # Attention sinks: the decode kernel does not take them.
    "gpt_oss": Family(verified=True, split_head=True, tensor_parallel=True),
    # Recurrent and hybrid families: per-sequence state beside the pool.
    "mamba": Family(verified=True),
    "mamba2": Family(verified=True),
    "lfm2": Family(verified=True, direct_decode=True),
    "qwen3_next": Family(verified=True, direct_decode=True),
    "nemotron_h": Family(verified=True, direct_decode=True),
    "falcon_h1": Family(verified=True),
    "jamba": Family(verified=True),
    "granitemoehybrid": Family(verified=True),
}


def family(name: str) -> Family:
    """The family's paths; an unknown family takes none of them."""
    return FAMILIES.get(name, Family())
