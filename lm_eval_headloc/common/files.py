"""Writing files: atomically (no reader, and no run killed half-way, sees half of one), and
only over a page of our own (a report script never replaces a file it did not write)."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["PARTIAL", "Beginning", "cache_root", "not_a_file", "page_refusal", "parse_json",
           "read_json", "strict_json", "write_atomically", "write_page"]

#: How much of a file is read to see how it begins.
_PEEK = 4096


#: The name of ``write_atomically``'s partial file of ``<name>``, left behind only by a kill
#: mid-write.
PARTIAL = re.compile(r"\.(?P<name>.+)\.\d+\.partial", re.ASCII)


def cache_root() -> Path:
    """This package's cache folder: ``$XDG_CACHE_HOME/lm_eval_headloc`` (``~/.cache`` where
    it is unset or, as the XDG spec says, not an absolute path)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "lm_eval_headloc"


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """``write(partial)`` writes a sibling file, which then replaces ``path`` in one rename
    (atomic on POSIX and Windows); the partial file is removed if ``write`` fails."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def not_a_file(path: str | os.PathLike) -> str | None:
    """``"<path> is a FIFO, not a regular file"`` (a socket, a device, a broken link) where
    ``path`` is there but is neither a regular file nor a folder; None else (not there, a
    file, a folder: each writer says what it makes of a folder). The one check of an
    output path a command writes or reads back before writing: a FIFO blocks whoever opens
    it until the other end is opened, for ever; a caller adds what to do instead."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.lexists(path):
            return None
        kind = "a broken link"
    except (OSError, ValueError):  # unreadable, or a name no path can have: the writer says
        return None
    else:
        if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
            return None
        kind = ("a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
                else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "something else")
    return f"{path} is {kind}, not a regular file"


#: How a page begins: its first characters, or a pattern its start matches (``re.match``).
Beginning = str | re.Pattern[str]


def _begins(text: str, begins: tuple[Beginning, ...]) -> bool:
    return any(text.startswith(b) if isinstance(b, str) else b.match(text) for b in begins)


def _shown(begins: tuple[Beginning, ...]) -> str:
    first = begins[0]
    return repr(first if isinstance(first, str) else first.pattern)


def page_refusal(path: str | os.PathLike,
                 begins: Beginning | tuple[Beginning, ...]) -> str | None:
    """Why a page that begins with ``begins`` (or one of them) may not be written to
    ``path``; None when it may: ``path`` does not exist (in a folder that does: a long
    run would otherwise lose its page at the end), or it is a regular file that is empty
    (nothing in it to lose) or begins that way (a page of the same writer)."""
    path = Path(path)
    begins = begins if isinstance(begins, tuple) else (begins,)
    if not path.exists():
        if not path.parent.is_dir():
            return (f"{path.parent} is not a folder, so {path} cannot be written; name a "
                    "file in an existing folder")
        return None
    if (what := not_a_file(path)) is not None:
        return f"{what}; name a file"
    if not path.is_file():
        return f"{path} is not a regular file; name a file (e.g. {path / 'page.md'})"
    try:
        with path.open("rb") as file:
            start = file.read(_PEEK).decode("utf-8", "replace")
    except OSError as error:
        return f"{path} cannot be read ({error.strerror}); name another file"
    if not start or _begins(start, begins):
        return None
    return (f"{path} exists and does not begin with {_shown(begins)}: not a page this "
            "writes, so it is left alone; name a new file or one this wrote")


def write_page(path: str | os.PathLike, text: str,
               begins: Beginning | tuple[Beginning, ...]) -> None:
    """Write ``text`` to ``path`` atomically, unless ``page_refusal`` refuses (checked
    again here: a long run checks before its work and the file may have changed since);
    ``FileExistsError`` then, with the refusal as its message."""
    begins = begins if isinstance(begins, tuple) else (begins,)
    why = page_refusal(path, begins)
    if why is not None:
        raise FileExistsError(why)
    if not _begins(text, begins):  # else the next run would refuse its own page
        raise ValueError(f"the page for {path} does not begin with {_shown(begins)}")
    write_atomically(path, lambda partial: partial.write_text(text, encoding="utf-8"))


def parse_json(text: str | bytes, where: str | Path, error: type[Exception]) -> Any:
    """The JSON value of ``text`` (read from ``where``), or one line of ``error`` naming
    ``where``: not JSON, not UTF-8, nested deeper than the reader follows (a 100,000-deep
    array is a RecursionError), or a number longer than Python reads (4,300 digits). The
    one way the package reads a JSON file it did not just write."""
    try:
        return json.loads(text)
    except RecursionError:
        raise error(f"{where}: nested too deeply to be read as JSON") from None
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError, a too long integer
        raise error(f"{where} is not readable JSON ({str(err).splitlines()[0][:200]})") \
            from None


def read_json(path: str | os.PathLike, error: type[Exception]) -> Any:
    """``parse_json`` of the file at ``path``; one line of ``error`` where it cannot be
    read."""
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise error(f"{path} cannot be read ({err.strerror or err})") from None
    return parse_json(data, path, error)


def _finite_or_none(data: Any) -> Any:
    if isinstance(data, float) and not math.isfinite(data):
        return None
    if isinstance(data, Mapping):
        return {k: _finite_or_none(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_finite_or_none(v) for v in data]
    return data


def _json_key(key: Any) -> str:
    """An object key as ``json.dumps`` writes it (a number, bool or null as its text)."""
    if isinstance(key, str):
        return json.dumps(key)
    if key is None or isinstance(key, (int, float)):
        return json.dumps(json.dumps(key, allow_nan=False))
    raise TypeError(f"keys must be str, int, float, bool or None, not {type(key).__name__}")


def _indented(data: Any, depth: int) -> str:
    if isinstance(data, list) and data and all(
            x is None or isinstance(x, (int, float)) for x in data):
        # A list of plain numbers goes on one line: a neuron prior holds lists of tens of
        # thousands, and a line for each number made prior.json several times larger.
        return json.dumps(data, allow_nan=False)
    if not isinstance(data, (list, dict)) or not data:
        return json.dumps(data, allow_nan=False)
    pad, inner = "\n" + "  " * depth, "\n" + "  " * (depth + 1)
    if isinstance(data, list):
        items = [_indented(v, depth + 1) for v in data]
        return "[" + inner + ("," + inner).join(items) + pad + "]"
    items = [f"{_json_key(k)}: {_indented(v, depth + 1)}" for k, v in data.items()]
    return "{" + inner + ("," + inner).join(items) + pad + "}"


def strict_json(data: Any) -> str:
    """JSON any strict parser reads: NaN and infinities (undefined numbers) become null.

    Laid out as ``json.dumps(indent=2)`` does, but for lists of numbers (and nulls),
    each written on one line; every number is json's own text of it (``repr``), so the
    values read back exactly."""
    return _indented(_finite_or_none(data), 0) + "\n"
