"""Loads headloc_induction's committed data file, found next to this file (any working directory).

Made by `python -m lm_eval_headloc.capability_tasks --out task_configs`.
"""

import json
from pathlib import Path
from typing import Any

import datasets

DATA_FILE = Path(__file__).parent / "headloc_induction.jsonl"


def load_docs(**kwargs: Any) -> datasets.DatasetDict:
    """lm-eval's `custom_dataset`; it passes the task metadata and model args, unused here."""
    with DATA_FILE.open(encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
