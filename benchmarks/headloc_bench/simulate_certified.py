"""Measurement-equivalents a default run needs to be certified, in the planted-sparse simulator.

A default ``locate`` run goes on after its masks and its heads measured alone with group
tests until it is certified (every head measured alone or ruled out by a measured set
clearly under the top-5's entry bar; docs/method.md, "Group tests and the certificate") or
until it has spent ``--max-measurements`` (auto: half the heads). How much does
certification need, and does the default cap leave room for it as N grows? This runs the
package's own locate loop (``headloc_bench.simulated_run.simulated_locate``: the design, the
confirmation, the group tests, the fit and the certificate, every default of ``RunSpec``)
on ``planted_world(..., noise="documents")`` worlds at N = 270 (the embedded SmolLM2),
1,024 (Llama-3.1-8B's 32 × 32) and 4,096 heads, with atp-path's two-point prior
(``headloc_bench.defaults.simulated_prior``) and without a prior, with the cap raised to N: the
table shows what certification needs, not where the default cap would stop it, and counts
the runs that certified within the default cap (N/2) and within N/5. A run is
deterministic up to its cap (the cap only ends the group tests), so one certified within
a cap is what a run with that cap would have ended with.

Seed s is the world and prior of seed s in ``benchmarks/simulate_recovery.py``'s defaults
section (``headloc_bench.defaults.confirmed_masks_needed``): the world from the first of the seed's
five ``SeedSequence`` streams (``seed_trial``'s), the prior from the fourth.

Usage (from the repository root)::

    python benchmarks/simulate_certified.py --out SIMULATION.md   # the full table (minutes)
    python benchmarks/simulate_certified.py --quick                # N = 270, 2 seeds: seconds
    python benchmarks/simulate_certified.py --n-heads 1024 --seeds 20

``--out`` writes the table as SIMULATION.md's marked section ``certified``
(``bench_sections.write_section``); the rest of the page stays byte for byte, and
``simulate_recovery.py --out`` keeps the section when it rewrites its part.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from headloc_bench.bench_sections import measured_now, write_section
from headloc_bench.defaults import PRIOR_POINTS, simulated_prior
from headloc_bench.simulate_recovery import TITLE
from headloc_bench.simulated_run import simulated_locate
from headloc_bench.simulation import World, planted_world
from lm_eval_headloc.common.files import page_refusal
from lm_eval_headloc.runs.spec import RunSpec

#: The marked section of SIMULATION.md this writes.
SECTION = "certified"

#: The priors compared: the default's (``--prior auto`` is atp-path, two path points) and none.
PRIORS: tuple[str, ...] = ("atp-path", "none")

#: The world: ``planted_world``'s defaults with the fixed documents a real run measures on
#: (simulate_recovery.py's default world).
WORLD_OPTIONS: dict[str, object] = {"noise": "documents"}

QUICK = dict(n_heads=[270], seeds=2)


@dataclass(frozen=True)
class SeedRun:
    """One run's outcome: its certificate's verdict, whether its top-5 is the exhaustive
    top-5 (as a set), the measurement-equivalents it spent (prior's allowance included),
    the certificate's counts, and its wall time."""

    n_heads: int
    prior: str
    seed: int
    certified: bool
    exact: bool
    spent: int
    helps: int
    violations: int
    unchecked: int
    tied_at_k: int
    to_finish: int | None
    seconds: float


def seed_world(n_heads: int, seed: int) -> tuple[World, np.ndarray]:
    """Seed ``seed``'s world and two-point prior, drawn as ``confirmed_masks_needed`` draws
    them: the world from the seed's first stream (``seed_trial``'s world), the prior from
    its fourth."""
    streams = np.random.SeedSequence(seed).spawn(5)
    world = planted_world(n_heads, np.random.default_rng(streams[0]), **WORLD_OPTIONS)
    prior = simulated_prior(world, np.random.default_rng(streams[3]),
                            points=PRIOR_POINTS["defaults"])
    return world, prior


def run_settings(n_heads: int, prior: str) -> RunSpec:
    """The defaults (``RunSpec().budgeted``: masks, heads alone, group tests) with the cap
    raised to ``n_heads``. One bootstrap refit: the bootstrap only gives the final fit its
    stability figures, never what is measured or the top-5 (seeds 0-3 at 270 heads: the
    same spent, certificate and top-5 with 200 refits, at 20-40 times the time)."""
    spec = RunSpec(bootstrap=1, progress=False, max_measurements=n_heads)
    if prior == "none":
        return spec.replace(prior="none").budgeted(None)
    return spec.budgeted(prior)


def seed_run(n_heads: int, prior: str, seed: int) -> SeedRun:
    """Seed ``seed``'s run at ``n_heads`` with ``prior`` (``PRIORS``), the cap at N."""
    world, estimates = seed_world(n_heads, seed)
    started = time.perf_counter()
    run = simulated_locate(world, run_settings(n_heads, prior),
                           **({} if prior == "none" else {"prior": estimates,
                                                          "prior_kind": prior}))
    cert = run.certificate
    return SeedRun(n_heads, prior, seed, cert.certified, run.exact(5), run.spent, cert.helps,
                   cert.violations, len(cert.unchecked), len(cert.tied_at_k),
                   cert.max_measurements_to_finish, time.perf_counter() - started)


def default_cap(n_heads: int) -> int:
    """The cap a default run has (``--max-measurements auto``)."""
    return RunSpec().measurement_cap(n_heads)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _median(values: list[int]) -> str:
    return f"{statistics.median(values):g}"


def row(runs: list[SeedRun]) -> str:
    """One (N, prior) row of the table."""
    n_heads, seeds = runs[0].n_heads, len(runs)
    spent = [r.spent for r in runs]
    cap, fifth = default_cap(n_heads), n_heads / 5
    certified = [r for r in runs if r.certified]
    cells = [
        f"{n_heads:,}", runs[0].prior,
        f"{len(certified)}/{seeds}",
        f"{sum(r.exact for r in runs)}/{seeds}",
        f"{_median(spent)} ({min(spent)}–{max(spent)})",
        f"{100 * statistics.median(spent) / n_heads:.0f} %",
        f"{sum(r.spent <= cap for r in certified)}/{seeds}",
        f"{sum(r.spent <= fifth for r in certified)}/{seeds}",
        f"{_median([r.helps for r in runs])} / {_median([r.violations for r in runs])}",
        f"{sum(r.seconds for r in runs):.0f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEAD = ("| N | prior | certified | exact top-5 | spent: median (min–max) | median / N "
        "| certified ≤ N/2 (default cap) | certified ≤ N/5 | helps / violations (median) "
        "| seconds |")
RULE = "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"


def table(runs: list[SeedRun]) -> str:
    """The table, one row per (N, prior) in the order run, and a line per run that did
    not certify."""
    cells: dict[tuple[int, str], list[SeedRun]] = {}
    for r in runs:
        cells.setdefault((r.n_heads, r.prior), []).append(r)
    lines = [HEAD, RULE, *(row(group) for group in cells.values())]
    failed = [r for r in runs if not r.certified]
    if failed:
        lines += ["", "Not certified at the cap N:", ""]
        lines += [f"- N = {r.n_heads:,}, {r.prior}, seed {r.seed}: {r.unchecked} heads "
                  f"unchecked, {r.tied_at_k} tied at the 5th place, top-5 "
                  f"{'exact' if r.exact else 'not exact'}"
                  + ("" if r.to_finish is None
                     else f"; --max-measurements {r.to_finish} would test the rest")
                  for r in failed]
    inexact = [r for r in runs if r.certified and not r.exact]
    if inexact:
        lines += ["", "Certified with a top-5 that is not the exhaustive one: "
                  + "; ".join(f"N = {r.n_heads:,}, {r.prior}, seed {r.seed} "
                              f"({r.tied_at_k} tied at the 5th place)" for r in inexact)]
    return "\n".join(lines) + "\n"


def command(argv: list[str]) -> str:
    return "python benchmarks/simulate_certified.py " + " ".join(shlex.quote(a) for a in argv)


def section(runs: list[SeedRun], argv: list[str], seeds: int, seconds: float) -> str:
    """The section's body: heading, when and how it was made, the table, what it means."""
    world = planted_world(270, np.random.default_rng(0), **WORLD_OPTIONS)
    params = ", ".join(f"`{k}={v}`" for k, v in world.params.items() if k != "n_heads")
    return "\n".join([
        "## Measurements to a certificate: the defaults run until certified",
        "",
        f"Generated {measured_now()} in {seconds:.0f} s on {platform.machine()}, "
        f"{os.cpu_count()} cores, by `{command(argv).strip()}`.",
        "",
        table(runs).rstrip("\n"),
        "",
        "Each run is the package's own locate loop "
        "(`headloc_bench.simulated_run.simulated_locate`) with every default of `RunSpec` "
        "— prior, masks, heads measured alone, then group tests — and the cap "
        "(`--max-measurements`) raised to N, so the counts are what "
        "certification needs; the default cap is N/2, and a run certified within it is what "
        "a default run ends with. Up to 108 heads a default run does not run this plan: "
        "half the heads would not cover its fixed part (54), and it measures every head "
        "alone after 2 masks instead (`budget.measures_all_alone`: N + 2, certified, the "
        "exhaustive top-5); the rows there are the plan that rule replaces. "
        "Prior: atp-path's two-point `simulated_prior` (charged "
        "its allowance) or none. **certified**: every head measured alone or ruled out by a "
        "measured set whose harm plus 1.645 paired standard errors stays under the top-5's "
        "entry bar ([docs/method.md](docs/method.md#group-tests-and-the-certificate-"
        "measured-until-no-other-head-can-be-in-the-top-k)). **exact top-5**: the run's "
        "top-5 is the exhaustive one-at-a-time top-5 on the same documents, as a set. "
        "**spent**: measurement-equivalents (prior's allowance, masks, heads alone, group "
        "tests; the baseline aside); a run not certified counts the cap N. **helps / "
        "violations**: measured sets that ruled nothing out because they helped beyond the "
        "noise or harmed clearly less than a measured part. **seconds**: the row's runs, "
        "load not controlled. World (`planted_world`; seed s is the world and prior of "
        f"seed s in `simulate_recovery.py`'s defaults section; seeds 0..{seeds - 1}): "
        f"{params}; 100 fixed documents shared by every measurement, each with its own "
        "sensitivity. Regenerate with "
        f"`{command(argv).strip()}`.",
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measurement-equivalents a default run needs to be certified, simulated.")
    parser.add_argument("--n-heads", type=_ints, default=[270, 1024, 4096],
                        help="model sizes (heads), comma-separated (default 270,1024,4096)")
    parser.add_argument("--seeds", type=int, default=10,
                        help="seeds 0..S-1 per (N, prior) (default 10)")
    parser.add_argument("--quick", action="store_true",
                        help="N = 270 only, 2 seeds: seconds")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"also write the table as section {SECTION!r} of this page "
                             "(SIMULATION.md: it must exist, as simulate_recovery.py wrote it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.n_heads, args.seeds = QUICK["n_heads"], QUICK["seeds"]
    if args.seeds < 1 or not args.n_heads or min(args.n_heads) < 6:
        parser.error("need >= 1 seed and N >= 6 heads")
    if args.out is not None:  # before the minutes of work, not after them
        if (why := page_refusal(args.out, TITLE)) is not None:
            parser.error(f"--out: {why}")
        if not args.out.is_file() or not args.out.stat().st_size:
            parser.error(f"--out: {args.out} is missing or empty; the section goes into the "
                         "page simulate_recovery.py writes (python benchmarks/"
                         f"simulate_recovery.py --out {args.out} first)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started = time.perf_counter()
    runs = []
    for n_heads in args.n_heads:
        for prior in PRIORS:
            for seed in range(args.seeds):
                runs.append(seed_run(n_heads, prior, seed))
                r = runs[-1]
                print(f"N={n_heads} prior={prior} seed {seed}: "
                      f"{'certified' if r.certified else f'{r.unchecked} unchecked'}, "
                      f"{r.spent} spent, top-5 {'exact' if r.exact else 'not exact'} "
                      f"({r.seconds:.1f} s)", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    print(table(runs), end="")
    print(f"({seconds:.0f} s)")
    if args.out is not None:
        write_section(args.out, SECTION, section(runs, argv, args.seeds, seconds), TITLE)
        print(f"wrote section {SECTION!r} of {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
