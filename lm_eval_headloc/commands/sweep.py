"""``sweep``: the paper's hyper-parameter search (appendix A.1). A ``locate`` run per
(masks, sparsity) cell on the example subset; each cell is scored by how much knocking
out its top-k hurts the (first) task."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.commands.locate import fits_from_disk, locate
from lm_eval_headloc.commands.verify import kind_words
from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError, as_python, check_number
from lm_eval_headloc.common.words import signed
from lm_eval_headloc.measurement.noise import paired_se
from lm_eval_headloc.measurement.store import PlanEntry, SharingStore, run_plan
from lm_eval_headloc.method.group_tests import CONFIDENCE, Z
from lm_eval_headloc.method.lasso import harm
from lm_eval_headloc.method.ranking import relative_drop
from lm_eval_headloc.report.pages import FLOOR_HINT, scores_at_floor
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.plan import OnDemand
from lm_eval_headloc.runs.record import start_run
from lm_eval_headloc.runs.setup import check_design_budget, prepare
from lm_eval_headloc.runs.spec import RunSpec, command_spec

__all__ = ["SWEEP_MASKS", "SWEEP_SPARSITY", "sweep", "sweep_table", "within_noise_of_best"]

SWEEP_MASKS = (100, 200)
SWEEP_SPARSITY = (0.01, 0.02, 0.05)


@timing.on_clock
def sweep(out: str | Path, masks: Sequence[int] = SWEEP_MASKS,
          sparsity: Sequence[float] = SWEEP_SPARSITY, spec: RunSpec | None = None, *,
          force: bool = False, **options: Any) -> dict[str, Any]:
    """Every (masks, sparsity) cell of the grid on one loaded model; returns the table.

    Each cell is ``spec`` with that cell's ``masks`` and ``sparsity`` (checked before the
    model loads); its locate run goes to ``out/m{M}-p{P}``. A ``spec`` setting masks or
    sparsity is refused where that grid is left out.
    """
    spec = command_spec("sweep", spec, options)
    for name, grid, default in (("masks", masks, SWEEP_MASKS),
                                ("sparsity", sparsity, SWEEP_SPARSITY)):
        value = getattr(spec, name)
        # ``is``: the grid left out (masks=None is refused below, as a grid it is not).
        if grid is default and value != getattr(RunSpec(), name):
            # sweep(out, spec=RunSpec(masks=4)) ran the default grid, ignoring the 4.
            raise UsageError(
                f"sweep(): spec= sets {name}={value!r}, which each cell takes from the "
                f"grid (default {','.join(map(str, default))}); give the grid as "
                f"sweep's {name}= (one number is a grid of one)")
    for name, value in (("masks", masks), ("sparsity", sparsity)):
        if isinstance(value, RunSpec):  # locate(out, spec)'s order: sweep's spec is 4th
            raise TypeError(f"sweep(): {name}= is a RunSpec; give it as spec= (sweep's "
                            "second and third arguments are the masks and sparsity grids)")
        value = as_python(value)
        if isinstance(value, (str, bytes)) or not isinstance(value, (numbers.Real, Iterable)):
            # Text would be a grid of its characters ("100": --masks '1' refused).
            raise UsageError(f"{name}={value!r}: give a number or a list of numbers (the "
                             "grid)")
    # One value is a grid of one (a notebook's sweep(out, masks=100)).
    # Python's numbers: numpy's (a notebook's np.arange) failed in config.json's writing.
    masks, sparsity = ([as_python(value)] if isinstance(value, numbers.Real) else
                       list(map(as_python, value)) for value in (masks, sparsity))
    if not masks or not sparsity:
        raise UsageError("--masks and --sparsity each need at least one value")
    _check_grid(masks, sparsity)
    setup = prepare(spec)
    spec = setup.spec
    # A cell is compared by what its masks (and confirmation) found: no group tests, which
    # would spend each cell what its certificate needs rather than its budget.
    cells = {f"m{m}-p{p:g}": spec.replace(masks=m, sparsity=p, group_tests=0).validate()
             for m in masks for p in sparsity}
    for cell in cells.values():
        check_design_budget(cell.masks, setup.total_heads)
    task = setup.task_names[0]
    with RunFolder(out) as folder:
        if spec.confirm is None and not force:
            # --confirm left out of a rerun: the sweep's own, as a resumed locate keeps it.
            spec = spec.replace(confirm=_stored_confirm(folder))
            cells = {name: cell.replace(confirm=spec.confirm) for name, cell in cells.items()}
        # Phases: started, measuring, and (with --workers) measured: their shares. Each
        # cell is a locate run of its own, in its own folder.
        run = start_run(folder, "sweep", spec, force=force, identity={
            **spec.identity("sweep"), "masks": masks, "sparsity": sparsity},
            fingerprint=setup.model_fingerprint)
        measuring = OnDemand(setup, folder, run, spec.num_samples)  # the model when needed

        # A cell with something left to measure loads the model its cells share; a rerun
        # whose every cell is finished fits them again from disk (locate's own rerun).
        if force or not all(fits_from_disk(folder.path / name, cell, setup)
                            for name, cell in cells.items()):
            measuring()
        # What the sweep and each cell measure is shared by the cells after them (the same
        # model and examples): a knockout (the prior) made once, kept in each folder that
        # needs it as a copy naming where it was made.
        shared = SharingStore(folder)
        baseline = run_plan(shared, measuring([("baseline", [])]), [("baseline", [])],
                            desc="baseline", progress=spec.progress)["baseline"]
        higher = bool(baseline["higher_is_better"][task])
        results, examples = [], []
        for name, cell in cells.items():
            with timing.run_clock():  # the cell's own timings; the sweep's add them up
                rankings = locate(folder.path / name, cell, force=force, setup=setup,
                                  measure=measuring.measure, shared=shared)
            top = rankings[task].top(spec.top_k)
            key = f"{name}-top{spec.top_k}"
            plan: list[PlanEntry] = [(key, rankings[task].top_knocked_out(spec.top_k))]
            check = run_plan(shared, measuring(plan, shared), plan, desc=f"check {name}",
                             progress=False)[key]
            score = check["scores"][task]
            examples.append(check.get("examples", {}).get(task))
            results.append({
                "masks": cell.masks, "sparsity": cell.sparsity, "heads": [str(h) for h in top],
                "score": score,
                "drop": drop(score, baseline["scores"][task], higher),
                "relative_drop": relative_drop(baseline["scores"][task], score, higher),
                "r2": rankings[task].facts.r2})
        # Cells are compared by the absolute harm (defined even for a zero baseline).
        best = max(results, key=lambda c: c["drop"])
        for cell, near in zip(results, within_noise_of_best(results, examples), strict=True):
            cell["within_noise_of_best"] = near
        # The metric decides, as for locate's ranking, whether a score of 0 is a floor.
        result = {"task": task, "metric": baseline["metrics"][task],
                  "baseline": baseline["scores"][task], "higher_is_better": higher,
                  "top_k": spec.top_k, "cells": results, "best": best}
        if measuring.measure is not None:  # a rerun that loaded nothing keeps its record
            run.save(folder, measuring.measure)  # the workers' shares and the timings so far
        folder.write_json("sweep.json", result)
        folder.write_text("sweep.md", sweep_table(result) + "\n")
    return result


def _check_grid(masks: Sequence[int], sparsity: Sequence[float]) -> None:
    """Refuse a grid value no cell can take, or two values that make one cell (its folder
    ``m{M}-p{P:g}``): '--masks 4,4' ran one cell and recorded two; the cells' own checks
    said "or 'auto'", which a grid does not take."""
    for m in masks:  # the package's one scalar check, without RunSpec's "or 'auto'"
        check_number(m, "--masks", whole=True, min_val=2)
    for p in sparsity:
        number = isinstance(p, numbers.Real) and not isinstance(p, bool)
        if not (number and 0 < p < 1):
            raise UsageError(f"--sparsity {format(p, 'g') if number else repr(p)}: each "
                             "value of the grid must be a number strictly between 0 and 1")
    for flag, values, cell in (("--masks", masks, "m{}"), ("--sparsity", sparsity, "p{:g}")):
        given = ",".join(map(str, values))
        for name in {cell.format(v) for v in values}:
            same = [v for v in values if cell.format(v) == name]
            if len(set(same)) > 1:  # a folder name keeps 6 digits of a sparsity
                raise UsageError(f"{flag} {given}: {' and '.join(map(str, same))} make one "
                                 f"cell ({name} in its folder's name); give values that "
                                 "differ in the first 6 digits")
            if len(same) > 1:
                raise UsageError(f"{flag} {given}: {same[0]} given twice (each value is "
                                 "one cell of the grid)")


def drop(score: float, baseline: float, higher_is_better: bool) -> float:
    """How much worse ``score`` is than ``baseline`` (positive = worse); a score that held
    drops by 0, not -0.0 (the table printed "-0.0000")."""
    return float(harm(score - baseline, higher_is_better)) + 0.0


def _stored_confirm(folder: RunFolder) -> int | None:
    """The --confirm a sweep in ``folder`` was made with (None: none there, or left to
    each cell's prior)."""
    if not folder.exists():
        return None
    try:
        config = folder.read_config()
    except RunFolderError:
        return None  # start_run says what is wrong with it
    confirm = config["identity"].get("confirm") if config["command"] == "sweep" else None
    return confirm if isinstance(confirm, int) else None


def within_noise_of_best(cells: Sequence[Mapping[str, Any]],
                         examples: Sequence[Any]) -> list[bool]:
    """For each cell (its ``drop``) whether it is not the best (the first of the largest
    drop) and the noise cannot tell it from the best: their drops differ by at most ``Z``
    paired standard errors of their checks' difference, from the per-example scores
    (``examples``, each check's record's ``examples[task]``; a cell without them: False)."""
    first = max(range(len(cells)), key=lambda i: (cells[i]["drop"], -i))
    return [i != first and (se := paired_se(examples[first], values)) is not None
            and cells[first]["drop"] - cells[i]["drop"] <= Z * se
            for i, values in enumerate(examples)]


def sweep_table(result: Mapping[str, Any]) -> str:
    sparsities = sorted({c["sparsity"] for c in result["cells"]})
    masks = sorted({c["masks"] for c in result["cells"]})
    by_cell = {(c["masks"], c["sparsity"]): c for c in result["cells"]}
    best = result["best"]
    kind = kind_words(best["heads"])  # a neuron run's cells knock out neurons
    lines = [f"Drop of {result['task']} (baseline {result['baseline']:.4f}) when the "
             f"top-{result['top_k']} {kind} of each cell are knocked out:", "",
             "| masks \\ sparsity | " + " | ".join(f"{p:g}" for p in sparsities) + " |",
             "| --- |" + " --- |" * len(sparsities)]
    for m in masks:
        lines.append(f"| {m} | " + " | ".join(
            f"{signed(by_cell[(m, p)]['drop'])}" if (m, p) in by_cell else ""
            for p in sparsities) + " |")
    return "\n".join([*lines, "", _best_words(result, kind)])


def _best_words(result: Mapping[str, Any], kind: str) -> str:
    """The grid's verdict: its best cell, or the cells tied at the best drop, or that no
    cell's top-k hurts the task (a ranking is a claim: the first of equal cells, or a
    drop of 0, is no best)."""
    best, task = result["best"], result["task"]

    def cell(c: Mapping[str, Any]) -> str:
        return f"--masks {c['masks']} --sparsity {c['sparsity']:g}"

    if best["drop"] <= 0:
        floor = scores_at_floor(result["baseline"], result.get("higher_is_better"),
                                result.get("metric"))
        return (f"Nothing found: no cell's top-{result['top_k']} {kind} hurt {task} (the "
                f"largest drop: {signed(best['drop'])}), so no cell is best"
                + (f"; {task} scores 0 with nothing knocked out, so no knockout can lower "
                   f"it: {FLOOR_HINT}" if floor else "") + ".")
    tied = [c for c in result["cells"] if c["drop"] == best["drop"]]
    if len(tied) > 1:
        return (f"Best, tied: {len(tied)} cells drop it by {signed(best['drop'])}: "
                + "; ".join(f"{cell(c)} ({kind} {'+'.join(c['heads'])})" for c in tied)
                + ".")
    close = [best, *(c for c in result["cells"] if c.get("within_noise_of_best"))]
    if len(close) > 1:
        return (f"Best, within the noise: {len(close)} cells' drops are within one-sided "
                f"{CONFIDENCE:.0%} noise of the largest, so none is best: "
                + "; ".join(f"{cell(c)} ({kind} {'+'.join(c['heads'])}, drop "
                            f"{signed(c['drop'])})" for c in close) + ".")
    return f"Best: {cell(best)} ({kind} {'+'.join(best['heads'])}, drop {signed(best['drop'])})"
