"""``universal``: heads in the top-k of several tasks' rankings (of one model): the
heads that hurt every task, to report apart from each task's own and to keep out of
masks (``--never-ablate``). Components are compared by name, so MLP neurons (``L3N12``)
of neuron runs are counted as heads are (listed under ``head`` too). Ties are not an
order: where a ranking's k-th and (k+1)-th have the same evidence, the members of that tie
group are in its top-k by name order only, so they count for no task; a head that would
reach ``min_tasks`` with them is listed as undecided, not as universal. A head that hurts
a task by no more than a single knockout helps it there (``report.pages.within_spread``) counts
as listed, marked ``within_spread_in`` with those rankings: noise, not evidence.

A neuron run searches only its candidate neurons (the prior's picks on its own tasks), so
a neuron missing from a task's top-k may never have been searched there: it counts only
where it was, and the output says where it was not (``not_searched``), so that few or no
universal neurons read as the runs' candidate choice where it is. The table labels each
ranking by its run's number and task (the legend gives the folders; the file keeps the
full ``FOLDER:task`` labels)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lm_eval_headloc.commands.overlap import RankingFile, candidate_neurons, never_searched
from lm_eval_headloc.common.checks import UsageError, check_number
from lm_eval_headloc.common.files import not_a_file, strict_json, write_atomically
from lm_eval_headloc.intervention.model_args import same_model
from lm_eval_headloc.runs.folder import (
    RunFolder,
    checked_path,
    refuse_writing_into,
    run_list,
)
from lm_eval_headloc.runs.record import RunRecord, load_run, ranking_files
from lm_eval_headloc.runs.spec import RunSpec

__all__ = ["MADE_BY", "component_word", "universal", "universal_table"]

MADE_BY = "headloc-harness universal"  # marks a file of ours: the only kind we overwrite
_WORDS = {"heads": "head", "neurons": "neuron"}  # what a run's --components ranks


def component_word(components: str | None) -> str:
    """What the rankings rank, for the output's words: head, neuron, or component (both)."""
    return _WORDS.get(components or "heads", "component")


def _check_out(out: Path, runs: Sequence[str | Path]) -> None:
    refuse_writing_into(out, runs)
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; universal writes one JSON file "
                         f"(e.g. {out / 'universal.json'})")
    if (what := not_a_file(out)) is not None:  # reading a FIFO below would wait for ever
        raise UsageError(f"--out {what}; name a file")
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
    if not runs:
        raise UsageError("universal needs a run folder (one of several tasks, or several)")
    out = checked_path(out, "--out", "universal.json")
    _check_out(out, runs)
    rankings: dict[str, RankingFile] = {}
    task_of: dict[str, str] = {}  # ranking label -> its task
    models: dict[str, str] = {}
    kinds: dict[str, str] = {}  # run -> its --components
    run_of: dict[str, str] = {}  # ranking label -> its run, as given
    record_of: dict[str, RunRecord] = {}  # ranking label -> its run's record
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
            run_of[label], record_of[label] = str(run), record
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
    # The rankings whose run never searched a neuron (not among its candidates): it counts
    # for no task there, as no ranking could hold it (a heads run searches every head).
    listed = sorted({*ranks, *maybe})
    unsearched: dict[str, list[str]] = {}
    unknown = [label for label in rankings  # neuron runs from before candidates were recorded
               if "neurons" in first_kind and candidate_neurons(record_of[label]) is None]
    for label in rankings:
        for name in never_searched(listed, record_of[label]) or []:
            unsearched.setdefault(name, []).append(label)
    searches = ({"not_searched": unsearched, "candidates_unknown": unknown}
                if "neurons" in first_kind else {})

    def marks(h: str) -> dict[str, list[str]]:
        return {**({"within_spread_in": noise[h]} if h in noise else {}),
                **({"not_searched_in": unsearched[h]} if h in unsearched else {})}

    result = {"made_by": MADE_BY, "model_args": next(iter(models.values())), "top_k": top_k,
              "min_tasks": min_tasks, "components": first_kind,
              "runs": list(models), "rankings": list(rankings),
              "heads": [{"head": h, "tasks": tasks(ranks[h]), "ranks": ranks[h], **marks(h)}
                        for h in chosen],
              "undecided": [{"head": h, "tasks": tasks(ranks.get(h, {})),
                             "tasks_at_most": tasks([*ranks.get(h, {}), *maybe[h]]),
                             "ranks": ranks.get(h, {}), "tied_in": maybe[h], **marks(h)}
                            for h in undecided],
              "ties": ties, "candidates": {h: ranks[h] for h in sorted(ranks)},
              **searches}
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        text = strict_json(result)
        write_atomically(out, lambda partial: partial.write_text(text))
    except OSError as err:
        raise UsageError(f"cannot write --out {out}: {err.strerror or err}") from None
    return result


def _short_labels(result: Mapping[str, Any]) -> dict[str, str]:
    """Each ranking's column label: its run's number (``runs``' order) and its task, as
    ``1:gsm8k``; the full ``FOLDER:task`` where the file names no runs (an older file)."""
    # The longest folder first: one folder's path may begin another's.
    runs = sorted(enumerate(result.get("runs", []), start=1), key=lambda run: -len(run[1]))
    short = {}
    for label in result["rankings"]:
        short[label] = next((f"{n}:{label[len(path) + 1:]}" for n, path in runs
                             if label.startswith(f"{path}:")), label)
    return short


def universal_table(result: Mapping[str, Any]) -> str:
    """The universal (and undecided) heads by ranking: a rank, ``tie`` where the head is in
    the tie group across that ranking's k-th place, ``–`` where the ranking's run never
    searched it (a neuron not among its candidates); rankings by short label, with the
    legend of run folders below, and one line instead of a table where none is listed."""
    labels, word = result["rankings"], component_word(result.get("components"))
    short = _short_labels(result)
    entries = [*result["heads"], *result.get("undecided", [])]
    k, min_tasks = result["top_k"], result["min_tasks"]
    if entries:
        lines = [f"| {word} | tasks | " + " | ".join(short[lbl] for lbl in labels) + " |",
                 "| --- | --- |" + " --- |" * len(labels)]
    else:
        lines = [f"No {word} is in the top-{k} of the rankings of {min_tasks} or more tasks "
                 f"(--min-tasks {min_tasks})." if min_tasks > 1 else
                 f"No {word} is in a ranking's top-{k}."]

    def cell(entry: Mapping[str, Any], label: str, empty: str = "") -> str:
        if label in entry.get("not_searched_in", ()):
            return "–"
        shown = str(entry["ranks"].get(label, empty))
        return f"{shown}*" if shown and label in entry.get("within_spread_in", ()) else shown

    for entry in result["heads"]:
        lines.append(f"| {entry['head']} | {entry['tasks']} | "
                     + " | ".join(cell(entry, lbl) for lbl in labels) + " |")
    for entry in result.get("undecided", []):
        cells = [cell(entry, lbl, "tie" if lbl in entry["tied_in"] else "") for lbl in labels]
        lines.append(f"| {entry['head']} (undecided) | {entry['tasks']}-"
                     f"{entry['tasks_at_most']} | " + " | ".join(cells) + " |")
    if result.get("runs") and any(short[lbl] != lbl for lbl in labels):
        lines.append("\nRuns: " + "; ".join(f"{n} = {path}"
                                            for n, path in enumerate(result["runs"], start=1)))
    if any("within_spread_in" in e for e in entries):
        lines.append(f"\n*: in that ranking the {word} hurts the task by no more than a single "
                     "knockout helps it (within the spread of single knockouts): no evidence "
                     "that the task needs it, though it counts as listed")
    lines += _not_searched_lines(result, short,
                                 any("not_searched_in" in e for e in entries))
    for label, tie in result.get("ties", {}).items():
        lines.append(f"\n{short[label]}: ranks {tie['from_rank']}-"
                     f"{tie['from_rank'] + len(tie['group']) - 1} ({', '.join(tie['group'])}) "
                     "have the same evidence or measured harms within the noise of each "
                     f"other; its top-{k} holds {tie['places']} of them, so none counts there")
    return "\n".join(lines)


def _not_searched_lines(result: Mapping[str, Any], short: Mapping[str, str],
                        marked: bool) -> list[str]:
    """What the neuron runs never searched: neurons in some ranking's top-k that another
    ranking's run never had among its candidates, so could not count there (``marked``:
    the table shows some as ``–``)."""
    unsearched, lines = result.get("not_searched") or {}, []
    if unsearched:
        listed = {*result.get("candidates", {}),
                  *(h for tie in result.get("ties", {}).values() for h in tie["group"])}
        word, one = component_word(result.get("components")), len(unsearched) == 1
        legend = "–: that ranking's run never searched the neuron. " if marked else ""
        lines.append(f"\n{legend}{len(unsearched)} of the {len(listed)} {word}s in a "
                     f"ranking's top-{result['top_k']} {'was' if one else 'were'} never "
                     "searched by the run of another ranking (not among its candidate "
                     "neurons), so could not count there: few universal neurons then "
                     "reflect which candidates each run's prior picked on its own tasks, not "
                     "that the tasks need other neurons (more --candidates make the runs "
                     "search more of the same neurons)")
    for label in result.get("candidates_unknown", []):
        lines.append(f"\n{short[label]}: its run records no candidate neurons (a run folder "
                     "from an older version), so which neurons it never searched is unknown")
    return lines
