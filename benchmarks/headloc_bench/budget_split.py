"""How the default budget is split between masks and heads measured alone, with and
without an attribution prior: the evidence behind ``budget.MASK_SHARE``.

Two sources, each counting how many of the exhaustive top-5 (every head knocked out alone,
ranked by the task's metric, ties by the gold log-likelihood) a confirming run's top-5
holds:

- **the embedded model, replayed**: SmolLM2's three offline tasks, four design seeds. The
  masks are the committed no-prior runs' (``benchmarks/recovery-runs/<task>/stratified-p0.1/
  seed<s>``: 54 masks at p = 0.1 each; a budget uses the first M, as a run of M masks
  would measure them), the prior the committed atp-path prior (``prior-atp-path``), and a
  head measured alone reads what the exhaustive run measured for it (``benchmarks/
  exhaustive``: the same examples, the same knockout). The confirmation itself is the
  package's (``headloc_bench.defaults.confirming_run``: ``confirm.confirmation``'s rounds,
  the screen refitted with what was measured, the run's ranking rule), so a replay is what
  ``locate`` would have done with those measurements. A check runs first: replaying each
  committed default run (``stratified-p0.1-atp-path/m54-seed<s>``, its own masks) must
  pick the heads that run picked and rank its top-5.
- **without a prior, rounds or up front**: the same replay without a prior, today's rounds
  against the defaults before them (``confirming_run``'s ``method="before"``: every head
  picked at once in the plain fit's order), because SIMULATION.md's no-prior rows favour
  the up-front pick.
- **the planted simulator** (``headloc_bench.simulation``, SIMULATION.md's world) at 270 and 1,024
  heads, 50 seeds, with no prior and with the prior as on the embedded model
  (``simulated_prior``: two points, noise 0.7, 20 % of the planted heads missed).

A split is a share of the budget left after the prior's allowance (``confirm.
PRIOR_ALLOWANCE``: 8 for atp-path, none without a prior) spent on masks, the rest measured
alone. The committed folders are read from their unpacked copy, ``bench-work/``
(``benchmarks/bench_store.py`` unpacks ``benchmarks/`` there first). Usage (repository root,
about two minutes)::

    python benchmarks/budget_split.py --out docs/budget_split.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from headloc_bench import simulate_recovery  # simulate_recovery: SIMULATION.md's world
from headloc_bench.bench_store import WORK_TREE, work_tree  # the committed runs, unpacked
from headloc_bench.defaults import (
    METHODS,
    confirming_run,
    confirming_run_top,
    exhaustive_top,
    grouped_run_top,
    measured_alone,
    simulated_prior,
)
from headloc_bench.simulation import seed_trial
from lm_eval_headloc.common.files import page_refusal, write_page
from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.method.budget import DEFAULT_BUDGET, MASK_SHARE, PRIOR_ALLOWANCE, budget_split

BENCHMARKS = WORK_TREE  # benchmarks/, unpacked (bench_store.py)
TASKS = ("headloc_induction", "headloc_ioi", "headloc_arith")
DESIGN_SEEDS = (0, 1, 2, 3)
#: Shares of the budget after the prior's allowance spent on masks: the defaults' two.
SHARES = (MASK_SHARE[True], MASK_SHARE[False], 3 / 4)
BUDGETS = (DEFAULT_BUDGET, 100)
#: The prior each row has: atp-path's, or none.
PRIORS = ("atp-path", "none")
#: Group tests (--group-tests) out of the default budget's heads-alone part: none (the
#: default), then the share of it spent on groups instead.
GROUP_TESTS = (0, 6, 10, 14)
#: The page's first line: --out overwrites only a file that starts with it.
TITLE = "# How the default budget is split"


def _records(path: Path) -> dict[str, dict]:
    lines = path.read_text(encoding="utf-8").splitlines()
    return {record["key"]: record for record in map(json.loads, lines)}


def _flat(name: str, heads_per_layer: int) -> int:
    return parse_heads(name)[0].flat_index(heads_per_layer)


class EmbeddedTask:
    """One task's exhaustive measurements, its atp-path prior and the committed masks."""

    def __init__(self, task: str, root: Path = BENCHMARKS) -> None:
        exhaustive = _records(root / "exhaustive" / "measurements.jsonl")
        self.task, self.base = task, exhaustive["baseline"]
        config = json.loads((root / "exhaustive" / "config.json").read_text())
        self.heads_per_layer = int(config["heads_per_layer"])
        total = int(config["layers"]) * self.heads_per_layer
        self.changes, self.logprob = np.zeros(total), np.zeros(total)
        for key, record in exhaustive.items():
            if key == "baseline":
                continue
            head = _flat(record["mask"], self.heads_per_layer)
            self.changes[head] = record["scores"][task] - self.base["scores"][task]
            self.logprob[head] = record["logprob"][task] - self.base["logprob"][task]
        ranking = json.loads((root / "exhaustive" / f"heads-{task}.json").read_text())
        self.truth = {_flat(n, self.heads_per_layer) for n in ranking["top_k"][:5]}
        self.root, self.runs = root, root / "recovery-runs" / task
        self.prior = self._prior(self.runs / "prior-atp-path" / "prior.json")

    def _prior(self, path: Path) -> np.ndarray:
        points = json.loads(path.read_text())["tasks"][self.task]["points"]
        return np.array([point["effects"] for point in points])

    def masks(self, folder: Path) -> tuple[np.ndarray, np.ndarray]:
        """A run folder's design and its masks' scores, in design order."""
        design = np.load(folder / "design_matrix.npy")
        records = _records(folder / "measurements.jsonl")
        if records["baseline"]["scores"][self.task] != self.base["scores"][self.task]:
            raise SystemExit(f"{folder}: its baseline is not the exhaustive run's; the "
                             "replay needs the same examples")
        keys = json.loads((folder / "config.json").read_text()).get("row_keys") or [
            f"mask-{i:04d}" for i in range(len(design))]
        return design, np.array([records[k]["scores"][self.task] for k in keys])

    def run(self, design: np.ndarray, scores: np.ndarray, prior: np.ndarray | None,
            confirm: int, method: str = "defaults") -> tuple[list[int], list[int]]:
        """(the heads measured alone, the top-5) of a confirming run on these masks
        (``headloc_bench.defaults.confirming_run``; ``method`` "before": every head picked up
        front from one plain fit), each head alone reading the exhaustive run's
        measurement of it."""
        picked, top = confirming_run(design, scores, prior, confirm, self.changes,
                                     method=method, logprob_changes=self.logprob)
        return [int(h) for h in picked], [int(h) for h in top]

    def top(self, design: np.ndarray, scores: np.ndarray, prior: np.ndarray | None,
            confirm: int) -> list[int]:
        """The top-5 of a confirming run on these masks."""
        return self.run(design, scores, prior, confirm)[1]


def check_replay(tasks: Sequence[EmbeddedTask]) -> list[str]:
    """Replay each committed default run on its own masks: its picks and top-5 must come
    out as the run wrote them, or the replay is not what locate does."""
    checked = []
    for task in tasks:
        for seed in DESIGN_SEEDS:
            folder = task.runs / "stratified-p0.1-atp-path" / f"m{DEFAULT_BUDGET}-seed{seed}"
            config = json.loads((folder / "config.json").read_text())
            design, scores = task.masks(folder)
            picks, top = task.run(design, scores, task.prior, config["spec"]["confirm"])
            written = [_flat(n, task.heads_per_layer) for n in config["confirm"]["heads"]]
            ranked = json.loads((folder / f"heads-{task.task}.json").read_text())["top_k"][:5]
            if picks != written or top != [_flat(n, task.heads_per_layer) for n in ranked]:
                raise SystemExit(f"{folder}: the replay does not pick or rank as the run did")
            checked.append(f"benchmarks/{folder.relative_to(task.root).as_posix()}")
    return checked


def embedded_rows(tasks: Sequence[EmbeddedTask]) -> list[dict]:
    """Found of the exhaustive top-5 per (prior, budget, share), over tasks and seeds."""
    cells = [(prior, budget, share, *budget_split(budget, prior, share))
             for prior in PRIORS for budget in BUDGETS for share in SHARES]
    # The no-prior defaults until this change: atp-path's 12 + 34, the prior's 8 unspent.
    cells.insert(len(cells) - len(BUDGETS) * len(SHARES),
                 ("none", DEFAULT_BUDGET - PRIOR_ALLOWANCE["atp-path"], None,
                  *budget_split(DEFAULT_BUDGET)))
    runs = {(task.task, seed): task.masks(task.runs / "stratified-p0.1" / f"seed{seed}")
            for task in tasks for seed in DESIGN_SEEDS}
    rows = []
    for prior, budget, share, masks, confirm in cells:
        found: dict[str, list[int] | None] = {}
        for task in tasks:
            hits = []
            for seed in DESIGN_SEEDS:
                design, scores = runs[task.task, seed]
                if masks > len(design):
                    hits = None
                    break
                top = task.top(design[:masks], scores[:masks],
                               task.prior if prior != "none" else None, confirm)
                hits.append(len(set(top) & task.truth))
            found[task.task] = hits
        rows.append(dict(prior=prior, budget=budget, share=share, masks=masks,
                         confirm=confirm, found=found))
    return rows


#: Without a prior, today's rounds against the up-front pick before them, at even splits.
METHOD_CELLS = ((DEFAULT_BUDGET, 27, 27), (100, 50, 50))


def method_rows(tasks: Sequence[EmbeddedTask]) -> list[dict]:
    """Found of the exhaustive top-5 without a prior, per method ("defaults": rounds with
    the screen refitted; "before": the plain fit's order picked up front) and cell of
    ``METHOD_CELLS``: SIMULATION.md's no-prior rows ask the same of the simulator."""
    runs = {(task.task, seed): task.masks(task.runs / "stratified-p0.1" / f"seed{seed}")
            for task in tasks for seed in DESIGN_SEEDS}
    rows = []
    for budget, masks, confirm in METHOD_CELLS:
        for method in METHODS:
            found = {}
            for task in tasks:
                found[task.task] = []
                for seed in DESIGN_SEEDS:
                    design, scores = runs[task.task, seed]
                    top = task.run(design[:masks], scores[:masks], None, confirm, method)[1]
                    found[task.task].append(len(set(top) & task.truth))
            rows.append(dict(budget=budget, masks=masks, confirm=confirm, method=method,
                             found=found))
    return rows


def method_section(rows: list[dict]) -> list[str]:
    """The rounds against the up-front pick, without a prior, on the embedded model."""
    lines = [
        "## Without a prior: rounds or the up-front pick", "",
        "The same replay, no prior. **rounds** (today's `--confirm`): heads measured alone "
        "in rounds of 5, the screen refitted with them held fixed before each. **up "
        "front** (the defaults before): every head picked at once in the plain Lasso "
        "fit's order. SIMULATION.md's no-prior rows find the up-front pick needs fewer "
        "measurements there to reach 4 of 5 in 80 % of seeds; on the real model:", "",
        "| budget | masks + alone | method | " + " | ".join(TASKS) + " | all |",
        "| ---: | ---: | --- |" + " ---: |" * (len(TASKS) + 1),
    ]
    words = {"defaults": "rounds", "before": "up front"}
    for row in rows:
        lines.append(f"| {row['budget']} | {row['masks']} + {row['confirm']} | "
                     f"{words[row['method']]} | "
                     + " | ".join(_mean(row["found"][t]) for t in TASKS)
                     + f" | {_overall(row)} |")
    gaps = []
    for budget, masks, confirm in METHOD_CELLS:
        found = {r["method"]: float(_overall(r)) for r in rows
                 if (r["budget"], r["masks"], r["confirm"]) == (budget, masks, confirm)}
        gap = found["defaults"] - found["before"]
        gaps.append(f"at {budget} the rounds find {gap:+.2f} of 5 against the up-front "
                    "pick" if abs(gap) >= 0.005 else f"at {budget} the two tie")
    runs = len(TASKS) * len(DESIGN_SEEDS)
    return [*lines, "", f"Over {runs} runs, {'; '.join(gaps)}. The default keeps the "
            "rounds: where the real model's measurements and the simulator's world "
            "disagree, the measurements decide; twelve runs on one small model are the "
            "evidence, not a proof.", ""]


def simulated_rows(n_heads: Sequence[int], seeds: int) -> list[dict]:
    """Found of the exhaustive top-5 in the simulator, per N, prior, budget and share, in
    SIMULATION.md's world (``simulate_recovery``'s defaults: fixed documents that every
    measurement shares, as a real run's)."""
    world = simulate_recovery._world_options(simulate_recovery.parse_args([]))
    cells = [(prior, budget, share, *budget_split(budget, prior, share))
             for prior in PRIORS for budget in BUDGETS for share in SHARES]
    rows = []
    for n in n_heads:
        hits: dict[tuple, list[int]] = {cell: [] for cell in cells}
        for seed in range(seeds):
            # One world, design and prior per seed: a cell of M masks is the first M rows.
            trial = seed_trial(n, 0.1, seed, max(cell[3] for cell in cells),
                               world_options=world)
            prior_seq, alone_seq = np.random.SeedSequence(seed).spawn(5)[3:]
            changes = measured_alone(trial.world, int(alone_seq.generate_state(1)[0]))[1]
            truth = set(map(int, exhaustive_top(changes)))
            estimates = simulated_prior(trial.world, np.random.default_rng(prior_seq),
                                        points=2)
            for cell in cells:
                prior, _budget, _share, masks, confirm = cell
                top = confirming_run_top(trial.world, trial.design[:masks],
                                         trial.scores[:masks],
                                         None if prior == "none" else estimates, confirm,
                                         changes)
                hits[cell].append(len(set(map(int, top)) & truth))
        rows += [dict(n_heads=n, prior=prior, budget=budget, share=share, masks=masks,
                      confirm=confirm, hits=hits[prior, budget, share, masks, confirm])
                 for prior, budget, share, masks, confirm in cells]
    return rows


def grouped_rows(n_heads: Sequence[int], seeds: int) -> list[dict]:
    """Found of the exhaustive top-5 and the exact top-5 in the simulator at the default
    budget, with ``GROUP_TESTS`` of its heads measured alone spent on group tests instead
    (``headloc_bench.defaults.grouped_run_top``), per N and prior."""
    world = simulate_recovery._world_options(simulate_recovery.parse_args([]))
    rows = []
    for n in n_heads:
        for prior in PRIORS:
            masks, alone = budget_split(DEFAULT_BUDGET, prior)
            hits: dict[int, list[int]] = {g: [] for g in GROUP_TESTS}
            for seed in range(seeds):
                trial = seed_trial(n, 0.1, seed, 2 * masks, world_options=world)
                prior_seq, alone_seq = np.random.SeedSequence(seed).spawn(5)[3:]
                changes = measured_alone(trial.world,
                                         int(alone_seq.generate_state(1)[0]))[1]
                truth = set(map(int, exhaustive_top(changes)))
                estimates = None if prior == "none" else simulated_prior(
                    trial.world, np.random.default_rng(prior_seq), points=2)
                for groups in GROUP_TESTS:
                    top = grouped_run_top(trial.world, trial.design[:masks],
                                          trial.scores[:masks], estimates, alone - groups,
                                          groups, changes)
                    hits[groups].append(len(set(map(int, top)) & truth))
            rows.append(dict(n_heads=n, prior=prior, masks=masks, alone=alone, hits=hits))
    return rows


def grouped_section(rows: list[dict]) -> list[str]:
    lines = [
        "## Group tests out of the heads-alone part", "",
        f"The default budget ({DEFAULT_BUDGET}), its masks as above, and G of the "
        "measurements it spends on heads alone spent on group tests instead "
        "(`--group-tests G`, `group_tests.group_testing`: the heads not measured alone "
        "knocked out together, those the fit implicates first, then those the masks "
        "covered least, halved where a group reaches the top-5's entry bar). The planted "
        f"simulator as below ({len(rows[0]['hits'][0])} seeds, fixed documents, so a set's "
        "score is a function of the set as on a real model). Cell: mean found of the "
        "exhaustive top-5 (share of seeds with all 5).", "",
        "| N | prior | masks + alone | " + " | ".join(f"G = {g}" for g in GROUP_TESTS)
        + " |", "| ---: | --- | --- |" + " ---: |" * len(GROUP_TESTS)]
    for row in rows:
        cells = [f"{_mean(row['hits'][g])} ({np.mean(np.array(row['hits'][g]) == 5):.0%})"
                 for g in GROUP_TESTS]
        lines.append(f"| {row['n_heads']:,} | {row['prior']} | {row['masks']} + "
                     f"{row['alone']} | " + " | ".join(cells) + " |")
    best = all(max(GROUP_TESTS, key=lambda g, r=r: (np.mean(r["hits"][g]), -g)) == 0
               for r in rows)
    lines += ["", ("No group-test share finds more of the top-5 than none, at any N, with "
                   "or without a prior: in this world the heads measured alone are worth "
                   "more than the groups, so the default budget's 54 stay masks and heads "
                   "alone, and the group tests come after them: a default run tests what "
                   "they left unchecked until it is certified (docs/method.md)."
                   if best else
                   "Some group-test share finds more of the top-5 than none here (the "
                   "row's best): see RECOVERY.md for the real model before a default "
                   "follows it."), ""]
    return lines


def _share_words(share: float | None) -> str:
    return "before this change" if share is None else f"{share:.2f}"


def _mean(values: Sequence[int]) -> str:
    return f"{np.mean(values):.2f}"


def _overall(row: dict) -> str:
    return _mean([h for t in TASKS for h in row["found"][t]])


def _row_of(rows: list[dict], prior: str, budget: int, share: float | None) -> dict:
    return next(r for r in rows if (r["prior"], r["budget"], r["share"]) == (prior, budget, share))


def embedded_section(embedded: list[dict], checked: list[str]) -> list[str]:
    """The replay's table and what the defaults take from it (no simulator: the tests
    render it to compare with the committed page)."""
    lines = [
        "## The embedded model, replayed", "",
        f"SmolLM2-135M (270 heads), {len(TASKS)} tasks × {len(DESIGN_SEEDS)} design seeds "
        "(their committed masks, the committed atp-path prior, the exhaustive run's "
        "single-head measurements). Checked first: replaying the "
        f"{len(checked)} committed default runs on their own masks picks and ranks "
        "exactly as they did. n/a: more masks than the committed runs hold.", "",
        "| prior | budget | masks share | masks + alone | " + " | ".join(TASKS)
        + " | all |",
        "| --- | ---: | ---: | ---: |" + " ---: |" * (len(TASKS) + 1),
    ]
    for row in embedded:
        found = row["found"]
        cells = ["n/a" if found[t] is None else _mean(found[t]) for t in TASKS]
        total = "n/a" if any(found[t] is None for t in TASKS) else _overall(row)
        lines.append(f"| {row['prior']} | {row['budget']} | {_share_words(row['share'])} | "
                     f"{row['masks']} + {row['confirm']} | " + " | ".join(cells)
                     + f" | {total} |")
    old = _row_of(embedded, "none", DEFAULT_BUDGET - PRIOR_ALLOWANCE["atp-path"], None)
    new = _row_of(embedded, "none", DEFAULT_BUDGET, MASK_SHARE[False])
    kept = _row_of(embedded, "atp-path", DEFAULT_BUDGET, MASK_SHARE[True])
    lines += [
        "", f"Without a prior the defaults were {old['masks']} + {old['confirm']} "
        f"({old['budget']} measurements, the prior's 8 unspent): {_overall(old)} of 5 here. "
        f"Now the whole {DEFAULT_BUDGET}, {new['masks']} + {new['confirm']}: "
        f"{_overall(new)} of 5. With atp-path's prior the split stays {kept['masks']} + "
        f"{kept['confirm']}: {_overall(kept)} of 5. Twelve runs are few: a difference of a "
        "few tenths is within their spread; the doubling is not.", "",
    ]
    return lines


def simulated_section(simulated: list[dict]) -> list[str]:
    lines = [
        "## The planted simulator", "",
        f"SIMULATION.md's world, {len(simulated[0]['hits'])} seeds, the exhaustive top-5 as "
        "the truth; with a prior: two points as on the embedded model (noise 0.7, 20 % of "
        "the planted heads missed, each point on its own). Cell: mean found (share of "
        "seeds with ≥ 4). Read it for the direction at sizes the embedded model cannot "
        "show (1,024 heads is Llama-3.1-8B's count), not for the level: its world is a "
        "model of a task. Where it and the embedded model disagree on the best share "
        "without a prior, the default follows the real model's measurements.", "",
        "| N | prior | budget | " + " | ".join(f"share {s:.2f}" for s in SHARES)
        + " | most found |",
        "| ---: | --- | ---: |" + " ---: |" * len(SHARES) + " --- |",
    ]
    for n in sorted({r["n_heads"] for r in simulated}):
        for prior in PRIORS:
            for budget in BUDGETS:
                cells, means = [], {}
                for share in SHARES:
                    hits = next(r["hits"] for r in simulated if (
                        r["n_heads"], r["prior"], r["budget"], r["share"])
                        == (n, prior, budget, share))
                    means[share] = _mean(hits)
                    cells.append(f"{means[share]} ({np.mean(np.array(hits) >= 4):.0%})")
                best = [f"{s:.2f}" for s in SHARES if means[s] == max(means.values())]
                lines.append(f"| {n:,} | {prior} | {budget} | " + " | ".join(cells)
                             + f" | share {' = '.join(best)} |")
    return [*lines, ""]


def render(embedded: list[dict], methods: list[dict], simulated: list[dict],
           checked: list[str], command: str, seconds: float,
           grouped: list[dict] | None = None) -> str:
    lines = [
        TITLE, "",
        f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC} in {seconds:.0f} s by",
        "", f"```bash\n{command}\n```", "",
        "A budget of M measurement-equivalents is the prior's allowance (8 for atp-path, "
        "none without a prior), then a share of the rest in masks (p = 0.1) and the "
        "remainder measured alone in rounds of 5 (`budget.budget_split`). The defaults: "
        f"{MASK_SHARE[True]:.2f} with a prior (12 + 34 at 54), {MASK_SHARE[False]:.2f} "
        "without one (27 + 27). Each cell: how many of the exhaustive top-5 the run's "
        "top-5 holds, the mean over runs. The method is in the docstring of "
        "`benchmarks/headloc_bench/budget_split.py`.", "",
        *embedded_section(embedded, checked), *method_section(methods),
        *simulated_section(simulated), *(grouped_section(grouped) if grouped else [])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the Markdown here")
    parser.add_argument("--seeds", type=int, default=50, help="simulator seeds (default 50)")
    parser.add_argument("--n-heads", default="270,1024",
                        help="simulated model sizes (default 270,1024)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(n) for n in args.n_heads.split(",")]
    except ValueError:
        parser.error(f"--n-heads {args.n_heads!r}: whole numbers, comma-separated")
    if args.seeds < 1 or any(n < 20 for n in sizes):
        parser.error("--seeds must be >= 1 and each --n-heads >= 20")
    if args.out is not None and (why := page_refusal(args.out, TITLE)) is not None:
        parser.error(f"--out: {why}")
    root = work_tree()  # up to date with benchmarks/
    started = time.perf_counter()
    tasks = [EmbeddedTask(task, root) for task in TASKS]
    checked = check_replay(tasks)
    simulated = simulated_rows(sizes, args.seeds)
    grouped = grouped_rows(sizes, args.seeds)
    text = render(embedded_rows(tasks), method_rows(tasks), simulated, checked,
                  "python benchmarks/budget_split.py " + " ".join(map(shlex.quote, argv)),
                  time.perf_counter() - started, grouped)
    print(text, end="")
    if args.out is not None:
        write_page(args.out, text, TITLE)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
