"""``types``: what kind of head each head is — previous-token, duplicate-token, induction or
attention sink (``head_types``) — for a model alone, and inside every ``locate`` run
(``types.json``), where the ranking files carry each head's scores and the report labels the
heads it finds.

The scores come from a forward pass with attention weights over the standard probe (random
tokens repeated twice, after the tokenizer's first token, as TransformerLens's head
detector; ``--probe-rows`` rows) and one over the run's own examples (the contexts lm-eval
builds for its tasks). A head's type is the probe's: ``dominant_type`` names it only where
the head stands clearly above the model's typical head by more than the probe's own
sampling error, and says nothing otherwise; a head within that error of a threshold is
``borderline``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lm_eval_headloc.common import timing
from lm_eval_headloc.method.head_types import (
    HeadTypes,
)
from lm_eval_headloc.report.type_pages import types_table
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.spec import RunSpec, command_spec
from lm_eval_headloc.runs.types_file import ensure_types, read_types

__all__ = ["types"]

log = logging.getLogger(__name__)


@timing.on_clock
def types(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
          **options: Any) -> HeadTypes | None:
    """The head types of ``spec``'s model, on the probe and its tasks' examples, written to
    ``out`` (a run folder: types.json, types.csv)."""
    from lm_eval_headloc.runs.plan import load_model, open_measurement
    from lm_eval_headloc.runs.record import start_run
    from lm_eval_headloc.runs.setup import prepare

    spec = command_spec("types", spec, options)
    setup = prepare(spec, generates=False)  # it reads prompts, generates nothing
    spec = setup.spec
    with RunFolder(out) as folder:
        run = start_run(folder, "types", spec, force=force,
                        fingerprint=setup.model_fingerprint)
        found = read_types(folder)  # a finished run rerun: no model needed
        if found is None:
            measure = open_measurement(setup, load_model(setup), folder, spec.num_samples,
                                       run=run)
            run.save(folder, measure)
            found = ensure_types(folder, measure, spec.probe_rows)
            run.save(folder, measure)  # the timings, head types included
        if found is not None:
            folder.write_text("types.csv", types_table(found))
    return found
