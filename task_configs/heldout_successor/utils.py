"""Loads heldout_successor's committed data file, found next to this file (any working directory).

Made by `python -m lm_eval_headloc.tasks.generators --out task_configs`.
"""

from pathlib import Path

from lm_eval_headloc.tasks.data import jsonl_docs

load_docs = jsonl_docs(Path(__file__).parent / "heldout_successor.jsonl")
