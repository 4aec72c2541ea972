"""A run as a value: the record config.json is written from, and the one reader of it.

A measuring command (locate, greedy, sweep, verify) builds its run's record in memory as
it goes, and writes config.json from it once per phase of the run, whole and atomically
(``RunRecord.save``): never a read-modify-write of the file, never a value read back from
disk to decide or report something. A locate run's record (``LocateRun``) also holds
what has a file of its own — the design, the attribution prior, the measurements, the
rankings — so its report and ranking files are rendered from the same value.

``load_run`` is the one reader of a run folder's config.json (refit, verify, universal,
the command line's printing). config.json carries a ``schema`` version (``CONFIG_SCHEMA``);
a file without one was written before the field existed, and is read as the same layout
with the defaults older folders need (``LocateRun``'s properties say which).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.files import read_json
from lm_eval_headloc.intervention.arg_string import ModelArgs
from lm_eval_headloc.intervention.components import Head, Neuron
from lm_eval_headloc.intervention.model_args import model_identity, same_model
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.measurement.metrics import parse_task_metric
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.confirm import ConfirmRecord
from lm_eval_headloc.method.pilot import UNFITTED
from lm_eval_headloc.method.rank import mask_keys
from lm_eval_headloc.method.ranking import Ranking, ranking_from_json
from lm_eval_headloc.runs.folder import CONFIG_SCHEMA, RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.spec import RunSpec

if TYPE_CHECKING:
    from typing import Self

    from lm_eval_headloc.intervention.geometry import Geometry
    from lm_eval_headloc.measurement.measure import Measurement
    from lm_eval_headloc.runs.setup import Setup

__all__ = ["CONFIG_SCHEMA", "RANKING_COMMANDS", "GreedyRun", "LocateRun", "RunRecord",
           "check_model_files", "column_prior", "load_run", "measured_on", "model_facts",
           "ranking_files", "read_ranking_file", "read_rankings", "start_run", "stored_prior",
           "stored_priors"]


log = logging.getLogger("lm_eval_headloc")


def measured_on(setup: Setup, measure: Measurement) -> dict[str, Any]:
    """What config.json records of a measurement once the model is loaded: the example
    subset and the examples used per task, which tasks it asks through the chat template
    (decided from the tokenizer when --apply-chat-template is left out), the model
    (``model_facts``), and the ablation (``None`` for a measurement that sets none)."""
    from lm_eval_headloc.measurement.measure import measurement_fingerprint

    return {"example_subset": measure.subset, "examples_used": dict(measure.examples_used),
            "chat_template": dict(sorted(measure.chat_template.items())),
            "requests_fingerprint": measurement_fingerprint(measure),
            **model_facts(setup.geometry, setup.model_fingerprint),
            "ablation": getattr(measure, "ablation_config", None)}


def model_facts(geometry: Geometry, fingerprint: str | None) -> dict[str, Any]:
    """What config.json records of the run's model, from its config, so that the commands
    reading a finished run (refit, export, read_rankings) need no model files: its
    geometry (a hybrid's layers with heads only where not every layer has them; the MLP's
    width, the residual stream's and the block layout where the config tells) and what
    identifies a model loaded from a local folder (``engine.model_fingerprint``), so a
    folder moved with its model can be pointed at the model's new place."""
    return {"layers": geometry.num_layers, "heads_per_layer": geometry.heads_per_layer,
            **({} if geometry.head_layers is None else
               {"head_layers": list(geometry.head_layers)}),
            "neurons_per_layer": geometry.neurons_per_layer, "d_model": geometry.d_model,
            "parallel_attn_mlp": geometry.parallel_attn_mlp,
            "model_fingerprint": fingerprint}


@dataclass
class RunRecord:
    """What every measuring command's config.json records.

    Fields left None were not recorded (or not yet: the phase that sets them has not
    run) and are left out of the file, unless the run recorded them as null (``_nulls``:
    a phase that decided "none"); keys this version does not know are kept as read
    (``other``). So a folder read and written back keeps its keys.
    """

    command: str
    identity: dict[str, Any]  # what resume compares; on resume, the stored one
    settings: dict[str, Any]  # the fields the command may change on resume (refit's)
    spec: RunSpec
    versions: dict[str, str] | None = None  # package versions when the folder was made
    created: str | None = None
    # The measurement, once the model is loaded (``measured_with``).
    example_subset: dict[str, list[int]] | None = None
    examples_used: dict[str, int] | None = None
    chat_template: dict[str, bool] | None = None  # leaf task -> asked through it
    # A digest of every request the measurements ask (``measurement_fingerprint``): a
    # resumed run whose tasks' documents or prompts changed is refused (``measured_with``).
    requests_fingerprint: str | None = None
    layers: int | None = None
    heads_per_layer: int | None = None
    head_layers: list[int] | None = None  # a hybrid model's layers with heads (else all)
    # The MLP's width (a run locating neurons: as the loaded model has it), the residual
    # stream's, the block layout and the model files' fingerprint (``model_facts``; None:
    # a folder from before they were recorded, or a config that does not tell).
    neurons_per_layer: int | None = None
    d_model: int | None = None
    parallel_attn_mlp: bool | None = None
    model_fingerprint: str | None = None
    ablation: dict[str, Any] | None = None
    # Each session's phase timings (``timing.PhaseClock.snapshot``; a resumed run adds one).
    timings: list[dict[str, Any]] | None = None
    workers: list[dict[str, Any]] | None = None  # --workers: each worker's share
    # The masks per pass (per generate call) the measurement chose where --masks-per-pass
    # was left automatic (``auto_masks_per_pass``); None: asked for, or not chosen here.
    masks_per_pass: int | None = None
    other: dict[str, Any] = field(default_factory=dict)
    # The config last written or read: a phase that changed nothing writes nothing.
    _written: dict[str, Any] | None = field(default=None, init=False, repr=False,
                                            compare=False)
    # The keys whose None is written as null rather than left out.
    _nulls: set[str] = field(default_factory=set, init=False, repr=False, compare=False)
    # A run going on in this process (``started``): its saves record this session's
    # timings after the earlier sessions'.
    _earlier_timings: list[dict[str, Any]] | None = field(default=None, init=False,
                                                           repr=False, compare=False)

    #: The keys of config.json this class owns, in the order they are written.
    KEYS: ClassVar[tuple[str, ...]] = (
        "command", "identity", "settings", "spec", "versions", "created", "example_subset",
        "examples_used", "chat_template", "requests_fingerprint", "layers",
        "heads_per_layer", "head_layers",
        "neurons_per_layer", "d_model", "parallel_attn_mlp", "model_fingerprint",
        "ablation", "timings", "workers", "masks_per_pass")

    # --- reading -------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Self:
        """The record of a config.json (any schema up to ``CONFIG_SCHEMA``). The spec of a
        folder made before config.json held it whole is its identity and settings, with
        what options added since then did before they existed (``RunSpec.from_config``)."""
        values = {key: config[key] for key in cls.KEYS
                  if key in config and key not in ("spec", "settings")}
        other = {key: value for key, value in config.items()
                 if key not in cls.KEYS and key != "schema"}
        record = cls(**values, settings=dict(config.get("settings", {})),
                     spec=RunSpec.from_config(config), other=other)
        record._written = dict(config)
        record._nulls = {key for key, value in values.items() if value is None}
        return record

    @classmethod
    def started(cls, config: Mapping[str, Any], spec: RunSpec) -> Self:
        """The record of a run that starts (or resumes) in a folder whose config.json
        ``RunFolder.start`` has just written: its command, identity, versions and
        creation time as written there (a resumed run keeps the stored ones), this run's
        spec, and nothing the run measures or decides — a resumed run decides again, so
        a value from an earlier session with other settings is never carried over."""
        stored = cls.from_config(config)
        record = cls(command=stored.command, identity=stored.identity,
                     settings=stored.settings, spec=spec, versions=stored.versions,
                     created=stored.created, other=stored.other)
        record._written = stored._written
        record._earlier_timings = list(stored.timings or [])
        return record

    @property
    def has_geometry(self) -> bool:
        """Whether the measuring phase has recorded the model's layers and heads per layer
        (a run killed before its model loaded has not)."""
        return isinstance(self.layers, int) and isinstance(self.heads_per_layer, int)

    @property
    def grid(self) -> tuple[int, int]:
        """(layers, heads per layer): the model's geometry as recorded (ValueError for a run
        that has not recorded it: ``has_geometry``)."""
        if not self.has_geometry:
            raise ValueError("the run records no model geometry (its model never loaded)")
        return int(self.layers), int(self.heads_per_layer)  # type: ignore[arg-type]

    @property
    def tasks(self) -> list[str]:
        """The run's task names (its ``--tasks`` without metrics): what its files are
        keyed by (a greedy run's ranking files too)."""
        return [parse_task_metric(task)[0] for task in self.spec.tasks]

    # --- phases --------------------------------------------------------------------

    def measured_with(self, setup: Setup, measure: Measurement,
                      where: str | Path | None = None) -> None:
        """Take what the measurement was made on (``measured_on``), refusing (a
        RunFolderError naming ``where``, the run folder) a resumed run's whose requests or
        mean/resample reference set are not the ones its stored measurements were made on:
        they would be mixed with the new ones, silently."""
        values = measured_on(setup, measure)
        stored = self._written or {}
        run = where if where is not None else "the run"
        if None not in (stored.get("requests_fingerprint"), values["requests_fingerprint"]) \
                and stored["requests_fingerprint"] != values["requests_fingerprint"]:
            raise RunFolderError(
                f"{run}: its tasks ask other requests than those its measurements were made "
                "on (a task's documents, prompt template or few-shot examples changed "
                "since); --force starts it over, or give another --out")
        before = (stored.get("ablation") or {}).get("reference_digest")
        now = (values["ablation"] or {}).get("reference_digest")
        if None not in (before, now) and before != now:
            raise RunFolderError(
                f"{run}: the ablation's reference examples are not those its measurements "
                "were made with (the --ablation-data file or task changed since); --force "
                "starts it over, or give another --out")
        self._set(**values)

    def _set(self, **values: Any) -> None:
        """Record ``values``; a None among them is recorded as null."""
        for key, value in values.items():
            setattr(self, key, value)
            if value is None:
                self._nulls.add(key)
            else:
                self._nulls.discard(key)

    def to_config(self) -> dict[str, Any]:
        """config.json's content: the schema version, then every recorded key, then the
        keys this version does not know."""
        config: dict[str, Any] = {"schema": CONFIG_SCHEMA}
        for key in self.KEYS:
            value = self.spec.as_config() if key == "spec" else getattr(self, key)
            if hasattr(value, "to_json"):  # a typed part of the record (``confirm``)
                value = value.to_json()
            if value is not None or key in self._nulls:
                config[key] = value
        return {**config, **{k: v for k, v in self.other.items() if k not in config}}

    def save_timings(self, folder: RunFolder, **fields: Any) -> None:
        """Only this session's timings so far (and ``fields``) into config.json, the rest
        as on disk: a session interrupted (Ctrl-C, every worker dead) between its phases'
        saves keeps the time it spent, while what it had half-decided stays unwritten."""
        clock = timing.current()
        if self._earlier_timings is not None and clock is not None:
            fields["timings"] = [*self._earlier_timings, clock.snapshot()]
        if not fields or not folder.exists():
            return
        config = folder.read_config()
        config.update(fields)
        folder.write_config(config)

    def save(self, folder: RunFolder, measure: Measurement | None = None) -> bool:
        """Write config.json from this record: one phase's one write. With a distributed
        ``measure`` (``--workers``) its workers' shares so far are recorded too, and for a
        run going on in this process (``started``) its timings so far. A record equal to
        what was last written or read is not written again; returns whether it was
        written."""
        workers = None if measure is None else measure.workers_config()
        if workers is not None:  # measured on workers: where, and their shares
            self.workers = workers
        chosen = getattr(measure, "chosen_masks_per_pass", None)
        if chosen is not None and self.spec.masks_per_pass is None:
            self.masks_per_pass = chosen
        clock = timing.current()
        if self._earlier_timings is not None and clock is not None:
            self.timings = [*self._earlier_timings, clock.snapshot()]
        config = self.to_config()
        as_read = json.loads(json.dumps(config))  # as it reads back (tuples as lists)
        if as_read == self._written:
            return False
        folder.write_config(config)
        self._written = as_read
        return True


@dataclass
class LocateRun(RunRecord):
    """A locate run: its record, and what it measured and fitted.

    Phases and what each adds to config.json: *started* (``RunFolder.start``: command,
    identity, settings, spec, versions, created); *measuring* (the model loaded: example
    subset, examples used, geometry, ablation); *designed* (everything fixed before the
    masks are measured: ``pilot`` with --sparsity auto, ``row_keys``, ``prior_used`` and
    ``prior_method``); *measured* (``masks_used``, and ``confirm`` with --confirm). The
    rankings follow from those and the files on disk; they are written as heads and
    report files, not into config.json. (A resumed run's start keeps the stored config
    with the new settings; its next phases write what this session decided.)
    """

    candidates: list[str] | None = None  # the neurons the design has columns for
    never_neurons: list[str] | None = None  # --never-ablate's neurons: in no group either
    pilot: dict[str, Any] | None = None  # --sparsity auto: the pilot's choice
    row_keys: list[str] | None = None  # the measurement of each design row
    prior_used: bool | None = None
    prior_method: str | None = None  # a PRIOR_POINTS key, or None without a prior
    prior_skipped: str | None = None  # why --prior auto computed none
    masks_used: int | None = None  # measurements of masks (the pilot's included)
    confirm: ConfirmRecord | None = None  # --confirm: the heads measured alone, the groups
    # Held here, written to files of their own: design_matrix.npy, prior.json,
    # measurements.jsonl, heads*.json / report.md.
    design: np.ndarray | None = field(default=None, repr=False, compare=False)
    priors: dict[str, np.ndarray] | None = field(default=None, repr=False, compare=False)
    records: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False,
                                               compare=False)
    # load_run's of a ranked run: its ranking files, read on first use (``_StoredRankings``).
    rankings: Mapping[str, Ranking] = field(default_factory=dict, repr=False, compare=False)

    KEYS: ClassVar[tuple[str, ...]] = (
        *RunRecord.KEYS[:-1], "candidates", "never_neurons", "pilot", "row_keys",
        "prior_used", "prior_method", "prior_skipped", "masks_used", "confirm",
        RunRecord.KEYS[-1])

    def __post_init__(self) -> None:
        self.confirm = ConfirmRecord.of(self.confirm)  # config.json's dict, typed

    def set_prior(self, priors: dict[str, np.ndarray] | None, method: str | None,
                  skipped: str | None = None) -> None:
        """The designed phase's prior: the estimates (None: no prior) and the method (a
        ``PRIOR_POINTS`` key); recorded as a pair, a run without one recording null, and
        ``skipped``: why ``--prior auto`` computed none."""
        self.priors = priors
        self._set(prior_used=priors is not None, prior_method=method)
        self.prior_skipped = skipped  # recorded only when there is a reason
        if skipped is not None:
            self._set(prior_skipped=skipped)

    # --- what older folders leave out ------------------------------------------------

    @property
    def columns(self) -> Columns:
        """The component of each design column: every head (a heads run, and every run
        from before neurons), then the neuron candidates when the run locates neurons,
        then the groups of the other neurons (``--neuron-groups``)."""
        layers, heads_per_layer = self.grid
        return Columns.of(self.spec.components, layers, heads_per_layer,
                          self.candidates or (), self.spec.neuron_groups,
                          self.neurons_per_layer, self.never_neurons or (), self.head_layers)

    @property
    def uses_prior(self) -> bool:
        """Whether the fit is eased by prior.json (not recorded by the earliest folders:
        then whether the spec asks for a prior)."""
        return self.spec.prior in PRIOR_POINTS if self.prior_used is None \
            else bool(self.prior_used)

    @property
    def prior_kind(self) -> str | None:
        """The attribution prior computed (a ``PRIOR_POINTS`` key), or None. Folders from
        before path points computed plain AtP and did not record its name."""
        return (self.prior_method or "atp") if self.uses_prior else None

    @property
    def unfitted(self) -> int:
        """Measurements of masks that are not design rows: --sparsity auto's pilot
        measures a floor mask that only chooses the sparsity."""
        return UNFITTED if self.pilot is not None else 0

    @property
    def masks_measured(self) -> int:
        """The masks the run measured (--masks auto: before it stopped); folders that did
        not record it measured their whole design."""
        if self.masks_used is not None:
            return self.masks_used
        if self.design is None:
            raise ValueError("masks_measured needs the design (read_data)")
        return len(self.design)

    def keys(self, rows: int | None = None) -> list[str]:
        """The measurement keys of the first ``rows`` design rows (default: all)."""
        if self.row_keys is not None:
            keys = list(self.row_keys)
        elif self.design is not None:
            keys = mask_keys(len(self.design))
        else:
            raise ValueError("keys() needs the design (read_data) or recorded row_keys")
        return keys if rows is None else keys[:rows]

    # --- the files ---------------------------------------------------------------------

    def read_data(self, folder: RunFolder) -> None:
        """Read what the run's config.json points to: the design, the measurements and
        (when the fit uses one) the attribution prior."""
        path = folder.file("design_matrix.npy")
        if not path.is_file():
            raise RunFolderError(f"{folder.path} is incomplete (no {path.name}: its design "
                                 "was never made); rerun the locate command to finish it")
        self.design = np.load(path)
        self.records = _measurements_by_key(folder)
        self._check_design_against_records(folder)
        self.priors = column_prior(stored_priors(folder), self.columns, self.heads_per_layer,
                                   self.neurons_per_layer) if self.uses_prior else None


    def _check_design_against_records(self, folder: RunFolder) -> None:
        """The records are the truth: each design row a measurement stands for knocks out
        what that measurement did (its ``mask``), else the matrix was altered."""
        design = self.design
        if design is None or design.ndim != 2:
            return
        if self.row_keys is not None:
            keys = list(self.row_keys)
            if len(set(keys)) != len(keys) or len(keys) < min(len(design),
                                                            self.masks_used or 0):
                raise RunFolderError(f"{folder.file('config.json')}: its row_keys name "
                                     f"{len(set(keys))} distinct measurements for "
                                     f"{self.masks_used or len(design)} masks; each design "
                                     "row has a measurement of its own")
        columns = self.columns
        for index, (row, key) in enumerate(zip(design, self.keys(), strict=False)):
            record = self.records.get(key)
            if record is None:
                continue
            knocked = {str(m) for i in np.flatnonzero(row) for m in columns.members(int(i))}
            if knocked != {name for name in record["mask"].split("+") if name}:
                raise RunFolderError(
                    f"{folder.file('design_matrix.npy')}: row {index} knocks out "
                    f"{len(knocked)} components, not those its measurement {key} knocked "
                    "out; the matrix was altered (the measurements are the record)")


def _measurements_by_key(folder: RunFolder) -> dict[str, dict[str, Any]]:
    """``folder``'s measurements by key; a key measured twice with different scores is
    refused (which one the fit would take could not be told)."""
    records: dict[str, dict[str, Any]] = {}
    direction: dict[str, Any] = {}  # each task's higher_is_better, as first recorded
    for record in folder.measurements():
        key = record["key"]
        for task, higher in (record.get("higher_is_better") or {}).items():
            if direction.setdefault(task, higher) != higher:
                raise RunFolderError(f"{folder.file('measurements.jsonl')}: {key} says "
                                     f"higher_is_better={higher!r} for {task!r}, the "
                                     f"measurements before it {direction[task]!r}; a "
                                     "task's direction is the same in every measurement")
        if key in records and records[key].get("scores") != record.get("scores"):
            raise RunFolderError(f"{folder.file('measurements.jsonl')} holds {key} twice "
                                 f"with different scores ({records[key]['scores']} and "
                                 f"{record['scores']}); remove the one that is wrong")
        records.setdefault(key, record)
    return records


#: prior.json's key of each kind's estimates at a path point.
PRIOR_KEYS = {"heads": "effects", "neurons": "neuron_effects"}


def stored_priors(folder: RunFolder) -> dict[str, dict[str, np.ndarray]]:
    """prior.json's per-task attribution estimates by kind: ``"heads"`` ``(points,
    heads)`` in flat head order, ``"neurons"`` ``(points, layers x neurons)`` in flat
    neuron order, each where the run computed it (a file from before path points holds
    the clean run's heads alone)."""
    path = folder.file("prior.json")
    if not path.is_file():
        raise RunFolderError(f"{folder.path} is incomplete (no prior.json, which its fit "
                             "uses); rerun the locate command to finish it")
    data = read_json(path, RunFolderError)
    priors: dict[str, dict[str, np.ndarray]] = {}
    for task, entry in data["tasks"].items():
        points = entry["points"] if "points" in entry else [entry]
        priors[task] = {kind: np.atleast_2d(np.asarray([p[key] for p in points],
                                                       dtype=np.float64))
                        for kind, key in PRIOR_KEYS.items() if key in points[0]}
    return priors


def stored_prior(folder: RunFolder) -> dict[str, np.ndarray]:
    """prior.json's per-task estimates of the heads, ``(points, heads)``."""
    return {task: kinds["heads"] for task, kinds in stored_priors(folder).items()}


def column_prior(priors: Mapping[str, Mapping[str, np.ndarray]], columns: Columns,
                 heads_per_layer: int, neurons_per_layer: int | None
                 ) -> dict[str, np.ndarray]:
    """Each task's estimates over a run's design columns, ``(points, columns)``: a head's
    from the heads' estimates, a neuron's from the neurons'. A neuron group has none of its
    own (+inf: the prior ranks it after everything and leaves its penalty as it is): its
    neurons are the ones the prior passed over, so the masks alone speak for it."""
    neuron = np.array([isinstance(c, Neuron) for c in columns], dtype=bool)
    head = np.array([isinstance(c, Head) for c in columns], dtype=bool)
    flat = np.array([c.layer * ((neurons_per_layer or 0) if isinstance(c, Neuron)
                                else heads_per_layer) + c[1] for c in columns], dtype=np.int64)
    out = {}
    for task, by_kind in priors.items():
        points = next(iter(by_kind.values())).shape[0]
        values = np.full((points, len(columns)), np.inf, dtype=np.float64)
        for kind, where in (("heads", head), ("neurons", neuron)):
            if where.any():
                values[:, where] = by_kind[kind][:, flat[where]]
        out[task] = values
    return out


@dataclass
class GreedyRun(RunRecord):
    """A greedy run: its record, and (``load_run``'s of a ranked run) its rankings, as a
    locate run's: greedy writes heads-<task>.json too."""

    rankings: Mapping[str, Ranking] = field(default_factory=dict, repr=False, compare=False)


_RECORDS: dict[str, type[RunRecord]] = {"locate": LocateRun, "greedy": GreedyRun}


def load_run(folder: RunFolder | str | Path) -> RunRecord:
    """The record of the run in ``folder`` (a ``LocateRun`` for a locate run, a
    ``GreedyRun`` for a greedy one) from its config.json, once the folder is checked
    (``RunFolder.read_checked``: names, geometry, the other files agreeing with it; a
    config.json from a newer version is refused). The files it points to are read on
    demand (``LocateRun.read_data``); a locate or greedy run's ``rankings``, those
    ``read_rankings`` reads, on first use."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    config = folder.read_checked()
    record = _RECORDS.get(config["command"], RunRecord).from_config(config)
    if isinstance(record, (LocateRun, GreedyRun)) and any(
            folder.ranking_file(task).is_file() for task in record.tasks):
        record.rankings = _StoredRankings(folder, record)  # was {}: "ranked nothing"
    return record


class _StoredRankings(Mapping[str, Ranking]):
    """A loaded run's rankings (``LocateRun.rankings``, ``GreedyRun.rankings``), read
    from its ranking files as ``read_rankings`` reads them, on first use: a command that
    reads only the record never reads them (refit rewrites a ranking file altered by
    hand)."""

    def __init__(self, folder: RunFolder, record: RunRecord) -> None:
        self._folder, self._record = folder, record
        self._read: dict[str, Ranking] | None = None

    def _rankings(self) -> dict[str, Ranking]:
        if self._read is None:
            self._read = _read_rankings(self._folder, self._record)
        return self._read

    def __getitem__(self, task: str) -> Ranking:
        return self._rankings()[task]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rankings())

    def __len__(self) -> int:
        return len(self._rankings())

    def __repr__(self) -> str:
        return repr(self._rankings())


#: The commands whose runs rank components (``heads-<task>.json``).
RANKING_COMMANDS = ("locate", "greedy")


def ranking_files(folder: RunFolder, record: RunRecord | None = None) -> list[Path]:
    """The per-task ranking files (``heads-<task>.json``) of the locate or greedy run in
    ``folder``; a one-line ``RunFolderError`` for another command's run or one that has
    ranked nothing yet."""
    record = load_run(folder) if record is None else record
    if record.command not in RANKING_COMMANDS:
        hint = (" (a sweep: give one of its cell folders, m<M>-p<P>/)"
                if record.command == "sweep" else "")
        raise RunFolderError(f"{folder.path} is a {record.command} run{hint}; give a "
                             "locate or greedy run, which ranks heads")
    # The run's own tasks' files only: another heads-x.json put here is no ranking of it.
    files = [path for task in record.tasks if (path := folder.ranking_file(task)).is_file()]
    if not files:
        raise RunFolderError(f"{folder.path} has no heads-<task>.json; finish the run first")
    return files


def _check_ranking_data(data: Any) -> None:
    """What a ranking's reader takes on trust, checked (ValueError): a non-empty ``heads``
    list of entries each naming its component, once (a name twice counts twice in an
    overlap), with a finite number (or null) as its effect and its ``baseline``;
    ``higher_is_better`` true or false
    (without it no effect's sign can be read); a ``largest_single_help`` with a finite
    number as its change; a ``tied_with_above`` that is a list of names; the order its
    writer gives the entries (``_check_order``: a list reversed or a ``top_k`` that is not
    its head, verify knocked out as the run's top-k)."""
    def number(value: Any) -> bool:  # the package writes an unknown one as null
        return value is None or (isinstance(value, (int, float))
                                 and not isinstance(value, bool) and math.isfinite(value))

    heads = data.get("heads") if isinstance(data, dict) else None
    if not isinstance(heads, list) or not heads:
        raise ValueError("its 'heads' is not a non-empty list")
    first: dict[str, int] = {}
    for place, entry in enumerate(heads, start=1):
        name = (entry.get("head") or entry.get("neuron") or entry.get("group")
                if isinstance(entry, dict) else None)
        if not (isinstance(name, str) and number(entry.get("effect"))):
            raise ValueError(f"its entry {place} of 'heads' names no component with a "
                             "number as its effect")
        if name in first:
            raise ValueError(f"its 'heads' names {name} twice (entries {first[name]} and "
                             f"{place})")
        first[name] = place
    if not number(data.get("baseline")):
        raise ValueError(f"its 'baseline' is {data.get('baseline')!r}, not a finite number")
    higher = data.get("higher_is_better")
    if not isinstance(higher, bool):
        raise ValueError(f"its 'higher_is_better' is {higher!r}, not true or false")
    help_ = data.get("largest_single_help")
    change = help_.get("change") if isinstance(help_, dict) else None
    if help_ is not None and not (number(change) and change is not None
                                  and math.isfinite(change)):
        raise ValueError("its 'largest_single_help' has no number as its change")
    tied = data.get("tied_with_above")
    if tied is not None and not (isinstance(tied, list)
                                 and all(isinstance(name, str) for name in tied)):
        raise ValueError("its 'tied_with_above' is not a list of names")
    _check_order(data, list(first))


#: The ``method``s (their starts) whose ranking files order their entries by harm
#: (``_check_order``): locate's and refit's, and greedy's.
_BY_HARM = ("compressed sensing", "one-shot greedy", "iterative greedy")


def _check_order(data: Mapping[str, Any], names: list[str]) -> None:
    """The order ``ranked_heads_json`` writes, checked where it is sound to (ValueError):
    each entry's ``rank`` is its place; ``top_k`` is the first names of ``heads``; and
    where ``method`` says the order is by harm, no entry harms the task more than one
    ranked above it that has the same kind of evidence. Not the whole list: locate ranks
    the components measured alone that hurt, then the estimates that hurt, then those
    measured to do no harm, then the other estimates (``rank.confirmed_order``), so its
    measured (``measured_alone``) and its estimated entries are each in harm order but
    not together; iterative greedy ranks its winners first, by the round they won, not by
    harm (``greedy._rankings``). Equal harms (ties) pass; an entry without an effect is
    compared with none; a file that names no method (or one this version does not know)
    has no order to check."""
    for place, entry in enumerate(data["heads"], start=1):
        rank = entry.get("rank", place)
        if type(rank) is not int or rank != place:
            raise ValueError(f"its entry {place} of 'heads' ({names[place - 1]}) says rank "
                             f"{rank!r}")
    top = data.get("top_k")
    if top is not None and not (isinstance(top, list) and top and names[:len(top)] == top):
        first = names[:len(top)] if isinstance(top, list) and top else names[:1]
        raise ValueError(f"its 'top_k' {top!r} is not the first {len(first)} of its "
                         f"'heads' ({', '.join(first)})")
    method = data.get("method")
    if not (isinstance(method, str) and method.startswith(_BY_HARM)):
        return
    winners = data.get("winners") if method == "iterative greedy" else None
    skip = {w for w in winners if isinstance(w, str)} if isinstance(winners, list) else set()
    sign = -1.0 if data["higher_is_better"] else 1.0  # harm: positive = worse
    above: dict[bool, tuple[str, float]] = {}  # per kind of evidence, the last entry seen
    for name, entry in zip(names, data["heads"], strict=True):
        effect = entry.get("effect")
        if name in skip or effect is None:
            continue
        kind = method.startswith("compressed") and entry.get("measured_alone") is True
        if kind in above and sign * effect > sign * above[kind][1]:
            worse = "lower" if data["higher_is_better"] else "higher"
            raise ValueError(
                f"its 'heads' is not in ranked order: {name} (effect {effect:g}) is ranked "
                f"below {above[kind][0]} (effect {above[kind][1]:g}), though it harms the "
                f"task more ({worse} is worse: higher_is_better is "
                f"{str(data['higher_is_better']).lower()})")
        above[kind] = (name, effect)


def _not_a_ranking(path: Path, err: Exception) -> RunFolderError:
    """A ranking file altered by hand (a field renamed, a number that is text): where its
    reader stopped, in one line, not its traceback."""
    return RunFolderError(f"{path} is not a ranking file as headloc-harness writes one "
                          f"({type(err).__name__}: {str(err).splitlines()[0]}); refit the "
                          "run to write it again")


def read_ranking_file(path: Path) -> dict[str, Any]:
    """A ranking file's (heads-<task>.json's) content, checked (``_check_ranking_data``):
    what every reader of a ranking reads it through (``read_rankings``, ``overlap``,
    ``universal``), so a tampered file is one ``RunFolderError`` naming it and the field,
    never a traceback or a number computed from it."""
    data = read_json(path, RunFolderError)
    try:
        _check_ranking_data(data)
    except ValueError as err:
        raise _not_a_ranking(path, err) from None
    return data


def read_rankings(folder: RunFolder | str | Path) -> dict[str, Ranking]:
    """The rankings a finished locate or greedy run wrote (heads-<task>.json), by task,
    as ``Ranking``s: for a notebook, read only (``refit`` fits again and rewrites)."""
    folder = folder if isinstance(folder, RunFolder) else RunFolder(folder)
    return _read_rankings(folder, load_run(folder))


def _read_rankings(folder: RunFolder, record: RunRecord) -> dict[str, Ranking]:
    """``read_rankings`` of the run in ``folder`` whose record is ``record``."""
    from lm_eval_headloc.runs.types_file import read_types

    files = ranking_files(folder, record)
    if not record.has_geometry:
        raise RunFolderError(f"{folder.path} records no model geometry; finish the run first")
    columns = record.columns if isinstance(record, LocateRun) else Columns.heads(
        *record.grid, record.head_layers)
    head_types = read_types(folder)
    rankings = {}
    for path in files:
        data = read_ranking_file(path)
        try:
            rankings[data["task"]] = ranking_from_json(data, columns, head_types)
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as err:
            raise _not_a_ranking(path, err) from None
    return rankings


def start_run(folder: RunFolder, command: str, spec: RunSpec, *, force: bool = False,
              identity: Mapping[str, Any] | None = None,
              protect: Sequence[str | Path] = (), fingerprint: str | None = None
              ) -> RunRecord:
    """Start (or resume) ``command``'s run in ``folder`` — its first phase, one write of
    config.json (``RunFolder.start``: the folder's identity checked, its lock taken) —
    and return the run's record. ``identity``: the command's, when it is more than the
    spec's (verify's, sweep's). ``fingerprint``: the model's (``engine.model_fingerprint``):
    a run whose model was loaded from a local folder resumes with the model moved
    elsewhere, named by ``--model-args`` there, when its files are the ones the run
    recorded; the run then names the new place."""
    from lm_eval_headloc.runs.setup import same_components  # the model's libraries: here

    identity = spec.identity(command) if identity is None else identity
    recorded = _stored_config(folder)
    stored, stored_args = _stored_model(recorded)
    moved = fingerprint is not None and stored == fingerprint
    if not force and same_model(stored_args, identity.get("model_args")):
        # Its model's place, other files: another model (other args are another run).
        check_model_files(stored, fingerprint, folder.path, model_args=spec.model_args)
    folder.start(command, identity, spec.settings(command), spec.as_config(), force=force,
                 protect=protect, assumed=RunSpec.assumed_for_old_runs(),
                 same={"model_args": _same_files if moved else same_model,
                       "exclude": same_components, "never_ablate": same_components,
                       "apply_chat_template": _same_chat(recorded)})
    record = _RECORDS.get(command, RunRecord).started(folder.read_config(), spec)
    folder.on_interrupt(lambda: record.save_timings(folder))  # Ctrl-C keeps the time spent
    given = json.loads(json.dumps(identity)).get("model_args")
    if moved and record.identity.get("model_args") != given:
        log.info("%s: its model's files are at %s now (the same files as recorded); the run "
                 "names that place from here on", folder.path, given)
        record.identity = {**record.identity, "model_args": given}
        record.save(folder)
    return record


def check_model_files(recorded: str | None, fingerprint: str | None, run: str | Path,
                      remedy: str = "use another --out or --force for a new run of this "
                                    "model", model_args: str | None = None) -> None:
    """Refuse a model whose files are not the ones run ``run`` recorded (``recorded``,
    its ``model_fingerprint``): another model left at the run's path (a folder rewritten
    since) would be measured as the run's; and a run made of a local folder's files whose
    ``model_args`` name no folder now (a relative path read from another working
    directory, which Hugging Face then takes for a Hub id)."""
    if recorded is not None and fingerprint is not None and recorded != fingerprint:
        raise RunFolderError(f"{run}: the model its args name now is not the one it was made "
                             "with (the files at that place differ from those it recorded); "
                             f"{remedy}")
    if recorded is not None and fingerprint is None:
        named = "" if model_args is None else \
            f" ({ModelArgs.parse(model_args).get('pretrained')!r} from {Path.cwd()})"
        raise RunFolderError(f"{run}: it was made with a model loaded from a local folder, "
                             f"and its model args name none here{named}; give the folder's "
                             "place with --model-args pretrained=<folder>,... (the run's "
                             "other model args as they were)")


def _stored_config(folder: RunFolder) -> dict[str, Any]:
    """``folder``'s config.json; empty where there is none to read (``start`` says why)."""
    try:
        return folder.read_config() if folder.exists() else {}
    except RunFolderError:
        return {}


def _stored_model(config: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """The model fingerprint and model args a run's ``config`` records, each None where it
    records none."""
    identity = config.get("identity")
    args = identity.get("model_args") if isinstance(identity, dict) else None
    return config.get("model_fingerprint"), args if isinstance(args, str) else None


def _same_chat(config: Mapping[str, Any]) -> Callable[[Any, Any], bool]:
    """Whether ``--apply-chat-template`` given (True or False) where the run ``config``
    left it out asks every task as the run did: the tokenizer's decision it recorded
    (``chat_template``, per task) was that value for each. (Left out where the run gave
    it is another matter: the decision now is not known before the model loads.)"""
    decided = config.get("chat_template")
    values = set(decided.values()) if isinstance(decided, dict) else set()

    def same(given: Any, stored: Any) -> bool:
        return stored is None and isinstance(given, bool) and values == {given}
    return same


def _same_files(given: str | None, stored: str | None) -> bool:
    """Whether two runs' model args name one model, or its files moved (the fingerprints
    are the same): the same arguments but for ``pretrained=``."""
    if same_model(given, stored):
        return True
    if not (isinstance(given, str) and isinstance(stored, str)):
        return False
    ours, theirs = model_identity(given), model_identity(stored)
    return {**ours, "pretrained": ""} == {**theirs, "pretrained": ""}
