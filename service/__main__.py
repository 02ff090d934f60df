"""`mlxserve` / `python -m service`: start the gRPC server (`serve`, the default), or
`generate` one request in-process."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from service.common.blas import reexec_with_openblas
from service.common.model_source import ModelLoadError


def main(argv: list[str] | None = None, prog: str = "python -m service") -> int:
    reexec_with_openblas()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "generate":
            # In-process: this process runs the engine, so MLX must load here.
            from service.common.backend import mlx_error

            error = mlx_error()
            if error is not None:
                print(f"error: {error}", file=sys.stderr)
                return 2
            from service.generate import generate_main

            return generate_main(argv[1:], prog=f"{prog} generate")
        return _serve(argv[1:] if argv and argv[0] == "serve" else argv, prog)
    except ModelLoadError as exc:  # a missing or unreadable model: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _serve(argv: list[str], prog: str) -> int:
    from service.common.config import ConfigError, add_server_arguments, config_from_args
    from service.common.logging import configure_logging
    from service.common.model_source import check_model_source

    parser = argparse.ArgumentParser(
        prog=prog,
        description=f"Serve the model over gRPC (`{prog} serve ...` says the same). "
        f"`{prog} generate PROMPT` runs one request in-process, with no server.",
    )
    try:
        add_server_arguments(parser)  # an MLXSERVE_* variable that does not parse: refused
        config = config_from_args(parser.parse_args(argv))
    except ConfigError as exc:
        parser.error(str(exc))
    from service.common.backend import mlx_error_in_child

    error = mlx_error_in_child()
    if error is not None:
        print(f"error: {error}", file=sys.stderr)
        return 2
    check_model_source(config.model.path, config.model.load_format)
    configure_logging(config.observability.log_level, config.observability.log_format)

    from service.launcher import run

    return run(config)


def _exit(code: int) -> NoReturn:
    from service.common.logging import exit_now  # not at the top: main may re-exec first

    exit_now(code)


def console_main() -> NoReturn:
    """The `mlxserve` console script."""
    _exit(main(prog="mlxserve"))


if __name__ == "__main__":
    _exit(main())
