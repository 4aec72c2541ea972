"""Group tests of what no run measured alone, and the completeness certificate.

The expected values are worked out by hand from the rule (a set whose harm stays under the
top-k's entry bar rules out its members), not read off the code's output.
"""

from __future__ import annotations

import json
import math
import signal

import numpy as np
import pytest
from helpers import (
    assert_same_run,
    harness,
    read_run,
    shown_bars,
    stopped_part_way,
    strict_json,
    tiny_args,
)

from lm_eval_headloc.method.group_tests import (
    HELPS,
    OVER,
    UNCLEAR,
    UNDER,
    VIOLATES,
    Harm,
    Z,
    background_harm,
    certificate,
    entry_bar,
    group_key,
    group_order,
    group_size,
    group_testing,
    halves,
    next_size,
    peeled,
    read_sets,
    status,
    tied_at_k,
    unmasked,
)


def additive(harm_of_head, se_of_set=None):
    """measure() of a world where a set's harm is the sum of its members' (the rule holds
    whenever no head helps), with a log of every set asked for; ``se_of_set(members)``
    gives each set's standard error (default 0: exact)."""
    asked = []

    def measure(sets):
        asked.extend(sets)
        return {s: {"t": Harm(float(sum(harm_of_head[h] for h in s)),
                              0.0 if se_of_set is None else se_of_set(s))} for s in sets}

    return measure, asked


def test_z_is_the_one_sided_95_percent_quantile():
    assert Z == pytest.approx(1.6449, abs=1e-4)


def test_entry_bar_is_the_kth_measured_harm_or_zero_below_k():
    assert entry_bar({1: 0.3, 2: 0.1, 3: 0.2}, 2) == 0.2
    assert entry_bar({1: 0.3, 2: 0.1, 3: 0.2}, 3) == 0.1
    assert entry_bar({1: 0.3, 2: 0.1}, 3) == 0.0  # fewer than k measured: any harm enters
    assert entry_bar({1: 0.3, 2: -0.1, 3: 0.0}, 2) == 0.0  # the k-th does not hurt
    assert entry_bar({1: Harm(0.3, 0.1), 2: Harm(0.2, 0.05)}, 2) == 0.2


def test_status_without_noise_is_under_or_over_the_bar():
    assert status(0.049, 0.05) == UNDER
    assert status(0.05, 0.05) == OVER and status(0.2, 0.05) == OVER
    assert status(0.0, 0.0) == UNDER  # fewer than k hurt: a set that hurts nothing clears
    assert status(0.01, 0.0) == OVER
    # Any help at all is a help beyond a noise of 0: it can hide a harmful member.
    assert status(-0.1, 0.05) == HELPS


def test_status_with_noise_rules_out_only_clearly_under_the_bar():
    # 1.645 standard errors of 0.02 is a margin of 0.0329.
    assert status(Harm(0.06, 0.02), 0.1) == UNDER  # 0.0929 < 0.1
    assert status(Harm(0.07, 0.02), 0.1) == UNCLEAR  # 0.1029 >= 0.1, 0.0371 < 0.1
    assert status(Harm(0.14, 0.02), 0.1) == OVER  # 0.1071 >= 0.1
    assert status(Harm(-0.05, 0.02), 0.1) == HELPS  # a help beyond 0.0329
    assert status(Harm(-0.02, 0.02), 0.1) == UNDER  # a help within the noise
    assert status(Harm(0.0, 0.01), 0.0) == UNCLEAR  # could hurt: fewer than k hurt


def test_status_sees_a_violation_of_the_rule_in_a_measured_part():
    # The set harms 0.05, a member alone 0.2: 0.15 > 1.645 * hypot(0.01, 0.01) = 0.0233.
    assert status(Harm(0.05, 0.01), 0.3, [Harm(0.2, 0.01)]) == VIOLATES
    # 0.07 vs 0.05: 0.02 < 1.645 * hypot(0.02, 0.01) = 0.0368, within the noise.
    assert status(Harm(0.05, 0.01), 0.1, [Harm(0.07, 0.02)]) == UNDER
    assert status(0.05, 0.1, [0.06]) == VIOLATES  # exact numbers: any excess


def test_a_helper_measured_alone_gives_its_help_back_to_the_sets_it_is_in():
    """A mask knocking out a strong head (0.2) beside one measured alone to help (-0.15)
    harms 0.05, under the bar of 0.1: it ruled the strong head out ("at most 0.05 alone"),
    though it would be 2nd. The helper breaks the rule inside the set: its help is added
    back, 0.2, over the bar."""
    assert unmasked(Harm(0.05, 0.01), [Harm(-0.15, 0.02)]) == pytest.approx(
        Harm(0.2, math.hypot(0.01, 0.02)))
    assert unmasked(Harm(0.05, 0.01), [Harm(-0.01, 0.01)]) == Harm(0.05, 0.01)  # in noise
    assert status(0.05, 0.1, [-0.15], alone=[-0.15]) == OVER
    design = np.zeros((2, 7), dtype=bool)
    design[0, [0, 1, 2]] = True
    design[1, [0, 5, 6]] = True  # 0.01 with the helper: 0.16 without it
    cert = certificate(range(7), design, [0.05, 0.01], {0: -0.15, 3: 0.25, 4: 0.1}, [], 2)
    assert cert.bar == pytest.approx(0.1)
    assert cert.unchecked == [1, 2, 5, 6] and not cert.ruled_out
    # Under a bar of 0.25 both rule their members out, each at most its harm given back.
    cert = certificate(range(7), design, [0.05, 0.01], {0: -0.15, 3: 0.3, 4: 0.25}, [], 2)
    assert cert.complete and cert.ruled_out == pytest.approx({1: 0.2, 2: 0.2, 5: 0.16,
                                                              6: 0.16})


def test_a_helper_left_out_of_the_ranking_still_gives_its_help_back():
    """`refit --exclude` of the helper above (measured alone, then left out of the
    ranking): it no longer set the bar, so the certificate passed only the ranked heads
    as ``alone``, and its help stayed hidden in the mask, ruling the strong head out
    again. Its measurement alone (a 1-set) still gives the help back."""
    design = np.zeros((2, 7), dtype=bool)
    design[0, [0, 1, 2]] = True
    design[1, [0, 5, 6]] = True
    # Column 0 measured alone (-0.15) but not ranked: a group test of its own 1-set.
    before = certificate(range(1, 7), design, [0.05, 0.01], {3: 0.25, 4: 0.1}, [], 2)
    assert before.ruled_out  # its help unknown here: the rule reads the mask as it is
    cert = certificate(range(1, 7), design, [0.05, 0.01], {3: 0.25, 4: 0.1}, [], 2,
                       left_out={0: -0.15})
    assert cert.bar == pytest.approx(0.1)
    assert cert.unchecked == [1, 2, 5, 6] and not cert.ruled_out
    assert cert.helps == [] and 0 not in cert.alone  # its own measurement is no set tested
    reading = read_sets({(0, 1, 2): Harm(0.05, 0.01), (0,): Harm(-0.15, 0.01)}, 1,
                        alone={3: 0.1})
    assert reading.statuses[(0, 1, 2)] == OVER and not set(reading.ruled_out) & {1, 2}


def test_read_sets_rules_out_with_the_upper_bound_and_counts_what_it_cannot_use():
    measured = {(0,): Harm(0.3, 0.02), (1,): Harm(0.2, 0.02),  # bar (k=2) 0.2
                (2, 3): Harm(0.05, 0.02),  # 0.05 + 0.0329 = 0.0829: under
                (3, 4): Harm(0.18, 0.02),  # unclear
                (0, 5): Harm(0.1, 0.02),  # a part (0) harms 0.3: violates
                (6, 7): Harm(-0.2, 0.02),  # helps
                (2, 8, 9): Harm(0.12, 0.03)}  # 0.12 + 0.0493 = 0.1693: under
    reading = read_sets(measured, 2)
    assert reading.bar == pytest.approx(0.2)
    assert reading.statuses == {(2, 3): UNDER, (3, 4): UNCLEAR, (0, 5): VIOLATES,
                                (6, 7): HELPS, (2, 8, 9): UNDER}
    # Each column's bound: its least ruling set's harm plus the margin.
    assert reading.ruled_out == {2: pytest.approx(0.05 + Z * 0.02),
                                 3: pytest.approx(0.05 + Z * 0.02),
                                 8: pytest.approx(0.12 + Z * 0.03),
                                 9: pytest.approx(0.12 + Z * 0.03)}


def test_ties_at_the_kth_place_are_those_the_noise_cannot_tell_apart():
    alone = {0: Harm(0.5, 0.02), 1: Harm(0.30, 0.02), 2: Harm(0.28, 0.02),
             3: Harm(0.20, 0.02)}
    # k=2: the 2nd harms 0.30; 0.28 is within 1.645 * hypot(0.02, 0.02) = 0.0465 of it,
    # 0.20 and 0.5 are not.
    assert tied_at_k(alone, 2) == [1, 2]
    assert tied_at_k(alone, 1) == []  # the first is clear of the second
    assert tied_at_k({0: 0.3, 1: 0.3, 2: 0.1}, 1) == [0, 1]  # exact ties
    assert tied_at_k({0: 0.3, 1: 0.2}, 2) == []  # no one outside the top-k


def test_no_tie_at_the_kth_place_where_the_kth_does_not_hurt():
    """With fewer than k measured alone to hurt, the k-th measured alone is a place filler:
    a neuron run's report listed 30 harmless neurons as "tied at the 5th place ... which
    of them make the top-5 is the measurement's order", none of them in its top-5 (the
    fit's estimates filled those places first)."""
    alone = {0: Harm(0.06, 0.02), 1: Harm(0.02, 0.02), 2: Harm(0.0, 0.02),
             3: Harm(0.0, 0.02), 4: Harm(-0.01, 0.02)}
    assert tied_at_k(alone, 3) == []
    assert tied_at_k({0: 0.3, 1: 0.0, 2: 0.0}, 2) == []
    # The k-th hurts: one that does not may still be within the noise of it.
    assert tied_at_k({0: Harm(0.3, 0.02), 1: Harm(0.02, 0.02), 2: Harm(0.0, 0.02)}, 2) \
        == [1, 2]


def test_group_size_keeps_a_groups_background_under_half_the_room_above_the_noise():
    # bar 0.08, 0.005 per member: 0.04 / 0.005 = 8 members.
    assert group_size(0.08, 0.005) == 8
    assert group_size(0.08, 0.006) == 4  # 6.7 rounds down to a power of two
    assert group_size(0.08, 0.0) == 16 and group_size(0.08, 0.0, largest=32) == 32
    assert group_size(0.0, 0.001) == 2  # any harm enters: the smallest groups
    assert group_size(0.01, 0.5) == 2
    # A margin of 0.04 leaves 0.04 of the bar: 0.02 / 0.005 = 4 members.
    assert group_size(0.08, 0.005, margin=0.04) == 4
    assert group_size(0.08, 0.005, margin=0.1) == 2  # the noise takes the whole bar


def test_background_harm_is_what_the_masks_leave_to_their_unmeasured_members():
    design = np.array([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 0, 1]], dtype=bool)
    harms = np.array([0.5, 0.06, 0.44])
    # Head 0 measured alone at 0.4: row 0 leaves 0.1 to 2 heads, row 1 0.06 to 3, row 2
    # 0.04 to 1 -> 0.05, 0.02, 0.04: the median 0.04.
    assert background_harm(design, harms, {0: 0.4}) == pytest.approx(0.04)
    assert background_harm(design, harms, {0: Harm(0.4, 0.1)}) == pytest.approx(0.04)


def test_group_order_takes_the_implicated_first_then_the_least_covered():
    design = np.array([[1, 1, 0, 0, 1], [1, 0, 0, 0, 1]], dtype=bool)
    # screen order 4, 0, 1, 2, 3; implicated: 0; coverage 4:2, 1:1, 2:0, 3:0.
    assert group_order([4, 0, 1, 2, 3], [0], design) == [0, 2, 3, 1, 4]
    assert group_order([4, 0, 1, 2, 3], [0], design, skip=[2]) == [0, 3, 1, 4]


def test_halves_put_the_likelier_members_first():
    position = {7: 0, 2: 1, 9: 2, 4: 3}
    assert halves((2, 4, 7, 9), position) == ((2, 7), (4, 9))
    assert halves((2, 4, 7), position) == ((7,), (2, 4))
    assert halves((1, 4, 3), position) == ((4,), (1, 3))  # unknown columns last, by index


def test_binary_splitting_finds_a_strong_head_and_clears_the_rest():
    harms = np.zeros(16)
    harms[[0, 1]] = [0.5, 0.3]  # measured alone before: the bar (k=2) is 0.3
    harms[11] = 0.35  # hidden: nobody measured it
    harms[[4, 5, 6, 7, 8, 9, 10, 12, 13, 14, 15, 2, 3]] = 0.01
    measure, asked = additive(harms)
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    order = list(range(2, 16))
    result = group_testing(order, known, measure, 20, size=8, top_k=2)
    # Round 1: groups 2..9 (harm 0.08 < 0.3: cleared) and 10..15 (0.05 + 0.35: over).
    assert result.rounds[0] == [tuple(range(2, 10)), tuple(range(10, 16))]
    # Then halves down to head 11 measured alone; each half under the bar cleared.
    assert result.rounds[1] == [(10, 11, 12), (13, 14, 15)]
    assert result.rounds[2] == [(10,), (11, 12)]
    assert result.rounds[3] == [(11,), (12,)]
    assert result.harms[(11,)]["t"].value == pytest.approx(0.35)
    assert len(result.sets) == 8 and asked == result.sets


def test_a_group_within_the_noise_of_the_bar_is_split_not_ruled_out():
    harms = np.zeros(10)
    harms[[2, 3, 4, 5]] = 0.05  # group (2..5): 0.2, under the bar 0.3 by 0.1
    harms[[6, 7, 8, 9]] = 0.01  # group (6..9): 0.04
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    exact = group_testing(range(2, 10), known, additive(harms)[0], 20, size=4, top_k=2)
    assert exact.rounds == [[(2, 3, 4, 5), (6, 7, 8, 9)]]  # both under: done
    # With a standard error of 0.1 a set, 0.2 + 0.1645 and 0.04 + 0.1645: the first is
    # within the noise of the bar and is halved, the second stays clearly under it.
    noisy = group_testing(range(2, 10), known, additive(harms, lambda s: 0.1)[0], 20,
                          size=4, top_k=2)
    assert noisy.rounds[:2] == [[(2, 3, 4, 5), (6, 7, 8, 9)], [(2, 3), (4, 5)]]


def test_a_helpful_member_does_not_hide_a_harmful_one():
    harms = np.zeros(10)
    harms[5] = 0.4  # would enter the top-2
    harms[6] = -0.5  # helps: the group (4..7) measures -0.1
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    result = group_testing(range(2, 10), known, additive(harms)[0], 30, size=4, top_k=2)
    assert (5,) in result.sets and result.harms[(5,)]["t"].value == pytest.approx(0.4)


def test_peeled_takes_the_likeliest_unsettled_helper_apart():
    helpers = {3: 0.2, 5: 1.0, 9: 0.5}
    assert peeled((1, 3, 5, 7), helpers) == ((5,), (1, 3, 7))
    assert peeled((1, 3, 5, 7), helpers, skip=[5]) == ((3,), (1, 5, 7))
    assert peeled((1, 2, 4, 7), helpers) is None  # no member is predicted to help
    assert peeled((3, 5), helpers) is None  # two members: the halves are the same
    assert peeled((1, 3, 7), {3: 0.0}) is None  # a predicted 0 is no help


def test_a_helping_group_is_split_into_its_likeliest_helper_and_the_rest():
    harms = np.full(18, 0.005)
    harms[[0, 1]] = [0.5, 0.3]  # measured alone before: the bar (k=2) is 0.3
    harms[9] = -0.4  # helps: group (2..17) measures 15 * 0.005 - 0.4 = -0.325
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    order = list(range(2, 18))
    peel, asked = additive(harms, lambda s: 0.02)
    result = group_testing(order, known, peel, math.inf, size=16, top_k=2,
                           helpers={9: 1.0, 4: 0.1})
    # By hand: the group helps (-0.325 < -1.645 * 0.02); its likeliest helper, 9, alone
    # and the other 15 (0.075 + 0.033 < 0.3: ruled out): three measurements in all.
    assert result.sets == [tuple(order), (9,), tuple(h for h in order if h != 9)]
    assert asked == result.sets
    halve, _ = additive(harms, lambda s: 0.02)
    halved = group_testing(order, known, halve, math.inf, size=16, top_k=2)
    # Halving narrows down to 9 a level at a time: 1 + 2 + 2 + 2 + 2 sets.
    assert len(halved.sets) == 9 and (9,) in halved.sets


def test_a_wrong_helper_prediction_still_settles_every_column():
    harms = np.full(18, 0.005)
    harms[[0, 1]] = [0.5, 0.3]
    harms[9] = -0.6  # the real helper: the group measures 0.07 - 0.6 + 0.35 = -0.18
    harms[12] = 0.35  # a hidden head that enters the top-2, under the help
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    result = group_testing(range(2, 18), known, additive(harms, lambda s: 0.02)[0],
                           math.inf, size=16, top_k=2, helpers={4: 1.0})
    assert result.sets[1] == (4,)  # the predicted helper first: wrong
    alone = {0: 0.5, 1: 0.3, **{s[0]: v["t"] for s, v in result.harms.items()
                                  if len(s) == 1}}
    groups = [(s, v["t"]) for s, v in result.harms.items() if len(s) > 1]
    cert = certificate(range(18), np.zeros((0, 18), dtype=bool), [], alone, groups, 2)
    assert cert.complete and {9, 12} <= set(cert.alone)


def test_a_larger_budget_extends_the_same_tests():
    rng = np.random.default_rng(0)
    harms = rng.uniform(0, 0.02, 40)
    harms[[5, 33]] = [0.4, 0.25]
    known = {(0,): {"t": 0.3}}
    small = group_testing(range(1, 40), known, additive(harms)[0], 7, size=8, top_k=1)
    large = group_testing(range(1, 40), known, additive(harms)[0], 30, size=8, top_k=1)
    assert large.sets[:7] == small.sets
    assert len(small.sets) == 7


def test_an_unbounded_budget_goes_on_until_every_column_is_settled():
    rng = np.random.default_rng(3)
    harms = rng.uniform(0, 0.01, 60)
    harms[[17, 44]] = [0.6, 0.35]
    known = {(0,): {"t": 0.3}, (1,): {"t": 0.2}}
    result = group_testing(range(2, 60), known, additive(harms)[0], math.inf, size=8,
                           top_k=2)
    alone = {0: 0.3, 1: 0.2, **{s[0]: v["t"] for s, v in result.harms.items()
                                  if len(s) == 1}}
    groups = [(s, v["t"]) for s, v in result.harms.items() if len(s) > 1]
    cert = certificate(range(60), np.zeros((0, 60), dtype=bool), [], alone, groups, 2)
    assert cert.complete and {17, 44} <= set(cert.alone)
    assert cert.bar == pytest.approx(0.35)


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


def test_next_size_doubles_after_a_clean_round_and_halves_after_a_failing_one():
    assert next_size(8, [True] * 5) == 16
    assert next_size(8, [True] * 5, largest=8) == 8
    assert next_size(8, [True, True, False, True, True]) == 8  # most ruled out: the same
    assert next_size(16, [True, False, False]) == 8  # fewer than half: half as large
    assert next_size(16, [True, False, False], smallest=16) == 16
    assert next_size(4, []) == 4  # no new group this round: nothing learnt


def test_groups_grow_while_every_new_group_rules_its_members_out():
    """A round whose new groups all stay under the bar says the groups could be larger:
    the next round's are twice the size (round after round, up to the largest), and a
    round where most new groups reach the bar takes them back, never below the size the
    run started from. A clean tail then costs a few large groups, not many small ones."""
    harms = np.full(400, 0.001)
    harms[300] = 0.6  # far in the order: reached once the groups have grown
    known = {(0,): {"t": 0.5}, (1,): {"t": 0.3}}
    measure, asked = additive(harms)
    result = group_testing(range(2, 400), known, measure, math.inf, size=4, top_k=2,
                           round_size=2, largest=32)
    fresh = [len(s) for batch in result.rounds for s in batch
             if not any(set(s) < set(p) for p in result.sets[:result.sets.index(s)])]
    # 2 groups of 4, 2 of 8, 2 of 16, then 32s: 398 columns, not 100 groups of 4.
    assert fresh[:6] == [4, 4, 8, 8, 16, 16] and max(fresh) == 32
    assert result.sizes[:4] == [4, 8, 16, 32]
    assert (300,) in result.sets  # the strong one is split out, measured alone
    alone = {0: 0.5, 1: 0.3, **{s[0]: v["t"] for s, v in result.harms.items()
                                  if len(s) == 1}}
    groups = [(s, v["t"]) for s, v in result.harms.items() if len(s) > 1]
    cert = certificate(range(400), np.zeros((0, 400), dtype=bool), [], alone, groups, 2)
    assert cert.complete and len(result.sets) < 40 and asked == result.sets
    fixed = group_testing(range(2, 400), known, additive(harms)[0], math.inf, size=4,
                          top_k=2, round_size=2, largest=4)
    assert len(fixed.sets) > 100  # the same world at a fixed size of 4


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
    known = {tuple(int(h) for h in np.flatnonzero(r)): {"t": float(h)}
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
# two masks and one head measured alone, seven heads are left for the group tests, on 4
# documents whose noise keeps most sets from clearing the bar: they are halved.
GROUPED = ["--tasks", "tiny_choice", "--masks", "2", "--sparsity", "0.25", "--num-samples",
           "8", "--seed", "1", "--signal", "logprob", "--prior", "atp", "--confirm", "1",
           "--max-measurements", "100", "--group-tests", "8"]


def test_the_group_tests_bar_counts_the_tests_and_names_its_cap(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """The stage's bar took the cap left (97) for its total: "10/97" was drawn for a
    stage that stopped there, certified. How many it tests is not known ahead: the bar
    counts them, with the cap in its name."""
    out = tmp_path / "run"
    with shown_bars(monkeypatch) as shown:
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks",
                       "tiny_choice", "--masks", "2", "--sparsity", "0.25", "--num-samples",
                       "8", "--seed", "1", "--signal", "logprob", "--prior", "none",
                       "--confirm", "1", "--max-measurements", "100", "--out", str(out)) == 0
    groups = strict_json(out / "config.json")["confirm"]["groups"]
    tested = sum(len(batch) for batch in groups["rounds"])
    assert groups["budget"] == 97 and 0 < tested < 97
    assert shown[-1] == ("group tests (at most 97)", tested, None), shown


def test_a_resumed_group_stages_bar_counts_what_it_had_measured(tiny_model_dir, tmp_path,
                                                                 monkeypatch):
    """A run stopped by its cap in the group tests, resumed with a larger one: the bar
    started at the groups on disk only, not the components the stage had narrowed down
    to and measured alone, and so ended short of the tests the stage made."""
    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "2", "--sparsity", "0.25", "--num-samples", "8", "--seed", "1",
            "--signal", "logprob", "--prior", "none", "--confirm", "1",
            "--out", str(tmp_path / "run")]
    assert harness(*base, "--max-measurements", "9") == 0  # 2 masks, 1 alone, 6 tests
    stopped = strict_json(tmp_path / "run" / "config.json")["confirm"]["groups"]["rounds"]
    assert [len(m) for batch in stopped for m in batch].count(1) >= 1  # some alone
    with shown_bars(monkeypatch) as shown:
        assert harness(*base, "--max-measurements", "100") == 0
    groups = strict_json(tmp_path / "run" / "config.json")["confirm"]["groups"]
    tested = sum(len(batch) for batch in groups["rounds"])
    assert tested > sum(len(batch) for batch in stopped)
    assert shown[-1] == (f"group tests (at most {groups['budget']})", tested, None), shown


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
    # --group-tests 8 caps the group tests: 2 masks, 1 head alone and atp's 4 leave the
    # default cap (4 of 8 heads) nothing, an explicit --max-measurements 100 plenty.
    assert groups["budget"] == 8 and 0 < len(sets) <= 8
    assert groups["cap"] == 100 and groups["spent_before"] == 4 + 2 + 1
    assert len({tuple(m) for m in sets}) == len(sets)  # no set measured twice
    for members in sets:  # each set measured under its key, knocking out its members
        key = group_key(members) if len(members) > 1 else f"alone-{members[0]}"
        assert records[key]["mask"] == "+".join(members)
        assert "tiny_choice" in records[key]["examples"]  # per-example scores: the noise
    # After the first round, every set is a half of one measured before.
    first = {tuple(m) for m in groups["rounds"][0]}
    for later in groups["rounds"][1:]:
        for members in later:
            assert any(set(members) < set(parent) for parent in map(tuple, sets)), members
    heads = strict_json(out / "heads.json")
    cert = heads["certificate"]
    assert cert["group_tests_run"] == len(sets)
    assert cert["confidence"] == 0.95
    assert cert["measurements_spent"] == 7 + len(sets) and cert["max_measurements"] == 100
    # The sets of two or more measured, with their changes and standard errors: the halves
    # narrowed down to single heads are measured alone (ranked by their measurement).
    assert [g["components"] for g in cert["group_tests"]] == [m for m in sets if len(m) > 1]
    for g in cert["group_tests"]:
        record = records[group_key(g["components"])]
        assert g["change"] == pytest.approx(record["scores"]["tiny_choice"]
                                            - records["baseline"]["scores"]["tiny_choice"])
        assert g["se"] > 0
    found = {e["head"]: e for e in heads["heads"]}
    for name in groups["alone"]:
        assert found[name]["measured_alone"]
    total = cert["measured_alone"] + cert["ruled_out"] + len(cert["unchecked"])
    assert total == len(heads["heads"])
    assert cert["certified"] == (not cert["unchecked"])
    report = (out / "report.md").read_text()
    assert "knocking out more never lessens" in report
    if cert["certified"]:
        assert "### Certified: every one of the 8 heads checked" in report
        assert "  certified: " in terminal
    else:
        assert f"### Not certified: {len(cert['unchecked'])} of 8 heads unchecked" in report
        assert f"  not certified: {len(cert['unchecked'])} heads unchecked" in terminal
    assert first  # the first round measured groups


def test_a_kill_mid_group_tests_resumes_to_the_same_tests_ranking_and_certificate(
        tiny_model_dir, tmp_path):
    """Killed (-9) inside the group tests' second round (the halves of the first round's
    sets): the resumed run measures the same sets and ends with the same ranking and
    certificate (heads.json) as an unbroken run."""
    args = ["locate", *tiny_args(tiny_model_dir("llama")), *GROUPED]
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    records = read_run(full)[0]
    first_group = 1 + 2 + 1  # baseline, 2 masks, 1 head alone
    rounds = strict_json(full / "config.json")["confirm"]["groups"]["rounds"]
    assert len(rounds) >= 2 and len(rounds[1]) >= 2
    assert len(records) == first_group + sum(map(len, rounds))
    killed = tmp_path / "killed"
    inside = first_group + len(rounds[0]) + 1  # one set of the second round measured
    partial = stopped_part_way(args, killed, after=inside, stop=signal.SIGKILL)
    assert partial == inside, "not stopped inside the second round"
    assert harness(*args, "--out", str(killed)) == 0
    assert_same_run(killed, full)
    assert strict_json(killed / "config.json")["confirm"] == \
        strict_json(full / "config.json")["confirm"]
    assert read_run(killed)[1]["certificate"]["group_tests"]


@pytest.mark.parametrize("given, fragment", [
    (["--group-tests", "4", "--confirm", "0"], "--group-tests 4: group tests look for"),
    (["--group-tests", "-1"], "--group-tests"),
    (["--group-tests", "2.5"], "--group-tests"),
    # int() reads other scripts' digits: Arabic-Indic three.
    (["--group-tests", "\u0663"], "only ASCII digits"),
    (["--confirm", "\u0663"], "only ASCII digits"),
    (["--group-tests", "1" + "0" * 23], "<= 10000000"),
    (["--max-measurements", "1" + "0" * 12], "from 1 to 10000000 or 'auto'"),
])
def test_bad_group_tests_are_one_line_refusals(given, fragment, tmp_path, capsys,
                                               no_model_loading):
    code = harness("locate", "--tasks", "tiny_copy", *given, "--out", str(tmp_path / "r"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and fragment in err[0], err
    assert not (tmp_path / "r").exists()


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


def test_group_tests_on_a_resumed_run_that_confirmed_nothing_are_refused(
        tiny_model_dir, tmp_path, capsys):
    """A run made with --confirm 0, resumed with --group-tests and no --confirm: the stored
    0 is kept, so the group tests would silently not run; refused as a fresh run is, and
    before the model loads."""
    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "2", "--sparsity", "0.25", "--num-samples", "8", "--prior", "none",
            "--out", str(tmp_path / "run")]
    assert harness(*base, "--confirm", "0") == 0
    before = (tmp_path / "run" / "config.json").read_bytes()
    capsys.readouterr()
    assert harness(*base, "--group-tests", "4") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--group-tests 4: group tests look for" in err[0], err
    assert (tmp_path / "run" / "config.json").read_bytes() == before


def test_a_rerun_with_a_larger_cap_measures_only_what_is_new(tiny_model_dir, tmp_path,
                                                              capsys):
    """A run stopped by --max-measurements says it is not certified and the cap that would
    test what it left; rerun with that cap, it measures only new sets and ends as a run
    that had the cap from the start."""
    base = ["locate", *tiny_args(tiny_model_dir("llama")), *GROUPED[:-4]]
    out = tmp_path / "run"
    # 4 (atp) + 2 masks + 1 alone = 7: a cap of 9 leaves two group tests.
    assert harness(*base, "--max-measurements", "9", "--out", str(out)) == 0
    terminal = capsys.readouterr().out
    first, heads = read_run(out)
    cert = heads["certificate"]
    assert cert["group_tests_run"] == 2 and cert["measurements_spent"] == 9
    assert not cert["certified"] and cert["unchecked"]
    assert cert["max_measurements_to_finish"] > 9
    assert f"not certified: {len(cert['unchecked'])} heads unchecked" in terminal
    assert f"--max-measurements {cert['max_measurements_to_finish']} or more" in terminal
    bigger = ["--max-measurements", "100"]
    assert harness(*base, *bigger, "--out", str(out)) == 0
    grown = read_run(out)[0]
    assert grown[:len(first)] == first and len(grown) > len(first)
    fresh = tmp_path / "fresh"
    assert harness(*base, *bigger, "--out", str(fresh)) == 0
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
    assert {m: h.value for m, h in plan.known.items()} == {
                          (0, 1): pytest.approx(0.5), (2, 3): pytest.approx(0.1),
                          (0, 4): pytest.approx(0.4), (1, 5): pytest.approx(0.2),
                          (0, 2): pytest.approx(0.45), (0,): 0.4, (3,): 0.0}
    # The heads left to test: not those measured alone, not the skipped one.
    assert sorted(plan.order) == [1, 2, 4]
    # Fewer than top-k measured alone hurt: any harm enters, so the smallest groups.
    assert plan.size == 2
    # Lower is better: the same scores are improvements, so no mask harmed.
    lower = plan_groups(design, scores, 1.0, False, {}, alpha=0.01, penalty_weights=None,
                        top_k=2)
    assert all(harm.value < 0 for harm in lower.known.values())


def test_a_group_plan_predicts_the_helpers_by_the_prior_else_by_the_fit():
    from lm_eval_headloc.method.locate_loop import plan_groups, predicted_help

    # The prior's estimates are the logprob's change: positive = the knockout helps.
    assert predicted_help(np.array([-0.5, 0.2, 0.4, 0.0]), True) == {1: 0.5, 2: 1.0}
    # A lower-is-better metric's fall is a help.
    assert predicted_help(np.array([0.3, -0.1]), False) == {1: 1.0}
    assert predicted_help(np.array([-0.5, 0.0]), True) == {}
    design = np.array([[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1], [1, 0, 0, 1],
                       [1, 0, 1, 0], [0, 1, 0, 1]], dtype=bool)
    # Head 1 raises the score wherever knocked out, head 0 lowers it: the fit's helper is 1.
    scores = 1.0 - 0.4 * design[:, 0] + 0.2 * design[:, 1]
    plan = plan_groups(design, scores, 1.0, True, {}, alpha=0.001, penalty_weights=None,
                       top_k=1)
    assert set(plan.helpers) == {1}
    prior = np.array([[0.1, -0.3, 0.3, 0.0], [0.0, 0.0, 0.0, 0.0]])
    with_prior = plan_groups(design, scores, 1.0, True, {2: -0.1}, alpha=0.001,
                             penalty_weights=None, top_k=1, prior=prior)
    # The prior's clean point decides; head 2 is measured alone, so not a group's helper.
    assert with_prior.helpers == {0: pytest.approx(1 / 3)}


def test_ties_read_the_paired_error_of_two_heads_where_given():
    alone = {0: Harm(0.5, 0.02), 1: Harm(0.30, 0.02), 2: Harm(0.25, 0.02)}
    # Independent: 0.05 <= 1.645 * hypot(0.02, 0.02) = 0.0465? No: not tied.
    assert tied_at_k(alone, 2) == []
    # Given, the paired error is the one read (0.04 here: it ties them).
    assert tied_at_k(alone, 2, se_between=lambda a, b: 0.04) == [1, 2]
    # A pair whose paired error is unknown falls back to the independent one.
    assert tied_at_k(alone, 2, se_between=lambda a, b: None) == []
