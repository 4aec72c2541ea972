"""``cross``: CNL's cross-task matrix. Knock out the top-k components (heads, MLP
neurons or both) each run ranked for each of its tasks, and measure every listed task with
them knocked out: is a capability's set specific to it, or general machinery other tasks
need as much?

Rows are the sets knocked out (``RUN:task``), columns the tasks measured, cells the drop
relative to the unablated baseline (``ranking.relative_drop``); erased (scale 0), and with
``--scale`` not 0 also at that scale (2: enhanced). One model load measures everything,
through ``runs.plan.run_plan``, so a killed run resumes.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.commands.verify import (
    ablation_words,
    ablations,
    effect,
    kind_words,
    located_heads,
    percent,
    ranking_notes,
)
from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import write_atomically
from lm_eval_headloc.intervention.model_args import same_model
from lm_eval_headloc.measurement.store import PlanEntry
from lm_eval_headloc.runs.folder import (
    RunFolder,
    option_words,
    refuse_output_path_into,
    refuse_recorded_code,
    run_list,
)
from lm_eval_headloc.runs.option_values import flag_of
from lm_eval_headloc.runs.plan import measured_plan
from lm_eval_headloc.runs.record import check_model_files, load_run
from lm_eval_headloc.runs.setup import NoEffectError, prepare
from lm_eval_headloc.runs.spec import RunSpec, command_spec

__all__ = ["PROMPT_OPTIONS", "cross", "cross_markdown", "plot_cross"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Set:
    label: str  # RUN:task, RUN as given
    run: str  # the run folder's full path
    task: str
    heads: list[str]


@timing.on_clock
def cross(runs: Sequence[str | Path], out: str | Path = "runs/cross",
          spec: RunSpec | None = None, *, force: bool = False, **options: Any
          ) -> dict[str, Any]:
    """The cross-task matrix of ``runs`` (all of one model) -> ``out`` (cross.json,
    cross.md, cross.png). ``spec`` or keyword options give the measurement's: tasks
    (default, or None: the runs' own), top_k, scale, num_samples, seed, ablation, …;
    the model is the runs', and so are the prompt options (``PROMPT_OPTIONS``: chat
    template, few-shot count, system instruction, generation arguments) unless given."""
    runs = [str(Path(run)) for run in run_list(runs)]  # labels without a trailing slash
    if not runs:
        raise UsageError("cross needs at least one run folder")
    own = command_spec("cross", spec, options, ("tasks", *PROMPT_OPTIONS),
                       RunSpec(tasks=None))
    stored, seen, records = {}, set(), {}
    for run in runs:
        path = RunFolder(run).path.resolve()
        if path in seen:
            raise UsageError(f"run folder {run} is given twice")
        seen.add(path)
        records[run] = load_run(run)
        stored[run] = records[run].spec
        refuse_recorded_code(run, stored[run].include_path, stored[run].model_args,
                             "cross cannot measure such a model; verify each run, giving "
                             "verify --model-args with trust_remote_code=True")
    first = runs[0]
    for run in runs[1:]:
        if not same_model(stored[run].model_args, stored[first].model_args):
            raise UsageError(f"the runs are of different models ({first}: "
                             f"{stored[first].model_args!r}; {run}: "
                             f"{stored[run].model_args!r}); a cross matrix compares one "
                             "model's sets")
    run_tasks: dict[str, str] = {}  # task name -> the first run's TASK[:METRIC]
    for run in runs:
        for task in stored[run].tasks:
            run_tasks.setdefault(task.split(":")[0], task)
    inherited = _runs_prompts(own, stored)
    spec = own.replace(
        model_args=stored[first].model_args, signal="metric",
        tasks=tuple(run_tasks.values()) if own.tasks is None else own.tasks,
        include_path=tuple(dict.fromkeys(
            [*(p for run in runs for p in stored[run].include_path), *own.include_path])),
        **inherited)
    spec.validate()
    RunFolder(out).refuse_inside(runs)  # before anything slow: a plain mistake
    refuse_output_path_into(spec.output_path, runs, out)
    sets = [_Set(f"{run}:{task}", str(Path(run).resolve()), task,
                 located_heads(RunFolder(run), task, spec.top_k, records[run]))
            for run in runs for task in (t.split(":")[0] for t in stored[run].tasks)]
    while True:
        try:
            setup = prepare(spec, ranks=False)  # each set's top-k: located_heads checked it
            break
        except NoEffectError as err:
            # A runs' option that would change nothing for these tasks (--gen-kwargs where
            # none generates): the matrix goes without it, and says so.
            name = next((n for n in inherited if getattr(spec, n) is not None
                         and str(err).startswith(flag_of(n))), None)
            if name is None:
                raise
            log.warning("cross: leaving out the runs' %s (%s)", flag_of(name), err)
            spec = spec.replace(**{name: None})
    for run in runs:
        check_model_files(records[run].model_fingerprint, setup.model_fingerprint, run,
                          "cross measures the model the runs were made with",
                          model_args=setup.spec.model_args)
    plan: list[PlanEntry] = [("baseline", [])]
    for ablation in ablations(spec.scale):
        plan += [(f"set{i}{ablation.suffix}", setup.checked(s.heads), ablation.entry)
                 for i, s in enumerate(sets, start=1)]
    identity = {**setup.spec.identity("cross"),
                "sets": [[f"{s.run}:{s.task}", "+".join(s.heads)] for s in sets]}
    with measured_plan(out, "cross", setup.spec, setup, plan, identity=identity,
                       protect=runs, force=force, num_samples=spec.num_samples
                       ) as (folder, records):
        table = _cross_table(records, sets, setup.task_names, setup.spec)
        # The matrix scores by the tasks' metrics (signal="metric" above) whatever each run
        # ranked by: cross.md says where that differs, as verify.md does.
        table["located_by"] = {run: stored[run].signal for run in runs}
        table["ranking_notes"] = {
            s.label: notes for s in sets
            if (notes := ranking_notes(RunFolder(s.run), s.task, spec.top_k))}
        folder.write_json("cross.json", table)
        folder.write_text("cross.md", cross_markdown(table))
        with folder.writing("cross.png") as path:
            plot_cross(table, path)
    return table


#: How each task is asked: a matrix measures the tasks as the runs located them.
PROMPT_OPTIONS = ("apply_chat_template", "num_fewshot", "system_instruction", "gen_kwargs")


def _runs_prompts(own: RunSpec, stored: Mapping[str, RunSpec]) -> dict[str, Any]:
    """The prompt options cross was not given, taken from its runs, which must agree on
    each (otherwise one line asks for it)."""
    taken = {}
    for name in PROMPT_OPTIONS:
        if getattr(own, name) is not None:
            continue
        values = {run: getattr(spec, name) for run, spec in stored.items()}
        if len(set(values.values())) > 1:
            listed = "; ".join(f"{run}: {option_words(flag_of(name), value)}"
                               for run, value in values.items())
            raise UsageError(f"the runs were located with different {flag_of(name)} "
                             f"({listed}); give {flag_of(name)} for the matrix")
        taken[name] = next(iter(values.values()))
    return taken


def _cross_table(records: Mapping[str, Mapping[str, Any]], sets: Sequence[_Set],
                 tasks: list[str], spec: RunSpec) -> dict[str, Any]:
    """cross.json: per ablation (erase first), each set's scores and drops on every
    task, and ``hurts_others``: for each set that hurts its own (measured) task, the
    other tasks it hurts at least as much."""
    base = records["baseline"]
    matrices = []
    for ablation in ablations(spec.scale):
        cells = {s.label: {t: effect(base, records[f"set{i}{ablation.suffix}"], t)
                           for t in tasks} for i, s in enumerate(sets, start=1)}
        drops = {label: {t: cell["task_drop"] for t, cell in row.items()}
                 for label, row in cells.items()}
        hurts = {}
        for s in sets:
            own = drops[s.label].get(s.task, math.nan)
            if math.isfinite(own) and own > 0:
                hurts[s.label] = [t for t in tasks if t != s.task
                                  and math.isfinite(drops[s.label][t])
                                  and drops[s.label][t] >= own]
        matrices.append({
            "name": ablation.name, "scale": ablation.scale,
            "scores": {label: {t: cell["score"] for t, cell in row.items()}
                       for label, row in cells.items()},
            "drops": drops, "hurts_others": hurts})
    return {"model_args": spec.model_args, "top_k": spec.top_k, "tasks": tasks,
            "ablation": spec.ablation, "metrics": base["metrics"], "baseline": base["scores"],
            "sets": [{"label": s.label, "run": s.run, "task": s.task, "heads": s.heads}
                     for s in sets],
            "ablations": matrices}


def _verdict(s: Mapping[str, Any], matrix: Mapping[str, Any], tasks: list[str]) -> str:
    """Whether a set is specific to its task, in words."""
    label, task = s["label"], s["task"]
    if task not in tasks:
        return f"{label}: its own task is not measured."
    own = matrix["drops"][label][task]
    if own is None or not math.isfinite(own):
        return f"{label}: its own task's drop is undefined (its baseline is 0)."
    if label not in matrix["hurts_others"]:
        return f"{label}: does not hurt its own task ({percent(own)})."
    others = matrix["hurts_others"][label]
    if tasks == [task]:  # nothing to be specific against
        return (f"{label}: hurts its own task ({percent(own)}); no other task is measured, "
                "so nothing says whether it is specific.")
    if not others:
        return f"{label}: specific: hurts no other task as much as its own ({percent(own)})."
    said = ", ".join(f"{t} ({percent(matrix['drops'][label][t])})" for t in others)
    return f"{label}: general: hurts {said} as much as its own task ({percent(own)})."


def _sets_word(table: Mapping[str, Any]) -> str:
    """heads, MLP neurons or components: what the table's sets are (``kind_words``)."""
    return kind_words(name for s in table["sets"] for name in s["heads"])


def _signal_words(table: Mapping[str, Any]) -> list[str]:
    """The line saying which runs ranked their sets by the logprob signal, which the
    matrix does not score ([] where none did): a set that moved the gold answers'
    log-likelihood can leave a task's metric where it was, and read as no drop."""
    runs = [run for run, signal in (table.get("located_by") or {}).items()
            if signal == "logprob"]
    if not runs:
        return []
    whose = f"Run {runs[0]} ranked its" if len(runs) == 1 else (
        f"Runs {', '.join(runs)} ranked their")
    return [f"{whose} sets by the gold answers' log-likelihood (--signal logprob); this "
            "matrix scores every task by its metric, which can stay where the "
            "log-likelihood moved.", ""]


def cross_markdown(table: Mapping[str, Any]) -> str:
    """cross.md: one task x task table per ablation, and which sets are specific."""
    tasks = table["tasks"]
    word = _sets_word(table)
    lines = [f"# Cross-task knockout: each run's top-{table['top_k']} {word} per task, "
             "measured on every task", "",
             f"Model: `{table['model_args']}`. Rows: the set knocked out (RUN:task, that "
             f"task's top {word} in that run); columns: the task measured; cells: its drop "
             "relative to the unablated baseline (positive = worse; n/a where the baseline "
             "is 0), the set's own task in bold.", "", *_signal_words(table),
             *ablation_words(table.get("ablation"))]
    for matrix in table["ablations"]:
        lines += [f"## {matrix['name']} (×{matrix['scale']:g})", "",
                  f"| set knocked out | {word} |" + "".join(f" {t} |" for t in tasks),
                  "| --- | --- |" + " --- |" * len(tasks)]
        for s in table["sets"]:
            cells = [percent(matrix["drops"][s["label"]][t]) for t in tasks]
            cells = [f"**{c}**" if t == s["task"] else c for t, c in zip(tasks, cells,
                                                                         strict=True)]
            lines.append(f"| {s['label']} | {'+'.join(s['heads'])} |"
                         + "".join(f" {c} |" for c in cells))
        lines += ["", *(f"- {_verdict(s, matrix, tasks)}" for s in table["sets"]), ""]
    notes = table.get("ranking_notes") or {}
    if notes:
        lines += ["What the runs' rankings say of their sets (each run's report.md):",
                  *(f"- {label}: {note}" for label, listed in notes.items()
                    for note in listed), ""]
    lines.append("Baseline: " + ", ".join(
        f"{t} {table['baseline'][t]:.4f} ({table['metrics'][t]})" for t in tasks) + ".")
    return "\n".join(lines) + "\n"


def plot_cross(table: Mapping[str, Any], path: Path) -> Any:
    """Sets x tasks image of each ablation's drops (report.plot_heatmap's style: red is
    worse, on a symmetric scale), each cell's drop written in it and the sets' own tasks
    boxed. A bare ``Figure`` (returned): the caller's pyplot state is not touched."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import PercentFormatter

    tasks, sets = table["tasks"], table["sets"]
    matrices = table["ablations"]
    # Room for the row labels (RUN:task, as long as the paths given) left of each panel.
    label_width = 0.5 + 0.075 * max(len(s["label"]) for s in sets)
    fig = Figure(figsize=((label_width + 2 + 1.1 * len(tasks)) * len(matrices),
                          2.5 + 0.5 * len(sets)))
    axes = fig.subplots(1, len(matrices), squeeze=False)[0]
    for ax, matrix in zip(axes, matrices, strict=True):
        drops = np.array([[np.nan if matrix["drops"][s["label"]][t] is None
                           else matrix["drops"][s["label"]][t] for t in tasks] for s in sets],
                         dtype=np.float64)
        finite = np.abs(drops[np.isfinite(drops)])
        limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        image = ax.imshow(np.ma.masked_invalid(drops), cmap="RdBu_r", vmin=-limit,
                          vmax=limit, aspect="auto", interpolation="nearest")
        for row, s in enumerate(sets):
            for column, task in enumerate(tasks):
                value = drops[row, column]
                ax.text(column, row, percent(value).replace(" ", ""), ha="center",
                        va="center", fontsize=8,
                        color="white" if abs(value) > 0.6 * limit else "black")
                if task == s["task"]:
                    ax.add_patch(Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False,
                                           edgecolor="black", linewidth=2))
        ax.set_xticks(range(len(tasks)), tasks, rotation=30, ha="right")
        ax.set_yticks(range(len(sets)), [s["label"] for s in sets])
        ax.set_xlabel("task measured")
        ax.set_ylabel("set knocked out")
        ax.set_title(f"{matrix['name']} (×{matrix['scale']:g})", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8, format=PercentFormatter(1.0),
                     label="drop relative to baseline (red: worse)")
    fig.suptitle(f"Cross-task knockout of each run's top-{table['top_k']} {_sets_word(table)} "
                 "(boxed: the set's own task)", fontsize=10)
    fig.tight_layout()
    # Atomically: a kill mid-write never leaves a truncated figure.
    write_atomically(path, lambda partial: fig.savefig(partial, dpi=120, format="png"))
    return fig
