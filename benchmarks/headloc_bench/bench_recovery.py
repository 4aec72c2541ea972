"""Recovery benchmark: how many measurements find a task's heads.

Ground truth: the exhaustive single-head knockout of each task on the embedded SmolLM2
(one-shot greedy: every head alone, ranked by the task's metric, ties by the gold
log-likelihood), on the example subset every run here uses. Its run folder is stored in
``benchmarks/exhaustive`` (``benchmarks/README.md`` has the command that made it); this
script makes it when it is missing.

The run folders are stored packed in ``benchmarks/`` (``benchmarks/bench_store.py``): the
script works in their unpacked copy, ``bench-work/`` (unpacked where the archives are
newer before it starts, packed back into ``benchmarks/`` when it ends; a part that did
not change keeps its archive byte for byte).

For each method (a ``locate`` configuration) and design seed (``--design-seed``: other
masks, the same examples) one locate run of the largest budget is made, and a budget M
is the fit on its first M masks: the designs draw row by row, so the first M rows are
the M-mask design itself (checked below). Per (task, method, budget, seed):

- **found**: how many of the exhaustive top-5 the run's top-5 holds;
- **joint drop**: the task's drop (its metric, baseline minus score) with the run's
  top-5 knocked out together, over the drop with the exhaustive top-5 knocked out.

Cost is counted in measurement-equivalents (forward passes over the example subset):
M masks (the baseline measurement, one more, is left out of every row alike). A
confirming method (``--confirm``, the defaults) spends a budget M as its prior's
allowance (``budget.PRIOR_ALLOWANCE``; the prior's measured cost is in the table), then
masks and heads knocked out alone as the simulator splits it
(``headloc_bench.defaults.confirmed_split``: the defaults' ``budget.budget_split``, the
earlier defaults' halves); its runs are made per budget (a confirmation is no prefix).

Methods that fit the logprob signal use the same runs as their metric twins: a
measurement by the metric records the gold answers' log-likelihood from the same
answers (``tests/test_signals.py`` checks that it equals ``--signal logprob``).

Usage (repository root; run folders go to bench-work/recovery-runs, resumed on rerun)::

    python benchmarks/bench_recovery.py --out RECOVERY.md
    python benchmarks/bench_recovery.py --tasks headloc_induction --seeds 2 --budgets 25,54 \\
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

from headloc_bench import ROOT
from headloc_bench.bench_store import WORK_TREE, store_work, work_tree
from headloc_bench.defaults import confirmed_split
from lm_eval_headloc.commands.greedy import greedy
from lm_eval_headloc.commands.locate import attribution_prior, locate, refit
from lm_eval_headloc.common.files import page_refusal, write_page
from lm_eval_headloc.intervention.components import Head, format_heads, parse_heads
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.measurement.metrics import TaskScore
from lm_eval_headloc.measurement.store import run_plan
from lm_eval_headloc.method.budget import PRIOR_ALLOWANCE
from lm_eval_headloc.method.confirm import alternated, prior_rankings
from lm_eval_headloc.method.designs import design_matrix
from lm_eval_headloc.method.rank import fit_rankings, mask_keys
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.plan import load_model, open_measurement
from lm_eval_headloc.runs.record import load_run
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import RunSpec

TASKS = ("headloc_induction", "headloc_ioi", "headloc_arith")
#: Tasks no default was chosen on: reported apart, with their own ground truth.
HELD_OUT = ("heldout_successor", "heldout_ioi_b", "heldout_kv_recall")
#: The priors the benchmark times and ranks (ig is not benchmarked).
BENCH_PRIORS = ("atp", "atp-path")
#: The page's first line: --out writes only over a page that begins with it.
TITLE = "# Recovery: how many measurements find the exhaustive top-5"
BUDGETS = (25, 27, 40, 54, 80, 100, 150)
GROUND_TRUTH = WORK_TREE / "exhaustive"
GROUND_TRUTH_COMMAND = ("headloc-harness greedy --tasks " + ",".join(TASKS)
                        + " --top-k 20 --out benchmarks/exhaustive")
HELD_OUT_TRUTH = WORK_TREE / "exhaustive-heldout"
HELD_OUT_TRUTH_COMMAND = ("headloc-harness greedy --tasks " + ",".join(HELD_OUT)
                          + " --top-k 20 --out benchmarks/exhaustive-heldout")


def truth_folder(task: str) -> Path:
    """The exhaustive run folder that holds ``task``'s ground truth."""
    return HELD_OUT_TRUTH if task in HELD_OUT else GROUND_TRUTH
WORK = WORK_TREE / "recovery-runs"
TOP = 5
#: The recovery goal: >= 4 of the exhaustive top-5 in >= 80 % of seeds, and a joint drop
#: >= 90 % of the exhaustive top-5's.
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
    #: Confirmation (--confirm): a budget M is the prior's allowance, then the rest split
    #: between masks and heads knocked out alone as the simulated method ``split_as``
    #: splits it (``headloc_bench.defaults.confirmed_split``); a run per budget (no prefixes).
    confirm: bool = False
    prior_kind: str = "atp"  # --prior of a confirming method
    split_as: str = "before"
    #: The share of the heads-alone part spent on group tests (--group-tests) instead.
    group_share: float = 0.0
    #: Not a locate run: a peer method computed from the prior or from other runs' masks.
    peer: str | None = None

    @property
    def run_name(self) -> str:  # methods differing only in fit_on share their runs
        return f"{self.design}-p{self.sparsity:g}" + (
            "" if not self.confirm else "-confirm" if self.prior_kind == "atp"
            else f"-{self.prior_kind}") + (f"-groups{self.group_share:.2f}"
                                           if self.group_share else "")

    @property
    def allowance(self) -> int:
        """Measurement-equivalents set aside for a confirming method's prior (its measured
        cost, seconds over a measurement's, is in each table's cost column)."""
        return PRIOR_ALLOWANCE[self.prior_kind]

    def split(self, budget: int) -> tuple[int, int, int]:
        """(masks, heads confirmed alone, group tests) of a budget."""
        if not self.confirm:
            return budget, 0, 0
        masks, alone = confirmed_split(budget, self.split_as)
        groups = round(alone * self.group_share)
        return masks, alone - groups, groups


DEFAULTS = RunSpec().budgeted("atp-path")  # the defaults of a run with its prior

METHODS = (
    Method("default", f"the defaults: `--prior {DEFAULTS.prior}` (atp-path here), p = "
           f"{DEFAULTS.sparsity:g}, the task {DEFAULTS.signal}; a budget M is "
           f"{PRIOR_ALLOWANCE['atp-path']} for the prior, then `--masks` "
           f"{DEFAULTS.masks}/{DEFAULTS.masks + DEFAULTS.confirm} of the rest (rounded) and "
           f"`--confirm` the rest, measured alone in rounds of 5 (at M = 54 the defaults "
           f"themselves, {DEFAULTS.masks} + {DEFAULTS.confirm})",
           DEFAULTS.sparsity, DEFAULTS.signal, prior=True, confirm=True,
           prior_kind="atp-path", split_as="defaults"),
    Method("default-groups", "the defaults' prior, masks and sparsity, with 10/34 of the "
           "heads-alone part spent on group tests instead (`--group-tests`; at M = 54: 12 "
           "masks + 24 alone + 10 group tests): the heads not measured alone, knocked out "
           "together in groups and halved where a group reaches the top-5's entry bar",
           DEFAULTS.sparsity, DEFAULTS.signal, prior=True, confirm=True,
           prior_kind="atp-path", split_as="defaults", group_share=10 / 34),
    Method("default-before", "the defaults until this change: `--prior atp`, p = 0.1, "
           f"the task metric; {PRIOR_ALLOWANCE['atp']} for the prior, then `--masks` and "
           "`--confirm` (M − 4)/2 each (at M = 54: 25 + 25, the heads to confirm picked up "
           "front, the prior's and the fit's in turn)",
           0.1, "metric", prior=True, confirm=True),
    Method("atp", "attribution patching alone (Nanda 2022; Kramár et al. 2024): the "
           "prior's own top-5, nothing measured but its pass", 0.1, "metric", prior=True,
           peer="atp"),
    Method("atp-path", "the two-point prior alone: the top-5 of its two rankings (the clean "
           "run's, the half-ablated run's) taken in turn", 0.1, "metric", prior=True,
           peer="atp-path"),
    Method("coar-p0.1", "a COAR-style fit (Shah, Ilyas & Madry 2024): the same random "
           "masks as metric-p0.1 (10 % of heads each), an ordinary least-squares fit with "
           "a small ridge (sklearn Ridge, alpha 1) instead of the Lasso", 0.1, "metric",
           peer="coar"),
    Method("coar-p0.02", "the same COAR-style fit on the paper's masks (2 % of heads each, "
           "the runs of the paper's settings)", 0.02, "metric", peer="coar"),
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


_RANKED: list[Path] = []


def ground_truth(task: str) -> dict[str, Any]:
    """The exhaustive ranking of ``task``: greedy's on benchmarks/exhaustive, run once per
    benchmark (it measures what is missing, then ranks with today's rules)."""
    folder = truth_folder(task)
    if folder not in _RANKED:
        spec = RunSpec(tasks=HELD_OUT if task in HELD_OUT else TASKS, top_k=20)
        if (folder / "config.json").is_file():
            # Resumed with the spec it records: a plain RunSpec would write today's
            # defaults of the options greedy does not use over the folder's own.
            spec = load_run(folder).spec.replace(top_k=20)
        greedy(folder, spec)
        _RANKED.append(folder)
    return json.loads((folder / f"heads-{task}.json").read_text())


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


def peer_tops(task: str, method: Method, seeds: Sequence[int], budgets: Sequence[int],
              setup: Any, priors: Mapping[str, Mapping[str, np.ndarray]]
              ) -> dict[tuple[str, int, int], list[Head]]:
    """A peer method's top-5 per (budget, seed). The priors alone measure nothing but their
    passes, so every budget and seed has the same answer; the COAR-style fit refits the
    metric-p0.1 runs' first M masks."""
    per_layer = setup.heads_per_layer
    tops = {}
    if method.peer in ("atp", "atp-path"):
        orders = prior_rankings(priors[method.peer][task])
        top = [Head.from_flat_index(h, per_layer) for h in alternated(orders, TOP)]
        return {(method.name, b, s): top for b in budgets for s in seeds}
    from sklearn.linear_model import Ridge

    for seed in seeds:
        out = WORK / task / f"{method.design}-p{method.sparsity:g}" / f"seed{seed}"
        measured = measured_prefix(out)
        if not measured:
            continue
        matrix = np.load(out / "design_matrix.npy")
        records = {r["key"]: r for r in RunFolder(out).measurements()}
        y = np.array([records[k]["scores"][task] for k in mask_keys(measured)])
        for budget in (b for b in budgets if b <= measured):
            fit = Ridge(alpha=1.0).fit(matrix[:budget].astype(float), y[:budget])
            order = np.argsort(fit.coef_, kind="stable")  # most harmful (negative) first
            tops[method.name, budget, seed] = [Head.from_flat_index(int(h), per_layer)
                                               for h in order[:TOP]]
    return tops


def types_once_per_task(task: str) -> None:
    """Every run of ``task`` writes the same head types (the model's, on the task's
    examples): the first computes them (82 s here), the others copy its types.json
    (``WORK/<task>/types.json``) instead of computing them again."""
    import importlib

    from lm_eval_headloc.runs.types_file import TYPES_FILE

    # The module (the package's ``locate`` is the function of that name).
    locate_module = importlib.import_module("lm_eval_headloc.commands.locate")

    original = getattr(locate_module.ensure_types, "__wrapped__", locate_module.ensure_types)
    cache = WORK / task / "types.json"

    def ensure_types(folder: Any, measure: Any, probe_rows: int) -> Any:
        if not folder.file(TYPES_FILE).is_file() and cache.is_file():
            data = json.loads(cache.read_text())
            if data["probe"]["batch"] == probe_rows:
                folder.write_json(TYPES_FILE, data)
        types = original(folder, measure, probe_rows)
        if types is not None and not cache.is_file():
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(folder.file(TYPES_FILE).read_text())
        return types

    ensure_types.__wrapped__ = original  # type: ignore[attr-defined]
    locate_module.ensure_types = ensure_types  # type: ignore[assignment]


class Reused:
    """The measurement, with masks already measured on the same examples (the exhaustive
    folder's single heads, the metric-p0.1 runs' masks) looked up instead of measured
    again. A measurement is a function of its mask on fixed examples: the 375 heads that
    the earlier defaults' runs measured alone equal the exhaustive folder's in every metric
    value (logprob to 3e-5, batching). The attribution prior is computed once per path
    set and kept (the same for every seed: the examples are)."""

    def __init__(self, measure: Any, task: str, folders: Sequence[Path],
                 with_examples: bool = False) -> None:
        self._measure, self._task = measure, task
        self._known: dict[str, dict[str, Any]] = {}
        for folder in folders:
            if (folder / "measurements.jsonl").is_file():
                for record in RunFolder(folder).measurements():
                    # A run whose certificate reads the noise looks up only records that
                    # carry their per-example scores (measured since they are recorded).
                    if task in record["scores"] and (
                            not with_examples or task in record.get("examples", {})):
                        self._known.setdefault(record["mask"], record)
        self._priors: dict[tuple[float, ...], dict[str, np.ndarray]] = {}
        self.looked_up = self.measured = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._measure, name)

    def __call__(self, heads: Sequence[Head]) -> dict[str, TaskScore]:
        return self.measure_many([heads])[0]

    def attribution(self, points: Sequence[float] = (0.0,), kind: str = "heads"
                    ) -> dict[str, np.ndarray]:
        key = tuple(points)
        if key not in self._priors:
            self._priors[key] = self._measure.attribution(key, kind=kind)
        return self._priors[key]

    def measure_chunks(self, chunks: Sequence[Sequence[Sequence[Head]]],
                       masks_per_pass: int | None = None, scale: float | None = None
                       ) -> Any:
        """``run_plan``'s way in (``Measurement.measure_chunks``), through the lookup:
        without it every chunk went to the model's own ``measure_many``, and nothing was
        looked up."""
        if scale is not None:
            raise ValueError("the recovery benchmark measures at the run's own scale")
        for index, chunk in enumerate(chunks):
            started = time.perf_counter()
            scores = self.measure_many(chunk, masks_per_pass or 1)
            yield index, scores, (time.perf_counter() - started) / max(len(chunk), 1)

    def measure_many(self, masks: Sequence[Sequence[Head]], masks_per_pass: int = 1
                     ) -> list[dict[str, TaskScore]]:
        task, answers = self._task, {}
        for i, heads in enumerate(masks):
            record = self._known.get(format_heads(list(heads)))
            if record is not None:
                examples = record.get("examples", {}).get(task)
                answers[i] = {task: TaskScore(
                    task, record["metrics"][task], record["scores"][task],
                    record["higher_is_better"][task],
                    logprob=record.get("logprob", {}).get(task),
                    examples=None if examples is None else tuple(map(tuple, examples)))}
        todo = [i for i in range(len(masks)) if i not in answers]
        fresh = self._measure.measure_many([masks[i] for i in todo], masks_per_pass) \
            if todo else []
        answers.update(zip(todo, fresh, strict=True))
        self.looked_up += len(masks) - len(todo)
        self.measured += len(todo)
        return [answers[i] for i in range(len(masks))]


def run_methods(task: str, methods: Sequence[Method], seeds: Sequence[int],
                budgets: Sequence[int], setup: Any, measure: Any,
                priors: Mapping[str, Mapping[str, np.ndarray]],
                confirm_budgets: Sequence[int], new_runs: bool = True
                ) -> dict[tuple[str, int, int], list[Head]]:
    """Each method's top-5 per (budget, seed): one locate run per (design, sparsity, seed)
    of the largest budget, fitted on its first M masks for each budget M. Without
    ``new_runs`` only what is on disk is fitted: a confirming run that finished, and a
    budget within the masks a run has measured; the rest is left out ("not run")."""
    tops = {}
    for method in (m for m in methods if m.peer):
        tops.update(peer_tops(task, method, seeds, budgets, setup, priors))
    for method in (m for m in methods if m.confirm):
        for budget in (b for b in budgets if b in confirm_budgets):
            masks, confirm, groups = method.split(budget)
            for seed in seeds:
                out = WORK / task / method.run_name / f"m{budget}-seed{seed}"
                if not new_runs and not (out / "heads.json").is_file():
                    continue
                cell = setup.spec.replace(design=method.design, sparsity=method.sparsity,
                                          design_seed=seed, masks=masks, confirm=confirm,
                                          group_tests=groups, prior=method.prior_kind,
                                          signal=method.fit_on, bootstrap=1)
                if not new_runs:
                    # Refitted from the picks on disk: resuming would pick with today's
                    # rules, and a method kept for comparison must stay what it was.
                    tops[method.name, budget, seed] = refit(out, bootstrap=1)[task].top(TOP)
                    continue
                print(f"[{task}] {method.name} seed {seed}: {masks} masks + {confirm} alone "
                      f"+ {groups} group tests -> {out}", flush=True)
                tops[method.name, budget, seed] = locate(
                    out, cell, setup=setup, measure=measure)[task].top(TOP)
    for run_name in dict.fromkeys(m.run_name for m in methods
                                  if not m.confirm and not m.peer):
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
            for method in (m for m in methods if m.run_name == run_name and not m.peer):
                for budget in (b for b in budgets if b <= measured):
                    tops[method.name, budget, seed] = top_heads(
                        matrix[:budget], records, task, method, setup.heads_per_layer,
                        priors["atp"])
    return tops


#: The folder of a task's certified runs (the defaults, measured until certified).
CERTIFIED = "certified"


def certified_runs(task: str, seeds: Sequence[int], setup: Any, measure: Reused,
                   new_runs: bool = True, work: Path = WORK) -> dict[int, dict[str, Any]]:
    """The default run, measured until certified (or its cap), per design seed: what its
    certificate says, what it spent and its top-5 (run folders in
    ``<work>/<task>/certified/seed<S>``; without ``new_runs``, only those on disk)."""
    found = {}
    for seed in seeds:
        out = work / task / CERTIFIED / f"seed{seed}"
        if not new_runs and not (out / "heads.json").is_file():
            continue
        spec = setup.spec.replace(masks=None, confirm=None, group_tests=None,
                                  max_measurements=None, design_seed=seed, bootstrap=1)
        print(f"[{task}] certified seed {seed} -> {out}", flush=True)
        started = time.perf_counter()
        ranking = (locate(out, spec, setup=setup, measure=measure) if new_runs
                   else refit(out, bootstrap=1))[task]
        cert = ranking.facts.certificate
        assert cert is not None
        config = json.loads((out / "config.json").read_text())
        found[seed] = {"top": [str(h) for h in ranking.top(TOP)],
                       "certified": cert.certified, "spent": cert.measurements_spent,
                       "cap": cert.max_measurements, "unchecked": len(cert.unchecked),
                       "tied_at_k": cert.tied_at_k, "helps": cert.helps,
                       # Where the spent went past the prior's allowance and the masks.
                       "alone": cert.measured_alone, "group_sets": len(cert.group_tests),
                       "violations": cert.violations,
                       # Every session's whole time (a resumed run adds one).
                       "minutes": sum(t.get("whole", 0.0) for t in config.get("timings", []))
                       / 60,
                       "seconds_this_call": time.perf_counter() - started}
    return found


def timed_prior(path: Path, kind: str, measure: Reused, identity: Mapping[str, Any],
                spec: RunSpec) -> tuple[dict[str, np.ndarray], float, float]:
    """(the prior, its seconds, a measurement's seconds) of ``kind``, computed once into
    ``path`` with a measurement timed in the same minute, so that their ratio (the prior's
    cost) does not depend on the machine's speed that day. Measure it on an idle machine:
    under other load the two slow down differently."""
    with RunFolder(path) as folder:
        folder.start("bench-prior", identity, {}, spec.as_config())
        if not folder.file("prior.json").is_file():
            times = []
            for _ in range(3):
                started = time.perf_counter()
                measure._measure.measure_many([[]])
                times.append(time.perf_counter() - started)
            folder.write_json("timing.json", {"measurement_seconds": float(np.median(times)),
                                              "measurements_timed": len(times)})
        prior = {task: by_kind["heads"]
                 for task, by_kind in attribution_prior(folder, measure, kind).items()}
        return (prior, json.loads(folder.file("prior.json").read_text())["seconds"],
                json.loads(folder.file("timing.json").read_text())["measurement_seconds"])


def joint_identity(spec: RunSpec) -> dict[str, Any]:
    """What a task's joint measurements depend on (its ``joint`` folder's identity): the
    model, the task and its examples."""
    return {k: v for k, v in spec.identity("locate").items()
            if k in ("model_args", "tasks", "num_samples", "seed", "apply_chat_template")}


def bench_task(task: str, methods: Sequence[Method], seeds: Sequence[int],
               budgets: Sequence[int], lm: Any, confirm_budgets: Sequence[int],
               new_runs: bool = True, certified: bool = True
               ) -> tuple[dict[str, Any], Any]:
    truth = ground_truth(task)
    true_top = truth["top_k"][:TOP]
    types_once_per_task(task)
    spec = RunSpec(tasks=(task,), masks=max(budgets), progress=True)
    setup = prepare(spec)
    if lm is None:
        lm = load_model(setup)
    spec = setup.spec
    per_layer = setup.heads_per_layer
    truth_config = json.loads((truth_folder(task) / "config.json").read_text())
    identity = joint_identity(spec)
    with RunFolder(WORK / task / "joint") as joint:
        joint.start("bench-joint", identity, {}, spec.as_config())
        measure = open_measurement(setup, lm, joint, spec.num_samples)
        if measure.subset[task] != truth_config["example_subset"][task]:
            raise SystemExit(f"{task}: the ground truth was measured on other examples")
        # Measurements already made on these examples are looked up, not repeated.
        # (the default runs' masks too: each budget's and method's are one seed's prefix).
        measure = Reused(measure, task, [truth_folder(task), joint.path, *sorted(
            (WORK / task / "stratified-p0.1").glob("seed*")), *sorted(
            (WORK / task).glob("stratified-p0.1-atp-path*/m*"))])
        # The priors are the same for every seed (the examples are): computed once each.
        priors, prior_seconds, reference_seconds = {}, {}, {}
        if any(m.prior for m in methods):
            for kind in BENCH_PRIORS:
                priors[kind], prior_seconds[kind], reference_seconds[kind] = timed_prior(
                    WORK / task / f"prior-{kind}", kind, measure, identity, spec)
            measure._priors[PRIOR_POINTS["atp-path"]] = priors["atp-path"]
        tops = run_methods(task, methods, seeds, budgets, setup, measure, priors,
                           confirm_budgets, new_runs)
        certified_found = {}
        if certified:
            noisy = Reused(measure._measure, task, sorted(
                (WORK / task / CERTIFIED).glob("seed*")), with_examples=True)
            noisy._priors = measure._priors  # the same priors: computed once per task
            certified_found = certified_runs(task, seeds, setup, noisy, new_runs)
            measure.looked_up += noisy.looked_up
            measure.measured += noisy.measured
        # Joint knockouts: every distinct top-5, and the exhaustive top-5, measured once.
        plan = {"baseline": []}
        for heads in [parse_heads("+".join(true_top)), *tops.values(),
                      *(parse_heads("+".join(r["top"])) for r in certified_found.values())]:
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
    top3 = {key: set(true_top[:3]) <= {str(h) for h in heads} for key, heads in tops.items()}
    return {"task": task, "truth": truth, "true_top": true_top, "baseline": base,
            "examples": len(truth_config["example_subset"][task]),
            "true_joint_score": base - true_drop, "found": found, "ratios": ratios,
            "top3": top3,
            "certified": {seed: {**r, "exact": set(r["top"]) == set(true_top[:TOP]),
                                 "in_order": r["top"] == true_top[:TOP],
                                 "found": len(set(r["top"]) & set(true_top)),
                                 "drop": drop(parse_heads("+".join(r["top"]))) / true_drop
                                 if true_drop else float("nan")}
                          for seed, r in certified_found.items()},
            "tops": {f"{m}|{b}|{s}": [str(h) for h in heads]
                     for (m, b, s), heads in tops.items()},
            "prior_seconds": prior_seconds,
            # A measurement's seconds to divide each prior's by: timed next to it.
            "reference_seconds": reference_seconds,
            "prior_ranks": {kind: [_prior_ranks(point, true_top, per_layer)
                                   for point in np.atleast_2d(values[task])]
                            for kind, values in priors.items()},
            "reused": {"looked_up": measure.looked_up, "measured": measure.measured},
            "measurement_seconds": float(np.median(
                [r["seconds"] for r in measured.values() if r.get("seconds")] or [0.0]))}, lm


def _prior_ranks(effects: np.ndarray, heads: Sequence[str], per_layer: int
                 ) -> dict[str, int]:
    """Where each head stands in the prior's ranking (1 = the most harmful)."""
    order = [str(Head.from_flat_index(int(i), per_layer))
             for i in np.argsort(effects, kind="stable")]
    return {head: order.index(head) + 1 for head in heads}


def _cost(method: Method, result: Mapping[str, Any]) -> str:
    kind = method.peer if method.peer in PRIOR_POINTS else method.prior_kind
    if not method.prior or not result["prior_seconds"].get(kind):
        return "M"
    prior = result["prior_seconds"][kind] / result["reference_seconds"][kind]
    if method.peer:
        return f"{prior:.1f} (any M)"
    if method.confirm:
        return f"M − {method.allowance} + {prior:.1f}"
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
    lines = [f"## {task}" + (" (held out)" if task in HELD_OUT else ""), "",
             *([f"Held out: no default was chosen on this task (ground truth: "
                f"`{HELD_OUT_TRUTH_COMMAND}`).", ""] if task in HELD_OUT else []),
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
        points = {"atp": "the clean run", "atp-path": "the clean run; with every head half "
                  "ablated"}
        lines[4:4] = [
            f"Attribution priors: the exhaustive top-{TOP} stand at "
            + "; ".join(
                f"**{kind}** ({result['prior_seconds'][kind]:.1f} s, a measurement "
                f"{result['reference_seconds'][kind]:.2f}"
                f" s; {points[kind]}): "
                + " / ".join(", ".join(f"{h} #{r}" for h, r in ranks.items())
                             for ranks in per_point)
                for kind, per_point in result["prior_ranks"].items())
            + " of its rankings.", ""]
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


#: The certified runs' goal: a median of at most this many measurement-equivalents.
CERTIFIED_GOAL = 90


def certified_section(results: Sequence[Mapping[str, Any]], seeds: Sequence[int]
                      ) -> list[str]:
    """The default run measured until certified, per task over ``seeds``: how often it
    ended certified, with the exhaustive top-5 (as a set, and in order), what it spent,
    the ties its certificate said at the 5th place, and the sets that ruled nothing out."""
    rows = []
    for r in results:
        # A benchmark made over several sessions: the seeds run so far, said as such.
        runs = [r["certified"][s] for s in seeds if s in r["certified"]]
        if not runs:
            rows.append(f"| {_task_label(r['task'])} | 0/{len(seeds)} | | | | | | | |")
            continue
        spent = [run["spent"] for run in runs]
        tied = [run for run in runs if run["tied_at_k"]]
        rows.append(
            f"| {_task_label(r['task'])} | {len(runs)}/{len(seeds)} | "
            f"{_share(runs, 'certified')} | "
            f"{_share(runs, 'exact')} | {_share(runs, 'in_order')} | "
            f"{np.median(spent):.0f} ({min(spent)}–{max(spent)}) of {runs[0]['cap']} | "
            f"{_medians(runs, 'alone', 'group_sets')} | "
            + (f"{len(tied)}/{len(runs)} (e.g. {', '.join(tied[0]['tied_at_k'])})" if tied
               else "none")
            + f" | {_medians(runs, 'helps', 'violations')} |")
    met = [r["task"] for r in results if all(s in r["certified"] for s in seeds)
           and all(run["certified"] and run["exact"] for run in r["certified"].values())
           and np.median([run["spent"] for run in r["certified"].values()])
           <= CERTIFIED_GOAL]
    over = [f"{r['task']} ({np.median([run['spent'] for run in r['certified'].values()]):.0f})"
            for r in results if r["task"] not in met and all(s in r["certified"] for s in seeds)]
    missing = any(s not in r["certified"] for r in results for s in seeds)
    return [
        f"## Certified by default: measured until no other head can be in the top-{TOP}", "",
        "The default run (`headloc-harness locate --tasks TASK --design-seed S`, every other "
        "option its default) goes on after its masks and the heads it measures alone with "
        "group tests of the heads no one measured alone (a set that is not clearly under "
        "the bar halved, one that helps the task split into its likeliest helper and the "
        "rest), until each head is measured alone "
        "or ruled out by a set clearly under the top-5's entry bar (one-sided 95 %, the "
        "paired standard error of the set's change) — certified — or its cap "
        "(`--max-measurements auto`: half the heads). Cells over the design seeds run "
        "(a task's five seeds take 1-2 hours on 2 CPU cores"
        + ("; the rest are not run yet" if missing else "") + "): runs "
        f"that ended certified; whose top-{TOP} is the exhaustive top-{TOP} as a set "
        "(exact) and in its order; the measurement-equivalents spent (the prior's allowance, "
        "masks, heads alone, group tests; median, range) of the cap; where they went past "
        "the prior's allowance and the masks (the median number of heads measured alone, "
        "the confirmation's and those the splitting narrowed down to, and of sets of two or "
        "more measured); runs whose certificate "
        "found heads at the 5th place the noise cannot tell apart (ties); and the median "
        "number of measured sets that ruled nothing out because they helped the task "
        "beyond the noise / harmed it clearly less than a measured part of them.", "",
        "| task | seeds run | certified | exact top-5 | in order | measurements | heads alone "
        "/ sets | ties at the 5th place | helps / violations |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
        f"Certified with the exact top-{TOP} in every seed, at a median of at most "
        f"{CERTIFIED_GOAL} measurements (a third of 270): "
        + (", ".join(met) if met else "none") + "."
        + (f" Not: {', '.join(over)}." if over else ""), ""]


def _medians(runs: Sequence[Mapping[str, Any]], *keys: str) -> str:
    """The runs' medians of ``keys``, as "a / b" (blank where a run from before a key lacks
    it)."""
    if not all(key in run for run in runs for key in keys):
        return ""
    return " / ".join(f"{np.median([run[key] for run in runs]):.0f}" for key in keys)


def _share(runs: Sequence[Mapping[str, Any]], key: str) -> str:
    return f"{sum(bool(run[key]) for run in runs)}/{len(runs)}"


def _task_label(task: str) -> str:
    return f"{task} (held out)" if task in HELD_OUT else task


def verdict_section(results: Sequence[Mapping[str, Any]], methods: Sequence[Method],
                    seeds: Sequence[int], budgets: Sequence[int], title: str, about: str,
                    verdict: Any, budget: int = 54) -> list[str]:
    """A yes/no table at ``budget``, one cell per (method, task): ``verdict(result, method
    name, budget, seeds)`` gives (met, what the cell shows)."""
    if budget not in budgets:
        return []
    lines = [f"## {title} at M = {budget}", "", about, "",
             "| method | " + " | ".join(r["task"] + (" (held out)" if r["task"] in HELD_OUT
                                                   else "") for r in results) + " |",
             "| --- |" + " --- |" * len(results)]
    for m in methods:
        cells = []
        for r in results:
            if any((m.name, budget, s) not in r["found"] for s in seeds):
                cells.append("not run")
                continue
            ok, shown = verdict(r, m.name, budget, seeds)
            cells.append(f"{'yes' if ok else 'no'} ({shown})")
        lines.append(f"| {m.name} | " + " | ".join(cells) + " |")
    return lines + [""]


def goal_verdict(r: Mapping[str, Any], name: str, budget: int, seeds: Sequence[int]
                 ) -> tuple[bool, str]:
    """The recovery goal: >= 4/5 in >= 80 % of seeds and a median joint drop >= 90 % of
    the exhaustive top-5's."""
    share = np.mean([r["found"][name, budget, s] >= FOUND_GOAL for s in seeds])
    drop = float(np.median([r["ratios"][name, budget, s] for s in seeds]))
    return share >= SEED_SHARE_GOAL and drop >= DROP_GOAL, f"{share:.0%}, {drop:.0%}"


def exact_verdict(r: Mapping[str, Any], name: str, budget: int, seeds: Sequence[int]
                  ) -> tuple[bool, str]:
    """The exact goal: the exhaustive top-5 exactly (5/5) in >= 80 % of seeds, and the
    exhaustive top-3 (all three in the run's top-5) in every seed."""
    exact = np.mean([r["found"][name, budget, s] == TOP for s in seeds])
    top3 = np.mean([r["top3"][name, budget, s] for s in seeds])
    return exact >= SEED_SHARE_GOAL and top3 == 1.0, f"{exact:.0%} · {top3:.0%}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=_comma(str), default=[*TASKS, *HELD_OUT])
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
    parser.add_argument("--no-certified", dest="certified", action="store_false",
                        help="leave out the certified runs (the default run measured until "
                             "certified, per seed)")
    parser.add_argument("--out", type=Path, default=ROOT / "RECOVERY.md")
    args = parser.parse_args(argv)
    known = {m.name: m for m in METHODS}
    unknown = [name for name in args.methods if name not in known]
    if unknown:
        parser.error(f"unknown method {unknown[0]!r}; known: {', '.join(known)}")
    if (why := page_refusal(args.out, TITLE)) is not None:
        parser.error(f"--out: {why}")  # before hours of runs, not after them
    methods = [known[name] for name in args.methods]
    seeds = list(range(args.seeds))
    budgets = sorted(args.budgets)
    start = time.time()
    work_tree()  # the committed runs unpacked (bench_store.py), up to date
    lm, results = None, []
    for task in args.tasks:
        result, lm = bench_task(task, methods, seeds, budgets, lm,
                                args.confirm_budgets or budgets, args.new_runs,
                                args.certified)
        results.append(result)
    (WORK / "results.json").write_text(json.dumps(
        [{**r, "found": {"|".join(map(str, k)): v for k, v in r["found"].items()},
          "ratios": {"|".join(map(str, k)): v for k, v in r["ratios"].items()},
          "top3": {"|".join(map(str, k)): v for k, v in r["top3"].items()},
          "certified": {str(k): v for k, v in r["certified"].items()}}
         for r in results], indent=1))
    import torch

    not_run = [m.name for m in METHODS if m not in methods]
    command = "python benchmarks/bench_recovery.py " + shlex.join(
        sys.argv[1:] if argv is None else list(argv))
    lines = [
        TITLE, "",
        "Generated by `benchmarks/bench_recovery.py`; do not edit by hand.", "",
        f"```bash\n{command}\n```", "",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; whole run "
        f"{time.time() - start:.0f} s (run folders already on disk are reused)",
        f"- machine: {platform.processor() or platform.machine()}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} "
        + ("thread" if torch.get_num_threads() == 1 else "threads"),
        "- model: the embedded SmolLM2-135M-Instruct (270 heads); 100 examples per task, "
        "the same subset (seed 0) in every measurement and in the ground truth",
        f"- ground truth: `{GROUND_TRUTH_COMMAND}` (benchmarks/exhaustive), the tasks the "
        "defaults were chosen on; and for the held-out tasks, on which no default was "
        f"chosen: `{HELD_OUT_TRUTH_COMMAND}` (benchmarks/exhaustive-heldout)",
        f"- design seeds: {', '.join(map(str, seeds))}; the Lasso: alpha 0.01 on "
        "standardised scores, fitted intercept", "",
        "Methods (each a `headloc-harness locate` configuration; stratified design):", "",
        *[f"- **{m.name}**: {m.about}" for m in methods], "",
        *([f"Not in this file (not run yet): {', '.join(not_run) or 'none'}; tasks not "
           f"run: {', '.join(t for t in (*TASKS, *HELD_OUT) if t not in args.tasks) or 'none'}; "
           "budgets: "
           f"{', '.join(map(str, budgets))} of {', '.join(map(str, BUDGETS))}.", ""]
          if not_run or set(args.tasks) != {*TASKS, *HELD_OUT} else []),
        *(["Made with `--no-new-runs`: only the runs on disk were fitted; a cell without a "
           "complete run for every seed says \"not run\".", ""] if not args.new_runs else []),
        "Cost of a cell: M measurement-equivalents (M masks, each one forward pass over the "
        "example subset; one baseline measurement more for every method).", "",
        "Measurements already made on the same examples are looked up rather than repeated "
        "(`Reused` in the script: the exhaustive folder's heads alone, the metric-p0.1 "
        "runs' masks): a measurement is a function of its mask on fixed examples, and the "
        "375 heads the earlier defaults' runs measured alone equal the exhaustive folder's "
        "in every metric value (benchmarks/README.md). This invocation of the script: "
        + ", ".join(f"{r['task']} {r['reused']['looked_up']} looked up, "
                    f"{r['reused']['measured']} measured" for r in results)
        + " (runs already on disk counted theirs when they were made).", "",
    ]
    if args.certified:
        lines += certified_section(results, seeds)
    for result in results:
        lines += task_section(result, methods, seeds, budgets)
    lines += verdict_section(
        results, methods, seeds, budgets, f"Exactly the top-{TOP}",
        f"{TOP}/{TOP} of the exhaustive top-{TOP} in ≥ {SEED_SHARE_GOAL:.0%} of seeds, and the "
        f"exhaustive top-3 in the run's top-{TOP} in every seed. Cells: share of seeds with "
        f"{TOP}/{TOP} · share with the top-3.", exact_verdict)
    lines += verdict_section(
        results, methods, seeds, budgets, "The goal",
        f"≥ {FOUND_GOAL}/{TOP} of the exhaustive top-{TOP} in ≥ {SEED_SHARE_GOAL:.0%} of "
        f"seeds, and a joint drop ≥ {DROP_GOAL:.0%} of the exhaustive top-{TOP}'s (the "
        "median over seeds).", goal_verdict)
    write_page(args.out, "\n".join(lines), TITLE)
    print(f"wrote {args.out}")
    store_work()  # what the runs added, packed into benchmarks/
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
