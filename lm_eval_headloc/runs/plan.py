"""Measuring a run's plan: load → open the measurement → measure what is not on disk yet.

``measurement.store.run_plan`` measures the masks of a plan that are not in the run folder
yet, each written before the next starts, so an interrupted run loses at most the work in
flight; ``measured_plan`` is the whole check → prepare → load → measure sequence a plain
measuring command runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import read_json
from lm_eval_headloc.common.timing import timed
from lm_eval_headloc.intervention.ablation import (
    AblationError,
)
from lm_eval_headloc.measurement.store import PlanEntry, SharingStore, _knockout_of, run_plan
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.option_values import parse_examples_part, parse_gen_kwargs
from lm_eval_headloc.runs.record import RunRecord, measured_on, start_run
from lm_eval_headloc.runs.setup import Setup, prepare
from lm_eval_headloc.runs.spec import RunSpec
from lm_eval_headloc.tasks import make_task_manager

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement

__all__ = ["DEFAULT_BATCH_SIZE", "LM_EVAL_FILES", "OnDemand", "chat_settings",
           "generation_batch",
           "load_model", "measured_plan", "nothing_left", "open_measurement", "set_ablation",
           "worker_measurement", "write_lm_eval_results"]

log = logging.getLogger("lm_eval_headloc")


@timed("model load")
def load_model(setup: Setup) -> Any:
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    # The kind is set once the reference set is known (open_measurement); the scale now.
    batch_size = setup.spec.batch_size
    return HFHeadAblateLM.create_from_arg_string(
        setup.spec.model_args, {"batch_size": DEFAULT_BATCH_SIZE if batch_size is None
                                else batch_size, "scale": setup.spec.scale})


@timed("measurement set-up")
def open_measurement(setup: Setup, lm: Any, folder: RunFolder | None = None,
                     num_samples: int | None = None, limit: int | None = None, *,
                     run: RunRecord | None = None) -> Any:
    """The measurement of ``setup``'s tasks on ``lm`` (a task with fewer documents than
    asked for is said in the log). What it is made on (``result.measured_on``: the
    example subset, the geometry, the ablation) goes into ``run``, the command's record,
    which writes it with its phase; without one, into ``folder``'s config.json at once
    (for scripts that keep no record). ``folder`` also holds mean ablation's cache."""
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    spec = setup.spec
    measure = HarnessMeasurement(
        lm, setup.tasks, setup.loaded, num_samples=num_samples, seed=spec.seed,
        apply_chat_template=spec.apply_chat_template, num_fewshot=spec.num_fewshot,
        gen_kwargs=parse_gen_kwargs(spec.gen_kwargs), system_instruction=spec.system_instruction,
        confirm_run_unsafe_code=spec.confirm_run_unsafe_code, limit=limit,
        verbose=spec.verbose, signal=spec.signal,
        examples_part=parse_examples_part(spec.examples_part),
        generation_batch=generation_batch(spec, lm))
    _say_short_tasks(measure, num_samples)
    measure.ablation_config = set_ablation(setup, lm, measure.subset, folder)
    if run is not None:
        run.measured_with(setup, measure, None if folder is None else folder.path)
    elif folder is not None:
        folder.update_config(**measured_on(setup, measure))
    if spec.workers > 1:
        from lm_eval_headloc.distributed.workers import start_workers

        workers = start_workers(setup, measure, worker_measurement, num_samples=num_samples,
                                limit=limit,
                                extra_tasks=setup.task_names[len(setup.run_task_names):])
        if run is not None and folder is not None:
            workers.on_all_dead = lambda: run.save_timings(
                folder, workers=workers.workers_config())
        return workers
    return measure


def worker_measurement(spec: Mapping[str, Any], *, extra_tasks: Sequence[str],
                       num_samples: int | None, limit: int | None,
                       reference: list[str] | None) -> Any:
    """One Ray worker's measurement, from the driver's resolved spec (``spec.RunSpec.as_config``):
    the same tasks, example subset and reference set, as one process on the worker's own
    device (``workers.worker_spec``)."""
    from lm_eval_headloc.distributed.workers import worker_spec

    setup = prepare(worker_spec(RunSpec(**spec)), extra_tasks=extra_tasks)
    setup.reference = reference
    return open_measurement(setup, load_model(setup), None, num_samples=num_samples,
                            limit=limit)


def generation_batch(spec: RunSpec, lm: Any) -> str | None:
    """Rows per mask of a generation task's ``generate`` calls: with no --batch-size on a
    GPU, every example where memory allows ("auto"; a generating step costs about as much
    for 100 rows as for 32 there), else the model's batch size (None)."""
    import torch

    if spec.batch_size is None and torch.device(lm.device).type == "cuda":
        return "auto"
    return None


def set_ablation(setup: Setup, lm: Any, subset: Mapping[str, list[int]] | None,
                 folder: RunFolder | None = None) -> dict[str, Any]:
    """Put ``setup``'s ablation kind on ``lm``: mean and resample take their reference
    examples from --ablation-data, or else from the run's own tasks on ``subset``; mean's
    statistics are cached in ``folder`` (``means/``). Returns what was used, for the
    run's config.json."""
    spec = setup.spec
    if spec.ablation == "zero":
        lm.set_ablation("zero")
        texts, source = None, None
    else:
        texts = setup.reference_texts(subset)
        source = spec.ablation_data or ("the run's tasks on its example subset: "
                                        + ",".join(setup.run_task_names))
        if spec.ablation_field is not None:
            source += f" (field {spec.ablation_field!r})"
        try:
            lm.set_ablation(spec.ablation, texts,
                            None if folder is None else folder.file("means"),
                            spec.ablation_data, spec.ablation_field)
        except AblationError as err:
            raise UsageError(f"--ablation {spec.ablation}: {err}") from None
    used = {"kind": spec.ablation, "scale": spec.scale, "reference": source,
            "reference_examples": None if texts is None else len(texts),
            "reference_digest": lm.reference_digest, "means_file": lm.means_file,
            "resample_seed": lm.resample_seed if spec.ablation == "resample" else None}
    return used


def _say_short_tasks(measure: Measurement, num_samples: int | None) -> None:
    """Say when a task has fewer documents than ``num_samples`` asked for."""
    if num_samples is None:
        return
    for task, count in sorted(dict(measure.examples_used).items()):
        if count < num_samples:
            log.warning("%s has only %d documents; all %d are used (--num-samples %d)",
                        task, count, count, num_samples)


@contextlib.contextmanager
def measured_plan(out: str | Path, command: str, spec: RunSpec, setup: Setup,
                  plan: Sequence[PlanEntry], *, identity: Mapping[str, Any],
                  protect: Sequence[str | Path] = (), force: bool = False,
                  num_samples: int | None = None, limit: int | None = None,
                  desc: str | None = None,
                  reference_of: tuple[str | Path, str] | None = None
                  ) -> Iterator[tuple[RunFolder, dict[str, dict[str, Any]]]]:
    """Start (or resume) ``command``'s run folder ``out``, load the model once, measure
    ``plan`` (``run_plan``) and hold the folder's lock while the caller writes its
    tables from the records: ``with measured_plan(...) as (folder, records):``. The
    commands that knock out given sets (verify, cross) share this. ``reference_of``: (a
    run, its mean/resample reference set's digest) where the sets are knocked out as that
    run knocked them out: other reference examples are refused, not measured."""
    if spec.output_path is not None:
        from lm_eval_headloc.measurement.lm_eval_output import (
            check_output_folder,
            make_output_folder,
        )

        check_output_folder(spec.output_path)
    with RunFolder(out) as folder:
        # Phases: started, measuring, and (with --workers) measured: their shares.
        record = start_run(folder, command, spec, force=force, protect=protect,
                           identity=identity, fingerprint=setup.model_fingerprint)
        if spec.output_path is not None:  # made once the run folder is known to be fine
            make_output_folder(spec.output_path)
        if nothing_left(folder, plan, spec.output_path, spec.log_samples):
            # A finished run rerun: its tables come from disk, no weights loaded (run_plan
            # still checks that what is on disk is what the plan asks for).
            yield folder, run_plan(folder, None, plan, desc=desc or command, progress=False)
            return
        measure = open_measurement(setup, load_model(setup), folder, num_samples=num_samples,
                                   limit=limit, run=record)
        if reference_of is not None:
            _check_reference(measure, spec, *reference_of)
        record.save(folder, measure)
        records = run_plan(folder, measure, plan, desc=desc or command,
                           progress=spec.progress)
        if spec.output_path is not None:
            write_lm_eval_results(folder, measure, setup, plan)
        record.save(folder, measure)  # the workers' shares and the timings so far
        yield folder, records


def _check_reference(measure: Measurement, spec: RunSpec, run: str | Path,
                     digest: str) -> None:
    """Refuse a reference set whose examples are not run ``run``'s (``digest``): its
    ``--ablation-data`` file, read from another working directory or machine, is another
    file of that name, or was changed since."""
    now = (getattr(measure, "ablation_config", None) or {}).get("reference_digest")
    if now is not None and now != digest:
        source = (f"--ablation-data {spec.ablation_data}" if spec.ablation_data else
                  "its tasks' examples")
        raise RunFolderError(f"{run}: the {spec.ablation} ablation's reference examples "
                             f"({source}, read from here) are not those the run was made "
                             "with; give --ablation-data the run's reference set, or "
                             "--ablation zero")


#: The run folder's index of the lm-eval results files ``--output-path`` wrote.
LM_EVAL_FILES = "lm_eval_files.json"


def nothing_left(folder: RunFolder, plan: Sequence[PlanEntry],
                 output_path: str | None = None, log_samples: bool = False,
                 shared: SharingStore | None = None) -> bool:
    """Every measurement of ``plan`` is on disk (and, with ``output_path``, every lm-eval
    results file --output-path wants for it), so the model is not needed. Without
    ``output_path``, a knockout on disk under another key, or one another store of
    ``shared``'s measurement made, counts: ``run_plan`` copies it (a twin) rather than
    measuring it (a sweep rerun whose lost check is an earlier cell's loaded the model)."""
    records = folder.measurements()
    done = {record["key"] for record in records}
    if output_path is None:
        made = {(record["mask"], record.get("scale")) for record in records}
        return all(entry[0] in done or (knockout := _knockout_of(*_heads_and_scale(entry)))
                   in made or (shared is not None
                               and shared.made_elsewhere(knockout) is not None)
                   for entry in plan)
    if any(entry[0] not in done for entry in plan):
        return False
    index = folder.file(LM_EVAL_FILES)
    written = read_json(index, RunFolderError) if index.is_file() else {}
    return all(_files_written(written.get(entry[0]), output_path, log_samples)
               for entry in plan)


def _heads_and_scale(entry: PlanEntry) -> tuple[Sequence[Any], float | None]:
    """A plan entry's heads and scale (None: the measurement's own)."""
    return entry[1], (entry[2] if len(entry) > 2 else None)  # type: ignore[misc]


class OnDemand:
    """The measurement a command's plans need, its model loaded at the first plan not all
    on disk (and recorded in ``run``), once: a rerun of a finished run never loads it.
    ``measure`` stays None until then."""

    def __init__(self, setup: Setup, folder: RunFolder, run: RunRecord,
                 num_samples: int | None) -> None:
        self.setup, self.folder, self.run, self.num_samples = setup, folder, run, num_samples
        self.measure: Measurement | None = None

    def __call__(self, plan: Sequence[PlanEntry] = (), shared: SharingStore | None = None
                 ) -> Measurement | None:
        """The measurement for ``plan`` (None while all of it is on disk, or in
        ``shared``'s other stores); no plan: load."""
        if self.measure is None and (not plan or not nothing_left(self.folder, plan,
                                                                  shared=shared)):
            self.measure = open_measurement(self.setup, load_model(self.setup), self.folder,
                                            self.num_samples, run=self.run)
            self.run.save(self.folder, self.measure)
        return self.measure


def _files_written(entry: Any, output_path: str, log_samples: bool) -> bool:
    """An index entry (one path, or a list of them: one per chat-template setting) whose
    every file is on disk under ``output_path`` (a rerun with another --output-path writes
    there), with its samples beside it where ``log_samples`` wants them (a rerun that adds
    --log-samples writes them)."""
    paths = [entry] if isinstance(entry, str) else entry
    if not (isinstance(paths, list) and paths and all(isinstance(p, str) for p in paths)):
        return False
    from lm_eval_headloc.measurement.lm_eval_output import results_folder

    root = results_folder(output_path).resolve()
    for path in map(Path, paths):
        if not path.is_file() or root not in path.resolve().parents:
            return False
        # lm-eval names a save's files with one date id (results_<id>.json, and
        # samples_<task>_<id>.jsonl beside it).
        date_id = path.stem.rsplit("_", 1)[-1]
        if log_samples and not any(path.parent.glob(f"samples_*_{date_id}.jsonl")):
            return False
    return True


@timed("lm-eval results files")
def write_lm_eval_results(folder: RunFolder, measure: Measurement, setup: Setup,
                          plan: Sequence[PlanEntry]) -> None:
    """``--output-path``: each knockout of ``plan`` evaluated again by lm-eval itself, on the
    same examples and prompts, and saved as lm-eval's CLI saves its results
    (``lm_eval_output``). A results file holds one chat-template setting, so where the
    measurement asks some tasks through the chat template (generation tasks, by default)
    and others not, each knockout gets one file per setting, as two ``lm_eval`` runs would
    write. The folder's ``lm_eval_files.json`` says which file (or files) each knockout
    went to, so a resumed run writes only the ones not written yet."""
    from lm_eval_headloc.measurement.lm_eval_output import (
        evaluate_knockout,
        save_lm_eval_results,
        save_reference_set,
    )

    spec = setup.spec
    index_path = folder.file(LM_EVAL_FILES)
    written = read_json(index_path, RunFolderError) if index_path.is_file() else {}
    manager = make_task_manager(list(spec.include_path))
    window = ({"samples": measure.subset} if measure.subset is not None
              else {"limit": measure.limit})
    settings = chat_settings(measure, [name for name, _ in setup.tasks])
    gen_kwargs = parse_gen_kwargs(spec.gen_kwargs)
    files_of: dict[tuple[str, float | None], Any] = {}  # one evaluation a knockout
    reference = None  # where the knockouts' model_args read a reference set given as texts
    for key, components, *scale in plan:
        knockout = _knockout_of(components, scale[0] if scale else None)
        if _files_written(written.get(key), str(spec.output_path), spec.log_samples):
            files_of.setdefault(knockout, written[key])
            continue
        if knockout in files_of:
            written[key] = files_of[knockout]
            folder.write_json(LM_EVAL_FILES, written)
            continue
        if components and reference is None and _reference_unnamed(measure.lm, spec):
            reference = save_reference_set(spec.output_path, measure.lm.reference_examples)
        paths = []
        for chat, names in settings.items():
            with measure.generation_batch():  # --batch-size auto: the measurement's batch
                results = evaluate_knockout(
                    measure.lm, names, task_manager=manager,
                    knocked_out=list(components), scale=scale[0] if scale else None,
                    model_args=spec.model_args, reference=reference,
                    log_samples=spec.log_samples,
                    apply_chat_template=chat, fewshot_as_multiturn=chat,
                    num_fewshot=spec.num_fewshot, gen_kwargs=gen_kwargs,
                    system_instruction=spec.system_instruction,
                    confirm_run_unsafe_code=spec.confirm_run_unsafe_code, **window)
            path = save_lm_eval_results(results, spec.output_path,
                                        log_samples=spec.log_samples)
            paths.append(str(path.resolve()))
        written[key] = files_of[knockout] = paths[0] if len(paths) == 1 else paths
        folder.write_json(LM_EVAL_FILES, written)


def _reference_unnamed(lm: Any, spec: RunSpec) -> bool:
    """Whether model arguments cannot load ``lm``'s mean/resample reference set from its
    ``ablation_data``: a set handed over as texts (the run's own examples) has none, and a
    task the run's --include-path may have found is not found by the model, which is told
    no include path (the results files then name a file of the texts)."""
    if lm.reference_examples is None:
        return False
    return lm.ablation_data is None or (bool(spec.include_path)
                                        and not Path(lm.ablation_data).is_file())


def chat_settings(measure: Measurement, names: Sequence[str]) -> dict[bool, list[str]]:
    """``names`` (the measurement's tasks) by whether it asks them through the chat
    template, the setting lm-eval is given for each (no template first)."""
    chat_of = {name: any(measure.chat_template[leaf] for leaf in measure.leaves_of[name])
               for name in names}
    return {chat: [name for name in names if chat_of[name] == chat]
            for chat in (False, True) if chat in chat_of.values()}


#: Rows per forward pass where --batch-size is not given (generation on a GPU aside:
#: ``generation_batch``).
DEFAULT_BATCH_SIZE = 32
