"""Baselines and analyses on the same engine as ``locate``: greedy, verify, universal, sweep."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .driver import (
    DEFAULT_GENERAL,
    DEFAULT_TASK,
    UsageError,
    _check_positive_int,
    _check_sparsity,
    _relative_drop,
    auto_masks_per_pass,
    head_list,
    load_model,
    locate,
    open_measurement,
    prepare,
    run_plan,
)
from .heads import Head, format_heads, parse_heads, read_heads_file
from .report import HeadRanking, heads_table, plot_heatmap, ranked_heads_json
from .runfolder import RunFolder, RunFolderError

__all__ = ["greedy", "sweep", "universal", "verify"]


# --- greedy -----------------------------------------------------------------------------

def greedy(
    out: str | Path,
    model_args: str | None = None,
    tasks: Sequence[str] = (DEFAULT_TASK,),
    num_samples: int = 100,
    rounds: int = 1,
    top_k: int = 5,
    seed: int = 0,
    include_path: Sequence[str] = (),
    exclude: str | None = None,
    never_ablate: str | None = None,
    apply_chat_template: bool | None = None,
    confirm_run_unsafe_code: bool = False,
    batch_size: int | str = 32,
    force: bool = False,
    verbose: bool = False,
    progress: bool = True,
    masks_per_pass: int | None = None,
) -> dict[str, HeadRanking]:
    """One-shot greedy (``rounds=1``: each head alone, N measurements) or iterative greedy
    (``rounds=k``: k·N, the winners of earlier rounds kept knocked out)."""
    _check_positive_int("--rounds", rounds)
    _check_positive_int("--num-samples", num_samples)
    _check_positive_int("--top-k", top_k)
    if masks_per_pass is not None:
        _check_positive_int("--masks-per-pass", masks_per_pass)
    setup = prepare(model_args, tasks, include_path, confirm_run_unsafe_code)
    if rounds > 1 and len(setup.tasks) > 1:
        raise UsageError("--rounds > 1 follows one task's winners; give a single task")
    skipped = head_list(exclude, setup.num_layers, setup.num_heads, "--exclude") + head_list(
        never_ablate, setup.num_layers, setup.num_heads, "--never-ablate")
    skipped_set = set(skipped)
    candidates = [head for head in (Head.from_index(i, setup.num_heads)
                                    for i in range(setup.total_heads))
                  if head not in skipped_set]
    if rounds > len(candidates) or top_k > len(candidates):
        raise UsageError(f"--rounds {rounds} / --top-k {top_k}: only {len(candidates)} heads "
                         "can be knocked out")
    folder = RunFolder(out)
    folder.start("greedy", {
        "model_args": setup.model_args, "tasks": [f"{n}:{m}" if m else n for n, m in setup.tasks],
        "num_samples": num_samples, "seed": seed, "rounds": rounds,
        "skipped": format_heads(skipped), "apply_chat_template": apply_chat_template,
        "include_path": [str(Path(p).resolve()) for p in include_path],
    }, {"top_k": top_k}, force=force)
    lm = load_model(setup, batch_size)
    measure = open_measurement(setup, lm, num_samples, seed, apply_chat_template,
                               confirm_run_unsafe_code, verbose=verbose)
    folder.update_config(example_subset=measure.subset, layers=setup.num_layers,
                         heads_per_layer=setup.num_heads)
    names = [n for n, _ in setup.tasks]
    per_pass = masks_per_pass or auto_masks_per_pass(lm)
    base = run_plan(folder, measure, [("baseline", [])], desc="baseline", progress=progress)
    baseline = base["baseline"]
    winners: list[Head] = []
    previous = baseline
    for round_number in range(1, rounds + 1):
        plan = [(f"round{round_number}-{head}", [*winners, head])
                for head in candidates if head not in winners]
        records = run_plan(folder, measure, plan, desc=f"greedy round {round_number}/{rounds}",
                           progress=progress, masks_per_pass=per_pass)
        effects = {name: np.full(setup.total_heads, np.nan) for name in names}
        for (_, heads), record in zip(plan, records.values(), strict=True):
            for name in names:
                effects[name][heads[-1].index(setup.num_heads)] = (
                    record["scores"][name] - previous["scores"][name])
        task = names[0]
        harm = _harm(effects[task], bool(baseline["higher_is_better"][task]))
        winner = Head.from_index(int(np.nanargmax(harm)), setup.num_heads)
        previous = records[f"round{round_number}-{winner}"]
        winners.append(winner)
    rankings = {}
    for name in names:
        higher = bool(baseline["higher_is_better"][name])
        harm = _harm(effects[name], higher)
        rest = [int(i) for i in np.argsort(-np.nan_to_num(harm, nan=-np.inf), kind="stable")
                if not math.isnan(harm[i])]
        lead = [w.index(setup.num_heads) for w in winners] if rounds > 1 else []
        order = lead + [i for i in rest if i not in lead]
        rankings[name] = HeadRanking(
            task=name, metric=baseline["metrics"][name], higher_is_better=higher,
            baseline=float(baseline["scores"][name]), effects=effects[name], order=order,
            num_heads=setup.num_heads,
            extra={"method": "iterative greedy" if rounds > 1 else "one-shot greedy",
                   "rounds": rounds, "winners": [str(w) for w in winners],
                   "measurements": len(folder.measurements())})
        folder.write_json(f"heads-{name}.json", ranked_heads_json(rankings[name], top_k))
        folder.write_text(f"heads-{name}.csv", heads_table(rankings[name]))
    first = rankings[names[0]]
    folder.write_json("heads.json", ranked_heads_json(first, top_k))
    folder.write_text("heads.csv", heads_table(first))
    plot_heatmap(list(rankings.values()), top_k, folder.file("heatmap.png"),
                 title=f"{first.extra['method']} (last round's marginal effects)")
    folder.write_text("report.md", _greedy_report(rankings, top_k))
    return rankings


def _harm(effects: np.ndarray, higher_is_better: bool) -> np.ndarray:
    return -effects if higher_is_better else effects


def _greedy_report(rankings: Mapping[str, HeadRanking], top_k: int) -> str:
    lines = []
    for name, ranking in rankings.items():
        lines += [f"# {ranking.extra['method']}: {name} ({ranking.metric})", "",
                  f"Baseline: {ranking.baseline:.4f}; {ranking.extra['measurements']} "
                  "measurements.", "", "| rank | head | score change |", "| --- | --- | --- |"]
        lines += [f"| {r} | {h} | {ranking.effects[h.index(ranking.num_heads)]:+.4f} |"
                  for r, h in enumerate(ranking.top(top_k), start=1)]
        lines.append("")
    return "\n".join(lines)


# --- verify -----------------------------------------------------------------------------

def verify(
    run: str | Path,
    out: str | Path | None = None,
    top_k: int = 5,
    general: Sequence[str] = DEFAULT_GENERAL,
    limit: int | None = None,
    batch_size: int | str = 32,
    confirm_run_unsafe_code: bool = False,
    force: bool = False,
    verbose: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """The paper's verification table: knock out a run's top 1..k heads cumulatively and
    measure the target task(s) ("Task" drop) and general tasks (mean "Gen" drop)."""
    _check_positive_int("--top-k", top_k)
    if limit is not None:
        _check_positive_int("--limit", limit)
    source = RunFolder(run)
    config = source.read_config()
    identity = config["identity"]
    targets = list(identity["tasks"])
    heads_by_task = {}
    for spec in targets:
        name = spec.split(":")[0]
        path = source.file(f"heads-{name}.json")
        if not path.is_file():
            raise RunFolderError(f"{run} has no {path.name}; finish the run first")
        heads_by_task[name] = parse_heads(read_heads_file(path, top=None)[:top_k])
        if len(heads_by_task[name]) < top_k:
            raise UsageError(f"--top-k {top_k}: {path.name} ranks only "
                             f"{len(heads_by_task[name])} heads")
    general = [g for g in general if g not in heads_by_task]
    setup = prepare(identity["model_args"], targets + list(general),
                    identity.get("include_path", []), confirm_run_unsafe_code)
    folder = RunFolder(out or Path(run) / "verify")
    folder.start("verify", {"run": str(Path(run).resolve()), "top_k": top_k,
                            "general": list(general), "limit": limit,
                            "heads": {t: format_heads(h) for t, h in heads_by_task.items()}},
                 {}, force=force)
    lm = load_model(setup, batch_size)
    measure = open_measurement(setup, lm, None, 0, identity.get("apply_chat_template"),
                               confirm_run_unsafe_code, limit=limit, verbose=verbose)
    ranked = {t: read_heads_file(source.file(f"heads-{t}.json"))[:top_k] for t in heads_by_task}
    plan = [("baseline", [])] + [
        (f"{task}-top{k}", parse_heads(names[:k])) for task, names in ranked.items()
        for k in range(1, top_k + 1)]
    records = run_plan(folder, measure, plan, desc="verify", progress=progress)
    table = _verification_table(records, ranked, list(general), top_k)
    folder.write_json("verify.json", table)
    folder.write_text("verify.md", _verification_markdown(table))
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
            drops = {g: _relative_drop(base["scores"][g], record["scores"][g],
                                       base["higher_is_better"][g]) for g in general}
            task_rows.append({
                "k": k, "heads": names[:k], "score": record["scores"][task],
                "task_drop": _relative_drop(base["scores"][task], record["scores"][task],
                                            base["higher_is_better"][task]),
                "gen_drop": float(np.mean(list(drops.values()))) if drops else None,
                "general_scores": {g: record["scores"][g] for g in general},
                "general_drops": drops,
            })
        rows[task] = task_rows
    return {"baseline": base["scores"], "metrics": base["metrics"], "general": general,
            "rows": rows}


def _verification_markdown(table: Mapping[str, Any]) -> str:
    general = table["general"]
    lines = ["# Verification: cumulative knockout of the top heads", ""]
    for task, rows in table["rows"].items():
        lines += [f"## {task} ({table['metrics'][task]}), baseline "
                  f"{table['baseline'][task]:.4f}", "",
                  "| k | heads | score | Task drop | Gen drop |"
                  + "".join(f" {g} |" for g in general),
                  "| --- | --- | --- | --- | --- |" + " --- |" * len(general)]
        for row in rows:
            gen = "n/a" if row["gen_drop"] is None else f"{100 * row['gen_drop']:.1f} %"
            lines.append(f"| {row['k']} | {'+'.join(row['heads'])} | {row['score']:.4f} | "
                         f"{100 * row['task_drop']:.1f} % | {gen} |"
                         + "".join(f" {row['general_scores'][g]:.4f} |" for g in general))
        lines.append("")
    lines.append("Drops are relative to the baseline (positive = worse); Gen is the mean over "
                 "the general tasks: " + (", ".join(general) or "none") + ".")
    return "\n".join(lines) + "\n"


# --- universal --------------------------------------------------------------------------

def universal(runs: Sequence[str | Path], out: str | Path, top_k: int = 5,
              min_tasks: int = 2) -> dict[str, Any]:
    """Heads in the top-k of at least ``min_tasks`` task rankings -> ``universal.json``."""
    _check_positive_int("--top-k", top_k)
    _check_positive_int("--min-tasks", min_tasks)
    if len(runs) < 2:
        raise UsageError(f"universal needs at least 2 run folders, got {len(runs)}")
    rankings: dict[str, list[str]] = {}
    geometry = set()
    for run in runs:
        folder = RunFolder(run)
        config = folder.read_config()
        geometry.add((config.get("layers"), config.get("heads_per_layer")))
        for path in sorted(folder.path.glob("heads-*.json")):
            label = f"{folder.path.name}/{path.stem.removeprefix('heads-')}"
            rankings[label] = read_heads_file(path)
        if not any(label.startswith(f"{folder.path.name}/") for label in rankings):
            raise RunFolderError(f"{run} has no heads-<task>.json; finish the run first")
    if len(geometry) > 1:
        raise UsageError(f"the runs are of different models (layers x heads: "
                         f"{sorted(geometry)}); universal heads compare one model's runs")
    if min_tasks > len(rankings):
        raise UsageError(f"--min-tasks {min_tasks}: only {len(rankings)} task rankings given")
    ranks: dict[str, dict[str, int]] = {}
    for label, names in rankings.items():
        for rank, name in enumerate(names[:top_k], start=1):
            ranks.setdefault(name, {})[label] = rank
    chosen = sorted((h for h in ranks if len(ranks[h]) >= min_tasks),
                    key=lambda h: (-len(ranks[h]), sum(ranks[h].values()), h))
    result = {"top_k": top_k, "min_tasks": min_tasks, "rankings": list(rankings),
              "heads": [{"head": h, "tasks": len(ranks[h]), "ranks": ranks[h]} for h in chosen],
              "candidates": {h: ranks[h] for h in sorted(ranks)}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def universal_table(result: Mapping[str, Any]) -> str:
    labels = result["rankings"]
    lines = ["| head | tasks | " + " | ".join(labels) + " |",
             "| --- | --- |" + " --- |" * len(labels)]
    for entry in result["heads"]:
        lines.append(f"| {entry['head']} | {entry['tasks']} | "
                     + " | ".join(str(entry["ranks"].get(lbl, "")) for lbl in labels) + " |")
    return "\n".join(lines)


# --- sweep ------------------------------------------------------------------------------

def sweep(
    out: str | Path,
    masks: Sequence[int] = (100, 200),
    sparsity: Sequence[float] = (0.01, 0.02, 0.05),
    model_args: str | None = None,
    tasks: Sequence[str] = (DEFAULT_TASK,),
    num_samples: int = 100,
    design: str = "stratified",
    alpha: float = 0.01,
    top_k: int = 5,
    seed: int = 0,
    include_path: Sequence[str] = (),
    never_ablate: str | None = None,
    exclude: str | None = None,
    apply_chat_template: bool | None = None,
    confirm_run_unsafe_code: bool = False,
    batch_size: int | str = 32,
    force: bool = False,
    verbose: bool = False,
    progress: bool = True,
    masks_per_pass: int | None = None,
) -> dict[str, Any]:
    """Appendix A.1: a locate run per (masks, sparsity) cell on the example subset; each
    cell is scored by how much knocking out its top-k hurts the (first) task."""
    if not masks or not sparsity:
        raise UsageError("--masks and --sparsity each need at least one value")
    for value in masks:
        _check_positive_int("--masks", value)
    for value in sparsity:
        _check_sparsity(value)
    if masks_per_pass is not None:
        _check_positive_int("--masks-per-pass", masks_per_pass)
    setup = prepare(model_args, tasks, include_path, confirm_run_unsafe_code)
    folder = RunFolder(out)
    folder.start("sweep", {"model_args": setup.model_args, "tasks": list(tasks),
                           "masks": list(masks), "sparsity": list(sparsity), "design": design,
                           "num_samples": num_samples, "seed": seed, "alpha": alpha,
                           "top_k": top_k, "never_ablate": never_ablate or "",
                           "exclude": exclude or ""}, {}, force=force)
    lm = load_model(setup, batch_size)
    measure = open_measurement(setup, lm, num_samples, seed, apply_chat_template,
                               confirm_run_unsafe_code, verbose=verbose)
    task = setup.tasks[0][0]
    base = run_plan(folder, measure, [("baseline", [])], desc="baseline", progress=progress)
    baseline = base["baseline"]
    cells = []
    for m in masks:
        for p in sparsity:
            cell = f"m{m}-p{p:g}"
            rankings = locate(
                folder.path / cell, tasks=tasks, num_samples=num_samples, masks=m, sparsity=p,
                design=design, alpha=alpha, top_k=top_k, seed=seed, exclude=exclude,
                never_ablate=never_ablate, include_path=include_path, setup=setup,
                measure=measure, progress=progress, force=force,
                masks_per_pass=masks_per_pass)
            top = rankings[task].top(top_k)
            check = run_plan(folder, measure, [(f"{cell}-top{top_k}", top)],
                             desc=f"check {cell}", progress=False)[f"{cell}-top{top_k}"]
            higher = baseline["higher_is_better"][task]
            harm = (baseline["scores"][task] - check["scores"][task]) * (1 if higher else -1)
            cells.append({"masks": m, "sparsity": p, "heads": [str(h) for h in top],
                          "score": check["scores"][task], "drop": harm,
                          "relative_drop": _relative_drop(baseline["scores"][task],
                                                          check["scores"][task], higher),
                          "r2": rankings[task].extra["r2"]})
    # Cells are compared by the absolute harm (defined even for a zero baseline).
    best = max(cells, key=lambda c: c["drop"])
    result = {"task": task, "baseline": baseline["scores"][task], "top_k": top_k,
              "cells": cells, "best": best}
    folder.write_json("sweep.json", result)
    folder.write_text("sweep.md", sweep_table(result) + "\n")
    return result


def sweep_table(result: Mapping[str, Any]) -> str:
    sparsities = sorted({c["sparsity"] for c in result["cells"]})
    masks = sorted({c["masks"] for c in result["cells"]})
    by_cell = {(c["masks"], c["sparsity"]): c for c in result["cells"]}
    lines = [f"Drop of {result['task']} (baseline {result['baseline']:.4f}) when the "
             f"top-{result['top_k']} heads of each cell are knocked out:", "",
             "| masks \\ sparsity | " + " | ".join(f"{p:g}" for p in sparsities) + " |",
             "| --- |" + " --- |" * len(sparsities)]
    for m in masks:
        lines.append(f"| {m} | " + " | ".join(
            f"{by_cell[(m, p)]['drop']:+.4f}" if (m, p) in by_cell else ""
            for p in sparsities) + " |")
    best = result["best"]
    lines += ["", f"Best: --masks {best['masks']} --sparsity {best['sparsity']:g} "
              f"(heads {'+'.join(best['heads'])}, drop {best['drop']:+.4f})"]
    return "\n".join(lines)
