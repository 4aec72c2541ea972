"""benchmarks/budget_split.py, the evidence for how the default budget is split: its replay
must be what locate does, and docs/budget_split.md must be what it renders."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headloc_bench import ROOT, budget_split

#: What a failed comparison with the committed page says to do.
STALE = ("docs/budget_split.md is stale: python benchmarks/budget_split.py "
         "--out docs/budget_split.md")


@pytest.fixture(scope="module")
def script():
    return budget_split


@pytest.fixture(scope="module")
def tasks(script, committed_benchmarks):
    return [script.EmbeddedTask(task, committed_benchmarks) for task in script.TASKS]


@pytest.fixture(scope="module")
def rows(script, tasks):
    return script.embedded_rows(tasks)


def test_the_replay_picks_and_ranks_as_the_committed_default_runs_did(script, tasks):
    # Every committed default run (three tasks, four design seeds) replayed on its own
    # masks: the same heads measured alone, in the same order, and the same top-5.
    assert len(script.check_replay(tasks)) == len(script.TASKS) * len(script.DESIGN_SEEDS)


def test_a_replay_that_differs_from_the_run_is_refused(script, tasks):
    task = tasks[0]
    folder = task.runs / "stratified-p0.1-atp-path" / "m54-seed0"
    design, scores = task.masks(folder)
    confirm = json.loads((folder / "config.json").read_text())["spec"]["confirm"]
    picks, top = task.run(design, scores, task.prior, confirm)
    written = json.loads((folder / "config.json").read_text())["confirm"]["heads"]
    assert [f"L{h // 9}H{h % 9}" for h in picks] == written
    # Without the prior the same masks name other heads: the check would see it.
    assert task.run(design, scores, None, confirm)[0] != picks


def test_the_exhaustive_truth_and_single_head_changes_are_read_as_written(
        script, tasks, committed_benchmarks):
    for task in tasks:
        ranking = json.loads((committed_benchmarks / "exhaustive" /
                              f"heads-{task.task}.json").read_text())
        effects = {h["head"]: h["effect"] for h in ranking["heads"]}
        for name, effect in effects.items():
            layer, head = (int(x) for x in name[1:].split("H"))
            assert task.changes[layer * task.heads_per_layer + head] == pytest.approx(effect)
        assert len(task.truth) == 5
        # The truth is the five most harmful single knockouts.
        worst = sorted(effects.values())[:5]
        assert sorted(task.changes[h] for h in task.truth) == pytest.approx(worst)


def test_the_committed_page_holds_what_the_replay_renders_now(script, tasks, rows):
    # The no-prior row of the defaults before this change, and the splits of today's.
    before = [r for r in rows if r["share"] is None]
    assert [(r["budget"], r["masks"], r["confirm"]) for r in before] == [(46, 12, 34)]
    from lm_eval_headloc.method.budget import default_split

    splits = {(r["prior"], r["budget"], r["masks"], r["confirm"]) for r in rows}
    assert ("none", 54, *default_split(None)) in splits
    assert ("atp-path", 54, *default_split("atp-path")) in splits
    section = script.embedded_section(rows, script.check_replay(tasks))
    page = (ROOT / "docs" / "budget_split.md").read_text(encoding="utf-8")
    assert "\n".join(section).strip() in page, (
        STALE)


def test_found_counts_are_the_overlap_with_the_exhaustive_top_5(tasks, rows):
    task = tasks[0]
    design, scores = task.masks(task.runs / "stratified-p0.1" / "seed0")
    top = task.top(design[:27], scores[:27], None, 27)
    row = next(r for r in rows if (r["prior"], r["budget"], r["masks"]) == ("none", 54, 27))
    assert row["found"][task.task][0] == len(set(top) & task.truth)
    assert len(top) == 5 and len(set(top)) == 5
    assert np.all(np.isin(list(task.truth), np.arange(len(task.changes))))


def test_out_overwrites_only_a_page_it_wrote(script, tmp_path):
    theirs = tmp_path / "notes.md"
    theirs.write_text("a user's notes\n")
    for target in (theirs, tmp_path):
        with pytest.raises(SystemExit) as stopped:
            script.main(["--out", str(target)])
        assert stopped.value.code == 2
    assert theirs.read_text() == "a user's notes\n"


@pytest.fixture(scope="module")
def methods(script, tasks):
    return script.method_rows(tasks)


def test_without_a_prior_rounds_and_up_front_are_replayed_as_each_method_picks(
        script, tasks, rows, methods):
    # Today's rounds at 27 + 27 are the budget table's no-prior default row.
    rounds = next(r for r in methods if (r["budget"], r["method"]) == (54, "defaults"))
    assert rounds["found"] == next(
        r for r in rows if (r["prior"], r["budget"], r["masks"]) == ("none", 54, 27))["found"]
    # Up front, with no prior ranking to take turns with, is the plain fit's order.
    from lm_eval_headloc.method.confirm import screen

    task = tasks[1]
    design, scores = task.masks(task.runs / "stratified-p0.1" / "seed2")
    picks, _ = task.run(design[:27], scores[:27], None, 27, "before")
    assert picks == [int(h) for h in screen(design[:27], scores[:27], True).order[:27]]
    assert picks != task.run(design[:27], scores[:27], None, 27)[0]  # the rounds differ
    section = "\n".join(script.method_section(methods)).strip()
    assert section in (ROOT / "docs" / "budget_split.md").read_text(encoding="utf-8"), (
        STALE)
