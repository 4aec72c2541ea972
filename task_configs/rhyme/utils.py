"""lm-eval hooks for the ``rhyme`` tasks; the scoring lives in lm_eval_headloc.tasks.rhymes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

from lm_eval_headloc.tasks.rhymes import rhymes

DATA = Path(__file__).parent / "rhyme_words.jsonl"
SPLITS = ("identification", "heldout")


def load_rows() -> list[dict]:
    """Every target word with its difficulty and split, in file order."""
    return [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line]


def load_docs(**kwargs: Any) -> datasets.DatasetDict:
    """The targets as a DatasetDict with an ``identification`` and a ``heldout`` split.

    Read from beside this file, so it works offline from any directory. lm-eval passes
    the task metadata and model_args as keyword arguments; unused here.
    """
    rows = load_rows()
    return datasets.DatasetDict(
        {
            split: datasets.Dataset.from_list([r for r in rows if r["split"] == split])
            for split in SPLITS
        }
    )


def process_results(doc: dict, results: list[str]) -> dict[str, int]:
    """rhyme_acc: 1 when the answer's first word rhymes with the target word."""
    return {"rhyme_acc": int(rhymes(doc["word"], results[0]))}
