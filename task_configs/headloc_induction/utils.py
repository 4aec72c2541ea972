"""Loads headloc_induction's committed data file, found next to this file (any working directory).

Made by `python -m lm_eval_headloc.capability_tasks --out task_configs`.
"""

from pathlib import Path

from lm_eval_headloc.taskdata import jsonl_docs

load_docs = jsonl_docs(Path(__file__).parent / "headloc_induction.jsonl")
