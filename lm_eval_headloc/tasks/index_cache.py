"""lm-eval's index of its own ~14,000 task YAMLs, parsed once and kept on disk.

Every ``TaskManager`` parses every built-in task YAML to find what each name is: about 4 s on
a CPU core, paid by every command before anything else (a mistyped task name waits for it,
and so does each Ray worker). The index of a folder depends only on the files below it, so
it is stored under ``$XDG_CACHE_HOME/lm_eval_headloc/`` (default ``~/.cache``) by a digest
of lm-eval's version and index code, the folder, and every file's path, size and
modification time, and read back (under a second) while nothing changed. The user's
folders and ours are small and parsed as before.

The stored index is JSON: reading it runs nothing, whoever wrote the file (a cache folder
may be shared, and a file in it a link to anything). What it says is checked before it is
used: each entry must name a YAML file inside the indexed folder (lm-eval loads the YAML
a name points to, and a YAML may name Python code to import), but a tag, which names no
YAML and carries no config (lm-eval would build a task from an inline config, rendering
its templates unsandboxed). So a forged file can at most misname lm-eval's own tasks;
anything else costs a rebuild.

It leans on lm-eval's private ``lm_eval.tasks._index`` (``TaskIndex.build``, ``Entry``,
``Kind``) and on ``TaskManager`` building its index through ``manager.TaskIndex``: there is
no public way to hand a manager an index. ``tests/test_patched_internals.py`` checks that
surface; an ``Entry`` with fields other than ``ENTRY_FIELDS`` is never cached (they would
be lost), only built.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from lm_eval_headloc.common.files import cache_root

log = logging.getLogger(__name__)
_INDEX_LOG = logging.getLogger("lm_eval.tasks._index")

#: The name of every file this module writes (``task-index-<digest>.json``).
_PREFIX, _SUFFIX = "task-index-", ".json"
#: What earlier versions wrote (pickles): removed like old indexes.
_OLD_SUFFIXES = (".pickle",)
#: The stored format; a change makes every stored index another digest's.
FORMAT = 1
#: Indexes kept (one per lm-eval install that used the cache), newest first; older ones
#: are removed.
KEEP = 4
#: A stored index larger than this is not read (lm-eval 0.4.13's is about 18 MB).
MAX_BYTES = 256 * 2**20
#: The fields of lm-eval's ``Entry`` that a stored index holds (lm-eval 0.4.13's).
ENTRY_FIELDS = frozenset({"name", "kind", "yaml_path", "cfg", "tags"})


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
                  f"{sys.version_info[:2]}\0json-{FORMAT}\0".encode())
    code = [Path(module.__file__) for module in (_index, _yaml_loader)]
    for path in [*code, *_files_below(root)]:
        stat_ = path.stat()
        digest.update(f"{path}\0{stat_.st_size}\0{stat_.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:24]


def entry_fields_known() -> bool:
    """Whether lm-eval's ``Entry`` has exactly ``ENTRY_FIELDS``: what a stored index
    holds, so that one read back is the index built (an unknown field would be lost)."""
    from lm_eval.tasks._index import Entry

    try:
        return {field.name for field in dataclasses.fields(Entry)} == ENTRY_FIELDS
    except TypeError:  # no longer a dataclass
        return False


def _files_below(root: Path) -> Iterator[Path]:
    """Every file below ``root`` in a fixed order, compiled Python left out (written when a
    task's code is first imported, it would make the index look changed)."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".pyc"):
                yield Path(folder, name)


def _as_json(index: Mapping[str, Any], root: Path) -> str | None:
    """The index as JSON text (YAML paths relative to ``root``), or None where an entry
    does not go into JSON and back unchanged (then it is not stored)."""
    entries = {}
    for name, entry in index.items():
        if entry.yaml_path is None:
            yaml = None
        else:
            try:
                yaml = Path(entry.yaml_path).relative_to(root).as_posix()
            except ValueError:
                return None
        entries[name] = {"name": entry.name, "kind": entry.kind.name, "yaml": yaml,
                         "cfg": entry.cfg, "tags": sorted(entry.tags)}
    data = {"format": FORMAT, "entries": entries}
    try:  # a tuple, a set, a date or a key that is not text would come back otherwise
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):
        return None
    return text if json.loads(text) == data else None


def _from_json(data: Any, root: Path) -> dict[str, Any] | None:
    """The index JSON data holds, or None where it is no index of ``root``: an entry that
    is malformed, or whose YAML is not a relative path inside ``root``."""
    from lm_eval.tasks._index import Entry, Kind

    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("entries"), dict):
        return None
    index = {}
    for name, item in data["entries"].items():
        if not (isinstance(item, dict) and item.get("name") == name
                and item.get("kind") in Kind.__members__
                and (item.get("cfg") is None or isinstance(item["cfg"], dict))
                and isinstance(item.get("tags"), list)
                and all(isinstance(tag, str) for tag in item["tags"])):
            return None
        yaml = item.get("yaml")
        if yaml is None:
            # lm-eval builds a task from an entry's inline config where it names no YAML
            # (and renders its templates unsandboxed); a folder's index has none such:
            # only a tag names no YAML, and it carries no config.
            if item["kind"] != Kind.TAG.name or item.get("cfg") is not None:
                return None
        else:
            relative = PurePosixPath(yaml) if isinstance(yaml, str) else None
            if (relative is None or relative.is_absolute() or ".." in relative.parts
                    or "\0" in yaml or not relative.parts
                    or not (root / relative).is_file()):
                return None
        index[name] = Entry(name=name, kind=Kind[item["kind"]],
                            yaml_path=None if yaml is None else root / yaml,
                            cfg=item.get("cfg"), tags=set(item["tags"]))
    return index


def _read_regular_file(path: Path) -> bytes | None:
    """``path``'s bytes if it is a regular file (through a link or not) of at most
    ``MAX_BYTES``; None for anything else. Opened without blocking: a FIFO or a device
    under the cache's name must not hang the reader."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError:
        return None
    with os.fdopen(descriptor, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_BYTES:
            return None
        return file.read(MAX_BYTES + 1)


def _stored_index(path: Path, root: Path) -> dict[str, Any] | None:
    """The index stored at ``path``, or None where there is none that can be used."""
    text = _read_regular_file(path)
    if text is None or len(text) > MAX_BYTES:
        return None
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):  # not JSON (torn, or not ours)
        return None
    return _from_json(data, root)


def cached_index(root: Path, cache_dir: Path | None = None) -> dict[str, Any]:
    """``TaskIndex.build([root])``, from the cache when ``root``'s files are unchanged.

    A cache that cannot be read, written or made is only slower: the index is built."""
    from lm_eval.tasks._index import TaskIndex

    if not entry_fields_known():  # an lm-eval whose entries hold more than is stored
        return TaskIndex.build([root])
    try:
        folder = cache_dir if cache_dir is not None else cache_root()
        path = folder / f"{_PREFIX}{index_digest(root)}{_SUFFIX}"
    except (OSError, RuntimeError, KeyError) as err:  # no home folder (a uid without one)
        log.debug("task index not cached: %s", err)
        return TaskIndex.build([root])
    index = _stored_index(path, root)
    if index is not None:
        with contextlib.suppress(OSError, NotImplementedError):  # most recently used: kept
            # longest. The name's own time: a link in a shared folder may point anywhere.
            os.utime(path, follow_symlinks=os.utime not in os.supports_follow_symlinks)
        return index
    index = TaskIndex.build([root])
    text = _as_json(index, root)
    if text is None:
        log.debug("task index of %s not cached: it does not go into JSON", root)
        return index
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _write_index(path, text)
        _remove_old(folder)
    except OSError as err:
        log.debug("task index not cached in %s: %s", folder, err)
    return index


def _write_index(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all: written to a new file of a
    random name (never one that is there already: in a shared folder it could be a link
    to another file), which then replaces ``path``."""
    descriptor, partial = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial",
                                           dir=path.parent)
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as file:
            file.write(text)
        os.chmod(partial, 0o644)  # mkstemp's 600 would keep it from others who share it
        os.replace(partial, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _remove_old(folder: Path) -> None:
    """Keep the ``KEEP`` most recently used indexes this module wrote; remove the pickles
    earlier versions wrote."""
    for old in folder.glob(f"{_PREFIX}*"):
        if old.suffix in _OLD_SUFFIXES:
            old.unlink(missing_ok=True)
    ours = sorted(folder.glob(f"{_PREFIX}*{_SUFFIX}"), key=lambda p: p.lstat().st_mtime,
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
