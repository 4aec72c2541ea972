"""``universal``: heads in the top-k of several tasks' rankings (of one model): the
heads that hurt every task, to report apart from each task's own and to keep out of
masks (``--never-ablate``). Components are compared by name, so MLP neurons (``L3N12``)
of neuron runs are counted as heads are (listed under ``head`` too). Ties are not an
order: where a ranking's k-th and (k+1)-th have the same evidence, the members of that tie
group are in its top-k by name order only, so they count for no task; a head that would
reach ``min_tasks`` with them is listed as undecided, not as universal. A head that hurts
a task by no more than a single knockout helps it there (``report.pages.within_spread``) counts
as listed, marked ``within_spread_in`` with those rankings: noise, not evidence."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.commands.overlap import RankingFile
from lm_eval_headloc.common.checks import UsageError, check_number
from lm_eval_headloc.common.files import strict_json, write_atomically
from lm_eval_headloc.intervention.model_args import same_model
from lm_eval_headloc.runs.folder import RunFolder, refuse_writing_into, run_list
from lm_eval_headloc.runs.record import load_run, ranking_files
from lm_eval_headloc.runs.spec import RunSpec

__all__ = ["MADE_BY", "universal", "universal_table"]

MADE_BY = "headloc-harness universal"  # marks a file of ours: the only kind we overwrite


def _check_out(out: Path, runs: Sequence[str | Path]) -> None:
    refuse_writing_into(out, runs)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; universal writes one JSON file "
                         f"(e.g. {out / 'universal.json'})")
    if out.exists():
        try:
            ours = json.loads(out.read_text()).get("made_by") == MADE_BY
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
            ours = False
        if not ours:
            raise UsageError(f"--out {out} exists and was not written by {MADE_BY}; "
                             "choose another file")


def universal(runs: Sequence[str | Path], out: str | Path, top_k: int = 5,
              min_tasks: int = 2) -> dict[str, Any]:
    """Heads in the top-k of rankings of at least ``min_tasks`` distinct tasks (two runs
    of one task, on other examples say, are one task) -> ``out`` (JSON); a
    head counts for a task only where its ranking does not record it as harmless
    (``intervention.components.recorded_harmless``).

    Rankings are labelled by their run folder's full path and task; every run must be
    of the same model (``model_args.same_model``: the same ``model_args`` but for where it ran).
    """
    runs = run_list(runs)
    top_k = RunSpec(top_k=top_k).validate().top_k  # --top-k's one check
    min_tasks = check_number(min_tasks, "--min-tasks", whole=True, min_val=1)
    if len(runs) < 2:
        raise UsageError(f"universal needs at least 2 run folders, got {len(runs)}")
    out = Path(out)
    _check_out(out, runs)
    rankings: dict[str, RankingFile] = {}
    task_of: dict[str, str] = {}  # ranking label -> its task
    models: dict[str, str] = {}
    kinds: dict[str, str] = {}  # run -> its --components
    run_of: dict[str, str] = {}  # ranking label -> its run, as given
    for run in runs:
        folder = RunFolder(run)
        record = load_run(folder)
        files = ranking_files(folder, record)
        model_args = record.spec.model_args
        path = str(folder.path.resolve())
        if path in models:
            raise UsageError(f"run folder {run} is given twice")
        models[path] = model_args or ""
        kinds[str(run)] = record.spec.components
        for file in files:
            task = file.stem.removeprefix("heads-")
            label = f"{path}:{task}"
            task_of[label], rankings[label] = task, RankingFile.read(file)
            run_of[label] = str(run)
    first, *_ = models
    other = next((p for p in models if not same_model(models[p], models[first])), None)
    if other is not None:
        raise UsageError(f"the runs are of different models ({first}: {models[first]!r}; "
                         f"{other}: {models[other]!r}); universal heads compare one model's "
                         "runs")
    first_run, first_kind = next(iter(kinds.items()))
    unlike = next((run for run, kind in kinds.items() if kind != first_kind), None)
    if unlike is not None:  # a head is never a neuron: a count of 0 shared would say nothing
        raise UsageError(f"the runs locate different components ({first_run}: {first_kind}; "
                         f"{unlike}: {kinds[unlike]}); universal compares runs of the same "
                         "--components")
    distinct = len(set(task_of.values()))
    if min_tasks > distinct:
        raise UsageError(f"--min-tasks {min_tasks}: the runs rank only {distinct} distinct "
                         f"task{'s' if distinct != 1 else ''} (a task ranked by several runs "
                         "counts once)")
    # A ranking shorter than the top-k counts whole (a greedy run may rank a few heads),
    # but a top-k past every ranking would be recorded as a top-k no ranking has.
    longest = max(rankings, key=lambda label: len(rankings[label].names))
    rankings[longest].check_top_k(top_k, run_of[longest], longest=True)
    ranks: dict[str, dict[str, int]] = {}  # head -> {ranking: rank}, surely in its top-k
    ties: dict[str, dict[str, Any]] = {}  # ranking -> the tie group across its k-th place
    noise: dict[str, list[str]] = {}  # head -> rankings where it is within their spread
    for label, ranking in rankings.items():
        for name in ranking.within_spread(top_k):
            noise.setdefault(name, []).append(label)
        sure, group, places = ranking.cut(top_k)
        for rank, name in enumerate(sure, start=1):
            if name not in ranking.harmless:  # a top-k place that does not hurt says nothing
                ranks.setdefault(name, {})[label] = rank
        group = [name for name in group if name not in ranking.harmless]
        if group:
            ties[label] = {"group": group, "places": places, "from_rank": len(sure) + 1}
    maybe = {h: [label for label, tie in ties.items() if h in tie["group"]]
             for h in {h for tie in ties.values() for h in tie["group"]}}

    def tasks(labels: Any) -> int:  # one task ranked by several runs counts once
        return len({task_of[label] for label in labels})

    def order(h: str) -> tuple[int, int, str]:
        return -tasks(ranks.get(h, {})), sum(ranks.get(h, {}).values()), h

    chosen = sorted((h for h in ranks if tasks(ranks[h]) >= min_tasks), key=order)
    undecided = sorted((h for h in maybe if tasks(ranks.get(h, {})) < min_tasks
                        <= tasks([*ranks.get(h, {}), *maybe[h]])), key=order)
    result = {"made_by": MADE_BY, "model_args": next(iter(models.values())), "top_k": top_k,
              "min_tasks": min_tasks, "rankings": list(rankings),
              "heads": [{"head": h, "tasks": tasks(ranks[h]), "ranks": ranks[h],
                         **({"within_spread_in": noise[h]} if h in noise else {})}
                        for h in chosen],
              "undecided": [{"head": h, "tasks": tasks(ranks.get(h, {})),
                             "tasks_at_most": tasks([*ranks.get(h, {}), *maybe[h]]),
                             "ranks": ranks.get(h, {}), "tied_in": maybe[h],
                             **({"within_spread_in": noise[h]} if h in noise else {})}
                            for h in undecided],
              "ties": ties, "candidates": {h: ranks[h] for h in sorted(ranks)}}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        text = strict_json(result)
        write_atomically(out, lambda partial: partial.write_text(text))
    except OSError as err:
        raise UsageError(f"cannot write --out {out}: {err.strerror or err}") from None
    return result


def universal_table(result: Mapping[str, Any]) -> str:
    """The universal (and undecided) heads by ranking: a rank, or ``tie`` where the head
    is in the tie group across that ranking's k-th place."""
    labels = result["rankings"]
    lines = ["| head | tasks | " + " | ".join(labels) + " |",
             "| --- | --- |" + " --- |" * len(labels)]

    def cell(entry: Mapping[str, Any], label: str, empty: str = "") -> str:
        shown = str(entry["ranks"].get(label, empty))
        return f"{shown}*" if shown and label in entry.get("within_spread_in", ()) else shown

    for entry in result["heads"]:
        lines.append(f"| {entry['head']} | {entry['tasks']} | "
                     + " | ".join(cell(entry, lbl) for lbl in labels) + " |")
    for entry in result.get("undecided", []):
        cells = [cell(entry, lbl, "tie" if lbl in entry["tied_in"] else "") for lbl in labels]
        lines.append(f"| {entry['head']} (undecided) | {entry['tasks']}-"
                     f"{entry['tasks_at_most']} | " + " | ".join(cells) + " |")
    if any("within_spread_in" in e for e in (*result["heads"], *result.get("undecided", []))):
        lines.append("\n*: in that ranking the head hurts the task by no more than a single "
                     "knockout helps it (within the spread of single knockouts): no evidence "
                     "that the task needs it, though it counts as listed")
    for label, tie in result.get("ties", {}).items():
        lines.append(f"\n{label}: ranks {tie['from_rank']}-"
                     f"{tie['from_rank'] + len(tie['group']) - 1} ({', '.join(tie['group'])}) "
                     f"have the same evidence; its top-{result['top_k']} holds "
                     f"{tie['places']} of them, so none counts there")
    return "\n".join(lines)
