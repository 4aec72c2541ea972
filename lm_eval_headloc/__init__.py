"""lm-eval-headloc: find the few attention heads a capability lives in, through lm-eval.

The public API is ``__all__``, each name listed in docs/python-api.md: the commands as
functions, a run's options and results, the estimator, the model class, the head notation
and the error base class. Everything else stays importable from the module that defines
it (the layer folders: docs/development.md) and is no promise of this package's top::

    from lm_eval_headloc import RunSpec, locate, verify, read_rankings
    rankings = locate("runs/smol", tasks=["headloc_induction"], masks=100)
    verify("runs/smol", "runs/smol-verify", top_k=5)
    read_rankings("runs/smol")["headloc_induction"].top(5)

    from lm_eval_headloc import HeadLasso, design_matrix  # the method, on your own arrays

``import lm_eval_headloc`` registers the ``hf-headablate`` model with lm-eval, so
``lm_eval.simple_evaluate(model="hf-headablate", model_args="pretrained=...,ablate=L0H1")``
works from Python. Lazily: importing the package imports neither lm-eval nor torch (the
component notation stays free of them); each other name loads its module on first use,
the model is registered when ``lm_eval.models`` is (or has been) imported, and torch
loads when the model is built.
"""

from __future__ import annotations

import importlib
from typing import Any

from lm_eval_headloc.intervention.components import Head, parse_heads
from lm_eval_headloc.intervention.registration import (
    register_when_imported as _register_when_imported,
)

__version__ = "0.1.0"

_register_when_imported()

#: What this package promises at its top; docs/python-api.md says what each one is.
__all__ = [
    # the commands, one function per headloc-harness subcommand (export: write_mib)
    "locate", "refit", "greedy", "verify", "universal", "overlap", "cross", "types", "sweep",
    "write_mib",
    # a run: its options, its record, its rankings, its head types; an exported MIB file
    "RunSpec", "load_run", "read_rankings", "Ranking", "read_types", "read_mib",
    # the estimator, on plain arrays
    "HeadLasso", "design_matrix",
    # the model, the head notation, the error every deliberate failure is
    "HFHeadAblateLM", "Head", "parse_heads", "HeadlocError",
]

#: Each lazily loaded public name -> the module that defines it, imported on first use
#: (PEP 562), so that ``import lm_eval_headloc`` stays light.
_LAZY = {
    "locate": "commands.locate", "refit": "commands.locate", "greedy": "commands.greedy",
    "verify": "commands.verify", "universal": "commands.universal",
    "overlap": "commands.overlap", "cross": "commands.cross", "types": "commands.types",
    "sweep": "commands.sweep", "write_mib": "report.mib",
    "RunSpec": "runs.spec", "load_run": "runs.record", "read_rankings": "runs.record",
    "Ranking": "method.ranking", "read_types": "runs.types_file",
    "read_mib": "report.mib_format",
    "HeadLasso": "method.lasso", "design_matrix": "method.designs",
    "HFHeadAblateLM": "intervention.model", "HeadlocError": "common.errors",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lm_eval_headloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lm_eval_headloc.{_LAZY[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
