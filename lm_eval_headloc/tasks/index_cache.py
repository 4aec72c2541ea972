"""lm-eval's index of its own ~14,000 task YAMLs, parsed once and kept on disk.

Every ``TaskManager`` parses every built-in task YAML to find what each name is: about 4 s on
a CPU core, paid by every command before anything else (a mistyped task name waits for it,
and so does each Ray worker). The index of a folder depends only on the files below it, so
it is stored under ``$XDG_CACHE_HOME/lm_eval_headloc/`` (default ``~/.cache``) by a digest
of lm-eval's version and index code, the folder, and every file's path, size and
modification time, and read back (under a second) while nothing changed. The user's
folders and ours are small and parsed as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..files import cache_root, write_atomically

log = logging.getLogger(__name__)
_INDEX_LOG = logging.getLogger("lm_eval.tasks._index")

#: The name of every file this module writes (``task-index-<digest>.pickle``).
_PREFIX, _SUFFIX = "task-index-", ".pickle"
#: Indexes kept (one per lm-eval install that used the cache), newest first; older ones
#: are removed.
KEEP = 4


def builtin_tasks_dir() -> Path:
    """The folder of lm-eval's own task YAMLs (what ``include_defaults`` indexes)."""
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).resolve().parent


def index_digest(root: Path) -> str:
    """What the index of ``root`` depends on: lm-eval's version and the code that builds
    the index, the folder as named, and the path, size and modification time of every file
    below it (the YAMLs, and what their ``include:`` names, most of which are not
    ``*.yaml``: ``_template_yaml``; compiled Python aside)."""
    import lm_eval
    from lm_eval.tasks import _index, _yaml_loader

    digest = hashlib.sha256()
    digest.update(f"{getattr(lm_eval, '__version__', '?')}\0{root}\0"
                  f"{sys.version_info[:2]}\0{pickle.HIGHEST_PROTOCOL}\0".encode())
    code = [Path(module.__file__) for module in (_index, _yaml_loader)]
    for path in [*code, *_files_below(root)]:
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def _files_below(root: Path) -> Iterator[Path]:
    """Every file below ``root`` in a fixed order, compiled Python left out (written when a
    task's code is first imported, it would make the index look changed)."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".pyc"):
                yield Path(folder, name)


def _ours(path: Path) -> bool:
    """Whether ``path`` may be unpickled: a file of this user's that no one else may
    write (a pickle runs code as it loads). Where there are no owners (Windows), yes."""
    stat = path.stat()
    if not hasattr(os, "getuid"):
        return True
    return stat.st_uid == os.getuid() and not stat.st_mode & 0o022


def cached_index(root: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """``TaskIndex.build([root])``, from the cache when ``root``'s files are unchanged.

    A cache that cannot be read, written or made is only slower: the index is built."""
    from lm_eval.tasks._index import TaskIndex

    try:
        folder = cache_dir if cache_dir is not None else cache_root()
        path = folder / f"{_PREFIX}{index_digest(root)}{_SUFFIX}"
    except (OSError, RuntimeError, KeyError) as err:  # no home folder (a uid without one)
        log.debug("task index not cached: %s", err)
        return TaskIndex.build([root])
    index = None
    with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, AttributeError,
                             ImportError, TypeError, ValueError):
        if _ours(path):
            with path.open("rb") as file:
                index = pickle.load(file)
    if isinstance(index, dict):
        with contextlib.suppress(OSError):  # most recently used: kept longest
            os.utime(path)
        return index
    index = TaskIndex.build([root])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda partial: _write_index(partial, index))
        _remove_old(folder)
    except OSError as err:
        log.debug("task index not cached in %s: %s", folder, err)
    return index


def _write_index(path: Path, index: dict[str, Any]) -> None:
    """The pickle, writable by its owner only whatever the umask (``_ours`` reads no
    other)."""
    path.write_bytes(pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL))
    path.chmod(0o644)


def _remove_old(folder: Path) -> None:
    """Keep the ``KEEP`` most recently used indexes this module wrote."""
    ours = sorted(folder.glob(f"{_PREFIX}*{_SUFFIX}"), key=lambda p: p.stat().st_mtime,
                  reverse=True)
    for old in ours[KEEP:]:
        old.unlink(missing_ok=True)


@contextlib.contextmanager
def builtin_index_cached(cache_dir: Path | None = None) -> Iterator[None]:
    """Inside, a new ``TaskManager`` reads lm-eval's own tasks from ``cached_index``.

    ``TaskIndex.build`` merges folder after folder, a later one's names overriding an
    earlier one's (with lm-eval's warning); the cached first folder merged with the
    others built as before is the same index."""
    from lm_eval.tasks import manager
    from lm_eval.tasks._index import TaskIndex

    builtin = builtin_tasks_dir()

    class CachedBuiltins(TaskIndex):
        @staticmethod
        def build(paths: Sequence[Path], *, resolve_includes: bool = True) -> dict:
            paths = [Path(p) for p in paths]
            if not paths or not resolve_includes or paths[0].resolve() != builtin:
                return TaskIndex.build(paths, resolve_includes=resolve_includes)
            # The folder as lm-eval names it (its entries' paths are spelled so).
            index = dict(cached_index(paths[0], cache_dir))
            for name, entry in TaskIndex.build(paths[1:]).items():
                if name in index:  # as TaskIndex.build says it, through its logger
                    _INDEX_LOG.warning("Task '%s' from %s overrides existing task from %s",
                                       name, entry.yaml_path, index[name].yaml_path)
                index[name] = entry
            return index

    original = manager.TaskIndex
    manager.TaskIndex = CachedBuiltins
    try:
        yield
    finally:
        manager.TaskIndex = original
