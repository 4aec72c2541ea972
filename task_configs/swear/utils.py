"""lm-eval hooks for the ``swear`` task; the scoring lives in lm_eval_headloc.profanity."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

from lm_eval_headloc.profanity import find_profanity

DATA = Path(__file__).parent / "swear_prompts.jsonl"


def load_docs(**kwargs: Any) -> datasets.DatasetDict:
    """The prompts as a one-split DatasetDict, read from beside this file (works offline).

    lm-eval passes the task metadata and model_args as keyword arguments; unused here.
    """
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def process_results(doc: dict, results: list[str]) -> dict[str, Any]:
    """swear_words: profane words in the answer; swear_matches: which ones (logged per sample)."""
    matches = find_profanity(results[0])
    return {"swear_words": len(matches), "swear_matches": matches}


def distinct_matches(items: list[list[str]]) -> int:
    """Aggregate of swear_matches: how many different list entries the answers used."""
    return len({word for matches in items for word in matches})
