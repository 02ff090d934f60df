"""Tiny random-weight models and engines over them: the shared helpers of the engine tests."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models import llama

from service.engine.config import EngineConfig
from service.engine.engine import Engine, StepRow
from service.engine.kv_dense import DenseKVStorage
from service.engine.kv_paged import PagedKVStorage
from service.engine.sampler import SamplingParams
from service.models.layout import CacheLayout, probe_layout

LAYERS, KV_HEADS, HEAD_DIM, VOCAB = 2, 2, 16, 256


def tiny_llama(
    hidden_size: int = 64, heads: int = 4, kv_heads: int = KV_HEADS, seed: int = 7
) -> llama.Model:
    """A random llama of LAYERS layers; head_dim = hidden_size / heads (16 by default)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=hidden_size,
        num_hidden_layers=LAYERS,
        intermediate_size=2 * hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    m = llama.Model(args)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    return m


def layout_of(model) -> CacheLayout:
    return probe_layout(model)


def make_engine(model, storage, config: EngineConfig | None = None, **kw) -> Engine:
    return Engine(model, storage, layout_of(model), config, split_head=True, **kw)


def paged(num_blocks: int = 64, block_size: int = 8, **kw) -> PagedKVStorage:
    return PagedKVStorage(LAYERS, KV_HEADS, HEAD_DIM, mx.float32, num_blocks, block_size, **kw)


def dense() -> DenseKVStorage:
    return DenseKVStorage(LAYERS, KV_HEADS, HEAD_DIM, mx.float32)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + i * 17 + (i * i) % 7) % VOCAB for i in range(length)]


PROMPTS = [prompt(1, 5), prompt(2, 13), prompt(3, 30)]


def generate(engine: Engine, prompts: list[list[int]], steps: int = 20, tag: str = "s"):
    seqs = [engine.add_sequence(f"{tag}{i}", SamplingParams(), p) for i, p in enumerate(prompts)]
    results = engine.prefill([StepRow(s, p) for s, p in zip(seqs, prompts)])
    out = [[r.token_id] for r in results]
    for _ in range(steps):
        for o, r in zip(out, engine.step([StepRow(s) for s in seqs])):
            o.append(r.token_id)
    return seqs, out


def run_split(engine: Engine, tokens: list[int], split: int, steps: int, adopt: bool = False):
    """Prefill tokens[:split] (or adopt them) then tokens[split:], then decode greedily."""
    seq = engine.add_sequence("split", SamplingParams(), tokens)
    if adopt:
        assert engine.adopt_prefix(seq, tokens) == split
    else:
        engine.prefill([StepRow(seq, tokens[:split], sample=False)])
    assert seq.num_cached == split
    out = [engine.prefill([StepRow(seq, tokens[split:])])[0].token_id]
    for _ in range(steps):
        out.append(engine.step([StepRow(seq)])[0].token_id)
    return seq, out
