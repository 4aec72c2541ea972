"""The run folder every ``headloc-harness`` subcommand writes, reads and resumes.

``config.json``        the run's record: spec, identity, the example subset, package
                       versions, what the run decided (``result.RunRecord`` writes it,
                       whole, once per phase; ``schema``: its layout's version)
``measurements.jsonl`` one line per measurement, on disk before the next starts
``design_matrix.npy``  the masks (locate), generated up front from the seed
results files          written by the subcommand (heads.json, heads.csv, report.md, …)
``.lock``              held while a command works in the folder (the holder's PID); removed
                       when it is done

A rerun of the same command continues where the last one stopped; a folder made with
different defining arguments is refused, unless it recorded nothing past its start (a
model that failed to load: the corrected command starts over). Nothing that is not provably
ours is ever deleted or overwritten: ``--force`` clears only a folder whose ``config.json``
says it is a headloc-harness run, and in it only the files the commands write (``WRITTEN``)
and nested run folders of ours that no other process holds; a folder holding anything else
is refused, deleting nothing, as is any other non-empty folder, forced or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import logging
import os
import platform
import shutil
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import (
    PARTIAL,
    _finite_or_none,
    not_a_file,
    read_json,
    strict_json,
    write_atomically,
)
from lm_eval_headloc.measurement.store import is_measurement, unusable_score
from lm_eval_headloc.runs.folder_checks import RunFolderError

__all__ = ["CONFIG_SCHEMA", "RunFolder", "enclosing_run", "option_words", "package_versions",
           "refuse_recorded_code", "refuse_writing_into"]

log = logging.getLogger("lm_eval_headloc")

#: The version of config.json's layout. A file without the field was written before it
#: existed, in layout 1 or an earlier one with fewer keys (``result.load_run`` reads
#: either); a file with a larger number is refused rather than misread. Layout 2 records
#: the embedded model by its name (``embedded.EMBEDDED``) where layout 1 recorded the
#: folder it lay in on the machine that made the run, and adds the model's width, block
#: layout and fingerprint (``result.model_facts``); ``read_config`` reads layout 1 as 2.
CONFIG_SCHEMA = 2

#: config.json's keys as ``RunFolder.start`` writes them, before a run records anything.
_STARTED_KEYS = frozenset({"schema", "command", "identity", "settings", "spec", "versions",
                           "created"})


def _other_run(config: Mapping[str, Any], command: str, identity: Mapping[str, Any],
               assumed: Mapping[str, Any],
               same: Mapping[str, Callable[[Any, Any], bool]] = {}) -> str | None:
    """How the run ``config`` records differs from ``command``'s with ``identity`` (the
    first key that differs), or None when it is the same run. ``same``: for a key whose
    values may differ in form only, whether two are the same."""
    if config["command"] != command:
        return f"holds a '{config['command']}' run, not '{command}'"
    assumed = json.loads(json.dumps(dict(assumed)))
    stored = {**{k: v for k, v in assumed.items() if k in identity}, **config["identity"]}
    # Only what defines this run's measurements now: a key the folder recorded that this
    # command no longer compares (an older, wider identity) is moot.
    differing = sorted(k for k in identity if identity[k] != stored.get(k)
                       and not (k in same and same[k](identity[k], stored.get(k))))
    if not differing:
        return None
    key = differing[0]
    given = identity.get(key)
    return (f"was made with {option_words(key, stored.get(key))}, not "
            f"{'left out' if given is None else repr(given)}")


def option_words(name: str, value: Any) -> str:
    """An option's value in a message: None is an option left out, said so, not "None"."""
    return f"{name} left out (its default)" if value is None else f"{name}={value!r}"


def _upgraded(config: dict[str, Any], schema: int) -> dict[str, Any]:
    """``config`` (of layout ``schema``) as this version's layout reads it; its ``schema``
    stays as read, so a folder read is rewritten only when a command writes it."""
    if schema < 2:
        # The embedded model by its name: the folder recorded was another machine's, or
        # will be once the folder is moved.
        from lm_eval_headloc.intervention.embedded import recorded_model_args

        for section in ("identity", "spec"):
            values = config.get(section)
            if isinstance(values, dict) and isinstance(values.get("model_args"), str):
                values["model_args"] = recorded_model_args(values["model_args"])
    return config


def package_versions() -> dict[str, str]:
    names = ["lm-eval-headloc", "lm_eval", "torch", "transformers", "peft", "numpy",
             "scikit-learn", "gguf"]
    versions = {"python": platform.python_version()}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _json_or_none(raw: bytes) -> Any:
    """One line's JSON value, or None where it is not JSON."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, too deep, too many digits
        return None


#: What the commands write in a run folder, by name or fnmatch pattern: ``--force`` clears
#: these (and run folders of ours nested in it) and refuses a folder holding anything else.
#: ``RunFolder.file`` hands out only these names, so a new results file is listed here.
WRITTEN = ("config.json", "measurements.jsonl", "design_matrix.npy", "prior.json",
           "report.md", "heads.json", "heads.csv", "heads-*.json", "heads-*.csv",
           "heatmap.png", "verify.json", "verify.md", "cross.json", "cross.md", "cross.png",
           "sweep.json", "sweep.md", "types.json", "types.csv", "lm_eval_files.json",
           "means", "timing.json", ".lock")
#: Entries of WRITTEN that only one command writes (its ``config.json`` "command"): the
#: same name in another run's folder is not the run's to delete.
WRITTEN_BY = {"timing.json": "bench-prior"}
#: The one entry of WRITTEN that is a folder, holding ``ablation.MEANS_FILE`` files only;
#: every other entry is a file.
WRITTEN_FOLDER = "means"


#: The bad measurement lines already warned of in this process: a command reads the file
#: several times, and one bad line is one warning.
_SAID_SKIPPED: set[tuple[str, int, str]] = set()


def _written(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in WRITTEN)


def _is_partial(entry: Path, written: Any = _written) -> bool:
    """Whether ``entry`` is a partial file of one of our files (``written(name)``)."""
    match = PARTIAL.fullmatch(entry.name)
    return bool(match and written(match["name"]) and entry.is_file()
                and not entry.is_symlink())


def _ours(entry: Path) -> bool:
    """Whether ``entry`` is one of the files or folders the commands write, of its kind: a
    regular file by a file's name, a folder of our files (or their partials) by a folder's
    name; never a link."""
    if entry.is_symlink() or not _written(entry.name):
        return _is_partial(entry)
    if entry.name != WRITTEN_FOLDER:
        return entry.is_file()
    from lm_eval_headloc.intervention.ablation import (
        MEANS_FILE as pattern,  # torch: only where a means/ is looked at
    )

    return entry.is_dir() and all(
        (inner.is_file() and not inner.is_symlink() and pattern.fullmatch(inner.name))
        or _is_partial(inner, pattern.fullmatch) for inner in entry.iterdir())


def _nested_run(entry: Path, config: Mapping[str, Any]) -> RunFolder | None:
    """``entry`` as a run folder that the run ``config`` records made, or None: its
    ``verify`` (verify's default --out) or, in a sweep's folder, one of its cells. Another
    run folder put here (a copy of another run) is not this run's to delete. One so named
    that was killed before its first config.json, holding nothing but its lock and our
    partial files, is the run's too."""
    if not entry.is_dir() or entry.is_symlink():
        return None
    identity = config.get("identity")
    cells: set[str] = set()
    if config.get("command") == "sweep" and isinstance(identity, dict):
        grid = [identity.get("masks"), identity.get("sparsity")]
        if all(isinstance(values, list) for values in grid):
            cells = {f"m{m}-p{p:g}" for m in grid[0] for p in grid[1]
                     if isinstance(m, int) and isinstance(p, (int, float))}
    run = RunFolder(entry)
    if not (entry / RunFolder.CONFIG).is_file():
        lock = entry / RunFolder.LOCK
        unstarted = ((not os.path.lexists(lock) or (lock.is_file() and not lock.is_symlink()))
                     and all(_is_partial(inner) for inner in run._entries()))
        return run if unstarted and (entry.name == "verify" or entry.name in cells) else None
    try:
        command = run.read_config()["command"]
    except RunFolderError:
        return None
    if (entry.name, command) == ("verify", "verify") or (
            entry.name in cells and command == "locate"):
        return run
    return None


def _own_rankings(config: Mapping[str, Any]) -> set[str]:
    """The ranking files (``heads-<task>.json`` and ``.csv``) the run ``config`` records
    writes: its tasks'. Another file of that pattern is not the run's to delete."""
    from lm_eval_headloc.measurement.metrics import parse_task_metric

    spec = config.get("spec")
    tasks = spec.get("tasks") if isinstance(spec, dict) else None
    names = [parse_task_metric(task)[0] for task in (tasks if isinstance(tasks, list) else [])
             if isinstance(task, str)]
    return {f"heads-{name}{suffix}" for name in names for suffix in (".json", ".csv")}


def _delete(entry: Path) -> None:
    """Delete a file, or a folder with what it holds (not a link's target)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def _within(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` is ``folder`` or inside it (links resolved)."""
    path, folder = Path(path).resolve(), Path(folder).resolve()
    return path == folder or folder in path.parents


def refuse_recorded_code(run: str | Path, include_path: Iterable[str], model_args: str | None,
                         remedy: str) -> None:
    """Refuse what a run's record (``config.json``) would have a command run as code: a
    task folder (``include_path``, whose YAMLs may name Python functions) that is not an
    absolute path outside the run folder (a run records its folders absolute: a relative
    one, or one shipped inside the folder, is the record's own doing), and a model that
    runs its own code (``trust_remote_code``). A run folder is data: the user names code
    to run on the command line (``remedy``: how, for this command)."""
    from lm_eval_headloc.intervention.arg_string import ModelArgs

    config = Path(run) / RunFolder.CONFIG
    for folder in include_path:
        if not Path(folder).is_absolute() or _within(folder, run):
            raise RunFolderError(f"{config}: include_path {folder!r} is "
                                 + ("relative" if not Path(folder).is_absolute() else
                                    "inside the run folder")
                                 + "; a run folder's record names no task code to run (keep "
                                   "task folders outside run folders)")
    trust = ModelArgs.parse(model_args).get("trust_remote_code") if model_args else None
    if str(trust).strip().lower() in ("true", "1"):
        raise RunFolderError(f"{config}: its model_args say trust_remote_code=True; a run "
                             f"folder's record runs no model's own code ({remedy})")


def refuse_writing_into(out: str | Path, runs: Iterable[str | Path]) -> None:
    """Refuse an output file ``out`` inside any of the run folders ``runs`` a command reads
    from, or inside any other run folder of ours: a run folder's files are its command's
    alone (another's ``heads-x.json`` there would read as a ranking, and ``--force`` on the
    run would delete it); and an ``out`` that is a link (writing replaces the link, not
    what it points to)."""
    if Path(out).is_symlink():
        raise RunFolderError(f"--out {out} is a link; name the file itself (the link would "
                             "be replaced by a file)")
    for run in runs:
        if _within(Path(out).parent, run):
            run = Path(run).resolve()
            raise RunFolderError(f"--out {out} would write into {run}, which this command "
                                 "reads from; choose another --out")
    run = enclosing_run(Path(out).parent)
    if run is not None:
        raise RunFolderError(f"--out {out} would write into {run}, a headloc-harness run "
                             "folder, whose files are its command's alone; choose a file "
                             "outside it")


def enclosing_run(path: str | Path) -> Path | None:
    """The run folder of ours that ``path`` is or lies in (the nearest), or None."""
    for folder in (Path(path).resolve(), *Path(path).resolve().parents):
        try:
            if (folder / RunFolder.CONFIG).is_file():
                RunFolder(folder).read_config()
                return folder
        except (RunFolderError, OSError):
            continue
    return None


def checked_path(value: object, what: str, example: str,
                 error: type[Exception] = RunFolderError) -> Path:
    """``value`` (an argument ``what`` names) as a Path; one line (``error``) naming it
    where it is no path (pathlib's TypeError, "expected str, bytes or os.PathLike object",
    names neither the argument nor the value)."""
    if not isinstance(value, (str, os.PathLike)) or not str(value).strip():
        raise error(f"{what} is a path (e.g. {example!r}), not {value!r}")
    return Path(value)


def run_list(runs: str | Path | Iterable[str | Path]) -> list[str | Path]:
    """The run folders a command reads: a list of them; one folder given alone (a string
    is not a list of folders, one a character). Each is checked to be a path."""
    if isinstance(runs, (str, os.PathLike)):
        runs = [runs]
    elif not isinstance(runs, Iterable):
        raise RunFolderError(f"the run folders are a path or a list of paths, not {runs!r}")
    listed = list(runs)
    for run in listed:
        checked_path(run, "a run folder", "runs/x")
    return listed


def refuse_output_path_into(output_path: str | Path | None, runs: Iterable[str | Path],
                            out: str | Path) -> None:
    """Refuse lm-eval's results files (``--output-path``) in a run folder ``runs`` the
    command reads (a later ``--force`` there would refuse them as foreign), unless inside
    the command's own ``out`` (verify's default ``RUN/verify`` is a run of its own)."""
    from lm_eval_headloc.measurement.lm_eval_output import results_folder

    if output_path is None or _within(results_folder(output_path), out):
        return
    for run in runs:
        if _within(results_folder(output_path), run):
            raise RunFolderError(f"--output-path {output_path} would write into {run}, which "
                                 f"this command reads from; choose another --output-path (one "
                                 f"inside --out {out} is fine)")
    run = enclosing_run(results_folder(output_path))
    if run is not None:
        raise RunFolderError(f"--output-path {output_path} would write into {run}, a "
                             "headloc-harness run folder, whose files are its command's "
                             f"alone; choose another --output-path (one inside --out {out} "
                             "is fine)")


class RunFolder:
    """A folder of one run. Use as a context manager: the lock is released on exit."""

    CONFIG = "config.json"
    MEASUREMENTS = "measurements.jsonl"
    LOCK = ".lock"

    def __init__(self, path: str | Path) -> None:
        self.path = checked_path(path, "a run folder", "runs/x")
        self._lock_fd: int | None = None
        self._on_interrupt: list[Callable[[], object]] = []  # ``on_interrupt``'s

    def __enter__(self) -> RunFolder:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is not None and issubclass(kind, KeyboardInterrupt):
                for callback in self._on_interrupt:
                    callback()  # under the lock still
        finally:
            self.release()

    def on_interrupt(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when the ``with`` block this folder is open in ends by Ctrl-C,
        before its lock is released (a run's record saves the session's time there)."""
        self._on_interrupt.append(callback)

    def file(self, name: str) -> Path:
        """The path of the folder's file ``name``, which must be a plain name
        (``folder_checks.plain_name``: a ranking file's holds a task read from config.json)
        of a file the commands write; a link out of the folder is refused."""
        from lm_eval_headloc.runs.folder_checks import plain_name

        plain_name(name, "file name", self.path)
        if not _written(name):
            from lm_eval_headloc.common.errors import InternalError

            raise InternalError(f"run folder file {name!r} is not in folder.WRITTEN, "
                                "so --force would refuse to clear it")
        path = self.path / name
        # The lock is opened without following a link (``_acquire``, which says so).
        if name != self.LOCK and path.is_symlink() and \
                path.resolve().parent != self.path.resolve():
            raise RunFolderError(f"{path} is a link to {path.resolve()}, outside the run "
                                 "folder; a run folder's files are its own")
        if name != self.LOCK and (what := not_a_file(path)) is not None:
            # A FIFO or a device would block the reader or the writer for ever.
            raise RunFolderError(f"{what}; a run folder's files are the ones its commands "
                                 "write")
        return path

    def ranking_file(self, task: str, suffix: str = ".json") -> Path:
        """``heads-<task>.json`` (or ``.csv``): the ranking of ``task``, a name read from
        config.json, so checked to be a plain name first."""
        from lm_eval_headloc.runs.folder_checks import plain_name

        return self.file(f"heads-{plain_name(task, 'task', self.path)}{suffix}")

    def exists(self) -> bool:
        return self.file(self.CONFIG).is_file()

    def read_config(self) -> dict[str, Any]:
        """config.json, or a one-line RunFolderError if there is none or it is unreadable."""
        path = self.file(self.CONFIG)
        if not path.is_file():
            if self.path.is_file():  # read_rankings("runs/x/heads.json"): no config.json in it
                inside = (f"; give the run folder it is in, {self.path.parent}"
                          if (self.path.parent / self.CONFIG).is_file() else "")
                raise RunFolderError(f"{self.path} is a file, not a run folder{inside}")
            raise RunFolderError(f"{self.path} is not a run folder (no {self.CONFIG})")
        config = read_json(path, RunFolderError)
        if not (isinstance(config, dict) and isinstance(config.get("command"), str)
                and isinstance(config.get("identity"), dict)):
            raise RunFolderError(f"{path} is not a headloc-harness run configuration")
        schema = config.get("schema", 1)
        if not (isinstance(schema, int) and schema <= CONFIG_SCHEMA):
            raise RunFolderError(f"{path} was written by a newer headloc-harness (config "
                                 f"schema {schema!r}; this version reads up to "
                                 f"{CONFIG_SCHEMA}); upgrade lm-eval-headloc to use it")
        config = _upgraded(config, schema)
        from lm_eval_headloc.runs.folder_checks import check_config

        check_config(config, path)  # names and geometry, before anything is built from them
        return config

    def read_checked(self) -> dict[str, Any]:
        """config.json (``read_config``) once the folder's other files are checked to
        agree with it (``folder_checks.check_files``): what every reader of a run takes."""
        from lm_eval_headloc.runs.folder_checks import check_files

        config = self.read_config()
        check_files(self, config)
        return config

    # --- starting a run -------------------------------------------------------------

    def start(self, command: str, identity: Mapping[str, Any], settings: Mapping[str, Any],
              spec: Mapping[str, Any] | None = None, force: bool = False,
              protect: Iterable[str | Path] = (), assumed: Mapping[str, Any] = {},
              same: Mapping[str, Callable[[Any, Any], bool]] = {}) -> bool:
        """Create the folder, or check that it holds this run; take its lock. True if
        resuming.

        ``assumed``: what a stored identity without a key was made with — options added
        to the tool after the folder was made, which then behaved as their defaults do.

        ``protect``: folders this command reads from; the run folder may neither be one
        of them nor contain one (so ``--force`` can never clear them).

        ``same``: for an identity key whose values may differ in form only (model args in
        another order), whether two are the same.
        """
        if force not in (True, False):  # force="no" from Python is true: the run cleared
            raise UsageError(f"force={force!r}: must be True or False")
        identity = json.loads(json.dumps(identity))  # as it will read back from disk
        self.refuse_inside(protect)
        ours = self._check_ownership()
        # A kill mid-write of the first config.json leaves only our partial file: empty.
        if not ours and self.path.exists() and any(
                not _is_partial(p) for p in self._entries()):
            raise RunFolderError(
                f"{self.path} is not empty and is not a headloc-harness run folder; choose "
                "another --out (--force only clears run folders)")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise RunFolderError(f"cannot create run folder {self.path}: "
                                 f"{err.strerror or err}") from None
        self._acquire()
        config = self.read_config() if ours and not force else None
        problem = None if config is None else _other_run(config, command, identity, assumed,
                                                         same)
        if problem is not None and self._only_started(config):
            # A run stopped before it recorded anything (its model failed to load, say):
            # nothing in it to lose, so the corrected command starts over without --force.
            log.info("%s %s but recorded nothing past its start: starting over", self.path,
                     problem)
            ours, config = True, None
        elif problem is not None:
            raise RunFolderError(f"{self.path} {problem}; use another --out or --force to "
                                 "start over")
        if config is not None:
            from lm_eval_headloc.runs.folder_checks import check_files

            for entry in self._entries():  # a FIFO as report.md: refused now, not at the end
                if _written(entry.name):
                    self.file(entry.name)
            check_files(self, config)  # what the resumed run reads must agree with it
            config["settings"] = dict(settings)
            if spec is not None:
                config["spec"] = dict(spec)
            config["schema"] = CONFIG_SCHEMA  # read_config has read an older one as this
            self.write_config(config)
            return True
        if ours:  # --force (or nothing recorded) on a run folder of ours: what we wrote
            self._clear()
        self._remove_partials()
        self.write_config({
            "schema": CONFIG_SCHEMA,
            "command": command, "identity": identity, "settings": dict(settings),
            "spec": dict(spec or {}), "versions": package_versions(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        })
        return False

    def _entries(self) -> list[Path]:
        return [p for p in self.path.iterdir() if p.name != self.LOCK]

    def _entries_config_last(self) -> list[Path]:
        return sorted(self._entries(), key=lambda entry: entry.name == self.CONFIG)

    def _remove_partials(self) -> None:
        # Held under our lock: a partial file here is a killed writer's, never a live one.
        for entry in self._entries():
            if _is_partial(entry):
                entry.unlink()

    def _clear(self) -> None:
        """Delete what the commands wrote here, and run folders of ours nested in it (a
        verify's, a sweep's cells), after checking that nothing else is here and that no
        other process is working in a nested run: otherwise refuse, deleting nothing."""
        foreign = self._foreign()
        if foreign:
            shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
            raise RunFolderError(f"--force: {self.path} holds what its run did not write "
                                 f"({shown}); it deletes only the run's own files, so move "
                                 "those out or choose another --out")
        config = self.read_config()
        nested = [run for entry in self._entries() if (run := _nested_run(entry, config))]
        try:
            for run in nested:
                run._acquire()  # refuses a run another process is working in
            # config.json last, in each folder: a clearing cut short (Ctrl-C) leaves a
            # run folder that --force clears again, not one refused as no run of ours.
            for run in nested:
                for entry in run._entries_config_last():
                    _delete(entry)
            for entry in self._entries_config_last():
                _delete(entry)
        finally:
            for run in nested:
                run.release()

    def _foreign(self) -> list[str]:
        """What is here that this folder's run did not write, nested runs' included
        (names): a file no command writes, a ranking file of no task of the run, a run
        folder that is not one of its own."""
        if not self.file(self.CONFIG).is_file():  # a nested run killed before it started
            return [entry.name for entry in self._entries() if not _is_partial(entry)]
        config = self.read_config()
        rankings = _own_rankings(config)
        found = []
        for entry in self._entries():
            run = _nested_run(entry, config)
            if run is not None:
                found += [f"{entry.name}/{name}" for name in run._foreign()]
            elif (not _ours(entry)
                  or (fnmatch.fnmatchcase(entry.name, "heads-*") and entry.name not in rankings)
                  or WRITTEN_BY.get(entry.name, config.get("command")) != config.get("command")):
                found.append(entry.name)
        return found

    def _only_started(self, config: Mapping[str, Any]) -> bool:
        """Whether the folder holds a config.json as ``start`` wrote it, and nothing else."""
        return (set(config) <= _STARTED_KEYS
                and [p.name for p in self._entries()] == [self.CONFIG])

    def _check_ownership(self) -> bool:
        """True if the folder is a run folder of ours; errors for what cannot be one."""
        if self.path.exists() and not self.path.is_dir():
            raise RunFolderError(f"--out {self.path} is a file, not a folder")
        if not self.file(self.CONFIG).exists():
            return False
        self.read_config()  # raises if it is not ours
        return True

    def refuse_inside(self, protect: Iterable[str | Path]) -> None:
        """Refuse to be (or to contain) any of these folders, which a command reads."""
        for source in protect:
            if _within(source, self.path):
                source = Path(source).resolve()
                raise RunFolderError(f"--out {self.path} would write into {source}, which "
                                     "this command reads from; choose another --out")

    def _acquire(self) -> None:
        """Hold an exclusive lock on the folder; a second process gets a one-line error.
        The lock file is removed when released (``release``), so a lock taken on a file
        another process has just removed is taken again on the file now there."""
        for _ in range(10):
            self._acquire_once()
            if self._lock_fd is None or self._holds_the_file():
                return
            os.close(self._lock_fd)  # locked a removed file: the holder released it
            self._lock_fd = None
        raise RunFolderError(f"cannot lock {self.path}: its lock file keeps being replaced "
                             "by another process")

    def _holds_the_file(self) -> bool:
        """Whether the lock held is on the file at ``.lock`` (not one removed since)."""
        assert self._lock_fd is not None
        try:
            there = os.lstat(self.path / self.LOCK)
        except FileNotFoundError:
            return False
        held = os.fstat(self._lock_fd)
        return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)

    def _acquire_once(self) -> None:
        if self._lock_fd is not None:
            return
        lock = self.file(self.LOCK)
        not_ours = (f"{lock} is not a regular file, so not the lock headloc-harness writes; "
                    "it is left alone: remove it or choose another --out")
        try:
            # Never through a link: its target is not ours to truncate.
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as err:
            if lock.is_symlink() or (lock.exists() and not lock.is_file()):
                raise RunFolderError(not_ours) from None
            raise RunFolderError(f"cannot write in {self.path}: {err.strerror or err}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO, a device
            os.close(fd)
            raise RunFolderError(not_ours)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunFolderError(f"{self.path} is in use by another headloc-harness process "
                                 f"(PID {holder}); wait for it or choose another --out") \
                from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def lock(self) -> RunFolder:
        """Take the lock of an existing run folder (refit); returns self."""
        self.read_config()
        self._acquire()
        return self

    def release(self) -> None:
        if self._lock_fd is not None:
            # Removed while still held (so it is the file this process locked): no lock
            # with a dead PID is left behind; closing then releases the flock.
            if self._holds_the_file():
                with contextlib.suppress(OSError):
                    os.unlink(self.path / self.LOCK)
            os.close(self._lock_fd)
            self._lock_fd = None

    # --- files ------------------------------------------------------------------------

    def update_config(self, **fields: Any) -> None:
        """Set ``fields`` in config.json (a read-modify-write: for scripts that keep no
        record; the commands write theirs whole, ``result.RunRecord.save``)."""
        config = self.read_config()  # an older layout read as this one: written as this one
        config.update(fields, schema=CONFIG_SCHEMA)
        self.write_config(config)

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Write config.json whole (atomically): every write of it goes through here."""
        self.write_json(self.CONFIG, config)

    @contextlib.contextmanager
    def writing(self, name: str, kept: str = "") -> Iterator[Path]:
        """The path of ``name``, for a write whose OSError (a full disk, a folder made
        read-only since the run began) ends in one line naming the file, not a traceback:
        every file of the run is written within it. ``kept``: what the line adds of what
        the failed write left."""
        path = self.file(name)
        try:
            yield path
        except OSError as err:
            raise RunFolderError(f"cannot write {path}: {err.strerror or err}{kept}") from None

    def write_text(self, name: str, text: str) -> None:
        """Write atomically: a reader never sees half a file."""
        with self.writing(name) as path:
            write_atomically(path, lambda partial: partial.write_text(text))

    def write_json(self, name: str, data: Any) -> None:
        self.write_text(name, strict_json(data))

    # --- measurements -------------------------------------------------------------

    def measurements(self) -> list[dict[str, Any]]:
        """Every measurement on disk, in order.

        A last line without its newline was cut short by a kill: it is dropped (and, by
        the lock's holder only, truncated, so appends stay valid: without the lock the
        line may be a live run's, half written). Any other line that is not a measurement is
        skipped with a warning naming it and left in the file: good lines after it are
        never lost.
        """
        path = self.file(self.MEASUREMENTS)
        if not path.is_file():
            return []
        data = path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline
        if torn and is_measurement(_json_or_none(torn)):
            # Whole, only its newline missing: kept (the lock's holder adds the newline,
            # so the next append starts a line of its own).
            lines.append(torn)
            if self._lock_fd is not None:
                with path.open("ab") as handle:
                    handle.write(b"\n")
        elif torn and self._lock_fd is not None:
            with path.open("r+b") as handle:
                handle.truncate(len(data) - len(torn))
            log.warning("%s: dropped an unfinished last line (%d bytes) left by an "
                        "interrupted run; it will be measured again", path, len(torn))
        records = []
        for number, raw in enumerate(lines, start=1):
            record = _json_or_none(raw)
            problem = (None if not is_measurement(record) else unusable_score(record))
            if not is_measurement(record) or problem:
                if (str(path.resolve()), number, raw) not in _SAID_SKIPPED:  # once a run
                    _SAID_SKIPPED.add((str(path.resolve()), number, raw))
                    if problem:
                        log.warning("%s line %d (%s): %s; skipped (left in the file): "
                                    "`headloc-harness locate` on this folder measures it "
                                    "again, or remove the line", path, number,
                                    record["key"], problem)
                    else:
                        log.warning("%s line %d is not a measurement record; skipped "
                                    "(left in the file)", path, number)
                continue
            records.append(record)
        return records

    def append_measurement(self, record: Mapping[str, Any]) -> None:
        """Append one line and force it to disk before the next measurement starts."""
        line = json.dumps(_finite_or_none(record), allow_nan=False) + "\n"
        # A full disk: the lines before it are kept, a torn one is cut when read.
        with self.writing(self.MEASUREMENTS, "; the measurements before it are kept for a "
                                             "rerun") as path, path.open("a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())
