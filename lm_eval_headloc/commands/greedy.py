"""``greedy``: the paper's baselines. One-shot (each head alone, N measurements) or
iterative (k rounds, each keeping the earlier winners knocked out, k·N)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import UsageError
from ..heads import Head
from ..recovery import harm
from .engine import load_model, open_measurement, prepare, run_plan
from .report import HeadRanking, ranking_table, write_ranking
from .runfolder import RunFolder
from .spec import RunSpec

__all__ = ["greedy"]


def greedy(out: str | Path, spec: RunSpec | None = None, *, force: bool = False,
           **options: Any) -> dict[str, HeadRanking]:
    """One-shot greedy (``rounds=1``) or iterative greedy (``rounds=k``); returns each
    task's ranking. Iterative rounds follow the first task's winners.

    A head's effect is its score change in the last round it was measured in: for a
    winner, the round it won (later rounds keep it knocked out and do not measure it).
    Heads whose metric changed equally (with 100 examples, accuracy moves in steps of
    0.01) are ordered by the change of the gold answers' log-likelihood where it was
    measured along (loglikelihood tasks), then by head index.
    """
    spec = (spec or RunSpec()).replace(**options)
    setup = prepare(spec)
    spec = setup.spec
    if spec.rounds > 1 and len(setup.tasks) > 1:
        raise UsageError("--rounds > 1 follows one task's winners; give a single task")
    skipped = set(setup.exclude) | set(setup.never_ablate)
    candidates = [head for head in (Head.from_flat_index(i, setup.heads_per_layer)
                                    for i in range(setup.total_heads)) if head not in skipped]
    if spec.rounds > len(candidates) or spec.top_k > len(candidates):
        raise UsageError(f"--rounds {spec.rounds} / --top-k {spec.top_k}: only "
                         f"{len(candidates)} heads can be knocked out")
    names = setup.task_names
    with RunFolder(out) as folder:
        folder.start("greedy", spec.identity("greedy"), spec.settings("greedy"),
                     spec.as_config(), force=force, assumed=RunSpec.assumed_for_old_runs())
        measure = open_measurement(setup, load_model(setup), folder, spec.num_samples)
        baseline = run_plan(folder, measure, [("baseline", [])], desc="baseline",
                            progress=spec.progress)["baseline"]
        effects = {name: np.full(setup.total_heads, np.nan) for name in names}
        # Tie-breaker: the logprob's change; 0 where it was not measured.
        logprob_effects = {name: np.zeros(setup.total_heads) for name in names}
        winners: list[Head] = []
        previous = baseline
        for round_number in range(1, spec.rounds + 1):
            plan = [(f"round{round_number}-{head}", [*winners, head])
                    for head in candidates if head not in winners]
            records = run_plan(folder, measure, plan,
                               desc=f"greedy round {round_number}/{spec.rounds}",
                               progress=spec.progress, masks_per_pass=spec.masks_per_pass)
            for (key, heads) in plan:
                for name in names:
                    flat = heads[-1].flat_index(setup.heads_per_layer)
                    effects[name][flat] = records[key]["scores"][name] - previous["scores"][name]
                    logprob_effects[name][flat] = _logprob(records[key], name) - _logprob(
                        previous, name)
            task = names[0]
            task_harm = harm(effects[task], bool(baseline["higher_is_better"][task]))
            measured = [head for _, (*_, head) in plan]
            winner = max(measured, key=lambda h: (
                task_harm[h.flat_index(setup.heads_per_layer)],
                -logprob_effects[task][h.flat_index(setup.heads_per_layer)],
                -h.flat_index(setup.heads_per_layer)))
            previous = records[f"round{round_number}-{winner}"]
            winners.append(winner)
        rankings = _rankings(effects, logprob_effects, winners, baseline, spec.rounds,
                             setup.heads_per_layer, len(folder.measurements()))
        first = next(iter(rankings.values()))
        write_ranking(folder, rankings, spec.top_k,
                      title=f"{first.extra['method']} (each head's score change in its "
                            "last measured round)",
                      report=_report(rankings, spec.top_k))
    return rankings


def _logprob(record: Mapping[str, Any], task: str) -> float:
    """The gold answers' log-likelihood a metric measurement carried (0 if none)."""
    return float(record.get("logprob", {}).get(task, 0.0))


def _rankings(effects: Mapping[str, np.ndarray], logprob_effects: Mapping[str, np.ndarray],
              winners: list[Head], baseline: Mapping[str, Any], rounds: int,
              heads_per_layer: int, measurements: int) -> dict[str, HeadRanking]:
    rankings = {}
    lead = [w.flat_index(heads_per_layer) for w in winners] if rounds > 1 else []
    for name, task_effects in effects.items():
        higher = bool(baseline["higher_is_better"][name])
        task_harm = harm(task_effects, higher)
        # Most harmful first; ties by the logprob's drop, then by head index; heads never
        # measured (skipped) left out.
        rest = [int(i) for i in np.lexsort((np.arange(task_harm.size),
                                            logprob_effects[name], -task_harm))
                if np.isfinite(task_harm[i]) and i not in lead]
        rankings[name] = HeadRanking(
            task=name, metric=baseline["metrics"][name], higher_is_better=higher,
            baseline=float(baseline["scores"][name]), effects=task_effects,
            order=lead + rest, heads_per_layer=heads_per_layer,
            extra={"method": "iterative greedy" if rounds > 1 else "one-shot greedy",
                   "rounds": rounds, "winners": [str(w) for w in winners],
                   "measurements": measurements})
    return rankings


def _report(rankings: Mapping[str, HeadRanking], top_k: int) -> str:
    lines = []
    for name, ranking in rankings.items():
        lines += [f"# {ranking.extra['method']}: {name} ({ranking.metric})", "",
                  f"Baseline: {ranking.baseline:.4f}; {ranking.extra['measurements']} "
                  "measurements.", "", *ranking_table(ranking, top_k, "score change"), ""]
    return "\n".join(lines)
