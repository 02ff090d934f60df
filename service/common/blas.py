"""OpenBLAS for MLX's Linux CPU backend.

The PyPI CPU wheel of MLX links the netlib reference BLAS, far too slow to serve a
model; preloading Debian's OpenBLAS fixes that (docs/cpu-backend.md). The
dynamic loader reads LD_PRELOAD only at process start, so the server re-executes
itself once with the variables set; `python -m service.common.blas --env` prints them
for the Makefile.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)
_MARKER = "MLXSERVE_BLAS_CONFIGURED"


def _openblas_path() -> str | None:
    if platform.system() != "Linux":
        return None
    return next((p for p in _CANDIDATES if Path(p).exists()), None)


def _core_type() -> str | None:
    """The VM hides its CPU model, so OpenBLAS would pick a generic kernel: name one by flags."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    if " avx512f" in flags:
        return "SkylakeX"
    if " avx2" in flags:
        return "Haswell"
    return None


def blas_env() -> dict[str, str]:
    """Environment variables that make MLX use OpenBLAS, or {} where it does not apply."""
    if os.environ.get("MLXSERVE_NO_OPENBLAS"):
        return {}
    lib = _openblas_path()
    if lib is None:
        return {}
    env = {"LD_PRELOAD": lib, _MARKER: "1"}
    core = os.environ.get("OPENBLAS_CORETYPE") or _core_type()
    if core:
        env["OPENBLAS_CORETYPE"] = core
    # OpenBLAS's worker threads spin for 2^28 cycles after each product before they sleep. A
    # decode step is many small products, so they spin through the whole step on cores the
    # engine's other threads and the front ends need; 2^4 puts them to sleep at once, and
    # waking them costs a large product nothing that shows (docs/cpu-backend.md).
    env["OPENBLAS_THREAD_TIMEOUT"] = os.environ.get("OPENBLAS_THREAD_TIMEOUT") or "4"
    return env


def reexec_with_openblas() -> None:
    """Replace this process with one that has OpenBLAS preloaded, once."""
    if os.environ.get(_MARKER):
        return
    env = blas_env()
    if not env:
        return
    preload = os.environ.get("LD_PRELOAD", "")
    if env["LD_PRELOAD"] in preload.split(":"):
        return
    new_env = dict(os.environ)
    new_env.update(env)
    if preload:
        new_env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{preload}"
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], new_env)


if __name__ == "__main__":
    if "--env" in sys.argv:
        print(" ".join(f"{k}={v}" for k, v in blas_env().items()))
