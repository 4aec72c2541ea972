"""lm-eval-headloc: find the few attention heads a capability lives in, through lm-eval.

The public API, re-exported here (the code lives in the layer folders; docs/development.md)::

    from lm_eval_headloc import RunSpec, locate, verify, read_rankings
    rankings = locate("runs/smol", tasks=["headloc_induction"], masks=100)
    verify("runs/smol", "runs/smol-verify", top_k=5)
    read_rankings("runs/smol")["headloc_induction"].top(5)

    from lm_eval_headloc import HeadLasso, design_matrix  # the method, on your own arrays
    from lm_eval_headloc import locate_components  # the loop, on a measurement, in memory

``import lm_eval_headloc`` registers the ``hf-headablate`` model with lm-eval, so
``lm_eval.simple_evaluate(model="hf-headablate", model_args="pretrained=...,ablate=L0H1")``
works from Python. Lazily: importing the package imports neither lm-eval nor torch (the
component notation and the other light modules stay free of them); each name below loads
its module on first use, the model is registered when ``lm_eval.models`` is (or has been)
imported, and torch loads when the model is built.
"""

from __future__ import annotations

import importlib
from typing import Any

from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    Head,
    Neuron,
    format_heads,
    parse_heads,
    read_heads_file,
)
from lm_eval_headloc.intervention.registration import MODEL_NAME, register_when_imported

__version__ = "0.1.0"

register_when_imported()

#: Public name -> the module that defines it, imported on first use (PEP 562).
_LAZY = {
    # the commands (each writes and resumes a run folder)
    "locate": "commands.locate", "refit": "commands.locate", "verify": "commands.verify",
    "greedy": "commands.greedy", "cross": "commands.cross", "sweep": "commands.sweep",
    "universal": "commands.universal", "overlap": "commands.overlap",
    "types": "commands.types", "write_mib": "report.mib", "read_mib": "report.mib_format",
    # a run: its options, its folder, its results
    "RunSpec": "runs.spec", "RunFolder": "runs.folder", "RunFolderError": "runs.folder_checks",
    "load_run": "runs.record", "read_rankings": "runs.record", "read_types": "runs.types_file",
    # the method, on plain arrays
    "HeadLasso": "method.recovery", "bootstrap_stability": "method.recovery",
    "design_matrix": "method.designs", "Ranking": "method.ranking",
    "Columns": "method.columns", "fit_rankings": "method.fit",
    # the locate loop on a measurement, without a run folder
    "locate_components": "method.locate_loop", "locate_loop": "method.locate_loop",
    "LocateState": "method.locate_loop", "MemoryStore": "measurement.store",
    "HarnessMeasurement": "measurement.measure",
    # the model and its errors
    "HFHeadAblateLM": "intervention.model", "UsageError": "common.checks",
    "UserError": "common.errors",
}

__all__ = ["MODEL_NAME", "Head", "ComponentSpecError", "Neuron", "__version__", "format_heads",
           "parse_heads", "read_heads_file", *sorted(_LAZY)]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'lm_eval_headloc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"lm_eval_headloc.{_LAZY[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
