"""Model loading: the embedded GGUF, an mlx-lm/Hugging Face directory, or dummy weights."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from service.common.model_source import (  # noqa: F401  (re-exported: the loader's public errors)
    EMBEDDED_INSTALL,
    EMBEDDED_MODEL_ID,
    ModelLoadError,
    embedded_gguf_path,
)
from service.common.tokenizer import Tokenizer, tokenizer_from_gguf, tokenizer_from_hf
from service.core.models import rope

log = logging.getLogger(__name__)
# Told of the model's tokenizer as soon as it exists, while the weights may still be loading.
TokenizerHook = Callable[[Tokenizer], object]


@dataclass(frozen=True)
class Quantization:
    """How the checkpoint's weights are quantized (mlx-lm's `quantization` config block)."""

    mode: str = ""  # "" = not quantized; "affine", "mxfp4", ...
    bits: int = 0
    group_size: int = 0
    overrides: int = 0  # modules quantized differently from the default (or left float)
    dequantized: bool = False  # served as float weights (dequantized at load)

    def describe(self) -> str:
        if not self.mode:
            return "none"
        extra = f", {self.overrides} per-layer overrides" if self.overrides else ""
        served = ", served dequantized" if self.dequantized else ""
        return f"{self.mode} {self.bits}-bit, group {self.group_size}{extra}{served}"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Tokenizer
    model_id: str
    architecture: str  # the model_type of its configuration (e.g. "mistral")
    family: str  # the mlx-lm module that implements it (e.g. "llama")
    num_layers: int
    num_heads: int  # query heads of an attention layer (0 for a purely recurrent model)
    vocab_size: int
    max_context: int
    dtype: mx.Dtype  # of the float parameters: what activations and the KV cache use
    quantization: Quantization = Quantization()
    config: dict | None = None  # the config.json it was built from (None: the GGUF)


def default_dtype() -> mx.Dtype:
    # On CPU only float32 is fast (docs/cpu-backend.md); on a GPU bfloat16.
    return mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def parse_dtype(name: str | None) -> mx.Dtype:
    if not name or name == "auto":
        return default_dtype()
    table = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if name not in table:
        raise ModelLoadError(f"unknown dtype {name!r}; use one of {sorted(table)} or auto")
    return table[name]


def model_family(model: nn.Module) -> str:
    """The mlx-lm module that implements the model: the key of service.core.models.families."""
    return type(model).__module__.rsplit(".", 1)[-1]


def float_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype of the model's float parameters. A quantized model's packed weights are
    uint32; its scales, norms and any float layers carry the dtype it computes in."""
    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    raise ModelLoadError("the model has no floating-point parameters")


def materialize(model: nn.Module) -> None:
    """Evaluate every array the modules hold, private ones included. mlx-lm's RoPE classes
    keep their frequencies as lazy `_freqs` arrays that `parameters()` does not list; left
    lazy, they would be evaluated on the first request, by whichever thread serves it."""
    arrays = [
        value
        for module in model.modules()
        for value in module.values()
        if isinstance(value, mx.array)
    ]
    mx.eval(model.parameters(), arrays)


def quantization_of(config: dict, model: nn.Module) -> Quantization:
    """The config's `quantization` block, with the modules quantized differently from its
    default: the block's per-module entries, plus the modules its predicate left float (mlx-lm
    writes no entry for those: they are the 2-D float weights that have no scales)."""
    block = config.get("quantization") or config.get("quantization_config")
    if not isinstance(block, dict) or "bits" not in block:
        return Quantization()
    entries = sum(1 for v in block.values() if isinstance(v, dict | bool))
    flat = dict(tree_flatten(model.parameters()))
    left_float = sum(
        1
        for name, w in flat.items()
        if name.endswith(".weight")
        and w.ndim == 2
        and mx.issubdtype(w.dtype, mx.floating)
        and name.removesuffix(".weight") + ".scales" not in flat
    )
    return Quantization(
        mode=str(block.get("mode", "affine")),
        bits=int(block["bits"]),
        group_size=int(block.get("group_size", 64)),
        overrides=entries + left_float,
    )


def model_arg(args: Any, name: str) -> Any:
    """A model argument, from the arguments or (multimodal layouts) their `text_config`."""
    value = getattr(args, name, None)
    if value is None:
        text = getattr(args, "text_config", None)
        value = text.get(name) if isinstance(text, dict) else getattr(text, name, None)
    return value


def _describe(
    model: Any, tokenizer: Tokenizer, model_id: str, config: dict | None = None
) -> LoadedModel:
    args = model.args
    rope.install(model)  # per-row dynamic-NTK bases for batched steps
    materialize(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        architecture=getattr(args, "model_type", None) or model_family(model),
        family=model_family(model),
        num_layers=len(model.layers),
        num_heads=model_arg(args, "num_attention_heads") or 0,
        vocab_size=model_arg(args, "vocab_size") or tokenizer.vocab_size,
        max_context=model_arg(args, "max_position_embeddings") or 4096,
        dtype=float_dtype(model),
        quantization=quantization_of(config or {}, model),
        config=config,
    )


def load_embedded(dtype: mx.Dtype, on_tokenizer: TokenizerHook | None = None) -> LoadedModel:
    from service.core.models.gguf import llama_from_gguf, read_gguf

    tensors, metadata = read_gguf(embedded_gguf_path())
    tokenizer = _announce(tokenizer_from_gguf(metadata), on_tokenizer)  # before dequantizing
    return _describe(llama_from_gguf(tensors, metadata, dtype), tokenizer, EMBEDDED_MODEL_ID)


def _announce(tokenizer: Tokenizer, on_tokenizer: TokenizerHook | None) -> Tokenizer:
    if on_tokenizer is not None:
        on_tokenizer(tokenizer)
    return tokenizer


def load_directory(
    path: Path, dtype: mx.Dtype | None, on_tokenizer: TokenizerHook | None = None
) -> LoadedModel:
    """A local mlx-lm / Hugging Face layout directory, through mlx-lm's architectures."""
    from mlx_lm.utils import load as mlx_lm_load

    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} is not a model directory (no config.json)")
    try:
        model, wrapper, config = mlx_lm_load(str(path), return_config=True)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise ModelLoadError(f"mlx-lm cannot load {path}: {exc}") from exc
    if dtype is not None:
        model.set_dtype(dtype)  # float parameters only: packed weights stay as they are
    hf = wrapper._tokenizer
    eos = sorted(wrapper.eos_token_ids) if wrapper.eos_token_ids else [hf.eos_token_id]
    tokenizer = _announce(tokenizer_from_hf(hf, eos), on_tokenizer)
    return _describe(model, tokenizer, path.name, config)


def load_dummy(
    preset: str, dtype: mx.Dtype, on_tokenizer: TokenizerHook | None = None
) -> LoadedModel:
    """Random weights of a preset's shape with the embedded tokenizer (EOS to be ignored)."""
    from service.core.models.gguf import read_gguf_metadata
    from service.core.models.presets import dummy_model

    metadata = read_gguf_metadata(embedded_gguf_path())
    tokenizer = _announce(tokenizer_from_gguf(metadata), on_tokenizer)
    try:
        model, config = dummy_model(preset, dtype)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from exc
    return _describe(model, tokenizer, f"dummy:{preset}", config)


def load_model(
    model: str | None,
    dtype_name: str | None = None,
    load_format: str = "auto",
    on_tokenizer: TokenizerHook | None = None,
) -> LoadedModel:
    """`on_tokenizer`: told of the tokenizer as soon as it exists (the embedded and dummy
    models: before their weights are made, the longest part of their load)."""
    if load_format.startswith("dummy"):
        _, _, preset = load_format.partition(":")
        return load_dummy(preset or "smollm2-135m", parse_dtype(dtype_name), on_tokenizer)
    if load_format != "auto":
        raise ModelLoadError(f"--load-format {load_format!r}: use auto or dummy:PRESET")
    if model is None or model == "embedded":
        return load_embedded(parse_dtype(dtype_name), on_tokenizer)
    path = Path(model)
    if not path.is_dir():
        raise ModelLoadError(f"--model {model!r}: no such directory (nothing is downloaded)")
    return load_directory(path, parse_dtype(dtype_name) if dtype_name else None, on_tokenizer)
