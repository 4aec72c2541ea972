"""The benchmarks' code, kept out of the package (the wheel ships none of it).

The yardsticks recovery methods are measured with before they cost model time
(``simulation``: a planted-sparse simulator of knockout measurements; ``defaults``: the
defaults re-enacted on it; ``simulated_run``: the locate loop itself on it), and the
benchmarks that write the result pages (BENCH.md, RECOVERY.md, NEURONS.md, SIMULATION.md,
docs/budget_split.md, docs/ablation_kinds.md), one module each with a ``main``, run as
``python benchmarks/<module>.py`` from the repository root (benchmarks/README.md lists
them), with what they share (``measuring``, ``bench_sections``, ``bench_shapes``,
``bench_store``).

It imports ``lm_eval_headloc``; ``lm_eval_headloc`` never imports it (the import
contracts in pyproject.toml). Importing it puts the repository root on ``sys.path``, so a
benchmark measures this checkout's ``lm_eval_headloc`` also where it is not installed.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: The repository root: the result pages, ``benchmarks/`` and ``bench-work/`` are there.
ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
