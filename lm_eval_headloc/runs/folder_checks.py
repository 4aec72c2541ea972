"""What a run folder's files may say, checked before anything is built from them.

A run folder travels (copied, downloaded, shared), so what its files say is data to
check, never an instruction. Three checks, each in one place:

- ``plain_name``: a name read from a file (a task, which becomes part of the file name
  ``heads-<task>.json``) is a plain name, never a path: ``RunFolder.file`` takes only
  such names and resolves every path inside the folder.
- ``check_config``: config.json on its own (``RunFolder.read_config``, its one reader):
  its task names are plain names and its geometry (layers, heads, MLP width) whole
  numbers of a size some model has.
- ``check_files``: the folder's other files agree with config.json — the design's width
  with the columns the geometry gives, prior.json's tasks and widths, the measurements'
  tasks, the ranking files' tasks and components, types.json's grid — read before
  anything is sized from them (``result.load_run``, for every command that reads a run,
  and ``RunFolder.start`` when a run resumes).

Each refusal is one ``RunFolderError`` line naming the file and what disagrees.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lm_eval_headloc.common.options import COMPONENTS
from lm_eval_headloc.measurement.store import StoreError

__all__ = ["MAX_HEADS", "MAX_NAME", "MAX_NEURONS", "MAX_WIDTH", "RunFolderError", "check_config",
           "check_files", "names_task_file", "plain_name", "run_tasks"]


class RunFolderError(StoreError):
    """A run folder that does not fit the command (a user mistake, reported in one line);
    a ``StoreError``, as a run folder is its measurements' store."""


class RunFolder(Protocol):
    """What these checks read of a run folder (``runs.folder.RunFolder``, which calls
    them: named here by its shape, so the checks need not import the folder back)."""

    path: Path

    def file(self, name: str) -> Path: ...

    def ranking_file(self, task: str, suffix: str = ".json") -> Path: ...

    def measurements(self) -> list[dict[str, Any]]: ...

#: The longest name that may stand in a file name (``heads-<task>.json`` must stay under
#: the 255 bytes a file name may have).
MAX_NAME = 200
#: More heads, MLP neurons in all or in one layer than any model has (Llama-3.1-405B:
#: 16,128 heads, 6.7 million neurons, 53,248 a layer): a config.json giving more is not
#: one of ours, and nothing is allocated for it.
MAX_HEADS = 2**20
MAX_NEURONS = 2**27
MAX_WIDTH = 2**20
#: The commands whose folders hold a ranking's files (design, prior, measurements,
#: heads-<task>.json) that must agree with config.json.
_RANKING = ("locate", "greedy")
_NOT_ALTERED = ("a folder headloc-harness wrote never does (altered, or mixed with another "
                "run's files)")


def plain_name(value: Any, what: str, source: str | Path) -> str:
    """``value``, a name read from ``source``, when it can stand inside a file name:
    a non-empty string of printable characters without a path separator (``/``, ``\\``),
    ``..`` or NUL, at most ``MAX_NAME`` long; else a one-line RunFolderError naming it."""
    if not isinstance(value, str):
        raise RunFolderError(f"{source}: {what} {value!r} is not a name (a string)")
    if (not value.strip() or ".." in value or "/" in value or "\\" in value
            or not value.isprintable() or len(value) > MAX_NAME):
        raise RunFolderError(f"{source}: {what} {value!r} is not a plain name (one without "
                             f"'/', '\\', '..' or control characters, at most {MAX_NAME} "
                             "long); a name read from a file is never a path")
    return value


def names_task_file(task: str) -> bool:
    """Whether ``task`` (``TASK`` or ``TASK:METRIC``) names a task YAML's path, as
    ``--tasks`` reads one (``setup.tasks_from_files``) rather than a task's name."""
    return task.partition(":")[0].strip().lower().endswith((".yaml", ".yml"))


def _whole(config: Mapping[str, Any], key: str, path: Path, low: int = 1) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if type(value) is not int or value < low:
        raise RunFolderError(f"{path}: {key} {value!r} is not a whole number >= {low}")
    return value


def run_tasks(config: Mapping[str, Any], path: Path | None = None) -> list[str]:
    """The run's task names as its files are keyed by them (``--tasks`` without metrics,
    ``LocateRun.tasks``); with ``path`` (config.json) each checked to be a plain name,
    those its identity records too."""
    from lm_eval_headloc.measurement.metrics import MetricError, parse_task_metric
    from lm_eval_headloc.runs.spec import RunSpec

    recorded = [RunSpec.from_config(config).tasks]
    if path is not None and isinstance(config["identity"].get("tasks"), (str, list)):
        recorded.append(RunSpec(tasks=config["identity"]["tasks"]).tasks)
    names = []
    for tasks in recorded:
        for task in tasks or ():
            if not isinstance(task, str):
                raise RunFolderError(f"{path}: task {task!r} is not a name (a string)")
            if path is not None and names_task_file(task):
                # A run records the task a YAML defines, never the file: read as a path
                # (relative to the working directory), its folder's code would run.
                raise RunFolderError(f"{path}: task {task!r} names a task file, not a task; "
                                     "a name read from a file is never a path")
            try:
                name = parse_task_metric(task)[0]
            except MetricError as err:
                raise RunFolderError(f"{path}: {err}") from None
            names.append(name if path is None else plain_name(name, "task", path))
    return list(dict.fromkeys(names))


def check_config(config: Mapping[str, Any], path: Path) -> None:
    """Refuse a config.json (already a mapping with a command and an identity) whose
    task names are no plain names or whose geometry is no model's: before any reader
    builds a path or an array from them."""
    for section in ("spec", "settings"):
        if not isinstance(config.get(section, {}), Mapping):
            raise RunFolderError(f"{path}: {section} is not a mapping of options")
    try:
        run_tasks(config, path)
    except (TypeError, ValueError) as err:
        if isinstance(err, RunFolderError):
            raise
        raise RunFolderError(f"{path}: its options are not a run's "
                             f"({str(err).splitlines()[0]})") from None
    for key in ("example_subset", "examples_used", "chat_template"):
        recorded = config.get(key)
        if recorded is None:
            continue
        if not isinstance(recorded, Mapping):
            raise RunFolderError(f"{path}: {key} is not a mapping of tasks")
        for task, value in recorded.items():
            plain_name(task, f"{key}'s task", path)
            # overlap counts and intersects the subsets, verify reads their documents:
            # each is a list of document indices, each count a whole number.
            if key == "example_subset" and not (
                    isinstance(value, list)
                    and all(type(i) is int and i >= 0 for i in value)):
                raise RunFolderError(f"{path}: example_subset of {task!r} is not a list of "
                                     f"document indices (whole numbers >= 0): {value!r:.60}")
            if key == "examples_used" and not (type(value) is int and value >= 0):
                raise RunFolderError(f"{path}: examples_used of {task!r} {value!r:.60} is not "
                                     "a whole number >= 0")
    layers = _whole(config, "layers", path)
    per_layer = _whole(config, "heads_per_layer", path)
    width = _whole(config, "neurons_per_layer", path)
    head_layers = config.get("head_layers")
    if head_layers is not None:
        if not (isinstance(head_layers, list) and head_layers
                and all(type(x) is int for x in head_layers)
                and head_layers == sorted(set(head_layers))
                and head_layers[0] >= 0 and (layers is None or head_layers[-1] < layers)):
            raise RunFolderError(f"{path}: head_layers is not a list of distinct layers in "
                                 f"0..{'L' if layers is None else layers - 1}, ascending")
    if (layers or 1) * (per_layer or 1) > MAX_HEADS:
        raise RunFolderError(f"{path}: {layers or '?'} layers x {per_layer or '?'} heads is "
                             f"more heads than any model has (at most {MAX_HEADS:,} are "
                             f"read); {_NOT_ALTERED}")
    d_model = _whole(config, "d_model", path)
    if d_model is not None and (d_model > MAX_WIDTH or d_model < (per_layer or 1)):
        # Copied into the MIB export as the model's width: no model is wider, and each of
        # its heads is at least one unit of it.
        raise RunFolderError(f"{path}: d_model {d_model} is not a model's width (at least "
                             f"its {per_layer or 1} heads a layer, at most {MAX_WIDTH:,}); "
                             f"{_NOT_ALTERED}")
    if width is not None and (width > MAX_WIDTH or (layers or 1) * width > MAX_NEURONS):
        raise RunFolderError(f"{path}: {layers or '?'} layers x {width} MLP neurons is more "
                             f"neurons than any model has (at most {MAX_NEURONS:,}, "
                             f"{MAX_WIDTH:,} a layer, are read); {_NOT_ALTERED}")
    spec = config.get("spec", {})
    if spec.get("components", "heads") not in COMPONENTS:
        raise RunFolderError(f"{path}: components {spec.get('components')!r} is not one of "
                             f"{', '.join(COMPONENTS)}")
    _whole(spec, "neuron_groups", path, low=0)
    for key in ("top_k", "num_samples", "seed"):  # counts every reader takes as numbers
        _whole(spec, key, path, low=0 if key == "seed" else 1)
    for key in ("candidates", "never_neurons", "row_keys"):
        names = config.get(key)
        if names is not None and not (isinstance(names, list)
                                      and all(isinstance(n, str) for n in names)):
            raise RunFolderError(f"{path}: {key} is not a list of names")
    _check_options(config, path)  # the rest, as the command line checks them


def _check_options(config: Mapping[str, Any], path: Path) -> None:
    """Refuse recorded options the command line would refuse (a number as text, a null
    count, model args that are no string): every reader takes them as a run's options,
    and a wrong type ended in a traceback deep inside it, or a wrong number."""
    from dataclasses import fields

    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.runs.spec import RunSpec

    try:
        spec = RunSpec.from_config(config)
        for spec_field in fields(RunSpec):
            # A number option that has a default is never null in a run's record.
            if (spec_field.metadata["number"] is not None and spec_field.default is not None
                    and getattr(spec, spec_field.name) is None):
                raise UsageError(f"{spec_field.name} None: must be a number")
        if not all(isinstance(folder, str) for folder in spec.include_path):
            raise UsageError(f"include_path {list(spec.include_path)!r}: must be folders")
        if spec.model_args is not None and not isinstance(spec.model_args, str):
            raise UsageError(f"--model-args {spec.model_args!r}: must be a string")
        # Its type only: which model args the command line takes as its own options
        # (batch_size=) is the command line's rule, not the record's (a run appends some).
        spec.replace(output_path=None, log_samples=False, model_args=None).validate()
    except (UsageError, TypeError, ValueError) as err:
        if isinstance(err, RunFolderError):
            raise
        raise RunFolderError(f"{path}: its options are not a run's "
                             f"({str(err).splitlines()[0]})") from None


# --- the other files against config.json ------------------------------------------------

_COLUMN = re.compile(r"L(\d+)([HNG])(\d+)", re.ASCII)


class _Run:
    """What config.json says that the other files must agree with."""

    def __init__(self, folder: RunFolder, config: Mapping[str, Any]) -> None:
        from lm_eval_headloc.runs.spec import RunSpec

        spec = RunSpec.from_config(config)
        self.folder, self.command = folder, config["command"]
        self.tasks = run_tasks(config)
        self.kinds = set(str(spec.components).split("+"))
        self.groups = spec.neuron_groups if "neurons" in self.kinds else 0
        self.layers, self.per_layer = config.get("layers"), config.get("heads_per_layer")
        self.head_layers = config.get("head_layers")
        self.width = config.get("neurons_per_layer")
        self.candidates = config.get("candidates")
        self.never = config.get("never_neurons") or []
        self.geometry = self.layers is not None and self.per_layer is not None

    def disagree(self, file: str, what: str) -> RunFolderError:
        return RunFolderError(f"{self.folder.path}: the folder's files disagree: {file} "
                              f"{what}; {_NOT_ALTERED}")

    @property
    def heads(self) -> int:
        """The run's heads (a hybrid model's layers with heads only)."""
        assert self.layers is not None and self.per_layer is not None
        layers = self.layers if self.head_layers is None else len(self.head_layers)
        return layers * self.per_layer

    def neuron_layers(self) -> dict[int, set[int]]:
        """The candidates' and never-knocked-out neurons by layer, checked against the
        geometry (a name outside it disagrees with it)."""
        taken: dict[int, set[int]] = {}
        for name in [*(self.candidates or []), *self.never]:
            match = _COLUMN.fullmatch(name)
            if match is None or match[2] != "N":
                raise self.disagree("config.json", f"lists {name!r} among its neurons")
            layer, neuron = int(match[1]), int(match[3])
            if layer >= self.layers or (self.width is not None and neuron >= self.width):
                raise self.disagree("config.json", f"names {name}, outside the model's "
                                                   f"{self.layers} layers x {self.width} neurons")
            taken.setdefault(layer, set()).add(neuron)
        return taken

    def columns(self) -> int | None:
        """The design's width the geometry gives (``Columns.of``, counted without building
        it), or None where config.json does not record enough to tell."""
        if not self.geometry:
            return None
        count = self.heads if "heads" in self.kinds else 0
        if "neurons" in self.kinds:
            if self.candidates is None:
                return None
            taken = self.neuron_layers()
            count += len(self.candidates)
            if self.groups:
                if self.width is None:
                    return None
                # Each layer's neurons outside candidates and --never-ablate, cut into at
                # most G groups (``columns.neuron_groups``).
                rest = {layer: self.width - len(taken.get(layer, ()))
                        for layer in taken}
                count += (self.layers - len(taken)) * min(self.groups, self.width)
                count += sum(min(self.groups, left) for left in rest.values() if left > 0)
        return count


def _json(folder: RunFolder, name: str) -> Any:
    from lm_eval_headloc.common.files import read_json

    return read_json(folder.file(name), RunFolderError)


def _design_shape(path: Path) -> tuple[int, ...]:
    """design_matrix.npy's shape from its header alone, checked against the file's size
    (a header may claim any shape; nothing is read or allocated for it)."""
    try:
        with path.open("rb") as file:
            version = np.lib.format.read_magic(file)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(file)
            start = file.tell()
    except (OSError, ValueError, EOFError) as err:
        raise RunFolderError(f"{path} is unreadable ({str(err).splitlines()[0]})") from None
    if dtype.hasobject or len(shape) != 2:
        raise RunFolderError(f"{path} is not a design matrix (masks x columns of booleans)")
    if path.stat().st_size - start != shape[0] * shape[1] * dtype.itemsize:
        raise RunFolderError(f"{path} is cut short or padded: its header says {shape[0]} "
                             f"masks x {shape[1]} columns")
    return shape


def _prior_widths(run: _Run) -> dict[str, int]:
    """What each of prior.json's lists holds a value for (``locate.attribution_prior``):
    ``effects`` every head in flat order over every layer, ``neuron_effects`` every MLP
    neuron."""
    assert run.layers is not None and run.per_layer is not None
    widths = {"effects": run.layers * run.per_layer}
    if run.width is not None:
        widths["neuron_effects"] = run.layers * run.width
    return widths


def _check_prior(run: _Run) -> None:
    data = _json(run.folder, "prior.json")
    tasks = data.get("tasks") if isinstance(data, dict) else None
    if not isinstance(tasks, dict):
        raise run.disagree("prior.json", "holds no estimates by task")
    if set(tasks) != set(run.tasks):
        missing = [t for t in run.tasks if t not in tasks]
        said = (f"has no estimates for task {missing[0]!r}" if missing else
                f"has estimates for task {next(t for t in tasks if t not in run.tasks)!r}, "
                "not one of the run's")
        raise run.disagree("prior.json", f"{said} (it has "
                                         f"{', '.join(map(repr, tasks)) or 'none'})")
    widths = _prior_widths(run) if run.geometry else {}
    for task, entry in tasks.items():
        points = entry.get("points", [entry]) if isinstance(entry, dict) else None
        if not (isinstance(points, list) and points
                and all(isinstance(p, dict) for p in points)):
            raise run.disagree("prior.json", f"holds no estimates for task {task!r}")
        needed = {"effects": "heads" in run.kinds, "neuron_effects": "neurons" in run.kinds}
        for key, values in ((k, p.get(k)) for p in points for k in needed):
            if values is None:
                if needed[key]:
                    raise run.disagree("prior.json", f"has no {key} for task {task!r}")
                continue
            if not isinstance(values, list) or (key in widths and len(values) != widths[key]):
                size = len(values) if isinstance(values, list) else "no"
                raise run.disagree("prior.json", f"holds {size} {key} for task {task!r}, "
                                   f"not {widths.get(key, 'a list')}")


def _check_measurements(run: _Run) -> None:
    scores: dict[str, Any] = {}  # by key, as first recorded
    for record in run.folder.measurements():
        missing = [t for t in run.tasks if t not in record["scores"]]
        if missing:
            raise run.disagree("measurements.jsonl", f"holds {record['key']!r} without a "
                               f"score of task {missing[0]!r}")
        # Which of the two a resumed run would take could not be told (it took the last).
        if scores.setdefault(record["key"], record["scores"]) != record["scores"]:
            raise run.disagree("measurements.jsonl", f"holds {record['key']!r} twice, with "
                               "different scores")


def _check_ranking(run: _Run, task: str, columns: int | None) -> None:
    name = run.folder.ranking_file(task).name
    data = _json(run.folder, name)
    entries = data.get("heads") if isinstance(data, dict) else data
    if not isinstance(entries, list):
        raise run.disagree(name, "holds no list of heads")
    if isinstance(data, dict) and data.get("task", task) != task:
        raise run.disagree(name, f"ranks task {data.get('task')!r}")
    if isinstance(data, dict) and data.get("heads_per_layer", run.per_layer) != run.per_layer:
        raise run.disagree(name, f"says {data.get('heads_per_layer')!r} heads per layer")
    if columns is not None and len(entries) > columns:
        raise run.disagree(name, f"ranks {len(entries)} components, more than the run's "
                                 f"{columns}")
    if not run.geometry:
        return
    limits = {"H": run.per_layer, "N": run.width, "G": run.groups}
    for entry in entries:
        label = (entry.get("head") or entry.get("neuron") or entry.get("group")
                 if isinstance(entry, dict) else entry)
        match = _COLUMN.fullmatch(label) if isinstance(label, str) else None
        if match is None:
            continue  # not a column name: the ranking's reader says what it is
        layer, kind, index = int(match[1]), match[2], int(match[3])
        limit = limits[kind]
        if layer >= run.layers or (limit is not None and index >= limit) or (
                kind == "H" and run.head_layers is not None and layer not in run.head_layers):
            raise run.disagree(name, f"ranks {label}, which the run's model "
                                     f"({run.layers} layers x {run.per_layer} heads) lacks")


def _check_types(run: _Run) -> None:
    data = _json(run.folder, "types.json")
    grid = data.get("dominant") if isinstance(data, dict) else None
    if not (isinstance(grid, list) and all(isinstance(row, list) for row in grid)):
        raise run.disagree("types.json", "holds no grid of head types")
    if run.geometry and (len(grid) != run.layers
                         or any(len(row) != run.per_layer for row in grid)):
        raise run.disagree("types.json", f"holds a grid of {len(grid)} layers, not "
                                         f"{run.layers} layers x {run.per_layer} heads")


def check_files(folder: RunFolder, config: Mapping[str, Any]) -> None:
    """Refuse a locate or greedy run folder whose files disagree with its config.json
    (``check_config`` has passed): a one-line RunFolderError saying which file and what.
    A file not there yet (a run still going) is not checked; every file there is, before
    a reader sizes anything from the geometry config.json records."""
    if config.get("command") not in _RANKING:
        return  # other commands' folders are read through config.json alone
    run = _Run(folder, config)
    columns = run.columns() if run.command == "locate" else (
        run.heads if run.geometry else None)
    design = folder.file("design_matrix.npy")
    if run.command == "locate" and design.is_file():
        shape = _design_shape(design)
        if "neurons" in run.kinds and run.geometry and not folder.file("prior.json").is_file():
            # Its neuron columns come from the prior: a design without one is no run's.
            raise run.disagree("design_matrix.npy", "exists without the prior.json its "
                                                     "neuron columns come from")
        if columns is not None and shape[1] != columns:
            parts = ([f"{run.layers} layers x {run.per_layer} heads"]
                     if "heads" in run.kinds else [])
            if "neurons" in run.kinds:
                parts.append(f"{columns - (run.heads if parts else 0)} neuron columns")
            raise run.disagree("design_matrix.npy", f"has {shape[1]} columns, not the "
                                                    f"{columns} of config.json's "
                                                    f"{' and '.join(parts)}")
    if folder.file("prior.json").is_file():
        _check_prior(run)
    _check_measurements(run)
    for task in run.tasks:
        if folder.ranking_file(task).is_file():
            _check_ranking(run, task, columns)
    if "heads" in run.kinds and folder.file("types.json").is_file():
        _check_types(run)
