"""`python -m bench.compare`: the client's benchmark harness with the repository's peers and
acceptance targets: our server through gRPC, then mlx-lm on the same weights and plan
(bench/peers/), then the targets of bench/targets.py checked and added to the JSON.

    env $(.venv/bin/python -m service.common.blas --env) .venv/bin/python -m bench.compare \\
        --spawn-server --concurrency 1,8,16 --max-tokens 96 --peer mlx-lm --targets cpu

The options are `python -m client bench`'s (which finds the same peers from a checkout, without
the targets), plus --targets.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import bench.peers
from bench import targets
from client.bench.cli import add_bench_arguments, default_out_path, run_bench
from client.cli import TARGET_ENV, add_connection_arguments, exit_status
from client.client import DEFAULT_TARGET


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.compare",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--target",
        default=os.environ.get(TARGET_ENV, DEFAULT_TARGET),
        help=f"server address host:port, without --spawn-server (env {TARGET_ENV})",
    )
    add_connection_arguments(parser, defaults=True)
    add_bench_arguments(parser, bench.peers)
    parser.add_argument(
        "--targets",
        choices=targets.KINDS,
        default="auto",
        help="which acceptance targets to check (auto: gpu for bfloat16, else cpu)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    args.out = args.out or default_out_path()
    status = run_bench(args, bench.peers.PEERS)
    if status == 0 and args.targets != "none" and args.out.exists():
        print(targets.annotate(args.out, args.targets))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status(lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
