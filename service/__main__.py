"""`python -m service`: start the gRPC server (the default), or `generate` in-process."""

from __future__ import annotations

import argparse
import asyncio
import sys

from service.blas import reexec_with_openblas


def main(argv: list[str] | None = None) -> int:
    reexec_with_openblas()
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "generate":
        from service.cli import generate_main

        return generate_main(argv[1:])
    if argv and argv[0] == "serve":
        argv = argv[1:]

    from service.config import ConfigError, add_server_arguments, config_from_args
    from service.logging import configure_logging

    parser = argparse.ArgumentParser(prog="python -m service", description=__doc__)
    add_server_arguments(parser)
    try:
        config = config_from_args(parser.parse_args(argv))
    except ConfigError as exc:
        parser.error(str(exc))
    configure_logging(config.log_level, config.log_format)

    from service.models.loader import ModelLoadError
    from service.server import serve

    try:
        asyncio.run(serve(config))
    except (ConfigError, ModelLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
