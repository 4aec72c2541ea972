"""The ``headloc-harness`` console script: ``commands.cli.main``, with a Ctrl-C during the
few seconds its imports take (torch, lm-eval) ending as one after them does, in one line
and status 130, not an import traceback."""

from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    try:
        from .commands.cli import main as run
    except KeyboardInterrupt:
        print("\nheadloc-harness: interrupted", file=sys.stderr)
        return 130
    return run(argv)
