"""RECOVERY.md's certified section (benchmarks/headloc_bench/bench_recovery.py): what each
task's certified runs spent, and where it went. The expected cells are worked out by hand
from the runs given, not read off the function's output."""

from __future__ import annotations

from headloc_bench.bench_recovery import CERTIFIED_GOAL, certified_section


def run(spent: int, alone: int, group_sets: int, helps: int = 0) -> dict:
    return {"top": ["L1H4"], "certified": True, "exact": True, "in_order": True,
            "spent": spent, "cap": 135, "unchecked": 0, "tied_at_k": [], "helps": helps,
            "violations": 0, "alone": alone, "group_sets": group_sets}


def row(lines: list[str], task: str) -> list[str]:
    found = [line for line in lines if line.startswith(f"| {task} ")]
    assert len(found) == 1, lines
    return [cell.strip() for cell in found[0].strip("|").split("|")]


def test_the_section_says_where_the_measurements_went_and_which_tasks_miss_the_goal():
    cheap = {0: run(80, 36, 24, helps=1), 1: run(84, 40, 24, helps=3),
             2: run(78, 34, 24, helps=2)}
    costly = {0: run(120, 50, 50, helps=15), 1: run(100, 44, 36, helps=11),
              2: run(106, 50, 36, helps=14)}
    lines = certified_section([{"task": "headloc_induction", "certified": cheap},
                               {"task": "heldout_successor", "certified": costly}],
                              seeds=[0, 1, 2])
    # Medians by hand: alone 36, 40, 34 -> 36; sets 24; helps 1, 3, 2 -> 2.
    cells = row(lines, "headloc_induction")
    assert cells[5] == "80 (78–84) of 135"
    assert cells[6] == "36 / 24" and cells[8] == "2 / 0"
    # alone 50, 44, 50 -> 50; sets 50, 36, 36 -> 36; spent 120, 100, 106 -> 106.
    cells = row(lines, "heldout_successor (held out)")
    assert cells[6] == "50 / 36" and cells[8] == "14 / 0"
    verdict = next(line for line in lines if line.startswith("Certified with the exact"))
    assert verdict.endswith(f"at most {CERTIFIED_GOAL} measurements (a third of 270): "
                            "headloc_induction. Not: heldout_successor (106).")


def test_runs_from_before_the_breakdown_leave_its_cell_blank_and_unrun_tasks_are_not_judged():
    old = run(80, 36, 24)
    del old["alone"], old["group_sets"]
    lines = certified_section([{"task": "headloc_ioi", "certified": {0: old}},
                               {"task": "headloc_arith", "certified": {}}], seeds=[0, 1])
    assert row(lines, "headloc_ioi")[6] == ""
    assert row(lines, "headloc_arith")[1] == "0/2"
    verdict = next(line for line in lines if line.startswith("Certified with the exact"))
    # Neither task has every seed run: none met, none judged as missing the goal.
    assert verdict.endswith("(a third of 270): none.")


def test_compare_certified_lines_put_each_seed_beside_the_committed_run():
    from headloc_bench.compare_certified import comparison_lines

    truth = ["L1H4", "L16H0", "L11H5", "L18H6", "L11H4", "L1H3"]
    today = {0: {**run(80, 36, 24), "top": truth[:5]},
             1: {**run(90, 40, 30), "top": [*truth[:4], "L1H3"], "certified": False},
             2: {**run(70, 34, 20), "top": truth[:5]}}
    committed = {0: {"spent": 85}, 1: {"spent": 95}}
    lines = comparison_lines("headloc_induction", today, committed, truth)
    assert lines[1].split()[1:] == ["0", "80", "85", "yes", "yes"]
    assert lines[2].split()[1:] == ["1", "90", "95", "no", "no"]  # L1H3 is the 6th
    assert lines[3].split()[1:] == ["2", "70", "-", "yes", "yes"]  # no committed seed 2
    # Medians over the seeds both have (0 and 1), by hand: (80 + 90) / 2, (85 + 95) / 2.
    assert lines[4].endswith("median over seeds 0, 1: 85 today, 90 committed")
