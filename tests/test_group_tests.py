"""Group tests of what no run measured alone, and the completeness certificate.

The expected values are worked out by hand from the rule (a set whose harm stays under the
top-k's entry bar rules out its members), not read off the code's output.
"""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest
from helpers import (
    assert_same_run,
    harness,
    read_run,
    stopped_part_way,
    strict_json,
    tiny_args,
)

from lm_eval_headloc.method.group_tests import (
    background_harm,
    certificate,
    entry_bar,
    group_key,
    group_order,
    group_size,
    group_testing,
    positive,
)


def additive(harm_of_head):
    """measure() of a world where a set's harm is the sum of its members' (the rule holds
    whenever no head helps), with a log of every set asked for."""
    asked = []

    def measure(sets):
        asked.extend(sets)
        return {s: {"t": float(sum(harm_of_head[h] for h in s))} for s in sets}

    return measure, asked


def test_entry_bar_is_the_kth_measured_harm_or_zero_below_k():
    assert entry_bar({1: 0.3, 2: 0.1, 3: 0.2}, 2) == 0.2
    assert entry_bar({1: 0.3, 2: 0.1, 3: 0.2}, 3) == 0.1
    assert entry_bar({1: 0.3, 2: 0.1}, 3) == 0.0  # fewer than k measured: any harm enters
    assert entry_bar({1: 0.3, 2: -0.1, 3: 0.0}, 2) == 0.0  # the k-th does not hurt


def test_positive_needs_harm_at_or_above_the_bar():
    assert positive(0.05, 0.05) and positive(0.2, 0.05)
    assert not positive(0.049, 0.05)
    assert not positive(0.0, 0.0) and not positive(-0.1, 0.0)  # no harm hides no harm
    assert positive(0.01, 0.0)


def test_group_size_keeps_a_groups_background_under_half_the_bar():
    # bar 0.08, 0.005 per member: 0.04 / 0.005 = 8 members.
    assert group_size(0.08, 0.005) == 8
    assert group_size(0.08, 0.006) == 4  # 6.7 rounds down to a power of two
    assert group_size(0.08, 0.0) == 16 and group_size(0.08, 0.0, largest=32) == 32
    assert group_size(0.0, 0.001) == 2  # any harm enters: the smallest groups
    assert group_size(0.01, 0.5) == 2


def test_background_harm_is_what_the_masks_leave_to_their_unmeasured_members():
    design = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=bool)
    harms = np.array([0.5, 0.06, 0.44])
    # Head 0 measured alone at 0.4: row 0 leaves 0.1 to 2 heads, row 1 0.06 to 3, row 2
    # 0.04 to 1 -> 0.05, 0.02, 0.04: the median 0.04.
    assert background_harm(design, harms, {0: 0.4}) == pytest.approx(0.04)


def test_group_order_takes_the_implicated_first_then_the_least_covered():
    design = np.array([[1, 1, 0, 0, 1], [1, 0, 0, 0, 1]], dtype=bool)
    # screen order 4, 0, 1, 2, 3; implicated: 0; coverage 4:2, 1:1, 2:0, 3:0.
    assert group_order([4, 0, 1, 2, 3], [0], design) == [0, 2, 3, 1, 4]
    assert group_order([4, 0, 1, 2, 3], [0], design, skip=[2]) == [0, 3, 1, 4]


def test_binary_splitting_finds_a_strong_head_and_clears_the_rest():
    harms = np.zeros(16)
    harms[[0, 1]] = [0.5, 0.3]  # measured alone before: the bar (k=2) is 0.3
    harms[11] = 0.35  # hidden: nobody measured it
    harms[[4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 2, 3]] = 0.01
    measure, asked = additive(harms)
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    order = list(range(2, 16))
    result = group_testing(order, known, measure, 20, size=8, top_k=2)
    # Round 1: groups 2..9 (harm 0.08 < 0.3: cleared) and 10..15 (0.05 + 0.35: positive).
    assert result.rounds[0] == [tuple(range(2, 10)), tuple(range(10, 16))]
    # Then halves down to head 11 measured alone; each negative half cleared.
    assert result.rounds[1] == [(10, 11, 12), (13, 14, 15)]
    assert result.rounds[2] == [(10,), (11, 12)]
    assert result.rounds[3] == [(11,), (12,)]
    assert result.harms[(11,)] == {"t": pytest.approx(0.35)}
    assert len(result.sets) == 8 and asked == result.sets


def test_a_larger_budget_extends_the_same_tests():
    rng = np.random.default_rng(0)
    harms = rng.uniform(0, 0.02, 40)
    harms[[5, 33]] = [0.4, 0.25]
    known = {(0,): {"t": 0.3}}
    small = group_testing(range(1, 40), known, additive(harms)[0], 7, size=8, top_k=1)
    large = group_testing(range(1, 40), known, additive(harms)[0], 30, size=8, top_k=1)
    assert large.sets[:7] == small.sets
    assert len(small.sets) == 7


def test_halves_of_a_group_the_risen_bar_rules_out_are_dropped():
    harms = np.zeros(10)
    harms[[1, 2, 3, 4]] = 0.02  # group (1..4): 0.08
    harms[7] = 0.5
    known = {(0,): {"t": 0.05}}
    measure, _ = additive(harms)
    # k=1, bar 0.05, two sets a round. Round 1: (5..8) and (1..4) both reach it. Round 2:
    # (5, 6) clears, (7, 8) reaches it; round 3: 7 alone at 0.5, 8 alone at 0. The bar is
    # now 0.5 and (1..4), at 0.08, is ruled out: its halves are never measured.
    result = group_testing([5, 6, 7, 8, 1, 2, 3, 4], known, measure, 20, size=4, top_k=1,
                           round_size=2)
    assert result.rounds == [[(5, 6, 7, 8), (1, 2, 3, 4)], [(5, 6), (7, 8)], [(7,), (8,)]]


def test_group_keys_are_by_content():
    assert group_key(["L0H1", "L2H3"]) == group_key(["L0H1", "L2H3"])
    assert group_key(["L0H1", "L2H3"]) != group_key(["L0H1", "L2H4"])
    assert group_key(["L0H1", "L2H3"]).startswith("group-")


def _world(n=40, seed=0):
    """A design of 6 masks over n heads, harms additive, with heads 0..4 measured alone."""
    rng = np.random.default_rng(seed)
    design = np.zeros((6, n), dtype=bool)
    for row in design:
        row[rng.choice(n, 8, replace=False)] = True
    return design


def test_the_certificate_does_not_rule_out_a_planted_head_hiding_in_the_untested_tail():
    n = 40
    design = _world(n)
    harms = np.full(n, 0.001)
    harms[:5] = [0.4, 0.3, 0.2, 0.15, 0.1]  # measured alone: bar (k=5) 0.1
    hidden = int(np.flatnonzero(design[0] & ~np.isin(np.arange(n), range(5)))[0])
    harms[hidden] = 0.3  # would be 2nd: only ever knocked out in masks
    mask_harms = design.astype(float) @ harms
    alone = {h: float(harms[h]) for h in range(5)}
    cert = certificate(range(n), design, mask_harms, alone, [], 5)
    assert cert.bar == pytest.approx(0.1)
    assert hidden in cert.unchecked and hidden not in cert.ruled_out
    assert not cert.complete
    # Every head the certificate rules out sits in a mask whose harm is under the bar.
    for head, bound in cert.ruled_out.items():
        assert bound < 0.1 and harms[head] <= bound
    # The group tests over the tail find it and then the certificate is complete.
    known = {tuple(np.flatnonzero(r)): {"t": float(h)}
             for r, h in zip(design, mask_harms, strict=True)}
    known.update({(h,): {"t": v} for h, v in alone.items()})
    order = [h for h in range(5, n)]
    tested = group_testing(order, known, additive(harms)[0], 40, size=8, top_k=5)
    assert (hidden,) in tested.sets
    found = {**alone, **{s[0]: v["t"] for s, v in tested.harms.items() if len(s) == 1}}
    groups = [(s, v["t"]) for s, v in tested.harms.items() if len(s) > 1]
    after = certificate(range(n), design, mask_harms, found, groups, 5)
    assert after.complete and hidden in after.alone
    assert after.bar == pytest.approx(0.15)  # the hidden head entered: the 5th is now 0.15


def test_the_certificate_is_complete_where_every_other_set_stays_under_the_bar():
    n = 12
    design = np.zeros((2, n), dtype=bool)
    design[0, 5:9] = design[1, 8:12] = True
    harms = np.full(n, 0.01)
    harms[:5] = [0.5, 0.4, 0.3, 0.2, 0.1]
    cert = certificate(range(n), design, design.astype(float) @ harms,
                       {h: float(harms[h]) for h in range(5)}, [], 5)
    assert cert.complete and not cert.unchecked
    assert cert.bound == pytest.approx(0.04)  # each mask: 4 heads at 0.01
    assert sorted(cert.ruled_out) == list(range(5, 12))


def test_a_set_above_the_bar_rules_out_nothing_and_the_unchecked_say_where_they_were():
    n = 8
    design = np.zeros((2, n), dtype=bool)
    design[0, [0, 4, 5]] = True  # beside head 0, which is measured to reach the bar
    design[1, [6]] = True
    harms = np.array([0.5, 0.4, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    cert = certificate(range(n), design, design.astype(float) @ harms,
                       {0: 0.5, 1: 0.4}, [], 2)
    assert cert.bar == pytest.approx(0.4)
    # Mask 1 (head 6 alone, 0.3 < 0.4) rules 6 out; mask 0 (0.5) rules out nothing.
    assert cert.ruled_out == {6: pytest.approx(0.3)}
    assert cert.unchecked == [2, 3, 4, 5, 7]
    assert cert.coverage == {2: 0, 3: 0, 4: 1, 5: 1, 7: 0}
    assert cert.shadowed == [4, 5]


# --- a locate run with group tests -------------------------------------------------------

# A random model's knockouts hurt the gold answers' log-likelihood now and then: with
# two masks and one head measured alone, six heads are left for the group tests (seed 1:
# four sets, and one of them reaches the bar and is halved).
GROUPED = ["--tasks", "tiny_choice", "--masks", "2", "--sparsity", "0.25", "--num-samples",
           "8", "--seed", "1", "--signal", "logprob", "--prior", "atp", "--confirm", "1",
           "--group-tests", "8"]


def test_a_locate_run_records_its_group_tests_and_its_certificate(tiny_model_dir, tmp_path,
                                                                   capsys):
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), *GROUPED,
                   "--out", str(out)) == 0
    terminal = capsys.readouterr().out
    groups = strict_json(out / "config.json")["confirm"]["groups"]
    records = {json.loads(x)["key"]: json.loads(x)
               for x in (out / "measurements.jsonl").read_text().splitlines()}
    sets = [m for batch in groups["rounds"] for m in batch]
    assert groups["budget"] == 8 and len(sets) == 6
    for members in sets:  # each set measured under its key, knocking out its members
        key = group_key(members) if len(members) > 1 else f"alone-{members[0]}"
        assert records[key]["mask"] == "+".join(members)
    heads = strict_json(out / "heads.json")
    cert = heads["certificate"]
    assert cert["group_tests_run"] == 8
    # The 2-sets measured, with their changes: the halves of the one that hurt are heads
    # measured alone (ranked by their measurement), not group tests.
    assert [g["components"] for g in cert["group_tests"]] == [m for m in sets if len(m) > 1]
    for g in cert["group_tests"]:
        record = records[group_key(g["components"])]
        assert g["change"] == pytest.approx(record["scores"]["tiny_choice"]
                                            - records["baseline"]["scores"]["tiny_choice"])
    found = {e["head"]: e for e in heads["heads"]}
    for name in groups["alone"]:
        assert found[name]["measured_alone"]
    total = cert["measured_alone"] + cert["ruled_out"] + len(cert["unchecked"])
    assert total == len(heads["heads"])
    report = (out / "report.md").read_text()
    assert "### What was checked" in report and "knocking out more never lessens" in report
    assert "  checked: " in terminal


def test_a_kill_mid_group_tests_resumes_to_the_same_tests_ranking_and_certificate(
        tiny_model_dir, tmp_path):
    """Killed (-9) inside the group tests' second round (the halves of a group that
    reached the bar): the resumed run measures the same sets and ends with the same
    ranking and certificate (heads.json) as an unbroken run."""
    args = ["locate", *tiny_args(tiny_model_dir("llama")), *GROUPED]
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    records = read_run(full)[0]
    first_group = 1 + 2 + 1  # baseline, 2 masks, 1 head alone
    rounds = strict_json(full / "config.json")["confirm"]["groups"]["rounds"]
    assert [len(batch) for batch in rounds] == [4, 2]  # 4 sets, then one's two halves
    assert len(records) == first_group + 6
    killed = tmp_path / "killed"
    partial = stopped_part_way(args, killed, after=first_group + 5,
                               stop=subprocess.Popen.kill)
    assert partial == first_group + 5, "not stopped inside the second round"
    assert harness(*args, "--out", str(killed)) == 0
    assert_same_run(killed, full)
    assert strict_json(killed / "config.json")["confirm"] == \
        strict_json(full / "config.json")["confirm"]
    assert read_run(killed)[1]["certificate"]["group_tests"]


@pytest.mark.parametrize("given, fragment", [
    (["--group-tests", "4", "--confirm", "0"], "--group-tests 4: group tests look for"),
    (["--group-tests", "-1"], "--group-tests"),
    (["--group-tests", "2.5"], "--group-tests"),
])
def test_bad_group_tests_are_one_line_refusals(given, fragment, tmp_path, capsys,
                                               no_model_loading):
    code = harness("locate", "--tasks", "tiny_copy", *given, "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "r").exists()


def test_grouped_run_without_group_tests_is_the_confirming_run():
    from lm_eval_headloc.bench.defaults import (
        confirming_run_top,
        grouped_run_top,
        measured_alone,
        simulated_prior,
    )
    from lm_eval_headloc.bench.simulation import seed_trial

    trial = seed_trial(120, 0.1, 3, 12, world_options={"noise": "documents"})
    changes = measured_alone(trial.world, 5)[1]
    prior = simulated_prior(trial.world, np.random.default_rng(1), points=2)
    plain = confirming_run_top(trial.world, trial.design, trial.scores, prior, 15, changes)
    grouped = grouped_run_top(trial.world, trial.design, trial.scores, prior, 15, 0, changes)
    assert list(grouped) == list(plain)


def test_a_rerun_keeps_its_group_tests_and_a_larger_budget_measures_only_new_ones(
        tiny_model_dir, tmp_path):
    base = ["locate", *tiny_args(tiny_model_dir("llama")), *GROUPED[:-2]]
    out = tmp_path / "run"
    assert harness(*base, "--group-tests", "3", "--out", str(out)) == 0
    first, heads = read_run(out)
    groups = strict_json(out / "config.json")["confirm"]["groups"]
    assert groups["budget"] == 3 and sum(map(len, groups["rounds"])) == 3
    # Left out on a rerun: the run's own (not 0, which would drop what it measured).
    assert harness(*base, "--out", str(out)) == 0
    assert read_run(out) == (first, heads)
    assert strict_json(out / "config.json")["confirm"]["groups"] == groups
    # More: the same first tests, then the new ones, as a run that asked for 8 at once.
    assert harness(*base, "--group-tests", "8", "--out", str(out)) == 0
    grown = read_run(out)[0]
    assert grown[:len(first)] == first
    fresh = tmp_path / "fresh"
    assert harness(*base, "--group-tests", "8", "--out", str(fresh)) == 0
    assert_same_run(out, fresh)


@pytest.mark.parametrize("confirmed", [None, ["L0H1"]])
def test_the_certificate_advises_flags_a_run_like_it_accepts(confirmed):
    from lm_eval_headloc.method.ranking import CertificateRecord, Ranking, RankingFacts
    from lm_eval_headloc.report.locate_report import certificate_words
    from lm_eval_headloc.runs.spec import RunSpec, UsageError

    cert = CertificateRecord(
        rule="r", entry_bar=0.0, top_k=2, measured_alone=0 if confirmed is None else 1,
        ruled_out=0, bound=0.0, unchecked=["L1H0", "L1H2"], unchecked_never_in_a_mask=0,
        unchecked_in_one_mask=2, unchecked_beside_measured=[], group_size=2,
        group_tests_run=0, group_tests=[], group_tests_to_cover=3)
    ranking = Ranking(task="t", metric="acc", higher_is_better=True, baseline=1.0,
                      effects=np.zeros(8), order=list(range(8)), heads_per_layer=4,
                      facts=RankingFacts(confirmed=confirmed, certificate=cert))
    line = next(x for x in certificate_words(ranking) if "would knock each" in x)
    flags = line.split(" would knock each")[0]  # what the line says to run
    assert "--group-tests 3" in flags
    # Group tests follow a confirmation: a run that confirmed nothing is told to confirm
    # too, as the spec refuses --group-tests with --confirm 0.
    assert ("--confirm" in flags) == (confirmed is None)
    with pytest.raises(UsageError, match="--group-tests 3"):
        RunSpec(masks=10, confirm=0, group_tests=3).validate()
    RunSpec(masks=10, confirm=1, group_tests=3).validate()


def test_a_tasks_group_plan_knows_every_measured_set_and_leaves_out_the_measured():
    from lm_eval_headloc.method.locate_loop import plan_groups

    design = np.array([[1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0],
                       [0, 1, 0, 0, 0, 1], [1, 0, 1, 0, 0, 0]], dtype=bool)
    scores = np.array([0.5, 0.9, 0.6, 0.8, 0.55])  # higher is better, baseline 1.0
    plan = plan_groups(design, scores, 1.0, True, {0: -0.4, 3: 0.0}, alpha=0.01,
                       penalty_weights=None, top_k=2, skip=[5])
    # Every mask's harm (baseline less its score), every head measured alone (its
    # change's opposite), by its members.
    assert plan.known == {(0, 1): pytest.approx(0.5), (2, 3): pytest.approx(0.1),
                          (0, 4): pytest.approx(0.4), (1, 5): pytest.approx(0.2),
                          (0, 2): pytest.approx(0.45), (0,): 0.4, (3,): 0.0}
    # The heads left to test: not those measured alone, not the skipped one.
    assert sorted(plan.order) == [1, 2, 4]
    # Fewer than top-k measured alone hurt: any harm enters, so the smallest groups.
    assert plan.size == 2
    # Lower is better: the same scores are improvements, so no mask harmed.
    lower = plan_groups(design, scores, 1.0, False, {}, alpha=0.01, penalty_weights=None,
                        top_k=2)
    assert all(harm < 0 for harm in lower.known.values())
