"""lm-eval's index of its own ~14,000 task YAMLs, parsed once and kept on disk.

Every ``TaskManager`` parses every built-in task YAML to find what each name is: about 4 s on
a CPU core, paid by every command before anything else (a mistyped task name waits for it,
and so does each Ray worker). The index of a folder depends only on its YAML files, so it is
stored under ``$XDG_CACHE_HOME/lm_eval_headloc/`` (default ``~/.cache``) by a digest of
lm-eval's version, the folder, and every YAML file's path, size and modification time, and
read back (well under a second) while nothing changed. The user's folders and ours are
small and parsed as before.
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
    """What the index of ``root`` depends on: lm-eval's version, the folder, each YAML
    file's path, size and modification time (the files lm-eval's walk would read, and a
    few it skips: a superset can only cost a needless rebuild)."""
    import lm_eval

    digest = hashlib.sha256()
    digest.update(f"{getattr(lm_eval, '__version__', '?')}\0{root}\0"
                  f"{sys.version_info[:2]}\0{pickle.HIGHEST_PROTOCOL}\0".encode())
    for path in sorted(root.glob("**/*.yaml")):
        stat = path.stat()
        digest.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\n"
                      .encode())
    return digest.hexdigest()[:24]


def cached_index(root: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """``TaskIndex.build([root])``, from the cache when ``root``'s files are unchanged.

    A cache that cannot be read, written or made is only slower: the index is built."""
    from lm_eval.tasks._index import TaskIndex

    folder = cache_dir if cache_dir is not None else cache_root()
    path = folder / f"{_PREFIX}{index_digest(root)}{_SUFFIX}"
    with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError, AttributeError,
                             ImportError, TypeError, ValueError):
        with path.open("rb") as file:
            index = pickle.load(file)
        if isinstance(index, dict):
            os.utime(path)  # most recently used: kept longest
            return index
    index = TaskIndex.build([root])
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomically(path, lambda partial: partial.write_bytes(
            pickle.dumps(index, protocol=pickle.HIGHEST_PROTOCOL)))
        _remove_old(folder)
    except OSError as err:
        log.debug("task index not cached in %s: %s", folder, err)
    return index


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
            index = dict(cached_index(builtin, cache_dir))
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
