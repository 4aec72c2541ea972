"""Where measurements are kept, and measuring a plan into it.

A measurement is a function of its mask on fixed examples, so a run keeps every one it
makes in a ``MeasurementStore`` (a run folder's ``measurements.jsonl``, or ``MemoryStore``
in a notebook) and ``run_plan`` measures only the plan's masks the store lacks: a run
resumed on the same store measures nothing twice and makes the same decisions.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.common.timing import timed
from lm_eval_headloc.intervention.components import Head, format_heads
from lm_eval_headloc.measurement.metrics import MetricError

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement

__all__ = ["MeasurementStore", "MemoryStore", "PlanEntry", "RecallingStore", "ReplayStore",
           "SharingStore", "StoreError", "is_measurement", "phase_bar", "run_plan",
           "unusable_score"]


class StoreError(UserError):
    """A store's measurement that does not fit the plan asked of it: the store was made
    with other arguments (``runs.folder_checks.RunFolderError`` is one, for a folder)."""


class MeasurementStore(Protocol):
    """What ``run_plan`` keeps its measurements in: records (dicts with a unique
    ``"key"``) in the order they were made. ``runs.folder.RunFolder`` is one."""

    @property
    def path(self) -> str | Path:
        """What the store is called in messages (a run folder's path)."""
        ...

    def measurements(self) -> list[dict[str, Any]]: ...

    def append_measurement(self, record: Mapping[str, Any]) -> None: ...


@runtime_checkable
class RecallingStore(MeasurementStore, Protocol):
    """A store that holds more than its ``measurements()`` and gives a held record when a
    plan asks for it (``ReplayStore``): ``run_plan`` takes it as measured then."""

    def recall(self, key: str) -> dict[str, Any] | None:
        """``key``'s record, counted among the measurements from here on; None where the
        store holds none."""
        ...


#: The largest score a measurement may hold: any metric's (a perplexity of e^300 aside),
#: and small enough that a fit's sums of squares stay finite.
_LARGEST_SCORE = 1e150


def unusable_score(record: Mapping[str, Any]) -> str | None:
    """What makes a measurement's scores (and log-likelihoods) unusable by a fit: a value
    that is not a finite number (NaN, written as null, an infinity, a string, true), or
    one too large to fit; None where each is usable."""
    for field in ("scores", "logprob"):
        values = record.get(field) or {}
        if not isinstance(values, Mapping):
            return f"its {field} are not a mapping of tasks"
        for task, value in values.items():
            if field == "logprob" and value is None:
                continue  # no log-likelihood recorded for this task: the metric is used
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or abs(value) > _LARGEST_SCORE):
                what = "score" if field == "scores" else "log-likelihood"
                return f"the {what} of task {task!r} is {value!r}, not a finite number"
    if record.get("key") == "baseline":  # each fit reads the tasks' metric and direction here
        for field, kind in (("metrics", str), ("higher_is_better", bool)):
            given = record.get(field)
            if not isinstance(given, Mapping):
                return f"it has no {field} by task"
            for task in record.get("scores") or {}:
                if not isinstance(given.get(task), kind):
                    return f"its {field} has no {kind.__name__} for task {task!r}"
    return None


def is_measurement(record: Any) -> bool:
    """Whether ``record`` has a measurement's shape: a ``key`` and a ``mask`` that are
    text, ``scores`` by task."""
    return (isinstance(record, dict) and isinstance(record.get("key"), str)
            and isinstance(record.get("mask"), str) and isinstance(record.get("scores"), dict))


class MemoryStore:
    """A ``MeasurementStore`` in memory: a notebook's run, kept as long as the object."""

    path = "the in-memory store"

    def __init__(self, records: Sequence[Mapping[str, Any]] = ()) -> None:
        for number, record in enumerate(records, start=1):
            if not is_measurement(record):
                raise StoreError(f"records[{number - 1}] is not a measurement record (a "
                                 "'key' and a 'mask' that are text, 'scores' by task)")
            if (problem := unusable_score(record)) is not None:
                raise StoreError(f"records[{number - 1}] ({record['key']}): {problem}")
        self.records: list[dict[str, Any]] = [dict(r) for r in records]

    def measurements(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self.records]

    def append_measurement(self, record: Mapping[str, Any]) -> None:
        self.records.append(dict(record))


class ReplayStore:
    """A ``MeasurementStore`` over a run folder's measurements (``records``, by key) that
    gives each as ``run_plan`` asks for it (``recall``), as if measured then: its
    ``measurements()`` are those asked for so far, as a fresh run's store holds them, so
    a loop run on it decides what a fresh run decides, with no model (a finished run
    rerun with a smaller budget: ``commands.locate``). What it lacks is left to
    ``run_plan``'s measurement; what is appended (a twin's copy) is kept in ``new``."""

    def __init__(self, path: str | Path, records: Mapping[str, Mapping[str, Any]]) -> None:
        self.path = path
        self._held = {key: dict(record) for key, record in records.items()}
        self._given: dict[str, dict[str, Any]] = {}
        self.new: list[dict[str, Any]] = []

    def measurements(self) -> list[dict[str, Any]]:
        return [dict(r) for r in self._given.values()]

    def append_measurement(self, record: Mapping[str, Any]) -> None:
        self._given[record["key"]] = dict(record)
        self.new.append(dict(record))

    def recall(self, key: str) -> dict[str, Any] | None:
        """``key``'s record, given from here on; None where the folder has none."""
        if key in self._held:
            self._given.setdefault(key, dict(self._held[key]))
        return self._given.get(key)


#: What a record measured: its mask and scale (None: the measurement's own).
Knockout = tuple[str, float | None]


class SharingStore:
    """A ``MeasurementStore`` (``store``) among others measured by one measurement (the
    same model, examples and settings: a sweep's folder and its cells' folders, each a run
    folder of its own), which shares with them what each made: ``run_plan`` takes a
    knockout another store made rather than measuring it again (a measurement is
    deterministic), kept here as a copy whose ``same_as`` names where it was made,
    relative to this store's folder (``../m100-p0.01/mask-0003``, ``../baseline``), as a
    twin's names its first. Files computed from the measurement alone (a cell's
    prior.json) are shared likewise (``made_file``, ``wrote_file``). ``top``: the store
    whose folder the others' are under (the sweep's), None for that store itself; each
    store is opened once its folder is known to hold this run's (``start_run``): what it
    holds then is shared from there on."""

    def __init__(self, store: MeasurementStore, top: SharingStore | None = None) -> None:
        self.store = store
        self._top: str = str(store.path) if top is None else top._top
        # By knockout (or file), where it was first made, relative to the top folder, and
        # the record (file) as made there.
        self._made: dict[Knockout, tuple[str, dict[str, Any]]] = (
            {} if top is None else top._made)
        self._files: dict[tuple[str, Hashable], tuple[str, dict[str, Any]]] = (
            {} if top is None else top._files)
        self._folder = os.path.relpath(store.path, self._top)
        for record in store.measurements():
            self._share(record)

    @property
    def path(self) -> str | Path:
        return self.store.path

    def measurements(self) -> list[dict[str, Any]]:
        return self.store.measurements()

    def append_measurement(self, record: Mapping[str, Any]) -> None:
        self.store.append_measurement(record)
        self._share(record)

    def made_elsewhere(self, knockout: Knockout) -> dict[str, Any] | None:
        """The record another store made of ``knockout``, as this one keeps a copy of it
        (``same_as`` naming it); None where none has."""
        if knockout not in self._made:
            return None
        where, record = self._made[knockout]
        return {**record, "same_as": self._relative(where)}

    def made_file(self, name: str, made: Hashable) -> dict[str, Any] | None:
        """The JSON file ``name`` another store's folder holds of the computation ``made``
        (the prior's method and kinds), ``same_as`` naming it; None where none does."""
        if (name, made) not in self._files:
            return None
        where, data = self._files[(name, made)]
        return {**data, "same_as": self._relative(where)}

    def wrote_file(self, name: str, made: Hashable, data: Mapping[str, Any]) -> None:
        """This store's folder holds ``data`` as its file ``name``, of ``made``."""
        where = data.get("same_as", name)
        self._files.setdefault((name, made), (self._at_top(where), dict(data)))

    def _share(self, record: Mapping[str, Any]) -> None:
        # A copy is shared as the record it copies: same_as names where it was made.
        where = self._at_top(record.get("same_as", record["key"]))
        self._made.setdefault((record["mask"], record.get("scale")), (where, dict(record)))

    def _at_top(self, where: str) -> str:
        return os.path.normpath(os.path.join(self._folder, where))

    def _relative(self, where: str) -> str:
        return Path(os.path.relpath(where, self._folder)).as_posix()


def _scale_words(scale: float | None) -> str:
    return "the run's scale" if scale is None else f"scale {scale:g}"


#: A plan entry: (key, heads), or (key, heads, scale) for heads knocked out at ``scale``
#: rather than at the measurement's own (the run's --scale).
PlanEntry = tuple[str, list[Head]] | tuple[str, list[Head], float | None]


@contextlib.contextmanager
def phase_bar(desc: str, total: int | None, done: int = 0, progress: bool = True
              ) -> Iterator[Any]:
    """One progress bar for a phase that measures in several calls of ``run_plan`` (the
    confirmation's rounds, ``--masks auto``'s), as lm-eval draws one per request type:
    pass it as their ``bar``; each advances it by what it measures. ``done``: what the
    phase finds on disk (a resumed run). A phase that ends short of ``total`` (it
    stopped early) ends at 100 % of what it measured, drawn once (as the bar closes);
    ``total`` None: a phase that cannot know how many it will measure (the group tests)
    counts them, with no total."""
    from tqdm import tqdm

    # Without a total tqdm writes the count and the unit as one word ("33meas").
    bar = tqdm(total=total, initial=done if total is None else min(done, total), desc=desc,
               unit="meas" if total is not None else " meas", disable=not progress,
               dynamic_ncols=True)
    try:
        yield bar
        if bar.total is not None and bar.n < bar.total:
            bar.total = bar.n  # drawn by close(): a refresh here drew the line twice
    finally:
        bar.close()


@timed("measurements")
def run_plan(store: MeasurementStore, measure: Measurement | None, plan: Sequence[PlanEntry],
             desc: str, progress: bool = True, masks_per_pass: int | None = 1,
             bar: Any = None) -> dict[str, dict[str, Any]]:
    """Measure every (key, heads) not yet in ``store``; return all records by key
    (``measure`` None: nothing may be left to measure).

    Each record is appended (a run folder fsyncs it) before the next measurement (or,
    with ``masks_per_pass`` K > 1, the next pass of K masks) starts, so an interrupted run
    loses at most the work in flight. ``masks_per_pass=None``: the measurement's choice.
    An entry ``(key, heads, scale)`` is measured at that scale (verify's and cross's
    erase beside an enhance) and its record holds ``scale``; an entry without one, at the
    measurement's own scale, which the run's identity fixes. A record's last key,
    ``examples``, holds each score's per-example values (``TaskScore.examples`` as lists;
    only the tasks that have them, the key left out where none does). A stored record
    whose mask or scale differs from the plan's refuses the store (``StoreError``); a
    measurement whose score is no finite number is refused (``MetricError``) before it is
    kept, as a stored one is skipped (``unusable_score``). A store that can ``recall`` a
    measurement it holds (``ReplayStore``) gives it when the plan asks: it is not
    measured; nor is a knockout another store of a ``SharingStore``'s measurement made (a
    sweep's cell takes its sweep's and earlier cells' records, as copies). A run folder's
    config.json is not touched: a distributed measurement's workers go into the command's
    record with its next phase (``RunRecord.save``).
    ``bar``: the phase's (``phase_bar``), advanced by each knockout this call measures (not
    by the baseline, which a phase's plans carry for the records they return: the bar
    counts what its phase names, the masks or the components alone); None: a bar of this
    plan's own (``desc``, shown unless ``progress`` is False), counting every entry.
    """
    entries = [(key, heads, rest[0] if rest else None) for key, heads, *rest in plan]
    done = {r["key"]: r for r in store.measurements()}
    if isinstance(store, RecallingStore):  # what it holds counts as measured
        for key, _, _ in entries:
            if key not in done and (record := store.recall(key)) is not None:
                done[key] = record
    for key, heads, scale in entries:
        if key not in done:
            continue
        if done[key]["mask"] != format_heads(heads):
            raise StoreError(
                f"{store.path}: measurement {key!r} on disk knocked out "
                f"{done[key]['mask'] or 'nothing'}, this run plans "
                f"{format_heads(heads) or 'nothing'}; the folder was made with other arguments "
                "(use another --out or --force)")
        wanted = None if scale is None else float(scale)
        if done[key].get("scale") != wanted:
            raise StoreError(
                f"{store.path}: measurement {key!r} on disk was made at "
                f"{_scale_words(done[key].get('scale'))}, this run plans "
                f"{_scale_words(wanted)}; the folder was made with other arguments (use "
                "another --out or --force)")
    # A knockout planned twice (two tasks' top-k that are the same heads, a set two runs
    # found, a head alone that a mask of one knocked out) is measured once: a measurement
    # is deterministic, so the second key's record is the first's, said by "same_as".
    # The first may be any record on disk, not only this plan's.
    # So is one another store of the same measurement made (``SharingStore``): its
    # record is kept as a copy, "same_as" naming where it was made.
    first_of: dict[Knockout, str] = {}
    for key, record in done.items():
        first_of.setdefault((record["mask"], record.get("scale")), key)
    # waiting: (twin's key, its first's key or the record made elsewhere), in plan order
    todo: list[tuple[str, list[Head], float | None]] = []
    waiting: list[tuple[str, str | dict[str, Any]]] = []
    for key, heads, scale in entries:
        if key in done:
            continue
        knockout = _knockout_of(heads, scale)
        made = (store.made_elsewhere(knockout)
                if isinstance(store, SharingStore) and knockout not in first_of else None)
        first = first_of.setdefault(knockout, key)
        if made is not None:
            waiting.append((key, made))
        elif first == key:
            todo.append((key, heads, scale))
        else:
            waiting.append((key, first))
    position = {key: index for index, (key, _, _) in enumerate(entries)}

    def copy_twins(final: bool = False) -> None:
        # In plan order: each twin once every entry planned before it is on disk.
        if not waiting:  # the usual case, once a measurement: nothing to scan
            return
        horizon = min((position[key] for key, _, _ in todo if key not in done),
                      default=len(entries))
        while waiting and (final or position[waiting[0][0]] < horizon):
            key, first = waiting.pop(0)
            done[key] = _twin_record(store, key, done[first] if isinstance(first, str)
                                     else first)
            advance(key)

    if todo and measure is None:
        raise ValueError(f"run_plan: {len(todo)} measurements left and no measurement")
    if masks_per_pass is None:
        masks_per_pass = measure.auto_masks_per_pass() if todo else 1
    own = bar is None  # a bar of the plan's own counts the baseline too
    if own:
        phase = phase_bar(desc, len(entries), sum(key in done for key, _, _ in entries),
                          progress)
    else:
        phase = contextlib.nullcontext(bar)

    def advance(key: str) -> None:
        if own or key != "baseline":
            bar.update(1)

    with phase as bar:
        copy_twins()  # those planned before anything left to measure
        # One scale per call of measure_chunks: entries grouped by scale, in plan order.
        for scale in dict.fromkeys(entry[2] for entry in todo):
            group = [entry for entry in todo if entry[2] == scale]
            chunks = [group[start:start + masks_per_pass]
                      for start in range(0, len(group), masks_per_pass)]
            at = {} if scale is None else {"scale": float(scale)}
            numbers = _numbers_of(measure, scale)  # what a refusal below names
            # Chunks may complete in any order (--workers); each is written as it arrives.
            results = measure.measure_chunks([[h for _, h, _ in c] for c in chunks],
                                             masks_per_pass, **at)
            for index, all_scores, seconds in results:
                for (key, heads, _), scores in zip(chunks[index], all_scores, strict=True):
                    record = {
                        "key": key, "mask": format_heads(heads), "num_knocked_out": len(heads),
                        **at,
                        "scores": {name: _plain(s.value) for name, s in scores.items()},
                        "metrics": {name: s.metric for name, s in scores.items()},
                        "higher_is_better": {name: s.higher_is_better
                                             for name, s in scores.items()},
                        "seconds": round(seconds, 4),
                    }
                    logprob = {name: s.logprob for name, s in scores.items()
                               if s.logprob is not None}
                    if logprob:  # the gold answers' log-likelihood, measured along the way
                        record["logprob"] = logprob
                    # The per-example values each score is the mean of (strata, as
                    # TaskScore.examples): the paired noise of a change between two records.
                    examples = {name: [list(stratum) for stratum in s.examples]
                                for name, s in scores.items() if s.examples is not None}
                    if examples:
                        record["examples"] = examples
                    _check_usable(store, record, *numbers)
                    store.append_measurement(record)
                    done[key] = record
                    advance(key)
                    copy_twins()
        copy_twins(final=True)
    return {key: done[key] for key, _, _ in entries}


def _plain(value: Any) -> Any:
    """A numpy number (a notebook's measurement may return one) as Python's own, which
    the record's JSON and ``unusable_score`` take; anything else as it is."""
    if isinstance(value, (np.floating, np.integer)) and not isinstance(value, np.bool_):
        return value.item()
    return value


def _numbers_of(measure: Any, scale: float | None) -> tuple[float | None, str | None]:
    """The scale a plan entry's knockouts are made at (its own, else the model's) and the
    dtype the model computes in (``"float32"``), each None where ``measure`` does not
    say (a notebook's measurement without an ``HFHeadAblateLM``)."""
    lm = getattr(measure, "lm", None)
    if scale is None:
        scale = getattr(lm, "scale", None)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        scale = None
    # A torch.dtype, read by its name (``torch.float32``) without importing torch here;
    # HFLM's autocast (``mixed_precision_dtype``), where set, is what the layers run in.
    names = [str(dtype) for dtype in (getattr(lm, "mixed_precision_dtype", None),
                                      getattr(getattr(lm, "model", None), "dtype", None))]
    name = next((n.removeprefix("torch.") for n in names if n.startswith("torch.")), None)
    return (None if scale is None else float(scale)), name


def _check_usable(store: MeasurementStore, record: Mapping[str, Any],
                  scale: float | None = None, dtype: str | None = None) -> None:
    """Refuse a measurement just made whose score is no finite number (NaN, None, text):
    a fit cannot use it, and, unlike a stored one (skipped, then measured again), it
    would come back the same if measured again. Kept out of the store. ``scale``: what
    its knockout was made at (a scale other than 0 and 1 multiplies the knocked-out
    outputs, which may overflow, and is named first); ``dtype``: the model's (a model
    in float32 or float64 is not told to load in float32); each None where unknown."""
    problem = unusable_score(record)
    if problem is None:
        return
    causes = []
    if record["mask"] and scale is not None and scale not in (0.0, 1.0):
        causes.append(f"it was knocked out at --scale {scale:g}, which multiplies each "
                      "knocked-out output and can overflow the model's numbers to inf or "
                      "NaN: give a smaller --scale")
    causes.append("score that task by a metric that always gives one (--tasks TASK:METRIC) "
                  "or by --signal logprob")
    if dtype not in ("float32", "float64"):
        causes.append("for a NaN from the model itself, load it with dtype=float32 in "
                      f"--model-args{'' if dtype is None else f' (it computes in {dtype})'}")
    raise MetricError(
        f"{store.path}: measurement {record['key']!r} (knocked out "
        f"{record['mask'] or 'nothing'}): {problem}; a fit needs a number from every "
        f"measurement: {', or '.join(causes)}")


def _knockout_of(heads: Sequence[Head], scale: float | None) -> Knockout:
    """What a plan entry measures: its mask and scale (None: the measurement's own)."""
    return format_heads(heads), None if scale is None else float(scale)


def _twin_record(store: MeasurementStore, key: str, measured: Mapping[str, Any]
                 ) -> dict[str, Any]:
    """``key``'s record, copied from ``measured``, the same knockout's, and appended."""
    record = {**measured, "key": key, "same_as": measured.get("same_as", measured["key"])}
    store.append_measurement(record)
    return record
