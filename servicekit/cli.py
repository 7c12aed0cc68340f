"""The entry point every service command shares: parse, log, run, and map start-up errors."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from servicekit import tracing
from servicekit.errors import ServiceFailed, StartupError
from servicekit.logs import configure_logging


def run_service(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], Coroutine[Any, Any, None]],
    argv: list[str] | None = None,
) -> int:
    """Run `run(args)` until shutdown, its spans named service `prog`; a bad flag, model, voice or
    busy port is one line and exit code 2, a failure while serving one line and exit code 1 (for a
    supervisor to restart)."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        tracing.setup(prog)
        asyncio.run(run(args))
    except (ValueError, FileNotFoundError, StartupError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except ServiceFailed as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    return 0
