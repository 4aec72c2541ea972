"""Recovery benchmark (issue 10): how many measurements find a task's heads.

Ground truth: the exhaustive single-head knockout of each task on the embedded SmolLM2
(one-shot greedy: every head alone, ranked by the task's metric, ties by the gold
log-likelihood), on the example subset every run here uses. Its run folder is stored in
``benchmarks/exhaustive`` (``benchmarks/README.md`` has the command that made it); this
script makes it when it is missing.

For each method (a ``locate`` configuration) and design seed (``--design-seed``: other
masks, the same examples) one locate run of the largest budget is made, and a budget M
is the fit on its first M masks: the designs draw row by row, so the first M rows are
the M-mask design itself (checked below). Per (task, method, budget, seed):

- **found**: how many of the exhaustive top-5 the run's top-5 holds;
- **joint drop**: the task's drop (its metric, baseline minus score) with the run's
  top-5 knocked out together, over the drop with the exhaustive top-5 knocked out.

Cost is counted in measurement-equivalents (forward passes over the example subset):
M masks (the baseline measurement, one more, is left out of every row alike). A
confirming method (``--confirm``, the defaults) spends a budget M as 4 for the
attribution prior (its measured cost is in the table), then (M − 4)/2 masks and as many
heads knocked out alone; its runs are made per budget (a confirmation is no prefix).

Methods that fit the logprob signal use the same runs as their metric twins: a
measurement by the metric records the gold answers' log-likelihood from the same
answers (``tests/test_signals.py`` checks that it equals ``--signal logprob``).

Usage (repository root; run folders go to benchmarks/recovery-runs, resumed on rerun)::

    python scripts/bench_recovery.py --out RECOVERY.md
    python scripts/bench_recovery.py --tasks headloc_induction --seeds 2 --budgets 25,54 \\
        --methods paper,logprob-p0.05 --out /tmp/recovery.md

The whole benchmark takes hours on a CPU: make it a part at a time (a task, a few
methods), then render every part that is on disk with ``--no-new-runs``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from lm_eval_headloc.commands import RunSpec  # noqa: E402
from lm_eval_headloc.commands.engine import load_model, open_measurement, prepare, run_plan  # noqa: E402
from lm_eval_headloc.commands.greedy import greedy  # noqa: E402
from lm_eval_headloc.commands.locate import (  # noqa: E402
    attribution_prior,
    fit_rankings,
    locate,
    mask_keys,
)
from lm_eval_headloc.commands.runfolder import RunFolder  # noqa: E402
from lm_eval_headloc.designs import design_matrix  # noqa: E402
from lm_eval_headloc.heads import Head, format_heads, parse_heads  # noqa: E402

TASKS = ("headloc_induction", "headloc_ioi", "headloc_arith")
BUDGETS = (25, 40, 54, 80, 100, 150)
GROUND_TRUTH = ROOT / "benchmarks" / "exhaustive"
GROUND_TRUTH_COMMAND = ("headloc-harness greedy --tasks " + ",".join(TASKS)
                        + " --top-k 20 --out benchmarks/exhaustive")
WORK = ROOT / "benchmarks" / "recovery-runs"
TOP = 5
#: The done-when of issue 10: >= 4 of the exhaustive top-5 in >= 80 % of seeds, and a
#: joint drop >= 90 % of the exhaustive top-5's.
FOUND_GOAL, SEED_SHARE_GOAL, DROP_GOAL = 4, 0.8, 0.9


@dataclass(frozen=True)
class Method:
    name: str
    about: str
    sparsity: float
    fit_on: str  # "metric" or "logprob": which recorded score the Lasso fits
    prior: bool = False  # the attribution prior eases the penalty of likely heads
    design: str = "stratified"
    alpha: float = 0.01
    #: Confirmation (--confirm): a budget M is the prior's allowance, then (M - allowance)
    #: split between masks and heads knocked out alone; a run per budget (no prefixes).
    confirm: bool = False

    @property
    def run_name(self) -> str:  # methods differing only in fit_on share their runs
        return f"{self.design}-p{self.sparsity:g}" + ("-confirm" if self.confirm else "")

    def split(self, budget: int) -> tuple[int, int]:
        """(masks, heads confirmed alone) of a budget."""
        if not self.confirm:
            return budget, 0
        masks = (budget - PRIOR_ALLOWANCE) // 2
        return masks, budget - PRIOR_ALLOWANCE - masks


#: Measurement-equivalents a confirming method sets aside for the attribution prior (its
#: measured cost, seconds over a measurement's, is in each table's cost column).
PRIOR_ALLOWANCE = 4
DEFAULTS = RunSpec()

METHODS = (
    Method("default", f"the defaults: `--prior {DEFAULTS.prior}` (atp here), p = "
           f"{DEFAULTS.sparsity:g}, the task {DEFAULTS.signal}; a budget M is "
           f"{PRIOR_ALLOWANCE} for the prior, then `--masks` and `--confirm` (M − "
           f"{PRIOR_ALLOWANCE})/2 each (at M = 54 the defaults themselves, "
           f"{DEFAULTS.masks} + {DEFAULTS.confirm})",
           DEFAULTS.sparsity, DEFAULTS.signal, prior=True, confirm=True),
    Method("paper", "task metric, p = 0.02 (the paper's settings, no confirmation)",
           0.02, "metric"),
    Method("logprob-p0.02", "gold log-likelihood, p = 0.02", 0.02, "logprob"),
    Method("metric-p0.05", "task metric, p = 0.05", 0.05, "metric"),
    Method("logprob-p0.05", "gold log-likelihood, p = 0.05", 0.05, "logprob"),
    Method("metric-p0.1", "task metric, p = 0.1", 0.1, "metric"),
    Method("logprob-p0.1", "gold log-likelihood, p = 0.1", 0.1, "logprob"),
    Method("logprob-p0.05-atp", "gold log-likelihood, p = 0.05, attribution prior "
           "(`--prior atp`)", 0.05, "logprob", prior=True),
    Method("logprob-p0.1-atp", "gold log-likelihood, p = 0.1, attribution prior", 0.1,
           "logprob", prior=True),
)


def _comma(kind: type) -> Any:
    return lambda text: [kind(part) for part in text.split(",") if part.strip()]


_RANKED: list[bool] = []


def ground_truth(task: str) -> dict[str, Any]:
    """The exhaustive ranking of ``task``: greedy's on benchmarks/exhaustive, run once per
    benchmark (it measures what is missing, then ranks with today's rules)."""
    if not _RANKED:
        greedy(GROUND_TRUTH, RunSpec(tasks=TASKS, top_k=20))
        _RANKED.append(True)
    return json.loads((GROUND_TRUTH / f"heads-{task}.json").read_text())


def view(records: Mapping[str, Mapping[str, Any]], task: str, fit_on: str
         ) -> dict[str, dict[str, Any]]:
    """The records as ``fit_rankings`` reads them, scored by the metric or the logprob."""
    if fit_on == "metric":
        return dict(records)
    return {key: {**r, "scores": {task: r["logprob"][task]}, "metrics": {task: "logprob"},
                  "higher_is_better": {task: True}} for key, r in records.items()}


def top_heads(matrix: np.ndarray, records: Mapping[str, Any], task: str, method: Method,
              heads_per_layer: int, prior: Mapping[str, np.ndarray]) -> list[Head]:
    rankings = fit_rankings(matrix, view(records, task, method.fit_on), [task],
                            heads_per_layer, method.alpha, top_k=TOP, bootstrap=None,
                            priors=prior if method.prior else None)
    return rankings[task].top(TOP)


def measured_prefix(out: Path) -> int:
    """How many of a run folder's first design rows have a measurement (0: no run)."""
    if not (out / "design_matrix.npy").is_file():
        return 0
    measured = {r["key"] for r in RunFolder(out).measurements()}
    rows = len(np.load(out / "design_matrix.npy"))
    return next((i for i, key in enumerate(mask_keys(rows)) if key not in measured), rows)


def run_methods(task: str, methods: Sequence[Method], seeds: Sequence[int],
                budgets: Sequence[int], setup: Any, measure: Any,
                prior: Mapping[str, np.ndarray], confirm_budgets: Sequence[int],
                new_runs: bool = True) -> dict[tuple[str, int, int], list[Head]]:
    """Each method's top-5 per (budget, seed): one locate run per (design, sparsity, seed)
    of the largest budget, fitted on its first M masks for each budget M. Without
    ``new_runs`` only what is on disk is fitted: a confirming run that finished, and a
    budget within the masks a run has measured; the rest is left out ("not run")."""
    tops = {}
    for method in (m for m in methods if m.confirm):
        for budget in (b for b in budgets if b in confirm_budgets):
            masks, confirm = method.split(budget)
            for seed in seeds:
                out = WORK / task / method.run_name / f"m{budget}-seed{seed}"
                if not new_runs and not (out / "heads.json").is_file():
                    continue
                cell = setup.spec.replace(design=method.design, sparsity=method.sparsity,
                                          design_seed=seed, masks=masks, confirm=confirm,
                                          prior="atp", signal=method.fit_on, bootstrap=1)
                print(f"[{task}] {method.name} seed {seed}: {masks} masks + {confirm} alone "
                      f"-> {out}", flush=True)
                tops[method.name, budget, seed] = locate(
                    out, cell, setup=setup, measure=measure)[task].top(TOP)
    for run_name in dict.fromkeys(m.run_name for m in methods if not m.confirm):
        first = next(m for m in methods if m.run_name == run_name)
        for seed in seeds:
            cell = setup.spec.replace(design=first.design, sparsity=first.sparsity,
                                      design_seed=seed, masks=max(budgets), bootstrap=1,
                                      prior="none", confirm=0)
            out = WORK / task / run_name / f"seed{seed}"
            if new_runs:
                print(f"[{task}] {run_name} seed {seed}: {cell.masks} masks -> {out}",
                      flush=True)
                locate(out, cell, setup=setup, measure=measure)
            elif measured_prefix(out) < min(budgets):
                continue
            matrix = np.load(out / "design_matrix.npy")
            measured = measured_prefix(out)
            # The first M rows are the M-mask design: a budget is a prefix.
            assert np.array_equal(matrix[:min(budgets)], design_matrix(
                first.design, min(budgets), setup.total_heads, first.sparsity, seed))
            records = {r["key"]: r for r in RunFolder(out).measurements()}
            for method in (m for m in methods if m.run_name == run_name):
                for budget in (b for b in budgets if b <= measured):
                    tops[method.name, budget, seed] = top_heads(
                        matrix[:budget], records, task, method, setup.heads_per_layer, prior)
    return tops


def bench_task(task: str, methods: Sequence[Method], seeds: Sequence[int],
               budgets: Sequence[int], lm: Any, confirm_budgets: Sequence[int],
               new_runs: bool = True) -> tuple[dict[str, Any], Any]:
    truth = ground_truth(task)
    true_top = truth["top_k"][:TOP]
    spec = RunSpec(tasks=(task,), masks=max(budgets), progress=True)
    setup = prepare(spec)
    if lm is None:
        lm = load_model(setup)
    spec = setup.spec
    per_layer = setup.heads_per_layer
    truth_config = json.loads((GROUND_TRUTH / "config.json").read_text())
    # What the joint measurements depend on: the model, the task and its examples.
    identity = {k: v for k, v in spec.identity("locate").items()
                if k in ("model_args", "tasks", "num_samples", "seed", "apply_chat_template")}
    with RunFolder(WORK / task / "joint") as joint:
        joint.start("bench-joint", identity, {}, spec.as_config())
        measure = open_measurement(setup, lm, joint, spec.num_samples)
        if measure.subset[task] != truth_config["example_subset"][task]:
            raise SystemExit(f"{task}: the ground truth was measured on other examples")
        # The prior is the same for every seed (the examples are): computed once.
        prior = attribution_prior(joint, measure) if any(m.prior for m in methods) else {}
        prior_seconds = json.loads(joint.file("prior.json").read_text())["seconds"] \
            if prior else None
        tops = run_methods(task, methods, seeds, budgets, setup, measure, prior,
                           confirm_budgets, new_runs)
        # Joint knockouts: every distinct top-5, and the exhaustive top-5, measured once.
        plan = {"baseline": []}
        for heads in [parse_heads("+".join(true_top)), *tops.values()]:
            ordered = sorted(heads, key=lambda h: h.flat_index(per_layer))
            plan.setdefault(format_heads(ordered), ordered)
        measured = run_plan(joint, measure, list(plan.items()), desc=f"{task} joint",
                            progress=True)
    base = measured["baseline"]["scores"][task]

    def drop(heads: Sequence[Head]) -> float:
        key = format_heads(sorted(heads, key=lambda h: h.flat_index(per_layer)))
        return base - measured[key]["scores"][task]

    true_drop = drop(parse_heads("+".join(true_top)))
    ratios = {key: drop(heads) / true_drop if true_drop else float("nan")
              for key, heads in tops.items()}
    found = {key: len({str(h) for h in heads} & set(true_top)) for key, heads in tops.items()}
    return {"task": task, "truth": truth, "true_top": true_top, "baseline": base,
            "examples": len(truth_config["example_subset"][task]),
            "true_joint_score": base - true_drop, "found": found, "ratios": ratios,
            "tops": {f"{m}|{b}|{s}": [str(h) for h in heads]
                     for (m, b, s), heads in tops.items()},
            "prior_seconds": prior_seconds,
            "prior_ranks": _prior_ranks(prior[task], true_top, per_layer) if prior else None,
            "measurement_seconds": float(np.median(
                [r["seconds"] for r in measured.values() if r.get("seconds")] or [0.0]))}, lm


def _prior_ranks(effects: np.ndarray, heads: Sequence[str], per_layer: int
                 ) -> dict[str, int]:
    """Where each head stands in the prior's ranking (1 = the most harmful)."""
    order = [str(Head.from_flat_index(int(i), per_layer))
             for i in np.argsort(effects, kind="stable")]
    return {head: order.index(head) + 1 for head in heads}


def _cost(method: Method, result: Mapping[str, Any]) -> str:
    if not method.prior or not result["prior_seconds"]:
        return "M"
    prior = result["prior_seconds"] / result["measurement_seconds"]
    if method.confirm:
        return f"M − {PRIOR_ALLOWANCE} + {prior:.1f}"
    return f"M + {prior:.1f}"


def _cell(values: Sequence[float | None], goal_share: bool = True) -> str:
    if any(v is None for v in values):
        return "not run"
    mean = float(np.mean(values))
    share = float(np.mean([v >= FOUND_GOAL for v in values]))
    return f"{mean:.1f} · {share:.0%}" if goal_share else f"{mean:.2f}"


def task_section(result: Mapping[str, Any], methods: Sequence[Method], seeds: Sequence[int],
                 budgets: Sequence[int]) -> list[str]:
    task, truth = result["task"], result["truth"]
    heads = truth["heads"]
    fifth = heads[TOP - 1]["effect"]
    tied = [h["head"] for h in heads if h["effect"] == fifth]
    lines = [f"## {task}", "",
             f"Baseline {truth['metric']} {result['baseline']:.2f} on "
             f"{result['examples']} examples. Exhaustive top-{TOP} (one head knocked out "
             "at a time): "
             + ", ".join(f"{h['head']} ({h['effect']:+.2f})" for h in heads[:TOP])
             + f"; knocked out together they take it to {result['true_joint_score']:.2f}. "
             f"Heads with the 5th place's metric change ({fifth:+.2f}): {len(tied)}"
             + (" (the gold log-likelihood orders them)" if len(tied) > 1 else "") + ".", "",
             f"Found: mean number of the exhaustive top-{TOP} in the run's top-{TOP} · share "
             f"of {len(seeds)} seeds with ≥ {FOUND_GOAL}. Cost: measurement-equivalents "
             "(the prior: its seconds over a measurement's).", "",
             "| method | cost | " + " | ".join(f"M = {b}" for b in budgets) + " |",
             "| --- | --- |" + " --- |" * len(budgets)]
    if result["prior_ranks"]:
        lines[4:4] = [
            f"Attribution prior ({result['prior_seconds']:.1f} s, a measurement "
            f"{result['measurement_seconds']:.2f} s): the exhaustive top-{TOP} stand at "
            + ", ".join(f"{h} #{r}" for h, r in result["prior_ranks"].items())
            + " of its ranking.", ""]
    for m in methods:
        lines.append(f"| {m.name} | {_cost(m, result)} | " + " | ".join(
            _cell([result["found"].get((m.name, b, s)) for s in seeds]) for b in budgets)
                     + " |")
    lines += ["", f"Joint drop: the run's top-{TOP} knocked out together, as a share of the "
              f"exhaustive top-{TOP}'s drop; median (min–max) over seeds.", "",
              "| method | " + " | ".join(f"M = {b}" for b in budgets) + " |",
              "| --- |" + " --- |" * len(budgets)]
    for m in methods:
        cells = []
        for b in budgets:
            ratios = [result["ratios"].get((m.name, b, s)) for s in seeds]
            if None in ratios:
                cells.append("not run")
                continue
            cells.append(f"{np.median(ratios):.0%} ({min(ratios):.0%}–{max(ratios):.0%})")
        lines.append(f"| {m.name} | " + " | ".join(cells) + " |")
    return lines + [""]


def goal_section(results: Sequence[Mapping[str, Any]], methods: Sequence[Method],
                 seeds: Sequence[int], budgets: Sequence[int], budget: int = 54) -> list[str]:
    """Issue 10's done-when at ``budget``: >= 4/5 in >= 80 % of seeds and a median joint
    drop >= 90 % of the exhaustive top-5's, per task."""
    if budget not in budgets:
        return []
    lines = [f"## The goal at M = {budget}", "",
             f"≥ {FOUND_GOAL}/{TOP} of the exhaustive top-{TOP} in ≥ {SEED_SHARE_GOAL:.0%} of "
             f"seeds, and a joint drop ≥ {DROP_GOAL:.0%} of the exhaustive top-{TOP}'s (the "
             "median over seeds).", "",
             "| method | " + " | ".join(r["task"] for r in results) + " |",
             "| --- |" + " --- |" * len(results)]
    for m in methods:
        cells = []
        for r in results:
            if any((m.name, budget, s) not in r["found"] for s in seeds):
                cells.append("not run")
                continue
            share = np.mean([r["found"][m.name, budget, s] >= FOUND_GOAL for s in seeds])
            drop = float(np.median([r["ratios"][m.name, budget, s] for s in seeds]))
            ok = share >= SEED_SHARE_GOAL and drop >= DROP_GOAL
            cells.append(f"{'yes' if ok else 'no'} ({share:.0%}, {drop:.0%})")
        lines.append(f"| {m.name} | " + " | ".join(cells) + " |")
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=_comma(str), default=list(TASKS))
    parser.add_argument("--seeds", type=int, default=5, help="design seeds 0..N-1")
    parser.add_argument("--budgets", type=_comma(int), default=list(BUDGETS))
    parser.add_argument("--methods", type=_comma(str), default=[m.name for m in METHODS])
    parser.add_argument("--confirm-budgets", type=_comma(int), default=None,
                        help="the budgets confirming methods run at (default: all; each "
                             "is its own run, not a prefix)")
    parser.add_argument("--no-new-runs", dest="new_runs", action="store_false",
                        help="fit only the locate runs already on disk (a benchmark made "
                             "over several sessions); cells without one say 'not run'. "
                             "The joint knockouts of the heads found are still measured")
    parser.add_argument("--out", type=Path, default=ROOT / "RECOVERY.md")
    args = parser.parse_args(argv)
    known = {m.name: m for m in METHODS}
    unknown = [name for name in args.methods if name not in known]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; known: {', '.join(known)}")
    methods = [known[name] for name in args.methods]
    seeds = list(range(args.seeds))
    budgets = sorted(args.budgets)
    start = time.time()
    lm, results = None, []
    for task in args.tasks:
        result, lm = bench_task(task, methods, seeds, budgets, lm,
                                args.confirm_budgets or budgets, args.new_runs)
        results.append(result)
    (WORK / "results.json").write_text(json.dumps(
        [{**r, "found": {"|".join(map(str, k)): v for k, v in r["found"].items()},
          "ratios": {"|".join(map(str, k)): v for k, v in r["ratios"].items()}}
         for r in results], indent=1))
    import torch

    not_run = [m.name for m in METHODS if m not in methods]
    command = "python scripts/bench_recovery.py " + shlex.join(
        sys.argv[1:] if argv is None else list(argv))
    lines = [
        "# Recovery: how many measurements find the exhaustive top-5", "",
        "Generated by `scripts/bench_recovery.py` (issue 10); do not edit by hand.", "",
        f"```bash\n{command}\n```", "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; whole run "
        f"{time.time() - start:.0f} s (run folders already on disk are reused)",
        f"- machine: {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads",
        "- model: the embedded SmolLM2-135M-Instruct (270 heads); 100 examples per task, "
        "the same subset (seed 0) in every measurement and in the ground truth",
        f"- ground truth: `{GROUND_TRUTH_COMMAND}` (benchmarks/exhaustive)",
        f"- design seeds: {', '.join(map(str, seeds))}; the Lasso: alpha 0.01 on "
        "standardised scores, fitted intercept", "",
        "Methods (each a `headloc-harness locate` configuration; stratified design):", "",
        *[f"- **{m.name}**: {m.about}" for m in methods], "",
        *([f"Not in this file (not run yet): {', '.join(not_run) or 'none'}; tasks not "
           f"run: {', '.join(t for t in TASKS if t not in args.tasks) or 'none'}; budgets: "
           f"{', '.join(map(str, budgets))} of {', '.join(map(str, BUDGETS))}.", ""]
          if not_run or set(args.tasks) != set(TASKS) else []),
        *(["Made with `--no-new-runs`: only the runs on disk were fitted; a cell without a "
           "complete run for every seed says \"not run\".", ""] if not args.new_runs else []),
        "Cost of a cell: M measurement-equivalents (M masks, each one forward pass over the "
        "example subset; one baseline measurement more for every method).", "",
    ]
    for result in results:
        lines += task_section(result, methods, seeds, budgets)
    lines += goal_section(results, methods, seeds, budgets)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
