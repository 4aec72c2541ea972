"""Certified default runs of today's code beside the committed ones, on the same examples.

    python benchmarks/compare_certified.py --tasks heldout_successor --out /tmp/variant
    python benchmarks/compare_certified.py --tasks headloc_induction,headloc_ioi --seeds 3 \
        --out /tmp/variant

A change to how the group tests choose their sets (``lm_eval_headloc.method.group_tests``)
or to the defaults before them changes what a certified run measures; RECOVERY.md's
certified row is the judge, over every task and five design seeds. This reruns the
default run measured until certified (``bench_recovery.certified_runs``) into ``--out``
(never into ``bench-work/``, the committed runs unpacked) and prints each seed's
measurements beside the committed run's, with the medians. A set the committed certified
runs (or the exhaustive folder, or an earlier run into ``--out``) measured is looked up,
not measured again: a measurement is a function of its mask on the fixed examples, so only
the sets today's code chooses anew cost model time (seconds each on a CPU: every task
here is scored by log-likelihood, none generates). The attribution
prior is the committed one, copied. Unchanged code reproduces the committed runs, every
set looked up.

The tasks the defaults were chosen on share the exhaustive folder (``benchmarks/
exhaustive``), the held-out ones theirs: run two tasks of one kind one after the other,
not in two processes at once (the folder is locked while one reads it).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from headloc_bench.bench_recovery import (
    CERTIFIED,
    HELD_OUT,
    TASKS,
    TOP,
    WORK,
    Reused,
    certified_runs,
    ground_truth,
    joint_identity,
    timed_prior,
    truth_folder,
)
from headloc_bench.bench_store import WORK_TREE, work_tree
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.plan import load_model, open_measurement
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import RunSpec

#: The prior a default run computes (``--prior auto`` on the embedded model).
PRIOR = "atp-path"


def committed_runs(task: str, seeds: Sequence[int]) -> dict[int, dict[str, Any]]:
    """What the committed certified runs of ``task`` spent (``bench-work``'s copy, read,
    never rewritten), for the ``seeds`` that have one."""
    found = {}
    for seed in seeds:
        path = WORK / task / CERTIFIED / f"seed{seed}" / "heads.json"
        if path.is_file():
            certificate = json.loads(path.read_text(encoding="utf-8"))["certificate"]
            found[seed] = {"spent": certificate["measurements_spent"]}
    return found


def comparison_lines(task: str, today: Mapping[int, Mapping[str, Any]],
                     committed: Mapping[int, Mapping[str, Any]], truth: Sequence[str]
                     ) -> list[str]:
    """One line per seed (today's measurements, the committed run's, whether today's run
    is certified and its top-5 the exhaustive one as a set) and one of the medians over
    the seeds both have."""
    lines = [f"{task}: seed  today  committed  certified  exact"]
    both = sorted(set(today) & set(committed))
    for seed in sorted(today):
        run = today[seed]
        before = committed.get(seed, {}).get("spent", "-")
        exact = set(run["top"]) == set(truth[:TOP])
        lines.append(f"{task}: {seed:>4}  {run['spent']:>5}  {before:>9}  "
                     f"{'yes' if run['certified'] else 'no':>9}  {'yes' if exact else 'no':>5}")
    if both:
        lines.append(f"{task}: median over seeds {', '.join(map(str, both))}: "
                     f"{statistics.median(today[s]['spent'] for s in both):g} today, "
                     f"{statistics.median(committed[s]['spent'] for s in both):g} committed")
    return lines


def compare_task(task: str, seeds: Sequence[int], out: Path, lm: Any) -> tuple[list[str], Any]:
    """Today's certified runs of ``task`` into ``out/<task>``, beside the committed ones."""
    setup = prepare(RunSpec(tasks=(task,), progress=False))
    lm = lm or load_model(setup)
    identity = joint_identity(setup.spec)
    truth = ground_truth(task)["top_k"]
    prior_dir = out / task / f"prior-{PRIOR}"
    if not prior_dir.exists():
        shutil.copytree(WORK / task / f"prior-{PRIOR}", prior_dir)
    with RunFolder(out / task / "joint") as joint:
        joint.start("bench-joint", identity, {}, setup.spec.as_config())
        measure = open_measurement(setup, lm, joint, setup.spec.num_samples)
        base = Reused(measure, task, [truth_folder(task)])
        prior, _, _ = timed_prior(prior_dir, PRIOR, base, identity, setup.spec)
        lookup = Reused(measure, task, [*sorted((WORK / task / CERTIFIED).glob("seed*")),
                                        *sorted((out / task / CERTIFIED).glob("seed*")),
                                        truth_folder(task)], with_examples=True)
        lookup._priors[PRIOR_POINTS[PRIOR]] = prior
        today = certified_runs(task, seeds, setup, lookup, work=out)
    lines = comparison_lines(task, today, committed_runs(task, seeds), truth)
    lines.append(f"{task}: {lookup.looked_up} sets looked up, {lookup.measured} measured")
    return lines, lm


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=lambda s: [t for t in s.split(",") if t],
                        default=[*TASKS, *HELD_OUT])
    parser.add_argument("--seeds", type=int, default=5, help="design seeds 0..N-1")
    parser.add_argument("--out", type=str, required=True,
                        help="where today's runs go (a folder of this script's; never "
                             "bench-work/)")
    args = parser.parse_args(argv)
    if not args.tasks:
        parser.error(f"--tasks: give one or more of {', '.join((*TASKS, *HELD_OUT))}")
    if not args.out.strip() or (Path(args.out).exists() and not Path(args.out).is_dir()):
        parser.error(f"--out {args.out!r}: must name a folder (new, or of this script's)")
    args.out = Path(args.out)
    unknown = [t for t in args.tasks if t not in (*TASKS, *HELD_OUT)]
    if unknown:
        parser.error(f"--tasks: unknown task {unknown[0]!r}; known: "
                     f"{', '.join((*TASKS, *HELD_OUT))}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be at least 1")
    out, committed = args.out.resolve(), WORK_TREE.resolve()
    if out == committed or committed in out.parents or out in committed.parents:
        parser.error(f"--out {args.out}: must not be, lie in or hold {WORK_TREE} (the "
                     "committed runs unpacked); give a folder of its own, e.g. /tmp/variant")
    work_tree()  # the committed runs unpacked (bench_store.py), up to date
    seeds, lm, lines = list(range(args.seeds)), None, []
    for task in args.tasks:
        found, lm = compare_task(task, seeds, out, lm)
        lines += found
    print("\n".join(lines))
    return 0


__all__ = ["comparison_lines", "committed_runs", "compare_task", "main"]
