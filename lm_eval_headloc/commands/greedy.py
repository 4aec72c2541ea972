"""``greedy``: the paper's baselines. One-shot (each head alone, N measurements: a
confirmation of every head, ranked by the same rule) or iterative (k rounds, each keeping
the earlier winners knocked out, k·N)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.measurement.store import run_plan
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.confirm import Changes
from lm_eval_headloc.method.rank import (
    logprob_changes,
    measured_changes,
    rank_measured,
    tied_with_above,
)
from lm_eval_headloc.method.ranking import Ranking, RankingFacts, largest_single_help
from lm_eval_headloc.report.pages import (
    equal_change_words,
    examples_words,
    floor_words,
    harmless_words,
    knockout_words,
    ranking_table,
    recorded_knockout,
    signal_words,
    spread_words,
    tie_words,
    write_ranking,
)
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.plan import OnDemand
from lm_eval_headloc.runs.record import load_run, start_run
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import RunSpec, command_spec
from lm_eval_headloc.runs.types_file import ensure_types, read_types

__all__ = ["greedy"]


@timing.on_clock
def greedy(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
           **options: Any) -> dict[str, Ranking]:
    """One-shot greedy (``rounds=1``) or iterative greedy (``rounds=k``); returns each
    task's ranking. Iterative rounds follow the first task's winners.

    A head's effect is its score change in the last round it was measured in: for a
    winner, the round it won (later rounds keep it knocked out and do not measure it).
    Heads rank, and each round's winner is chosen, by the rule for heads measured alone
    (``rank.rank_measured``): the most harmful change of the metric first, equal ones
    (with 100 examples, accuracy moves in steps of 0.01) by the drop of the gold answers'
    log-likelihood where it was measured along (loglikelihood tasks), then by head index.
    """
    spec = command_spec("greedy", spec, options)
    setup = prepare(spec)
    spec = setup.spec
    if spec.rounds > 1 and len(setup.tasks) > 1:
        raise UsageError("--rounds > 1 follows one task's winners; give a single task")
    skipped = set(setup.exclude) | set(setup.never_ablate)
    columns = Columns.heads(setup.num_layers, setup.heads_per_layer,
                            setup.geometry.head_layers)
    candidates = [head for head in columns if head not in skipped]
    if spec.rounds > len(candidates) or spec.top_k > len(candidates):
        raise UsageError(f"--rounds {spec.rounds} / --top-k {spec.top_k}: only "
                         f"{counted(len(candidates), 'head')} can be knocked out")
    names = setup.task_names
    with RunFolder(out) as folder:
        # config.json's phases: started, measuring, and (--workers) measured: their shares.
        run = start_run(folder, "greedy", spec, force=force,
                        fingerprint=setup.model_fingerprint)
        measuring = OnDemand(setup, folder, run, spec.num_samples)  # the model when needed

        if read_types(folder) is None:  # what kind of head each is: the ranking files say
            ensure_types(folder, measuring(), spec.probe_rows)
        baseline = run_plan(folder, measuring([("baseline", [])]), [("baseline", [])],
                            desc="baseline", progress=spec.progress)["baseline"]
        higher = {name: bool(baseline["higher_is_better"][name]) for name in names}
        # Per task, each head's changes in the last round it was measured in.
        changes: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in names}
        # Per task, the heads each round measured as its winner did: its winner was then
        # picked among them by head index (a tie, not evidence).
        alike: list[dict[str, set[int]]] = []
        # Per task, each head's changes knocked out alone: round 1's (the earlier winners
        # stay knocked out in later rounds, so theirs are no single knockouts).
        alone: dict[str, dict[int, tuple[float, float]]] = {}
        winners: list[Head] = []
        previous = baseline
        for round_number in range(1, spec.rounds + 1):
            plan = [(f"round{round_number}-{head}", [*winners, head])
                    for head in candidates if head not in winners]
            records = run_plan(folder, measuring(plan), plan,
                               desc=f"greedy round {round_number}/{spec.rounds}",
                               progress=spec.progress, masks_per_pass=spec.masks_per_pass)
            measured = {columns.index(heads[-1]): records[key] for key, heads in plan}
            for name in names:
                changes[name].update(measured_changes(previous, measured, name))
            if round_number == 1:
                alone = {name: dict(changes[name]) for name in names}
            # The round's winner: the first task's most harmful head of this round, by the
            # rule that ranks heads measured alone.
            task = names[0]
            won = rank_measured({h: changes[task][h] for h in measured}, higher[task])[0]
            winner = columns[won]
            alike.append({name: {h for h in measured if changes[name][h] == changes[name][won]}
                          for name in names})
            previous = records[f"round{round_number}-{winner}"]
            winners.append(winner)
        if measuring.measure is not None:  # a rerun that loaded nothing keeps its record
            run.save(folder, measuring.measure)  # the workers' shares, the timings the report says
        rankings = _rankings(changes, winners, baseline, spec.rounds, columns,
                             setup.heads_per_layer, len(folder.measurements()), alike,
                             alone)
        first = next(iter(rankings.values()))
        # A rerun that measured nothing reports what the run recorded: its own record
        # holds no timings or examples (it dropped report.md's time and examples lines).
        said = run if measuring.measure is not None else load_run(folder)
        write_ranking(folder, rankings, spec.top_k,
                      title=f"{first.facts.method} (each head's score change in its "
                            "last measured round)",
                      report=lambda: _report(rankings, spec.top_k, said.timings,
                                             spec.model_args, spec, said.examples_used),
                      knockout=recorded_knockout(spec),
                      # The timings report.md says then hold the report's own.
                      before_report=None if measuring.measure is None
                      else lambda: run.save(folder))
    return rankings


def _rankings(changes: Mapping[str, Changes], winners: list[Head],
              baseline: Mapping[str, Any], rounds: int, columns: Columns,
              heads_per_layer: int, measurements: int,
              alike: Sequence[Mapping[str, set[int]]] = (),
              alone: Mapping[str, Changes] | None = None) -> dict[str, Ranking]:
    """Each task's ranking: iterative greedy's winners first, in the order they won, then
    every head measured by ``rank.rank_measured`` (one-shot greedy: every head, ranked
    as a confirmation that measured every head alone ranks them); heads never measured
    (skipped) are left out and their effect is NaN. A winner is tied with the one above
    where, in the round that one won, it measured the same (``alike``, per round).

    ``alone``: per task, each head's changes knocked out alone (round 1's); the largest
    help among them is the run's ``largest_single_help``. One-shot greedy's ``changes``
    are these; iterative greedy's are not (a head's last round keeps the winners before
    it knocked out), so without ``alone`` it records none."""
    rankings = {}
    lead = columns.indices(winners) if rounds > 1 else []
    for name, task_changes in changes.items():
        higher = bool(baseline["higher_is_better"][name])
        effects = np.full(len(columns), np.nan)
        effects[list(task_changes)] = [change for change, _ in task_changes.values()]
        logprob_change = logprob_changes(task_changes, len(columns))  # the tie-break
        rest = [h for h in rank_measured(task_changes, higher) if h not in lead]
        # Equal measured changes are ties. An iterative winner is ranked by its round,
        # below the one before it unless that one's round measured the two alike.
        tied_leads = {lead[i] for i in range(1, len(lead))
                      if i - 1 < len(alike) and lead[i] in alike[i - 1].get(name, set())}
        tied_set = {h for h in tied_with_above(lead + rest, task_changes)
                    if h not in lead} | tied_leads
        tied = [h for h in lead + rest if h in tied_set]
        rankings[name] = Ranking(
            task=name, metric=baseline["metrics"][name], higher_is_better=higher,
            baseline=float(baseline["scores"][name]), effects=effects,
            order=lead + rest, heads_per_layer=heads_per_layer, columns=columns,
            facts=RankingFacts(
                method="iterative greedy" if rounds > 1 else "one-shot greedy",
                rounds=rounds, winners=[str(w) for w in winners], measurements=measurements,
                tied_with_above=columns.names(tied)),
            evidence={"logprob_change": logprob_change})
        single = (alone or {}).get(name, task_changes if rounds == 1 else None)
        recorded = None if single is None else largest_single_help(
            rankings[name],
            alone={columns[h]: change for h, (change, _) in sorted(single.items())})
        if recorded is not None:
            rankings[name].facts.largest_single_help = recorded
    return rankings


def _report(rankings: Mapping[str, Ranking], top_k: int,
            timings: list[dict[str, Any]] | None = None, model_args: str | None = None,
            spec: RunSpec | None = None, examples_used: Mapping[str, int] | None = None
            ) -> str:
    """report.md: the title, the model, what was scored, what a knockout did, the examples
    and the time, then a section per task (the time stood above the title, and each task
    was a title of its own)."""
    method = next(iter(rankings.values())).facts.method
    lines = [f"# Head localization by {method}", ""]
    if model_args is not None:
        lines.append(f"- model: `{model_args}`")
    if spec is not None:  # what locate's report says of the same (it had no signal line)
        lines += [signal_words(spec), knockout_words(spec, "head"),
                  examples_words(spec, examples_used)]
    if timings:
        lines.append(timing.timings_item(timings))
    if len(lines) > 2:
        lines.append("")
    for name, ranking in rankings.items():
        lines += [f"## {name} ({ranking.metric})", "",
                  f"Baseline: {ranking.baseline:.4f}; {ranking.facts.measurements} "
                  "measurements.", "",
                  *floor_words(ranking),
                  *tie_words(ranking, top_k),
                  *harmless_words(ranking, top_k, all_measured=True),
                  *spread_words(ranking, top_k),
                  *equal_change_words(ranking, top_k, all_measured=True),
                  *ranking_table(ranking, top_k, "score change"), ""]
    return "\n".join(lines)
