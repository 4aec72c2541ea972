"""One parse of a GGUF file per process, however many times transformers reads it.

Loading a model with ``gguf_file=`` parses the file for the config (our argument check,
then HFLM's), for the tokenizer and again for the weights: each parse reads every
metadata field, the vocabulary and merges included (3-4 s for the embedded SmolLM2), so a
command spent ~14 s parsing the same 94 MB five times. Inside ``cached_gguf_reads()``,
``gguf.GGUFReader`` (which transformers imports at each call) hands back the reader of
the file's last parse while the file is unchanged (same path, size and modification
time). Readers are read-only memory maps; nothing a reader holds is modified by its
users.

Two more repeats go with it. transformers parses the file's metadata (every field, the
vocabulary's 49,152 strings included) into Python values once per read: for the config
(twice), the tokenizer and the weights, ~1.5 s each; ``load_gguf_checkpoint`` without
tensors hands back a copy of the last such parse of the unchanged file. And it maps tensor
names by building gguf's ``TensorNameMap`` of the architecture once per module of the model
(397 times for SmolLM2, ~9 s); the map depends on the architecture and layer count only and
is read, never changed, so one is built per pair.

None of the three has a public setting, so each is patched, relying on how transformers
5.24 calls them: ``gguf.GGUFReader(path)``, ``gguf.get_tensor_name_map`` and
``modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=...)``, each
looked up at the call. ``tests/test_patched_internals.py`` checks that surface; a
``load_gguf_checkpoint`` of another signature is left unpatched (only slower).
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
_METADATA: dict[tuple[str, int, int], Any] = {}  # its metadata, as transformers parsed it
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
            _patch_transformers(gguf)
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                gguf.GGUFReader = cached_gguf_reads.original  # type: ignore[attr-defined]
                for owner, name, original_function in _PATCHED:
                    setattr(owner, name, original_function)
                _PATCHED.clear()
                _METADATA.clear()


#: (object, attribute, what it was) for each function ``_patch_transformers`` replaced.
_PATCHED: list[tuple[Any, str, Any]] = []


def _patch_transformers(gguf: Any) -> None:
    """The metadata parse and the tensor-name map, each made once (the module docstring);
    both are imported by transformers at each call, so the module attributes are patched."""
    import copy
    import functools

    try:
        from transformers import modeling_gguf_pytorch_utils as loading
    except ImportError:
        return
    load = loading.load_gguf_checkpoint
    name_map = getattr(gguf, "get_tensor_name_map", None)
    if name_map is not None:
        _PATCHED.append((gguf, "get_tensor_name_map", name_map))
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    if not takes_path_then_return_tensors(load):
        return  # what load_once passes on would mean something else

    @functools.wraps(load)
    def load_once(path: Any, return_tensors: bool = False, *args: Any, **kwargs: Any) -> Any:
        key = None if return_tensors or args or kwargs else _key(path)
        if key is None:
            return load(path, return_tensors, *args, **kwargs)
        if key not in _METADATA:
            _METADATA.clear()  # one file kept, as the readers
            _METADATA[key] = load(path, False)
        return copy.deepcopy(_METADATA[key])  # the caller's to change

    _PATCHED.append((loading, "load_gguf_checkpoint", load))
    loading.load_gguf_checkpoint = load_once


def takes_path_then_return_tensors(function: Any) -> bool:
    """Whether ``function`` takes ``(path, return_tensors=False, ...)``, both positional or
    keyword, as transformers 5.24's ``load_gguf_checkpoint`` does: ``load_once`` reads
    its first two arguments so."""
    import inspect

    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return (len(parameters) >= 2 and parameters[1].name == "return_tensors"
            and parameters[1].default is False
            and all(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters[:2]))
