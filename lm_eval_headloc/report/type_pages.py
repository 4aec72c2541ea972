"""A model's head types for people: types.csv and the summary ``types`` prints."""

from __future__ import annotations

import csv
import io

import numpy as np

from lm_eval_headloc.common.words import counted
from lm_eval_headloc.method.head_types import (
    HEAD_TYPES,
    LABELLED_TYPES,
    HeadTypes,
)

__all__ = ["types_summary", "types_table"]


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
            said = (f"{counted(labelled, 'head stands', 'heads stand')} out "
                    f"(threshold {thresholds[name]:.2f}"
                    + (f"; {near.count(name)} too near it to say" if near.count(name) else "")
                    + ")")
        else:
            # "the typical head does it: median 0.06" said of a model whose heads barely do.
            said = (f"labels no head (in most language models the typical head does it; "
                    f"median here {float(np.nanmedian(values)):.2f})")
        lines.append(f"  {name.replace('_', '-')}: {said}; highest "
                     + ", ".join(f"L{layer}H{head} {values[layer, head]:.2f}"
                                 for layer, head in best))
    rows = head_types.data.get("probe", {}).get("batch")
    return "\n".join(["Head types (scores on the repeated-token probe"
                      + (f", {rows} rows" if rows else "") + "):", *lines])
