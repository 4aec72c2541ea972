"""A run's head types: ``types.json``, computed once per run folder and read back."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.options import PROBE_ROWS
from lm_eval_headloc.method.head_types import HeadTypes, head_types_of, run_texts
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement
    from lm_eval_headloc.measurement.store import SharingStore

__all__ = ["TYPES_FILE", "ensure_types", "read_types"]

log = logging.getLogger("lm_eval_headloc")


#: The file a run keeps its head types in.
TYPES_FILE = "types.json"


@timing.timed("head types")
def ensure_types(folder: RunFolder, measure: Measurement, probe_rows: int = PROBE_ROWS,
                 shared: SharingStore | None = None) -> HeadTypes | None:
    """The run's head types: ``types.json`` when a resumed run made it, else computed on
    the measurement's model and written. A model whose attention weights cannot be read
    costs the run nothing: the reason is logged and the run goes on without types.
    ``shared``: a sweep's cell's store, whose sweep has an earlier cell's types of as many
    probe rows (a function of the model, the examples and the probe alone): a copy of
    that file, ``same_as`` naming it, rather than computed again."""
    stored = read_types(folder)
    if stored is not None:
        if shared is not None:  # a resumed cell's own, shared with the cells after it
            shared.wrote_file(TYPES_FILE, probe_rows, stored.data)
        return stored
    if shared is not None and (copy := shared.made_file(TYPES_FILE, probe_rows)) is not None:
        folder.write_json(TYPES_FILE, copy)
        return HeadTypes(copy)
    try:
        data = head_types_of(measure.lm, run_texts(measure), probe_rows)
    except (RuntimeError, ValueError, TypeError, AttributeError, NotImplementedError) as err:
        log.warning("head types skipped: %s", err)
        return None
    folder.write_json(TYPES_FILE, data)
    if shared is not None:
        shared.wrote_file(TYPES_FILE, probe_rows, data)
    return HeadTypes(data)


def read_types(folder: RunFolder | str | Path) -> HeadTypes | None:
    """``types.json`` of a run folder, or None where it has none (a folder that does not
    exist is a RunFolderError: a mistyped path is not a run without types)."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    if not folder.path.is_dir():
        raise RunFolderError(f"{folder.path} is not a run folder (no such folder)")
    path = folder.file(TYPES_FILE)
    if not path.is_file():
        return None
    from lm_eval_headloc.common.files import read_json

    return HeadTypes(read_json(path, RunFolderError))
