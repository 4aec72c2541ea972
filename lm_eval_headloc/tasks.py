"""Finding tasks: our ``task_configs`` next to lm-eval's built-ins and the user's folders."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["UnknownTaskError", "check_task_names", "make_task_manager", "task_configs_dir"]


class UnknownTaskError(ValueError):
    """A task name lm-eval does not know (a user mistake, reported in one line)."""


def task_configs_dir() -> Path:
    """Our YAML tasks: the repository's ``task_configs`` in a source checkout or editable
    install, else the copy shipped inside the installed package."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "task_configs", package / "task_configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"task_configs not found next to {package}")


def make_task_manager(include_path: str | Sequence[str] | None = None) -> Any:
    """lm-eval's TaskManager over the built-ins, our tasks, and ``include_path``."""
    from lm_eval.tasks import TaskManager

    extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for folder in extra:
        if not Path(folder).is_dir():
            raise UnknownTaskError(f"--include-path {folder!r} is not a folder")
    return TaskManager(include_path=[str(task_configs_dir()), *map(str, extra)])


def check_task_names(task_manager: Any, names: Iterable[str]) -> None:
    """Raise UnknownTaskError for the first name that is no task, group or tag."""
    known = set(task_manager.all_tasks)
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownTaskError(
                f"unknown task {name!r}{hint} (`lm_eval ls tasks` lists them; add your own "
                "folder with --include-path)")
