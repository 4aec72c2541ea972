"""Writing a file so that no reader, and no run killed half-way, sees half of it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_atomically"]


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
