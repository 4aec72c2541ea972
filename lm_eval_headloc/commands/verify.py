"""``verify``: the paper's verification table. Knock out a run's top 1..k heads
cumulatively and measure the run's task(s) ("Task" drop) and general tasks (mean "Gen"
drop)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import UsageError
from ..heads import parse_heads, read_heads_file
from .engine import is_embedded, load_model, open_measurement, prepare, run_plan
from .report import relative_drop
from .result import load_run, start_run
from .runfolder import RunFolder, RunFolderError
from .spec import ABLATION_FLAGS, COMMAND_OPTIONS, RunSpec

__all__ = ["DEFAULT_GENERAL", "OFFLINE_GENERAL", "verification_markdown", "verify"]

DEFAULT_GENERAL = ("hellaswag", "boolq", "arc_challenge", "mmlu")  # the paper's
# The embedded model runs where nothing can be downloaded: offline general tasks.
OFFLINE_GENERAL = ("headloc_induction", "headloc_ioi", "headloc_arith")


def verify(run: str | Path, out: str | Path | None = None, spec: RunSpec | None = None, *,
           force: bool = False, **options: Any) -> dict[str, Any]:
    """Verify run ``run``; the table goes to ``out`` (default ``RUN/verify``).

    The model, tasks and chat-template setting are the run's; ``spec`` or keyword options
    give verify's own (top_k, general, limit, batch_size, …). ``ablation``, ``scale`` and
    ``ablation_data`` keywords change the run's ablation for the verification.
    """
    source = RunFolder(run)
    stored = load_run(source)
    out = Path(out) if out is not None else Path(run) / "verify"
    RunFolder(out).refuse_inside([run])  # before anything slow: a plain mistake
    # The ablation is the run's unless given (verify --ablation mean checks heads found
    # under one kind under another); zero ablation takes no reference set.
    kind = {name: options.pop(name) for name in ABLATION_FLAGS if options.get(name) is not None}
    if kind.get("ablation") == "zero":
        kind.setdefault("ablation_data", None)
    if "ablation_data" in kind:  # the run's JSONL field belongs to the run's file
        kind.setdefault("ablation_field", None)
    own = (spec or RunSpec()).replace(**options)
    # Verification reports the tasks' own metrics, whatever signal the run ranked by.
    spec = stored.spec.replace(
        signal="metric",
        **{name: getattr(own, name) for name in (*COMMAND_OPTIONS["verify"], "progress")},
        **kind)
    spec.validate()
    heads_by_task: dict[str, list[str]] = {}
    for task_spec in spec.tasks:
        name = task_spec.split(":")[0]
        path = source.file(f"heads-{name}.json")
        if not path.is_file():
            raise RunFolderError(f"{run} has no {path.name}; finish the run first")
        ranked = read_heads_file(path)
        if len(ranked) < spec.top_k:
            raise UsageError(f"--top-k {spec.top_k}: {path.name} ranks only {len(ranked)} "
                             "heads")
        heads_by_task[name] = ranked[:spec.top_k]
    general = spec.general if spec.general is not None else (
        OFFLINE_GENERAL if is_embedded(spec.model_args) else DEFAULT_GENERAL)
    general = tuple(g for g in general if g not in heads_by_task)
    spec = spec.replace(general=general)
    setup = prepare(spec, extra_tasks=general)
    if spec.ablation != "zero":
        # The run's own tasks on the run's example subset (verify's --limit is another).
        setup.reference = setup.reference_texts(stored.example_subset)
    with RunFolder(out) as folder:
        # Phases: started, measuring, and (with --workers) measured: their shares.
        record = start_run(folder, "verify", spec, force=force, protect=[run], identity={
            **spec.identity("verify"), "run": str(Path(run).resolve()),
            "heads": {t: "+".join(h) for t, h in heads_by_task.items()}})
        measure = open_measurement(setup, load_model(setup), folder, limit=spec.limit,
                                   run=record)
        record.save(folder, measure)
        plan = [("baseline", [])] + [
            (f"{task}-top{k}", parse_heads(names[:k])) for task, names in heads_by_task.items()
            for k in range(1, spec.top_k + 1)]
        records = run_plan(folder, measure, plan, desc="verify", progress=spec.progress)
        record.save(folder, measure)  # written only if the workers' shares changed
        table = _verification_table(records, heads_by_task, list(general), spec.top_k)
        folder.write_json("verify.json", table)
        folder.write_text("verify.md", verification_markdown(table))
    return table


def _verification_table(records: Mapping[str, Mapping[str, Any]],
                        ranked: Mapping[str, list[str]], general: list[str],
                        top_k: int) -> dict[str, Any]:
    base = records["baseline"]
    rows = {}
    for task, names in ranked.items():
        task_rows = []
        for k in range(1, top_k + 1):
            record = records[f"{task}-top{k}"]
            drops = {g: relative_drop(base["scores"][g], record["scores"][g],
                                      base["higher_is_better"][g]) for g in general}
            defined = [d for d in drops.values() if math.isfinite(d)]
            task_rows.append({
                "k": k, "heads": names[:k], "score": record["scores"][task],
                "task_drop": relative_drop(base["scores"][task], record["scores"][task],
                                           base["higher_is_better"][task]),
                "gen_drop": float(np.mean(defined)) if defined else None,
                "general_scores": {g: record["scores"][g] for g in general},
                "general_drops": drops,
            })
        rows[task] = task_rows
    return {"baseline": base["scores"], "metrics": base["metrics"], "general": general,
            "rows": rows}


def _percent(value: float | None) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{100 * value:.1f} %"


def verification_markdown(table: Mapping[str, Any]) -> str:
    general = table["general"]
    lines = ["# Verification: cumulative knockout of the top heads", ""]
    for task, rows in table["rows"].items():
        lines += [f"## {task} ({table['metrics'][task]}), baseline "
                  f"{table['baseline'][task]:.4f}", "",
                  "| k | heads | score | Task drop | Gen drop |"
                  + "".join(f" {g} |" for g in general),
                  "| --- | --- | --- | --- | --- |" + " --- |" * len(general)]
        for row in rows:
            lines.append(f"| {row['k']} | {'+'.join(row['heads'])} | {row['score']:.4f} | "
                         f"{_percent(row['task_drop'])} | {_percent(row['gen_drop'])} |"
                         + "".join(f" {row['general_scores'][g]:.4f} |" for g in general))
        lines.append("")
    lines.append("Drops are relative to the baseline (positive = worse; n/a where the "
                 "baseline is 0); Gen is the mean over the general tasks: "
                 + (", ".join(general) or "none") + ".")
    return "\n".join(lines) + "\n"
