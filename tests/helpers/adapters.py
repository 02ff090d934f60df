"""LoRA adapters trained in the test itself by mlx-lm's own trainer (`mlx_lm lora`'s `run`), on
tiny seeded llama checkpoints, and mlx-lm's greedy generation with one of them loaded (what
`mlx_lm generate --adapter-path` computes): the reference the server is compared with.

Each adapter learns its own affine successor rule over the tiny vocabulary, so that every
adapter changes greedy output (the tests check it). A dozen iterations take a second or two.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import shutil
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB = 256
TINY_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
EOS_ID = 2


@dataclass(frozen=True)
class Spec:
    """One adapter to train: on which base ("f" float32, "q" 4-bit, "b" with biases), with
    which `mlx_lm lora` settings."""

    base: str
    fine_tune_type: str
    rank: int
    scale: float
    num_layers: int = -1
    keys: tuple[str, ...] | None = None
    seed: int = 0

    def overrides(self) -> dict[str, Any]:
        params: dict[str, Any] = {"rank": self.rank, "scale": self.scale, "dropout": 0.0}
        if self.keys is not None:
            params["keys"] = list(self.keys)
        return {
            "fine_tune_type": self.fine_tune_type,
            "num_layers": self.num_layers,
            "seed": self.seed,
            "lora_parameters": params,
        }


ATTENTION_HEAD = ("self_attn.q_proj", "self_attn.v_proj", "lm_head")
MLP_AND_O = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "self_attn.o_proj")
KV_DOWN = ("self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj")

SPECS: dict[str, Spec] = {
    # Every projection of every layer, rank 8.
    "all7": Spec("f", "lora", 8, 20.0, seed=1),
    # q/v of the last layer and the LM head, rank 4 (mixed ranks with all7).
    "qv_head": Spec("f", "lora", 4, 10.0, num_layers=1, keys=ATTENTION_HEAD, seed=2),
    "dora_mlp": Spec("f", "dora", 16, 5.0, num_layers=2, keys=MLP_AND_O, seed=3),
    "qlora": Spec("q", "lora", 8, 20.0, seed=4),
    "qdora": Spec("q", "dora", 4, 10.0, keys=KV_DOWN, seed=5),
    "blora": Spec("b", "lora", 8, 20.0, seed=6),
    "bdora": Spec("b", "dora", 8, 10.0, seed=7),
}
# Where mlx-lm computes its own base product (DoRA over a bias or a quantized base): the same
# tokens, logprobs to float tolerance.
TOLERANT = frozenset({"qdora", "bdora"})
# Elsewhere the low-rank products are mlx-lm's own ops on other shapes (a row of a gathered stack,
# a rank padded or sliced): some CPUs' BLAS kernels round those a few float32 ulps apart (at the
# logprobs' magnitude, one ulp is about 1e-6), others not at all. The tokens stay exact.
ULPS = 1e-5


def tokenizer_files(dst: Path) -> None:
    """A word-level tokenizer over the tiny vocabulary: "w3 w17 ..." <-> [3, 17, ...]."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS_ID} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
            }
        )
    )


def build_base(
    dst: Path, config: dict | None = None, seed: int = 0, quantize: bool = False
) -> Path:
    """A seeded tiny llama checkpoint (peaked logits: greedy never rests on a near-tie)."""
    from mlx_lm.models import llama

    config = dict(config or TINY_LLAMA)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.lm_head.weight = model.lm_head.weight * 6.0
    mx.eval(model.parameters())
    if quantize:
        from mlx_lm.utils import quantize_model

        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size=32, bits=4)
    dst.mkdir(parents=True)
    mx.save_safetensors(
        str(dst / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (dst / "config.json").write_text(json.dumps(config | {"eos_token_id": EOS_ID}))
    tokenizer_files(dst)
    return dst


BASES: dict[str, Callable[[Path], Path]] = {
    "f": lambda dst: build_base(dst),
    "q": lambda dst: build_base(dst, quantize=True),
    "b": lambda dst: build_base(dst, TINY_LLAMA | {"attention_bias": True, "mlp_bias": True}, 1),
}


def dataset(dst: Path, seed: int, vocab: int = VOCAB, words: Callable[[int], str] | None = None):
    """Sequences that follow one affine successor rule (per seed), as mlx-lm's text datasets."""
    rng = random.Random(seed)
    a, b = rng.randrange(3, 50), rng.randrange(0, 250)
    spell = words or (lambda t: f"w{t}")
    dst.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 24), ("valid", 4)):
        lines = []
        for _ in range(n):
            t = rng.randrange(3, vocab)
            seq = []
            for _ in range(20):
                seq.append(spell(t))
                t = 3 + (t * a + b) % (vocab - 3)
            lines.append(json.dumps({"text": " ".join(seq)}))
        (dst / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    return dst


def train(base: Path, data: Path, out: Path, overrides: dict[str, Any], iters: int = 12) -> Path:
    """`mlx_lm lora --train` with these settings, in this process."""
    from mlx_lm import lora

    args = dict(lora.CONFIG_DEFAULTS)
    args.update(
        model=str(base),
        train=True,
        data=str(data),
        adapter_path=str(out),
        iters=iters,
        batch_size=4,
        learning_rate=1e-2,
        steps_per_report=1000,
        steps_per_eval=1000,
        val_batches=1,
        save_every=1000,
        max_seq_length=64,
    )
    args.update(overrides)
    with contextlib.redirect_stdout(io.StringIO()):
        lora.run(types.SimpleNamespace(**args))
    return out


def train_all(root: Path, names: tuple[str, ...] | None = None) -> Path:
    """The bases and the adapters of SPECS (or of `names`) under root: root/<base>,
    root/adapters/<name>."""
    wanted = names or tuple(SPECS)
    for base in sorted({SPECS[n].base for n in wanted}):
        if not (root / base).exists():
            BASES[base](root / base)
    for i, name in enumerate(SPECS):
        if name in wanted and not (root / "adapters" / name).exists():
            spec = SPECS[name]
            data = dataset(root / "data" / name, seed=100 + i)
            train(root / spec.base, data, root / "adapters" / name, spec.overrides())
    return root


# Words of the embedded adapter's training sequences (one BPE token or two each).
WORDS = [
    *("the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "red", "house"),
    *("where", "blue", "birds", "sing", "every", "morning", "while", "old", "men", "read"),
    *("long", "books", "near", "quiet", "rivers", "under", "tall", "green", "trees"),
]
EMBEDDED_ADAPTER = {
    "fine_tune_type": "lora",
    "num_layers": 2,
    "batch_size": 2,
    "learning_rate": 1e-2,
    "lora_parameters": {
        "rank": 4,
        "scale": 20.0,
        "dropout": 0.0,
        "keys": ["self_attn.q_proj", "self_attn.v_proj"],
    },
}


def embedded_adapter(root: Path) -> tuple[Path, Path]:
    """The embedded SmolLM2 written as an mlx-lm float32 checkpoint (the weights the server
    serves), and a tiny adapter trained on it: rank 4 on q/v of the last two layers, a few
    iterations over word sequences of one successor rule. (checkpoint, adapter)"""
    from tests.helpers import model_zoo

    base = model_zoo.build_embedded(root)
    adapter = root / "smollm2-adapter"
    if not (adapter / "adapters.safetensors").exists():
        spell = WORDS.__getitem__
        data = dataset(root / "smollm2-data", seed=3, vocab=len(WORDS), words=spell)
        train(base, data, adapter, EMBEDDED_ADAPTER, iters=6)
    return base, adapter


def copy_adapter(
    src: Path,
    dst: Path,
    config_edit: Callable[[dict], Any] | None = None,
    weights_edit: Callable[[dict], Any] | None = None,
) -> Path:
    """A copy of an adapter directory, its config or weights edited (for refusals)."""
    shutil.copytree(src, dst)
    if config_edit is not None:
        config = json.loads((dst / "adapter_config.json").read_text())
        config_edit(config)
        (dst / "adapter_config.json").write_text(json.dumps(config))
    if weights_edit is not None:
        weights = mx.load(str(dst / "adapters.safetensors"))
        weights_edit(weights)
        mx.save_safetensors(str(dst / "adapters.safetensors"), weights)
    return dst


def prompts(n: int, seed: int, length: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(n)]


@dataclass
class Reference:
    tokens: list[int]
    logprobs: mx.array  # [steps, vocab]


_REFERENCES: dict[tuple[str, str | None, tuple[int, ...], int], Reference] = {}


def mlx_lm_generate(
    base: Path, adapter: Path | None, prompt: list[int], steps: int = 8
) -> Reference:
    """mlx-lm's greedy generation with the adapter loaded (`mlx_lm generate --adapter-path`):
    the tokens and every step's logprobs (memoized)."""
    key = (str(base), None if adapter is None else str(adapter), tuple(prompt), steps)
    if key not in _REFERENCES:
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        model, _ = load(str(base), adapter_path=None if adapter is None else str(adapter))
        tokens, logprobs = [], []
        for token, lp in generate_step(mx.array(prompt), model, max_tokens=steps):
            tokens.append(int(token))
            logprobs.append(lp)
        _REFERENCES[key] = Reference(tokens, mx.stack(logprobs))
    return _REFERENCES[key]
