"""What iterative greedy's report and verify's notes advise of its top-k, where its order is
the order heads won rounds (not harm): the heads that hurt, named where they are not the
first K (``ablate_top=K`` took a harmless one in their place), and the spread of single
knockouts taken from heads knocked out alone (round 1), not from a later round's change on
top of the earlier winners. An auditor's run, rebuilt: top-3 L3H1 (-0.025), L0H0 (+0.0,
does not hurt), L2H2 (-0.05); L2H3 helped by +0.05 alone and by +0.075 in round 3."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import harness, measurement_lines, read_run, tiny_args

from lm_eval_headloc.commands.greedy import _rankings, _report
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.method.columns import Columns, NeuronGroup
from lm_eval_headloc.method.ranking import Ranking, RankingFacts
from lm_eval_headloc.report.pages import harmless_words, spread_words

#: 4 layers x 4 heads, as the auditor's tiny Llama.
SIXTEEN = Columns.heads(4, 4)
BASELINE = {"scores": {"acc": 0.5}, "metrics": {"acc": "acc"},
            "higher_is_better": {"acc": True}}


def _flat(name: str) -> int:
    return SIXTEEN.index(name)


def _auditors_ranking() -> Ranking:
    """Round 1 (alone): L3H1 -0.025 wins, L2H3 +0.05, the rest 0. Round 2 (with L3H1):
    L0H0 0.0 wins, the rest +0.025. Round 3 (with both): L2H2 -0.05 wins, L2H3 +0.075, the
    rest 0. A head's effect is its change in the last round it was measured in."""
    alone = {h: (0.0, 0.0) for h in range(16)}
    alone[_flat("L3H1")], alone[_flat("L2H3")] = (-0.025, 0.0), (0.05, 0.0)
    last = {h: (0.0, 0.0) for h in range(16)}
    last[_flat("L3H1")], last[_flat("L0H0")] = (-0.025, 0.0), (0.0, 0.0)
    last[_flat("L2H2")], last[_flat("L2H3")] = (-0.05, 0.0), (0.075, 0.0)
    winners = [Head(3, 1), Head(0, 0), Head(2, 2)]
    return _rankings({"acc": last}, winners, BASELINE, 3, SIXTEEN, 4, 1 + 16 + 15 + 14,
                     alone={"acc": alone})["acc"]


def test_heads_that_hurt_not_first_in_the_top_k_are_named_not_counted():
    ranking = _auditors_ranking()
    assert [str(h) for h in ranking.top(3)] == ["L3H1", "L0H0", "L2H2"]
    assert ranking.harmless(3) == [Head(0, 0)]
    # ablate_top=2 would knock out L3H1 and L0H0 (the first two), leaving out L2H2.
    assert harmless_words(ranking, 3, all_measured=True) == [
        "Only 2 of the top-3 heads hurt the task; the other places are filled by heads that "
        "do not (L0H0: measured to do no harm). `ablate=L3H1+L2H2` knocks out only what "
        "hurts (not `ablate_top=2`, whose first 2 include L0H0).", ""]
    report = _report({"acc": ranking}, 3)
    assert "`ablate=L3H1+L2H2` knocks out only what hurts" in report
    assert "`ablate_top=2` knocks out" not in report


def test_the_first_k_hurting_still_get_ablate_top_and_groups_are_named():
    # The harmless one last: ablate_top=K is right, as before.
    last = Ranking("t", "acc", True, 0.5, np.array([-0.1, 0.0, -0.2, 0.0]), [2, 0, 1, 3], 2)
    assert harmless_words(last, 3, all_measured=True)[0].endswith(
        "`ablate_top=2` knocks out only what hurts.")
    # A neuron group that hurts, after a harmless neuron: its name is its run's own, so
    # no ablate= string is made of it.
    columns = Columns.of("neurons", 2, 4, ["L0N1", "L0N2"], groups_per_layer=1,
                         neurons_per_layer=6)
    assert isinstance(columns[2], NeuronGroup)
    grouped = Ranking("t", "acc", True, 0.5, np.array([-0.1, 0.0, -0.2, 0.0]), [0, 1, 2, 3],
                      4, columns=columns, facts=RankingFacts(
                          confirmed=["L0N1", "L0N2", "L0G0", "L1G0"]))
    words = harmless_words(grouped, 3, "neuron")[0]
    assert words.endswith(
        f"Knock out only what hurts by name (L0N1, {columns[2]} (4 neurons), a group as the "
        "neurons heads.json lists for it) with `ablate=`; not `ablate_top=2`, whose first 2 "
        "include L0N2.")


def test_the_spread_of_single_knockouts_is_measured_alone_not_on_top_of_winners():
    ranking = _auditors_ranking()
    # L2H3 alone (round 1): +0.05; its +0.075 was round 3's, with L3H1 and L0H0 out.
    assert ranking.effect(Head(2, 3)) == 0.075
    assert ranking.facts.largest_single_help == {"head": "L2H3", "change": 0.05}
    assert spread_words(ranking, 3) == [
        "Nothing beyond the spread of single knockouts: no top-3 head hurts the task by more "
        "than knocking out one head alone helps it (L2H3: +0.0500); their order may reflect "
        "which examples happened to flip, not heads the task needs.", ""]
    # Without round 1's changes an iterative run records no single help at all.
    bare = _rankings({"acc": {0: (-0.1, 0.0), 1: (0.2, 0.0), 2: (0.0, 0.0)}},
                     [Head(0, 0), Head(0, 2)], BASELINE, 2, SIXTEEN, 4, 5)["acc"]
    assert bare.facts.largest_single_help is None
    # One-shot greedy: its changes are single knockouts, as before.
    one_shot = _rankings({"acc": {0: (-0.1, 0.0), 1: (0.2, 0.0), 2: (0.0, 0.0)}}, [],
                         BASELINE, 1, SIXTEEN, 4, 4)["acc"]
    assert one_shot.facts.largest_single_help == {"head": "L0H1", "change": 0.2}


# --- the command: a real iterative run, its scores rewritten, rerun from disk --------------

@pytest.fixture(scope="module")
def iterative(tiny_model_dir, tmp_path_factory):
    """``greedy --rounds 3 --top-k 3`` on the tiny Llama (2 layers x 4 heads) and
    tiny_choice, its measurements' scores then rewritten as the auditor's run measured
    (the rounds' winners kept, so a rerun finds every measurement on disk and loads no
    model), and the ranking remade from them by a rerun."""
    out = tmp_path_factory.mktemp("greedy-advice") / "iterative"
    args = ["greedy", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--rounds", "3", "--top-k", "3", "--out", str(out)]
    assert harness(*args) == 0
    records, heads = read_run(out)
    first, second, third = heads["winners"]
    helper = next(h for h in ("L0H0", "L0H1", "L0H2", "L0H3") if h not in heads["winners"])
    # Score changes per round, relative to the round before's winner (0.5 at the start).
    wanted = {"baseline": 0.5, f"round1-{first}": 0.475, f"round1-{helper}": 0.55,
              f"round2-{second}": 0.475, f"round3-{third}": 0.425,
              f"round3-{helper}": 0.55}
    default = {"round1": 0.5, "round2": 0.5, "round3": 0.475}  # round 2: all help, +0.025
    for record in records:
        record["scores"]["tiny_choice"] = wanted.get(record["key"],
                                                     default.get(record["key"][:6]))
    (out / "measurements.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for name in ("heads.json", "heads-tiny_choice.json", "report.md"):
        (out / name).unlink(missing_ok=True)
    assert harness(*args) == 0
    return out, (first, second, third), helper


def test_an_iterative_runs_report_names_what_hurts_and_its_single_helps(iterative):
    out, (first, second, third), helper = iterative
    records, heads = read_run(out)
    scores = {r["key"]: r["scores"]["tiny_choice"] for r in measurement_lines(out)}
    effects = {h["head"]: h["effect"] for h in heads["heads"]}
    assert heads["top_k"] == [first, second, third]
    assert effects[first] == pytest.approx(-0.025) and effects[second] == pytest.approx(0.0)
    assert effects[third] == pytest.approx(-0.05)
    # The helper's effect is its round 3 change; alone it helped by round 1's.
    assert effects[helper] == pytest.approx(scores[f"round3-{helper}"]
                                            - scores[f"round2-{second}"]) == pytest.approx(0.075)
    alone = scores[f"round1-{helper}"] - scores["baseline"]
    assert heads["largest_single_help"] == {"head": helper, "change": pytest.approx(alone)}
    assert alone == pytest.approx(0.05)
    report = (out / "report.md").read_text()
    assert (f"`ablate={first}+{third}` knocks out only what hurts (not `ablate_top=2`, whose "
            f"first 2 include {second}).") in report
    assert f"helps it ({helper}: +0.0500)" in report and "+0.0750)" not in report


def test_verify_notes_do_not_say_a_harmless_head_before_one_that_hurts_fills_a_place(
        iterative):
    from lm_eval_headloc.commands.verify import ranking_notes
    from lm_eval_headloc.runs.folder import RunFolder

    out, (first, second, third), helper = iterative
    notes = ranking_notes(RunFolder(out), "tiny_choice", 3)
    assert not any("no harm, listed because fewer hurt" in note for note in notes)
    assert (f"{second}: recorded to do no harm, yet ranked above {third}, which hurts the "
            "task (iterative greedy ranks heads in the order they won its rounds, each "
            "measured with the earlier winners knocked out): listed for its place in that "
            "order, not because fewer hurt") in notes
