"""The ``headloc-harness`` console script: ``cli.main.main``, with a Ctrl-C during the
few seconds its imports take (torch, lm-eval) ending as one after them does, in one line
and status 130, not an import traceback."""

from __future__ import annotations

import os
import sys
import time

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    # Generating, every row's key/value cache grows a step at a time: expandable segments
    # keep PyTorch's CUDA allocator from fragmenting (and flushing its cache) at the large
    # batches of several masks per generate call. Before torch is imported; a user's wins.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from lm_eval_headloc.common.timing import process_age

    # The run's "start-up and imports" phase counts from the process's start.
    started = time.perf_counter() - (process_age() or 0.0)
    try:
        from lm_eval_headloc.cli.main import main as run
    except KeyboardInterrupt:
        print("\nheadloc-harness: interrupted", file=sys.stderr)
        return 130
    return run(argv, started=started)
