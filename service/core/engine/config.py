"""How the engine runs a loaded model: decided once, from the platform and the model, before
anything is built, and frozen. Nothing changes a built engine's mode afterwards.

One decode path per platform:
- CUDA: decode steps attend straight from the paged pool with the CUDA kernel, which also
  writes their K/V in place and applies q's and k's RoPE (three kernels a layer fewer), so
  step N+1 is queued before step N is read (overlap), N is read and handed to the scheduler
  on a second thread while N+1's dispatch runs, and a step replays a compiled graph; prefill
  forwards are padded to a few shape buckets (attention builds a plan per new shape there).
  Sibling projections that read one input (q/k/v, gate/up) run as one matmul, split
  (service.core.models.projections): a matmul costs MLX's host work the most of any
  primitive, where on the CPU the split costs more than it saves. For the same reason a
  decode step's products over small weights come from one custom tensor-core kernel
  (service.core.models.decode_gemm), and a residual add and the RMSNorm after it are one kernel
  (service.core.models.residual_norm). LoRA rows' updates come
  from custom kernels (service.core.models.lora_kernel; in a decode step one per group of
  adapted projections that read one input): MLX's CUDA gather_mm runs a row's product at a
  time, and every extra primitive costs host work. Quantized projections fold a batch's rows
  into one product (service.core.models.quantized): MLX's CUDA quantized matmul reads the whole
  weight once per row of a [B, 1, D] input.
- Elsewhere: MLX ops. Decode steps of two or more rows attend over a contiguous copy of the
  batch's K/V (service.core.engine.kv_mirror) instead of gathering it from the pool every step;
  in float32, SwiGLU MLPs and (on the CPU) that attention's softmax use the multiply-add exp
  (service.core.models.activations). On the CPU
  quantized weights are dequantized at load where they fit: MLX's CPU quantized matmul computes
  a row at a time; RMSNorm and RoPE, fallbacks of a dozen primitives each there, run as
  compiled chains of a few (service.core.models.norms, service.core.models.rope): every
  primitive costs the CPU host work on two threads.

The model narrows this: a family not verified against mlx-lm runs each row alone; a family
whose attention the kernel cannot read (sinks, soft-capping) gathers; recurrent state forbids
padded multi-token rows (no shape buckets, one row per prefill forward) and is not compiled.

`MLXSERVE_DEBUG_REFERENCE_PATH=1` forces the MLX-ops path on any platform (tests compare the
two paths with it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import mlx.core as mx

from service.core.models.families import Family
from service.core.models.layout import CacheLayout

DEBUG_REFERENCE_ENV = "MLXSERVE_DEBUG_REFERENCE_PATH"


STORAGES = ("paged", "dense", "native")


@dataclass(frozen=True)
class EngineConfig:
    # Where K/V live (service.core.engine.storage.make_storage builds it): "paged" (the block pool
    # the scheduler's KVCacheManager keeps), "dense" (arrays per sequence) or "native" (mlx-lm's
    # own caches, one sequence at a time).
    storage: str = "paged"
    batched: bool = True  # one forward for all rows; False: each row alone
    decode_attention: str = "gather"  # "gather", "mirror" (CPU) or "direct" (CUDA kernel)
    in_place_writes: bool = False  # decode K/V written in place by the CUDA kernel
    # Direct decode steps' q/k RoPE applied by the attention and K/V store kernels
    # (service.core.models.rope.DeferredRoPE) rather than by two RoPE kernels a layer.
    rope_in_kernels: bool = False
    overlap_steps: bool = False  # step N+1 queued before step N is read
    # Step N is read and handed to the scheduler on a second thread while this one is inside
    # step N+1's `mx.async_eval` (MLX's host work, the GIL released): the scheduler's Python
    # then costs the step nothing on a host-bound device.
    update_beside_dispatch: bool = False
    compile_decode: bool = False  # decode steps replay a compiled graph
    shape_buckets: bool = False  # multi-token forwards padded to bucket lengths
    single_row_prefill: bool = False  # multi-token forwards carry one row (recurrent state)
    fast_swiglu: bool = False
    # Mirrored decode steps compute attention themselves (kv_mirror.attend: the multiply-add
    # exp in the softmax); the family's attention is mlx-lm's scaled_dot_product_attention.
    fast_mirror_attention: bool = False
    # RoPE's cos and sin made once per forward for every layer (service.core.models.rope's
    # SharedAngleRoPE): MLX's CPU RoPE is a fallback that computes them in every call.
    shared_rope_angles: bool = False
    # RMSNorms as compiled chains (service.core.models.norms): MLX's CPU RMSNorm is a fallback
    # of a dozen primitives, each host work.
    compiled_norms: bool = False
    grouped_query_mask: bool = False  # batched masks as [B, 1, 1, N, T] (families.grouped_mask)
    # LoRA rows' updates come from CUDA kernels (service.core.models.lora_kernel) rather than
    # MLX's gathered products.
    lora_kernel: bool = False
    # q/k/v and gate/up each one matmul, split (service.core.models.projections).
    fused_projections: bool = False
    # Decode products over small plain weights from the custom tensor-core kernel
    # (service.core.models.decode_gemm) rather than cuBLASLt.
    decode_gemm: bool = False
    # A layer's residual adds and the RMSNorms after them one kernel each
    # (service.core.models.residual_norm).
    fused_add_norm: bool = False
    # Quantized projections fold a forward's rows into one product
    # (service.core.models.quantized).
    fold_quantized_rows: bool = False
    # Quantized layers dequantized at load, where their float weights fit
    # (service.core.models.quantized).
    dequantize_weights: bool = False

    @property
    def paged(self) -> bool:
        return self.storage == "paged"

    @property
    def native_caches(self) -> bool:
        """One sequence at a time on mlx-lm's own caches: no batching, no rollback, no redo."""
        return self.storage == "native"

    @property
    def decode_path(self) -> str:
        if self.native_caches:
            return "batch size 1 (mlx-lm's own caches)"
        return "native batched forward" if self.batched else "per-row fallback"

    def __post_init__(self) -> None:
        if self.storage not in STORAGES:
            raise ValueError(f"unknown KV storage {self.storage!r}")
        if self.decode_attention not in ("gather", "mirror", "direct"):
            raise ValueError(f"unknown decode attention {self.decode_attention!r}")
        if self.decode_attention != "gather" and not self.paged:
            raise ValueError(f"{self.decode_attention} decode attention needs paged storage")
        if self.native_caches and self.batched:
            raise ValueError("mlx-lm's own caches run one sequence per forward")
        if self.in_place_writes and self.decode_attention != "direct":
            raise ValueError("in-place K/V writes come with direct decode attention")
        if self.rope_in_kernels and self.decode_attention != "direct":
            raise ValueError("RoPE in the decode kernels comes with direct decode attention")
        if self.rope_in_kernels and self.shared_rope_angles:
            raise ValueError("RoPE is either left to the decode kernels or shares its angles")
        if self.overlap_steps and not self.in_place_writes:
            raise ValueError("overlapped steps need in-place K/V writes")
        if self.update_beside_dispatch and not self.overlap_steps:
            raise ValueError("reading a step beside the next one's dispatch needs overlapped steps")
        if self.compile_decode and self.decode_attention != "direct":
            raise ValueError("compiled decode steps need direct decode attention")
        if self.fast_mirror_attention and self.decode_attention != "mirror":
            raise ValueError("the mirror's own attention needs mirror decode attention")


def reference_path_forced() -> bool:
    return os.environ.get(DEBUG_REFERENCE_ENV, "") not in ("", "0")


def resolve(
    family: Family,
    layout: CacheLayout,
    *,
    paged: bool,
    batched: bool,
    cuda: bool | None = None,
    cpu: bool | None = None,
    head_dim_supported: bool = True,
    float32: bool = False,
    grouped_heads: bool = False,
    compilable: bool = True,
) -> EngineConfig:
    """The engine configuration for a model on this platform. `paged`: the storage is the
    paged pool, else dense (a model whose caches the views cannot serve keeps mlx-lm's own);
    `batched`: rows may share a forward (not --no-batch, and a verified family);
    `grouped_heads`: several query heads share each K/V head; `compilable`: the forward can
    be traced (not when a layer reads array values on the host, service.core.models.rope);
    `cuda` / `cpu`: the platform (None: MLX's default device)."""
    grouped_query_mask = family.grouped_mask and grouped_heads
    storage = "paged" if paged else "dense"
    if cpu is None:
        cpu = mx.default_device() == mx.cpu
    if layout.native:
        return EngineConfig(
            storage="native", batched=False, single_row_prefill=True, dequantize_weights=cpu
        )
    if cuda is None:
        cuda = mx.cuda.is_available()
    if reference_path_forced():
        cuda = False
    if cuda:
        direct = paged and family.direct_decode and head_dim_supported
        return EngineConfig(
            storage=storage,
            batched=batched,
            decode_attention="direct" if direct else "gather",
            in_place_writes=direct,
            rope_in_kernels=direct,
            overlap_steps=direct,
            update_beside_dispatch=direct,
            compile_decode=direct and family.split_head and not layout.stateful and compilable,
            shape_buckets=not layout.stateful,
            single_row_prefill=layout.stateful,
            grouped_query_mask=grouped_query_mask,
            lora_kernel=True,
            fused_projections=True,
            decode_gemm=True,
            fused_add_norm=True,
            fold_quantized_rows=True,
        )
    mirror = paged and batched and not layout.sliding
    fast_exp = float32 and not reference_path_forced()
    return EngineConfig(
        storage=storage,
        batched=batched,
        decode_attention="mirror" if mirror else "gather",
        single_row_prefill=layout.stateful,
        fast_swiglu=fast_exp,
        # MLX's CPU attention is unfused and its exp scalar; Metal's attention is a kernel.
        fast_mirror_attention=mirror and fast_exp and family.direct_decode and cpu,
        shared_rope_angles=cpu and not reference_path_forced(),
        compiled_norms=cpu and not reference_path_forced(),
        grouped_query_mask=grouped_query_mask,
        dequantize_weights=cpu,
    )
