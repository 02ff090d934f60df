"""Peers for the client's benchmark harness: the same plan through mlx-lm on the same weights.

- `mlx-lm`: mlx-lm's HTTP server (`mlx_lm.server`), started by the harness (mlx_lm_server.py),
  on an mlx-lm copy of our weights (export.py, cached);
- `raw`: the raw mlx-lm batched forward loop, no server: the upper bound at each C (raw.py);
- `mlx-lm-batch`: mlx-lm's in-process `batch_generate` (mlx_lm_batch.py).

They import MLX and the server's model loader (in their own processes), so they live here and
not in the client wheel. `PEERS` maps each name to a `client.bench.cli.PeerRun`;
`python -m bench.compare` runs the harness with them, and `python -m client bench --peer NAME`
finds them when this package is importable (a checkout). Importing this package is light: the
heavy imports happen in the peer processes.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Any

from client.bench.cli import PeerRun, Progress
from client.bench.metrics import LevelResult
from client.bench.workload import Plan

REPO_ROOT = Path(__file__).resolve().parents[2]


def mlx_env() -> dict[str, str]:
    """This environment plus OpenBLAS preloaded for MLX's CPU backend (docs/cpu-backend.md)."""
    from service.common.blas import blas_env

    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    extra = blas_env()
    if "LD_PRELOAD" in extra and env.get("LD_PRELOAD"):
        extra["LD_PRELOAD"] = f"{extra['LD_PRELOAD']}:{env['LD_PRELOAD']}"
    env.update(extra)
    return env


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The peers' own options, beside the harness's."""
    group.add_argument(
        "--peer-args", default="", help="extra arguments for mlx_lm.server, one shell-quoted string"
    )
    group.add_argument(
        "--peer-keep-eos",
        action="store_true",
        help="do not patch mlx_lm.server to ignore EOS (tokens still counted)",
    )
    group.add_argument(
        "--export-dir",
        type=Path,
        default=REPO_ROOT / ".cache",
        help="where the peer's mlx-lm copy of the weights is cached",
    )


def _dtype(args: argparse.Namespace) -> str | None:
    return None if args.dtype == "auto" else args.dtype


def run_mlx_lm_server(
    plan: Plan, progress: Progress, args: argparse.Namespace, log_stem: Path
) -> tuple[list[LevelResult], dict[str, Any]]:
    from bench.peers.export import ensure_model_dir
    from bench.peers.mlx_lm_server import run_peer

    model_dir = ensure_model_dir(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        progress=progress,
        cache_root=args.export_dir,
    )
    return run_peer(
        plan,
        progress,
        model_dir=model_dir,
        decode_concurrency=max(plan.workload.concurrency),
        log_path=Path(f"{log_stem}.mlx-lm.log"),
        extra_args=shlex.split(args.peer_args),
        ignore_eos=not args.peer_keep_eos,
        request_timeout=args.request_timeout,
    )


def run_raw(
    plan: Plan, progress: Progress, args: argparse.Namespace, log_stem: Path
) -> tuple[list[LevelResult], dict[str, Any]]:
    from bench.peers.raw import run_peer

    levels = run_peer(
        plan, progress, model=args.model, load_format=args.load_format, dtype=_dtype(args)
    )
    return levels, {}


def run_mlx_lm_batch(
    plan: Plan, progress: Progress, args: argparse.Namespace, log_stem: Path
) -> tuple[list[LevelResult], dict[str, Any]]:
    from bench.peers.mlx_lm_batch import run_peer

    levels = run_peer(
        plan, progress, model=args.model, load_format=args.load_format, dtype=_dtype(args)
    )
    return levels, {}


PEERS: dict[str, PeerRun] = {
    "mlx-lm": run_mlx_lm_server,
    "raw": run_raw,
    "mlx-lm-batch": run_mlx_lm_batch,
}
