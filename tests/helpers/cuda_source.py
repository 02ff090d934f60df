"""A custom kernel's CUDA source as MLX's `mx.fast.cuda_kernel` wraps it, compiled with nvcc:
compile errors, register spills and launch limits show on a machine without a GPU.

MLX (mlx/backend/cuda/custom_kernel.cpp) puts the header first, then a `__global__` function
taking each input as `const T*` (plus `NAME_shape` and `NAME_strides` where the source reads
them), each output as `T*`, the template values as `constexpr int` / `using` declarations,
and the source as its body.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

CUDA_TYPES = {
    mx.bfloat16: "__nv_bfloat16",
    mx.float16: "__half",
    mx.float32: "float",
    mx.int32: "int32_t",
    mx.uint32: "uint32_t",
}

_PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstddef>
#include <cstdint>
struct Shape {  // MLX's: an int32 per dimension
  int32_t dims[8];
  __device__ int32_t operator[](int i) const { return dims[i]; }
};
struct Strides {  // MLX's: an int64 per dimension
  int64_t dims[8];
  __device__ int64_t operator[](int i) const { return dims[i]; }
};
"""


@dataclass
class Launch:
    """One call of a custom kernel: what `mx.fast.cuda_kernel` was made with, and what the
    function it returned was called with."""

    source: str
    header: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    inputs: list[mx.array]
    template: list[tuple[str, Any]]
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    output_dtypes: list[mx.Dtype]


class Recorder:
    """Stands in for `mx.fast.cuda_kernel` (the modules' kernel factories must be called
    uncached, through `__wrapped__`): each launch is recorded and returns zeros, and
    `compile` compiles them all."""

    def __init__(self, monkeypatch: Any) -> None:
        self.launches: list[Launch] = []
        monkeypatch.setattr(mx.fast, "cuda_kernel", self._kernel)

    def _kernel(self, name, input_names, output_names, source, header="", **_):
        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
            self.launches.append(
                Launch(
                    source,
                    header,
                    input_names,
                    output_names,
                    inputs,
                    template,
                    grid,
                    threadgroup,
                    output_dtypes,
                )
            )
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

        return call

    def compile(self, workdir: Path) -> Compiled:
        """Every recorded launch, each its own `__global__` function: one nvcc run for each
        header, which comes first in its file as in MLX's (headers may define the same device
        functions: `lora_kernel`'s loads are in `fused_add`'s header and the row kernels' both)."""
        groups: dict[str, list[str]] = {}
        for i, launch in enumerate(self.launches):
            groups.setdefault(launch.header, []).append(wrap(f"k{i}", launch))
        results = []
        for g, (header, kernels) in enumerate(groups.items()):
            (workdir / str(g)).mkdir(exist_ok=True)
            results.append(compile_kernels(header, kernels, workdir / str(g)))
        return Compiled(
            [n for r in results for n in r.registers],
            sum(r.spills for r in results),
            "".join(r.log for r in results),
        )


def nvcc() -> str | None:
    return shutil.which("nvcc")


def wrap(name: str, launch: Launch) -> str:
    """The `__global__` function MLX would build for this launch."""
    args = []
    for arg, array in zip(launch.input_names, launch.inputs, strict=True):
        args.append(f"const {CUDA_TYPES[array.dtype]}* {arg}")
        if f"{arg}_shape" in launch.source:
            args.append(f"const __grid_constant__ Shape {arg}_shape")
        if f"{arg}_strides" in launch.source:
            args.append(f"const __grid_constant__ Strides {arg}_strides")
    args += [
        f"{CUDA_TYPES[dtype]}* {out}"
        for out, dtype in zip(launch.output_names, launch.output_dtypes, strict=True)
    ]
    consts = "".join(
        f"  using {key} = {CUDA_TYPES[value]};\n"
        if isinstance(value, mx.Dtype)
        else f"  constexpr int {key} = {int(value)};\n"
        for key, value in launch.template
    )
    return (
        f"__global__ void {name}(\n    "
        + ",\n    ".join(args)
        + ") {\n"
        + consts
        + launch.source
        + "}\n"
    )


@dataclass
class Compiled:
    registers: list[int]  # per kernel, in order
    spills: int  # bytes of spill stores over all kernels
    log: str


def compile_kernels(
    header: str, kernels: Sequence[str], workdir: Path, arch: str = "sm_90"
) -> Compiled:
    """nvcc's verdict on the header and kernels together (raises with its log on an error)."""
    path = workdir / "kernels.cu"
    path.write_text(_PRELUDE + header + "".join(kernels))
    tool = nvcc()
    assert tool is not None
    done = subprocess.run(
        [
            tool,
            f"-arch={arch}",
            "-std=c++17",
            "-Xptxas",
            "-v",
            "-c",
            str(path),
            "-o",
            str(workdir / "k.o"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"nvcc failed:\n{log}")
    registers = [int(n) for n in re.findall(r"Used (\d+) registers", log)]
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", log))
    return Compiled(registers, spills, log)
