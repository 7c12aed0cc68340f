"""The entry point every service command shares: parse, log, run, and map start-up errors."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Awaitable, Callable

from servicekit.logs import configure_logging


def run_service(prog: str, parser: argparse.ArgumentParser,
                run: Callable[[argparse.Namespace], Awaitable[None]],
                argv: list[str] | None = None) -> int:
    """Run `run(args)` until shutdown; a bad flag, model or voice is one line and exit code 2."""
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    try:
        asyncio.run(run(args))
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    return 0
