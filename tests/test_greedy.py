"""greedy's ranking: the rule for heads measured alone (``rank.rank_measured``), worked
out by hand; and the command itself on a tiny model (one-shot, iterative, a rerun)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import harness, read_run, strict_json, tiny_args

from lm_eval_headloc.commands.greedy import _rankings
from lm_eval_headloc.common import timing
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.rank import confirmed_order
from lm_eval_headloc.method.ranking import RankingFacts

#: The columns of 6 and of 4 heads (2 layers of 3, of 2).
SIX, FOUR = Columns.heads(2, 3), Columns.heads(2, 2)

BASELINE = {"scores": {"acc": 0.6, "ppl": 10.0}, "metrics": {"acc": "acc", "ppl": "ppl"},
            "higher_is_better": {"acc": True, "ppl": False}}


def test_one_shot_ranks_every_head_measured_as_a_confirmation_would():
    # 6 heads (3 per layer); head 4 was never measured (skipped).
    changes = {"acc": {0: (-0.05, -0.2), 1: (-0.10, -0.1), 2: (-0.05, -0.6),
                       3: (0.02, -1.0), 5: (-0.05, -0.2)},
               "ppl": {0: (1.0, 0.0), 1: (-0.5, 0.0), 2: (1.0, 0.0), 3: (2.0, 0.0),
                       5: (0.0, 0.0)}}
    rankings = _rankings(changes, [], BASELINE, 1, SIX, 3, 6)
    acc, ppl = rankings["acc"], rankings["ppl"]
    # acc: 1 drops most; 0, 2, 5 drop 0.05 (2's logprob drop is the largest, 0 and 5 are
    # equal: head order); 3 helps.
    assert acc.order == [1, 2, 0, 5, 3]
    # ppl (lower is better): the largest rise first; 0 and 2 equal: head order.
    assert ppl.order == [3, 0, 2, 5, 1]
    for ranking, task in ((acc, "acc"), (ppl, "ppl")):
        assert ranking.order == confirmed_order(changes[task], (), ranking.higher_is_better)
        assert math.isnan(ranking.effects[4])  # never measured: no effect, not ranked
        assert [ranking.effects[h] for h in (0, 1, 2, 3, 5)] == [
            changes[task][h][0] for h in (0, 1, 2, 3, 5)]
        assert {k: v for k, v in ranking.facts.to_json().items()
                if k not in ("tied_with_above", "largest_single_help")} == {
            "method": "one-shot greedy", "rounds": 1, "winners": [], "measurements": 6}
    # Every head was measured: the knockout that helps most (acc: head 3 gains 0.02; ppl,
    # lower is better: head 1's fall of 0.5) is the spread single knockouts show.
    assert acc.facts.largest_single_help == {"head": "L1H0", "change": 0.02}
    assert ppl.facts.largest_single_help == {"head": "L0H1", "change": -0.5}
    assert acc.baseline == 0.6 and not ppl.higher_is_better


def test_iterative_winners_lead_in_the_order_they_won():
    # Winners L1H0 (flat 2) then L0H1 (flat 1); the others by their last round's change.
    changes = {"acc": {2: (-0.30, 0.0), 1: (-0.01, 0.0), 0: (-0.20, 0.0), 3: (-0.05, 0.0)}}
    winners = [Head(1, 0), Head(0, 1)]
    ranking = _rankings(changes, winners, BASELINE, 2, FOUR, 2, 9)["acc"]
    assert ranking.order == [2, 1, 0, 3]
    assert ranking.facts.method == "iterative greedy"
    assert ranking.facts.winners == ["L1H0", "L0H1"]


def test_equal_measured_changes_are_marked_and_reported_as_ties():
    from lm_eval_headloc.method.ranking import ranked_heads_json
    from lm_eval_headloc.report.pages import tie_words

    changes = {"acc": {0: (-0.05, -0.2), 1: (-0.10, -0.1), 2: (-0.05, -0.6),
                       3: (0.02, -1.0), 5: (-0.05, -0.2)}}
    ranking = _rankings(changes, [], BASELINE, 1, SIX, 3, 6)["acc"]
    # Order 1, 2, 0, 5, 3: only 0 and 5 share both changes (L1H2 is head 5).
    assert ranking.facts.tied_with_above == ["L1H2"]
    listed = ranked_heads_json(ranking, 4)["heads"]
    assert [h["tied_with_above"] for h in listed[:4]] == [False, False, False, True]
    assert tie_words(ranking, 4) == [
        "Tied (the same evidence; listed in head order): L0H0 = L1H2.", ""]
    # Nothing measured tells any head apart: no order is claimed.
    flat = _rankings({"acc": {h: (0.0, 0.0) for h in range(6)}}, [], BASELINE, 1, SIX, 3,
                     6)["acc"]
    assert flat.facts.tied_with_above == [str(Head.from_flat_index(h, 3))
                                             for h in range(1, 6)]
    # Greedy measured each head alone: no fit is to blame (the terminal's line says it too).
    assert tie_words(flat, 3)[0].startswith(
        "No head stands out: all 3 listed heads have the same evidence (every head measured "
        "alone changed the score and log-likelihood alike)")
    flat.facts.method = "compressed sensing (Lasso)"
    assert "(the fit found no effect that tells the heads apart)" in tie_words(flat, 3)[0]


def test_an_iterative_winner_picked_by_head_index_is_tied_with_the_one_above():
    """Round 1 measured L0H0 (0) and L0H1 (1) alike, so its winner L0H0 was picked over
    L0H1 by index: L0H1, round 2's winner, is tied with it; told that round 1 measured
    L0H0 alone at its value, L0H1 is not. L1H0 (2), the first head after the winners,
    measured in round 2 what the winner did: tied either way. Without ``alike`` (the
    earlier code) a winner was never marked."""
    changes = {"acc": {0: (-0.2, -1.0), 1: (-0.1, -0.5), 2: (-0.1, -0.5), 3: (0.0, 0.0)}}
    winners = [Head(0, 0), Head(0, 1)]
    alike = [{"acc": {0, 1}}, {"acc": {1}}]
    ranking = _rankings(changes, winners, BASELINE, 2, FOUR, 2, 9, alike)["acc"]
    assert ranking.order == [0, 1, 2, 3]
    # L1H0 measured in round 2 as L0H1 did when it won: tied with it too.
    assert ranking.facts.tied_with_above == ["L0H1", "L1H0"]
    strict = _rankings(changes, winners, BASELINE, 2, FOUR, 2, 9,
                       [{"acc": {0}}, {"acc": {1}}])["acc"]
    assert strict.facts.tied_with_above == ["L1H0"]


def test_top_k_places_that_do_not_hurt_are_said_to():
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import harmless_words

    changes = {"acc": {0: (-0.05, -0.2), 1: (-0.10, -0.1), 2: (-0.05, -0.6),
                       3: (0.02, -1.0), 5: (-0.05, -0.2)}}
    ranking = _rankings(changes, [], BASELINE, 1, SIX, 3, 6)["acc"]  # order 1, 2, 0, 5, 3
    assert harmless_words(ranking, 4, all_measured=True) == []  # all four hurt
    assert ranking.harmless(5) == [Head(1, 0)]  # head 3 helps: +0.02
    unknown = Ranking("t", "acc", True, 0.5, np.array([-0.1, np.nan, 0.0]), [0, 1, 2], 3)
    assert unknown.harmless(3) == [Head(0, 2)]  # a NaN effect is unknown, not harmless
    assert harmless_words(ranking, 5, all_measured=True) == [
        "Only 4 of the top-5 heads hurt the task; the other places are filled by heads "
        "that do not (L1H0: measured to do no harm). `ablate_top=4` knocks out only what "
        "hurts.", ""]
    # A locate ranking: one head measured alone to do nothing, one the fit gives -0.01
    # (helps), one it implicates; lower is better here, so a positive change hurts.
    located = Ranking("t", "ppl", False, 10.0, np.array([0.0, -0.01, 0.3, 0.0]),
                          [2, 0, 1, 3], 2, facts=RankingFacts(confirmed=["L0H0"]))
    assert located.harmless(3) == [Head(0, 0), Head(0, 1)]
    assert harmless_words(located, 3, "head") == [
        "Only 1 of the top-3 heads hurts the task; the other places are filled by heads "
        "that do not (L0H0: measured alone to do no harm; L0H1: no harm in the fit's "
        "estimate). `ablate_top=1` knocks out only what hurts.", ""]
    none = Ranking("t", "acc", True, 0.5, np.array([0.0, 0.01, 0.0, 0.0]),
                       [0, 1, 2, 3], 2, facts=RankingFacts(confirmed=["L0H0"]))
    assert harmless_words(none, 2)[0].startswith(
        "Nothing found: none of the top-2 heads hurts the task (L0H0: measured alone to do "
        "no harm; L0H1: no harm in the fit's estimate)")


def _recorded(ranking, all_measured=False):
    """The ranking with its largest single help recorded, as locate and greedy record it."""
    from lm_eval_headloc.method.ranking import largest_single_help

    found = largest_single_help(ranking, all_measured)
    if found is not None:
        ranking.facts.largest_single_help = found
    return ranking


def test_harms_no_larger_than_a_single_knockouts_help_are_said_to_be_within_the_spread():
    """A task at chance: heads measured alone to lose one example of 100 were ranked as
    hurting, while other single knockouts gained three; the report now says so."""
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import spread_words

    # L0H0..L0H3 measured alone: -0.01, -0.01, +0.03, 0; L1H0 only estimated (-0.2).
    effects = np.array([-0.01, -0.01, 0.03, 0.0, -0.2, 0.0, 0.0, 0.0])
    chance = Ranking("t", "acc", True, 0.5, effects, [4, 0, 1, 3, 5, 6, 7, 2], 4,
                         facts=RankingFacts(confirmed=["L0H0", "L0H1", "L0H2", "L0H3"]))
    # L1H0's estimate (not a measurement) is beyond; the measured ones are not.
    assert spread_words(_recorded(chance), 3) == [
        "Only L1H0 hurts the task by more than knocking out one head alone helps it (L0H2: "
        "+0.0300); the other top-3 heads that hurt do so by no more, within the spread of "
        "single knockouts.", ""]
    measured_only = Ranking("t", "acc", True, 0.5, effects, [0, 1, 3, 2], 4,
                                facts=RankingFacts(confirmed=["L0H0", "L0H1", "L0H2", "L0H3"]))
    assert spread_words(_recorded(measured_only), 2) == [
        "Nothing beyond the spread of single knockouts: no top-2 head hurts the task by more "
        "than knocking out one head alone helps it (L0H2: +0.0300); their order may reflect "
        "which examples happened to flip, not heads the task needs.", ""]
    # Lower is better (perplexity): a rise hurts, a fall helps; a harm beyond every help
    # needs no such line, nor does a run in which no knockout helps.
    ppl = _recorded(Ranking("t", "ppl", False, 10.0, np.array([0.5, -0.1, 0.05, 0.0]),
                                [0, 2, 3, 1], 2), all_measured=True)
    assert spread_words(ppl, 1) == []
    assert spread_words(ppl, 2)[0].startswith(
        "Only L0H0 hurts the task by more than knocking out one head alone helps it (L0H1: "
        "-0.1000)")
    never_helps = _recorded(Ranking("t", "acc", True, 0.5,
                                        np.array([-0.01, 0.0, 0.0, 0.0]), [0, 1, 2, 3], 2),
                            all_measured=True)
    assert never_helps.facts.largest_single_help is None
    assert spread_words(never_helps, 2) == []
    # One example of 24 lost and one gained, as scores minus a baseline: the harm came out
    # larger in its last bits (an audit's run) and was called beyond the spread.
    baseline = 14 / 24
    lost, gained = 13 / 24 - baseline, 15 / 24 - baseline
    assert -lost > gained  # the round-off this guards against
    one_each = _recorded(Ranking("t", "acc", True, baseline,
                                     np.array([-0.2, lost, gained, 0.0]), [0, 1, 3, 2], 2),
                         all_measured=True)
    assert spread_words(one_each, 2) == [
        "Only L0H0 hurts the task by more than knocking out one head alone helps it (L1H0: "
        "+0.0417); the other top-2 heads that hurt do so by no more, within the spread of "
        "single knockouts.", ""]


def test_equal_measured_changes_are_said_to_be_ordered_by_the_log_likelihood():
    """Ranks 1-3 measured -0.01 each (not tied: their gold log-likelihood changes
    differed) read as an order the table did not explain."""
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import equal_change_words

    effects = np.array([-0.01, -0.01, -0.01, -0.3, -0.2, 0.0])
    ranking = Ranking("t", "acc", True, 0.5, effects, [3, 4, 0, 1, 2, 5], 3,
                          facts=RankingFacts(confirmed=["L0H0", "L0H1", "L0H2", "L1H0"],
                                 tied_with_above=[]))
    assert equal_change_words(ranking, 2) == []
    # L0H2 is measured alone; L1H1 (-0.2, estimated) differs from L0H0: one group.
    assert equal_change_words(ranking, 5) == [
        "The same measured change, ordered by the gold answers' log-likelihood change (the "
        "larger drop first): L0H0, L0H1, L0H2 (-0.0100).", ""]
    # The top-k's last place among equal measurements: which of them made the top-k was
    # the log-likelihood's call (an audit found a 5th and 6th both at -0.24, unsaid).
    assert equal_change_words(ranking, 3) == [
        "The same measured change, ordered by the gold answers' log-likelihood change (the "
        "larger drop first): L0H0 (-0.0100), and after the top-3 L0H1, L0H2, measured the "
        "same: the log-likelihood decided which of them are in the top-3.", ""]
    assert equal_change_words(ranking, 4)[0].endswith(
        ": L0H0, L0H1 (-0.0100), and after the top-4 L0H2, measured the same: the "
        "log-likelihood decided which of them are in the top-4.")
    # Many measured alike after it are counted, not listed; a harmless k-th (its place is
    # harmless_words' to explain) gets no such clause, or every head doing nothing would.
    many = Ranking("t", "acc", True, 0.5, np.array([-0.2] + [-0.1] * 8 + [0.0] * 4),
                       list(range(13)), 13, facts=RankingFacts(tied_with_above=[]))
    assert equal_change_words(many, 2, all_measured=True)[0].endswith(
        "L0H1 (-0.1000), and after the top-2 L0H2, L0H3, L0H4, L0H5, L0H6 and 2 more, "
        "measured the same: the log-likelihood decided which of them are in the top-2.")
    assert "after the top" not in equal_change_words(many, 10, all_measured=True)[0]
    # An estimate after the k-th, equal to its measurement, decided nothing of the kind.
    estimated_after = Ranking("t", "acc", True, 0.5, np.array([-0.2, -0.1, -0.1]),
                                  [0, 1, 2], 3, facts=RankingFacts(confirmed=["L0H0", "L0H1"],
                                                       tied_with_above=[]))
    assert equal_change_words(estimated_after, 2) == []
    # A tie (the same log-likelihood change too) is tie_words' to say, not this line's.
    ranking.facts.tied_with_above = ["L0H1", "L0H2"]
    assert equal_change_words(ranking, 5) == []
    # An estimate equal to a measurement is no such pair.
    estimated = Ranking("t", "acc", True, 0.5, np.array([-0.1, -0.1]), [0, 1], 2,
                            facts=RankingFacts(confirmed=["L0H0"]))
    assert equal_change_words(estimated, 2) == []
    assert equal_change_words(estimated, 2, all_measured=True)[0].endswith(
        "L0H0, L0H1 (-0.1000).")


def test_a_task_at_its_floor_is_said_to_be_and_the_signal_that_can_move_named():
    from lm_eval_headloc.commands.greedy import _report
    from lm_eval_headloc.report.pages import at_floor

    zero = {**BASELINE, "scores": {"acc": 0.0, "ppl": 10.0}}
    flat = {"acc": {h: (0.0, 0.0) for h in range(4)}, "ppl": {h: (0.0, 0.0) for h in range(4)}}
    rankings = _rankings(flat, [], zero, 1, FOUR, 2, 5)
    assert at_floor(rankings["acc"]) and not at_floor(rankings["ppl"])  # lower is better
    report = _report(rankings, 2)
    assert report.count("so no knockout can lower it; --signal logprob") == 1
    assert not at_floor(_rankings(flat, [], BASELINE, 1, FOUR, 2, 5)["acc"])  # 0.6: room


def test_a_metric_that_goes_below_0_has_no_floor_at_0():
    # A Matthews correlation of 0 (a model that answers one class every time) or a
    # difference of scores (truthfulqa_gen's bleu_diff) can fall below 0: "no knockout can
    # lower a score of 0" was said of them.
    from lm_eval_headloc.report.pages import scores_at_floor

    assert scores_at_floor(0.0, True, "acc,none") and scores_at_floor(0.0, True, "f1,none")
    for metric in ("mcc,none", "bleu_diff,none", "rouge1_diff,none"):
        assert not scores_at_floor(0.0, True, metric)


def test_a_neuron_groups_help_is_not_the_spread_of_single_knockouts():
    """With --neuron-groups a group of many neurons is measured alone where the fit
    implicates it; its help is no measure of what knocking out one neuron flips, and it
    called every top neuron's measured harm noise."""
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.report.pages import spread_words

    columns = Columns.of("neurons", 2, 4, ["L0N1", "L0N2", "L1N0"], groups_per_layer=1,
                         neurons_per_layer=6)
    assert [str(c) for c in columns] == ["L0N1", "L0N2", "L1N0", "L0G0", "L1G0"]
    # Measured alone: two neurons hurt, the group of layer 0's other neurons helps.
    effects = np.array([-0.01, -0.008, 0.0, 0.02, 0.0])
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 1, 2, 4, 3], 4,
                          columns=columns,
                          facts=RankingFacts(confirmed=["L0N1", "L0N2", "L1N0", "L0G0", "L1G0"]))
    assert spread_words(_recorded(ranking), 2, "neuron") == []  # no single neuron helps
    # A single neuron that helps more than they hurt is the spread, as for heads.
    effects[2] = 0.012
    ranking = Ranking("t", "acc", True, 0.5, effects, [0, 1, 4, 2, 3], 4,
                          columns=columns,
                          facts=RankingFacts(confirmed=["L0N1", "L0N2", "L1N0", "L0G0", "L1G0"]))
    assert spread_words(_recorded(ranking), 2, "neuron")[0].startswith(
        "Nothing beyond the spread of single knockouts: no top-2 neuron hurts the task by "
        "more than knocking out one neuron alone helps it (L1N0: +0.0120)")


# --- the greedy command on a tiny model ---------------------------------------------------

def test_greedy_one_shot_and_iterative(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("gpt2")
    one = tmp_path / "one"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--top-k", "3", "--out", str(one)) == 0
    records, heads = read_run(one)
    assert len(records) == 1 + 8  # baseline + every head alone
    base = records[0]["scores"]["tiny_copy"]
    drops = {r["mask"]: base - r["scores"]["tiny_copy"] for r in records[1:]}
    base_logprob = records[0]["logprob"]["tiny_copy"]
    logprob_drops = {r["mask"]: base_logprob - r["logprob"]["tiny_copy"] for r in records[1:]}
    ranked = [h["head"] for h in heads["heads"]]
    # Most harmful first; equal accuracy drops by the gold log-likelihood's drop, then in
    # head order (L0H0 < L0H1 < ... by flat index).
    flat = {f"L{i // 4}H{i % 4}": i for i in range(8)}
    assert ranked == sorted(drops, key=lambda h: (-drops[h], -logprob_drops[h], flat[h]))
    assert len(set(drops.values())) < len(drops), "no tie: the tie-break was not tested"
    # What kind of head each is, as in a locate run's files (types.json written once).
    types = strict_json(one / "types.json")
    assert set(heads["heads"][0]["types"]) == set(types["scores"])
    head = heads["heads"][0]["head"]
    layer, index = int(head[1:head.index("H")]), int(head[head.index("H") + 1:])
    assert heads["heads"][0]["types"]["induction"] == pytest.approx(
        types["scores"]["induction"][layer][index], abs=1e-6)
    assert "type" in (one / "heads.csv").read_text().splitlines()[0].split(",")
    # report.md opens with its title (the time line stood above it), then the model and
    # the time, then a section per task.
    report = (one / "report.md").read_text().splitlines()
    assert report[0] == "# Head localization by one-shot greedy"
    assert report[2] == f"- model: `{strict_json(one / 'config.json')['spec']['model_args']}`"
    # What was scored and on which examples, as locate's report says it (it had no line
    # on either).
    assert report[3] == "- signal: each task's metric, as lm-eval reports it"
    assert report[4] == ("- knockout: a knocked-out head's output is zeroed (--ablation zero, "
                         "--scale 0)")
    config = strict_json(one / "config.json")
    assert report[5] == (f"- examples per task: {config['spec']['num_samples']} asked, used "
                         f"tiny_copy {config['examples_used']['tiny_copy']} (the same subset "
                         "in every measurement)")
    assert report[6].startswith("- time: ") and report[6].endswith("(config.json's timings)")
    # The timings it says, the report's own among them, are config.json's.
    assert config["timings"][-1]["phases"]["report"] > 0
    assert report[6] == timing.timings_item(config["timings"])
    # The ranking files record it: hf-headablate reads them.
    assert heads["knockout"] == {"ablation": "zero", "scale": 0.0}
    assert [line for line in report if line.startswith("#")] == [report[0],
                                                                 "## tiny_copy (acc,none)"]

    it = tmp_path / "iterative"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--rounds", "2", "--top-k", "3", "--out", str(it)) == 0
    records, heads = read_run(it)  # strict JSON: no NaN for the round-1 winner
    assert len(records) == 1 + 8 + 7
    winner = heads["winners"][0]
    assert all(r["mask"].count("+") == 1 and winner in r["mask"]
               for r in records if r["key"].startswith("round2-"))
    by_key = {r["key"]: r["scores"]["tiny_copy"] for r in records}
    effects = {h["head"]: h["effect"] for h in heads["heads"]}
    # The first winner's effect is what it cost in round 1; the others' their round 2 cost.
    assert effects[winner] == pytest.approx(by_key[f"round1-{winner}"] - by_key["baseline"])
    second = heads["winners"][1]
    assert effects[second] == pytest.approx(by_key[f"round2-{second}"]
                                            - by_key[f"round1-{winner}"])
    assert [h["head"] for h in heads["heads"][:2]] == heads["winners"]
    assert "nan" not in (it / "heads.csv").read_text().lower()
    assert (it / "report.md").read_text().startswith("# Head localization by iterative greedy")


def test_a_finished_greedy_run_reruns_without_loading_the_model(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    out = tmp_path / "iterative"
    args = ["greedy", *tiny_args(tiny_model_dir("gpt2")), "--tasks", "tiny_copy",
            "--num-samples", "12", "--rounds", "2", "--top-k", "3", "--out", str(out)]
    assert harness(*args) == 0
    files = {name: (out / name).read_bytes() for name in
             ("heads.json", "heads.csv", "types.json", "config.json", "measurements.jsonl",
              "report.md")}  # report.md: a rerun dropped its time and examples lines
    original = HFHeadAblateLM.__init__
    loads = []
    monkeypatch.setattr(HFHeadAblateLM, "__init__",
                        lambda self, *a, **k: loads.append(1) or original(self, *a, **k))
    assert harness(*args) == 0
    assert loads == [] and {n: (out / n).read_bytes() for n in files} == files
    assert "- examples per task: 12 asked, used tiny_copy 12" in files["report.md"].decode()
    # The last round's last measurement lost: the model loads to measure it again.
    lines = (out / "measurements.jsonl").read_text().splitlines(keepends=True)
    (out / "measurements.jsonl").write_text("".join(lines[:-1]))
    assert harness(*args) == 0
    assert loads == [1]
    assert (out / "heads.json").read_bytes() == files["heads.json"]
