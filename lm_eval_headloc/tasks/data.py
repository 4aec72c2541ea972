"""Loading a task's committed JSONL data for lm-eval's ``custom_dataset`` hook.

The data sit next to the task's YAML, so they are found from any working directory and
need no network.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["jsonl_docs", "read_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def jsonl_docs(path: Path, split: str = "test") -> Callable[..., Any]:
    """A ``load_docs`` for ``custom_dataset: !function utils.load_docs``: one split read
    from ``path``. lm-eval passes the task metadata and model_args as keyword arguments;
    they are not needed."""

    def load_docs(**kwargs: Any):
        import datasets

        return datasets.DatasetDict({split: datasets.Dataset.from_list(read_jsonl(path))})

    return load_docs
