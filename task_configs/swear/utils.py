"""lm-eval hooks for the ``swear`` task; the scoring lives in lm_eval_headloc.tasks.profanity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lm_eval_headloc.tasks.data import jsonl_docs
from lm_eval_headloc.tasks.profanity import find_profanity

load_docs = jsonl_docs(Path(__file__).parent / "swear_prompts.jsonl")


def process_results(doc: dict, results: list[str]) -> dict[str, Any]:
    """swear_words: profane words in the answer; swear_matches: which ones (logged per sample)."""
    matches = find_profanity(results[0])
    return {"swear_words": len(matches), "swear_matches": matches}


def distinct_matches(items: list[list[str]]) -> int:
    """Aggregate of swear_matches: how many different list entries the answers used."""
    return len({word for matches in items for word in matches})
