"""One parse of a GGUF file per process, however many times transformers reads it.

Loading a model with ``gguf_file=`` parses the file for the config (our argument check,
then HFLM's), for the tokenizer and again for the weights: each parse reads every
metadata field, the vocabulary and merges included (3-4 s for the embedded SmolLM2), so a
command spent ~14 s parsing the same 94 MB five times. Inside ``cached_gguf_reads()``,
``gguf.GGUFReader`` (which transformers imports at each call) hands back the reader of
the file's last parse while the file is unchanged (same path, size and modification
time). Readers are read-only memory maps; nothing a reader holds is modified by its
users.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["cached_gguf_reads", "parses"]

_LOCK = threading.Lock()
_CACHE: dict[tuple[str, int, int], Any] = {}  # the last file parsed: (path, size, mtime)
_PARSES = [0]  # files actually parsed while the cache was on (for tests)
_DEPTH = [0]


def parses() -> int:
    """How many GGUF files were actually parsed under ``cached_gguf_reads`` so far."""
    return _PARSES[0]


def _key(path: Any) -> tuple[str, int, int] | None:
    try:
        real = os.path.realpath(os.fspath(path))
        stat = os.stat(real)
    except (OSError, TypeError):
        return None
    return real, stat.st_size, stat.st_mtime_ns


@contextlib.contextmanager
def cached_gguf_reads() -> Iterator[None]:
    """Inside, read-only ``gguf.GGUFReader(path)`` calls reuse the last parse of an
    unchanged file. Nests; a no-op where the ``gguf`` package is absent."""
    try:
        import gguf
    except ImportError:
        yield
        return
    with _LOCK:
        _DEPTH[0] += 1
        if _DEPTH[0] == 1:
            original = gguf.GGUFReader

            class CachedReader(original):  # type: ignore[misc, valid-type]
                def __new__(cls, path: Any, mode: str = "r") -> Any:
                    key = _key(path) if mode == "r" else None
                    if key is not None and key in _CACHE:
                        return _CACHE[key]
                    reader = object.__new__(cls)
                    original.__init__(reader, path, mode)
                    _PARSES[0] += 1
                    if key is not None:
                        _CACHE.clear()  # one file kept: a model's, for its loading
                        _CACHE[key] = reader
                    return reader

                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    pass  # parsed (or reused) in __new__

            CachedReader.__name__ = CachedReader.__qualname__ = original.__name__
            gguf.GGUFReader = CachedReader
            cached_gguf_reads.original = original  # type: ignore[attr-defined]
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                gguf.GGUFReader = cached_gguf_reads.original  # type: ignore[attr-defined]
