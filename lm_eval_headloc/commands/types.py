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

import csv
import io
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.intervention.components import Head, validate_heads
from lm_eval_headloc.method.head_types import (
    HEAD_TYPES,
    LABEL_MARGIN,
    LABELLED_TYPES,
    PROBE_ROWS,
    borderline,
    dominant_type,
    encode_texts,
    head_type_scores,
    probe_type_scores,
    repeated_probe,
    type_thresholds,
)
from lm_eval_headloc.runs.folder import RunFolder, RunFolderError
from lm_eval_headloc.runs.spec import RunSpec, command_spec

__all__ = ["PROBE", "TYPES_FILE", "HeadTypes", "ensure_types", "read_types", "types",
           "types_summary", "types_table"]

log = logging.getLogger(__name__)

#: The file a run keeps its head types in.
TYPES_FILE = "types.json"
#: The probe: ``length`` random tokens repeated twice, drawn with ``seed`` (its rows:
#: ``--probe-rows``).
PROBE = {"length": 32, "seed": 0}
#: The run's examples scored (its first distinct contexts), and how many per pass (the
#: probe's rows too).
EXAMPLES, PER_PASS = 64, 8


class HeadTypes:
    """A model's head types as ``types.json`` holds them: ``scores`` on the probe and
    ``on_examples`` (None without examples), each type -> (layers, heads); ``labels``: each
    head's dominant type or None."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.scores = {t: np.asarray(v, dtype=np.float64) for t, v in data["scores"].items()}
        self.labels: list[list[str | None]] = [list(row) for row in data["dominant"]]
        #: Head name -> the types it is too near the threshold of to be labelled or not
        #: (none in a file from before the probe's error was taken into account).
        self.near: dict[str, list[str]] = dict(data.get("borderline") or {})
        #: The layers with heads (a hybrid model's attention layers; else every layer).
        self.head_layers: tuple[int, ...] = tuple(data.get("head_layers")
                                                  or range(len(self.labels)))

    def of(self, layer: int, head: int) -> dict[str, float]:
        """One head's four probe scores."""
        self._check(layer, head)
        return {t: float(self.scores[t][layer, head]) for t in HEAD_TYPES}

    def label(self, layer: int, head: int) -> str | None:
        """One head's dominant type, or None."""
        self._check(layer, head)
        return self.labels[layer][head]

    def borderline(self, layer: int, head: int) -> list[str]:
        """The types one head's probe score is within ``LABEL_MARGIN`` standard errors of
        the threshold of: another probe seed may put it either side."""
        self._check(layer, head)
        return list(self.near.get(str(Head(int(layer), int(head))), []))

    def _check(self, layer: int, head: int) -> None:
        # numpy would wrap a negative index round to another head, or raise IndexError.
        validate_heads([Head(int(layer), int(head))], len(self.labels),
                       len(self.labels[0]) if self.labels else 0,
                       head_layers=self.head_layers)


def _texts(measure: Any) -> list[str]:
    """The run's own examples as the model reads them: each request's context (with its
    continuation for a log-likelihood request), distinct, the first ``EXAMPLES``."""
    seen: dict[str, None] = {}
    for instance in measure.recorded_instances():
        context, rest = instance.args[0], instance.args[1] if len(instance.args) > 1 else ""
        text = context + rest if instance.request_type == "loglikelihood" and \
            isinstance(rest, str) else context
        if isinstance(text, str) and text.strip():
            seen.setdefault(text, None)
        if len(seen) >= EXAMPLES:
            break
    return list(seen)


def head_types_of(lm: Any, texts: Sequence[str] = (), probe_rows: int = PROBE_ROWS
                  ) -> dict[str, Any]:
    """``types.json``'s content for the model of ``lm`` (an ``HFHeadAblateLM``): the
    probe's scores (``probe_rows`` rows) and their standard errors, the scores on
    ``texts``, the thresholds, each head's dominant type and the heads borderline to one."""
    model, tokenizer = lm.model, lm.tokenizer
    vocab = int(model.get_input_embeddings().num_embeddings)  # ids the model can embed
    first = tokenizer.bos_token_id
    probe = repeated_probe(vocab, batch=probe_rows, first_token=first, **PROBE).to(lm.device)
    scores, errors = probe_type_scores(model, probe, batch_size=PER_PASS)
    on_examples = None
    if texts:
        # As the model reads them in a measurement: lm-eval's encoding, its window.
        ids, mask = encode_texts(tokenizer, list(texts),
                                 lambda text: lm.tok_encode(text)[-lm.max_length:])
        on_examples = head_type_scores(model, ids.to(lm.device), mask.to(lm.device),
                                       batch_size=PER_PASS)

    def listed(values: Mapping[str, np.ndarray]) -> dict[str, list[list[float | None]]]:
        return {t: [[None if not np.isfinite(x) else round(float(x), 6) for x in row]
                    for row in values[t]] for t in HEAD_TYPES}

    head_layers = lm.knockout.geometry.head_layers
    near = {f"L{layer}H{head}": types_near
            for layer, row in enumerate(borderline(scores, errors))
            for head, types_near in enumerate(row) if types_near}
    return {"made_by": "lm-eval-headloc types",
            **({} if head_layers is None else {"head_layers": list(head_layers)}),
            "probe": {**PROBE, "batch": probe_rows, "first_token": first,
                      "what": "random tokens repeated twice after the first token"},
            "examples": len(texts),
            "scores": listed(scores),
            "errors": listed(errors),
            "on_examples": None if on_examples is None else listed(on_examples),
            "thresholds": {t: round(float(v), 6)
                           for t, v in type_thresholds(scores).items()},
            "label_margin": LABEL_MARGIN,
            "dominant": dominant_type(scores, errors=errors),
            "borderline": near}


@timing.timed("head types")
def ensure_types(folder: RunFolder, measure: Any, probe_rows: int = PROBE_ROWS
                 ) -> HeadTypes | None:
    """The run's head types: ``types.json`` when a resumed run made it, else computed on
    the measurement's model and written. A model whose attention weights cannot be read
    costs the run nothing: the reason is logged and the run goes on without types."""
    stored = read_types(folder)
    if stored is not None:
        return stored
    try:
        data = head_types_of(measure.lm, _texts(measure), probe_rows)
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as err:
        log.warning("head types skipped: %s", err)
        return None
    folder.write_json(TYPES_FILE, data)
    return HeadTypes(data)


def read_types(folder: RunFolder | str | Path) -> HeadTypes | None:
    """``types.json`` of a run folder, or None where it has none (a folder that does not
    exist is a RunFolderError: a mistyped path is not a run without types)."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    if not folder.path.is_dir():
        raise RunFolderError(f"{folder.path} is not a run folder (no such folder)")
    path = folder.file(TYPES_FILE)
    if not path.is_file():
        return None
    return HeadTypes(json.loads(path.read_text()))


def types_table(head_types: HeadTypes) -> str:
    """types.csv: one row per head — its probe scores, its scores on the examples (empty
    where undefined) and its dominant type."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    examples = head_types.data.get("on_examples")
    writer.writerow(["head", "layer", "head_in_layer", *HEAD_TYPES,
                     *([f"{t}_on_examples" for t in HEAD_TYPES] if examples else []), "type",
                     "borderline"])
    for layer, row in enumerate(head_types.labels):
        if layer not in head_types.head_layers:
            continue  # a hybrid model's layer without heads
        for head, label in enumerate(row):
            cells = [f"{v:.6g}" for v in head_types.of(layer, head).values()]
            if examples:
                cells += ["" if examples[t][layer][head] is None
                          else f"{examples[t][layer][head]:.6g}" for t in HEAD_TYPES]
            writer.writerow([f"L{layer}H{head}", layer, head, *cells, label or "",
                             "+".join(head_types.borderline(layer, head))])
    return out.getvalue()


def types_summary(head_types: HeadTypes | None, shown: int = 3) -> str:
    """Per type: how many heads it stands out in and the highest-scoring heads."""
    if head_types is None:
        return "No head types: the model's attention weights could not be read (see the log)."
    lines = []
    thresholds = head_types.data["thresholds"]
    near = [t for types_near in head_types.near.values() for t in types_near]
    for name in HEAD_TYPES:
        values = head_types.scores[name]
        labelled = sum(label == name for row in head_types.labels for label in row)
        order = np.argsort(-np.nan_to_num(values, nan=-np.inf), axis=None, kind="stable")
        best = [np.unravel_index(i, values.shape) for i in order[:shown]]
        if name in LABELLED_TYPES or name in thresholds:  # an older file labelled by all
            said = (f"{labelled} head(s) stand out (threshold {thresholds[name]:.2f}"
                    + (f"; {near.count(name)} too near it to say" if near.count(name) else "")
                    + ")")
        else:
            said = (f"labels no head (the typical head does it: median "
                    f"{float(np.nanmedian(values)):.2f})")
        lines.append(f"  {name.replace('_', '-')}: {said}; highest "
                     + ", ".join(f"L{layer}H{head} {values[layer, head]:.2f}"
                                 for layer, head in best))
    rows = head_types.data.get("probe", {}).get("batch")
    return "\n".join(["Head types (scores on the repeated-token probe"
                      + (f", {rows} rows" if rows else "") + "):", *lines])


@timing.on_clock
def types(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
          **options: Any) -> HeadTypes | None:
    """The head types of ``spec``'s model, on the probe and its tasks' examples, written to
    ``out`` (a run folder: types.json, types.csv)."""
    from lm_eval_headloc.runs.record import start_run
    from lm_eval_headloc.runs.setup import load_model, open_measurement, prepare

    spec = command_spec("types", spec, options)
    setup = prepare(spec)
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
