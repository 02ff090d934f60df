"""Quantized projections that take a forward's rows as one matrix.

A batched decode forward hands each projection x of shape [B, 1, D]: B matrices of one row
each. MLX's CUDA quantized matmul runs that as B matrix-vector products, each reading the whole
quantized weight, so a decode step's weight traffic grows with its batch (a dense matmul folds
the leading axes into one product instead). `fold_rows` gives each quantized linear layer
(sharded ones too) and a tied model's quantized LM head that folding: [..., D] becomes
[rows, D] for the product and is shaped back after, so one weight read serves every row. Each
row's product is the same quantized matmul; only the kernel MLX picks for the batch changes.

Sibling projections fused into one product (service.core.models.projections) fold their input
in that product, and their class chain ends here for the case where the group gives up.

MLX's CPU quantized matmul is worse: it computes a row at a time, far slower than the dense
product with OpenBLAS at any batch. On the CPU `dequantize` turns the quantized layers into
float ones at load (when the float weights fit: the runtime checks `dequantized_extra_bytes`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear, QuantizedShardedToAllLinear
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import dequantize_model

# From this many rows a product runs faster on the weight dequantized for the call, then a
# dense matmul: expanding the weight costs about one dense product's time, and MLX's CUDA
# quantized kernel falls behind the dense one as rows grow (bench/quantized_rows.py). Prefill
# passes and the widest decode batches take that path.
DEQUANTIZE_ROWS = 256


def folded_product(x: mx.array, w: mx.array, **quantization: Any) -> mx.array:
    """`mx.quantized_matmul(x, w, transpose=True, **quantization)` with x's leading axes folded
    into one, in x's leading shape; from DEQUANTIZE_ROWS rows, x @ the dequantized weight (the
    same products to float rounding)."""
    rows = x.reshape(-1, x.shape[-1]) if x.ndim > 2 else x
    if rows.shape[0] >= DEQUANTIZE_ROWS:
        y = rows @ mx.dequantize(w, dtype=x.dtype, **quantization).T
    else:
        y = mx.quantized_matmul(rows, w, transpose=True, **quantization)
    return y if x.ndim <= 2 else y.reshape(*x.shape[:-1], y.shape[-1])


def _folded(module: nn.Module, x: mx.array) -> mx.array:
    """A quantized layer's product (no bias) with x's rows folded."""
    return folded_product(
        x,
        module["weight"],
        scales=module["scales"],
        biases=module.get("biases"),
        group_size=module.group_size,
        bits=module.bits,
        mode=module.mode,
    )


class FoldedQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = _folded(self, x)
        return y + self["bias"] if "bias" in self else y


class FoldedQuantizedAllToShardedLinear(QuantizedAllToShardedLinear):
    # Serving takes no gradients: the forward is the product alone.
    def __call__(self, x: mx.array) -> mx.array:
        y = _folded(self, x)
        return y + self["bias"] if "bias" in self else y


class FoldedQuantizedShardedToAllLinear(QuantizedShardedToAllLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(_folded(self, x), group=self.group)
        return y + self["bias"] if "bias" in self else y


class FoldedQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return _folded(self, x)


_FOLDED: dict[type[nn.Module], type[nn.Module]] = {
    nn.QuantizedLinear: FoldedQuantizedLinear,
    QuantizedAllToShardedLinear: FoldedQuantizedAllToShardedLinear,
    QuantizedShardedToAllLinear: FoldedQuantizedShardedToAllLinear,
    nn.QuantizedEmbedding: FoldedQuantizedEmbedding,
}


def fold_rows(model: nn.Module) -> int:
    """Give the model's quantized linear layers (plain or sharded) and embeddings (MLX's own
    classes, not subclasses such as fused ones) the folded product; returns how many changed.
    Names, arrays and parameter counts stay as they were."""
    changed = 0
    for _, module in model.named_modules():
        folded = _FOLDED.get(type(module))
        if folded is not None:
            module.__class__ = folded
            changed += 1
    return changed


def _quantized_modules(model: nn.Module) -> list[nn.Module]:
    kinds = (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)
    return [m for _, m in model.named_modules() if isinstance(m, kinds)]


def dequantized_extra_bytes(model: nn.Module) -> int:
    """The memory `dequantize` would add: each quantized weight in its scales' dtype, less what
    the packed weight, scales and biases take now."""
    extra = 0
    for module in _quantized_modules(model):
        packed = module["weight"]
        values = packed.size * 32 // module.bits
        now = sum(module[k].nbytes for k in ("weight", "scales", "biases") if k in module)
        extra += values * module["scales"].dtype.size - now
    return extra


def dequantize(model: nn.Module) -> int:
    """Replace the model's quantized layers with float ones holding the dequantized weights
    (mlx-lm's `dequantize_model`, as `mlx_lm.convert --dequantize` does); returns how many."""
    count = len(_quantized_modules(model))
    if count:
        dequantize_model(model)
        mx.eval(model.parameters())
    return count
