"""Finding tasks: our ``task_configs`` next to lm-eval's built-ins and the user's folders."""

from __future__ import annotations

import difflib
import functools
import logging
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.errors import InternalError, UserError, one_line

__all__ = ["UnknownTaskError", "check_task_names", "load_failure", "make_task_manager",
           "task_configs_dir", "with_own_tasks"]


class UnknownTaskError(UserError):
    """A task name lm-eval does not know (a user mistake, reported in one line)."""


def task_configs_dir(package: Path | None = None) -> Path:
    """Our YAML tasks: in a source checkout (an editable install) the repository's
    ``task_configs`` next to ``pyproject.toml``, else the copy shipped inside the installed
    package. A stray ``task_configs`` elsewhere (say ``site-packages/task_configs``) is
    never taken for ours. ``package``: the ``lm_eval_headloc`` folder (default: this one).
    """
    package = package or Path(__file__).resolve().parent.parent
    checkout = package.parent
    candidates = [package / "task_configs"]
    if (checkout / "pyproject.toml").is_file():
        candidates.insert(0, checkout / "task_configs")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    # Our own files, not the user's: their absence is a broken install, never a mistake
    # in the command, so it keeps its traceback.
    raise InternalError(f"task_configs not found in {package}: the installed "
                        "lm-eval-headloc is incomplete; reinstall it")


def with_own_tasks(include_path: str | Path | Sequence[str | Path] | None
                   ) -> list[str | Path]:
    """``include_path`` as lm-eval's ``TaskManager`` takes it (one folder, a list, or
    None), as a list with our task folder first, unless it names that folder already
    (the same folder, however spelled). lm-eval indexes the folders in order, a later one
    overriding an earlier one's names: the user's folders win a clash with ours."""
    given = ([] if include_path is None else [include_path]
             if isinstance(include_path, (str, Path)) else list(include_path))
    ours = task_configs_dir()
    _quiet_own_metadata_notice()
    for folder in given:
        try:
            if Path(folder).resolve() == ours.resolve():
                return given
        except (OSError, RuntimeError, TypeError):  # not a path: lm-eval says what it is
            continue
    return [str(ours), *given]


def make_task_manager(include_path: str | Sequence[str] | None = None,
                      option: str = "--include-path ") -> Any:
    """lm-eval's TaskManager over the built-ins, our tasks, and ``include_path``
    (``with_own_tasks``: the start-up hook's ``TaskManager`` would add ours too, but a
    checkout used without installing has no hook).

    Indexing every task YAML takes seconds, so one manager per set of folders is kept for
    the process (a notebook or sweep building runs over and over) while their files are
    unchanged: a YAML added, removed or edited since builds a new one; its ``load`` builds
    fresh task objects on every call. ``option``: how an error names the setting (''
    would be the current folder: refused).
    """
    extra = [include_path] if isinstance(include_path, str) else list(include_path or [])
    for folder in extra:
        if not str(folder).strip() or not Path(folder).is_dir():
            raise UnknownTaskError(f"{option}{str(folder)!r} is not a folder (expected a "
                                   "folder of lm-eval task YAMLs)")
    folders = tuple(map(str, with_own_tasks([str(Path(folder).resolve()) for folder in extra])))
    return _task_manager(folders, _folders_state(folders))


def _folders_state(folders: Sequence[str]) -> tuple[str, ...]:
    """What the index of ``folders`` depends on (``index_digest``: each file's path, size
    and modification time, under a millisecond for a task folder), so that a kept manager
    is never one that misses a YAML written since: a notebook's second command took a task
    added to its --include-path folder for an unknown one."""
    from lm_eval_headloc.tasks.index_cache import index_digest

    return tuple(index_digest(Path(folder)) for folder in folders)


#: What lm-eval says on loading every task with a ``custom_dataset`` (ours all have one).
_METADATA_NOTICE = "Custom kwargs can be passed to `--metadata`"


class _OwnTasksMetadataNotice(logging.Filter):
    """Drops lm-eval's notice that a ``custom_dataset`` task takes ``--metadata`` for our
    own tasks, whose loaders take none (``data.jsonl_docs``): a notebook saw it on every
    task load of every command. Other tasks' notices pass."""

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (_METADATA_NOTICE in message and message.split(":", 1)[0] in self.names)


@functools.cache
def _quiet_own_metadata_notice() -> None:
    names = frozenset(re.findall(r"^task:\s*(\S+)", "\n".join(
        path.read_text(encoding="utf-8") for path in task_configs_dir().glob("*/*.yaml")),
        flags=re.MULTILINE))
    logging.getLogger("lm_eval.api.task").addFilter(_OwnTasksMetadataNotice(names))


@functools.lru_cache(maxsize=8)
def _task_manager(folders: tuple[str, ...], state: tuple[str, ...]) -> Any:
    # ``state`` (``_folders_state``) is only the cache's key: a changed folder is a miss.
    from lm_eval.tasks import TaskManager

    from lm_eval_headloc.tasks.index_cache import builtin_index_cached

    with builtin_index_cached():  # lm-eval's own ~14,000 YAMLs: parsed once, kept on disk
        return TaskManager(include_path=list(folders))


def check_task_names(task_manager: Any, names: Iterable[str]) -> None:
    """Raise UnknownTaskError for the first name that is no task, group or tag."""
    known = set(task_manager.all_tasks)
    for name in names:
        if name not in known:
            unread = _unread_yaml(getattr(task_manager, "include_path", None) or [], name)
            if unread:
                raise UnknownTaskError(f"unknown task {name!r}: {unread}")
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise UnknownTaskError(
                f"unknown task {name!r}{hint} (`lm_eval ls tasks` lists them; add your own "
                "folder with --include-path)")


def load_failure(name: str, error: BaseException) -> str:
    """Why lm-eval could not build task ``name``, in one line for the user.

    A task without documents fails inside lm-eval in ways that do not say so: an empty
    data file ends the ``json`` loader with a bare ``StopIteration`` (no message at all),
    and a dataset of zero rows fails where lm-eval tries its first document
    (``task_docs[0]``). Both are said as what they are."""
    if isinstance(error, StopIteration) or _zero_documents(error):
        return f"task {name!r} has no documents"
    return f"cannot load task {name!r}: {one_line(error)}"


def _zero_documents(error: BaseException) -> bool:
    """Whether ``error`` was raised inside an lm-eval task's construction whose documents
    had been read and were none."""
    traceback = error.__traceback__
    while traceback is not None:
        task = traceback.tb_frame.f_locals.get("self")
        docs = getattr(task, "__dict__", {}).get("task_docs")
        if docs is not None and type(task).__module__.startswith("lm_eval."):
            try:
                return len(docs) == 0
            except TypeError:  # an iterable dataset: no length to tell
                return False
        traceback = traceback.tb_next
    return False


def _unread_yaml(folders: Iterable[str | Path], name: str) -> str | None:
    """Why lm-eval does not know task ``name`` though a YAML in ``folders`` names it: it
    reads only ``*.yaml`` files, and skips one it cannot parse (said only in its debug
    log). None when no file names it."""
    import re

    names_it = re.compile(rf"^task\s*:\s*['\"]?{re.escape(name)}['\"]?\s*(#.*)?$", re.M)
    for folder in map(Path, folders):
        for path in sorted([*folder.glob("**/*.yaml"), *folder.glob("**/*.yml")]):
            try:
                if not names_it.search(path.read_text(encoding="utf-8", errors="replace")):
                    continue
            except OSError:
                continue
            if path.suffix == ".yml":
                return f"{path} names it, but lm-eval reads only *.yaml files; rename it"
            try:  # lm-eval's own loader (private: said plainly if it moves)
                from lm_eval.tasks._yaml_loader import load_yaml
            except ImportError:
                return f"{path} names it, but lm-eval did not take it in"
            try:
                load_yaml(path, resolve_func=False)
            except Exception as err:  # noqa: BLE001 (whatever lm-eval's loader says)
                why = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
                return f"{path} names it, but lm-eval cannot read that file ({why})"
    return None
