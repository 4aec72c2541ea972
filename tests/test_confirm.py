"""Confirmation (``confirm.py``): candidates, the confirmed ranking and its bootstrap.

Expected values are written out by hand from the docstrings' rules.
"""

from __future__ import annotations

import numpy as np
from sklearn.linear_model import Lasso

from lm_eval_headloc.confirm import (
    candidates,
    confirm_selector,
    confirmed_order,
    confirmed_top,
    task_candidates,
)
from lm_eval_headloc.recovery import HeadLasso, bootstrap_stability


def test_task_candidates_alternate_and_skip_repeats():
    prior, screen = [3, 1, 4, 0, 5], [1, 9, 2, 6]
    # 3 (prior), 1 (screen), prior's next new is 4 (1 taken), screen's 9, prior 0, screen 2
    assert task_candidates([prior, screen], 6) == [3, 1, 4, 9, 0, 2]
    # prior: 1 (3 skipped); screen: 2 (1 taken, 9 skipped); prior: 4
    assert task_candidates([prior, screen], 3, skip=[3, 9]) == [1, 2, 4]
    assert task_candidates([screen], 2) == [1, 9]
    # A list that runs out leaves the rest to the other; never more than exist.
    assert task_candidates([[7], [8, 7, 6]], 10) == [7, 8, 6]


def test_candidates_share_the_budget_between_tasks():
    picked, used = candidates({"a": [1, 2, 3, 4], "b": [2, 5, 6]}, 4)
    # a:1, b:2, a: 2 taken (free) -> 3, b:5
    assert picked == [1, 2, 3, 5]
    assert used == {"a": 3, "b": 2}
    picked, used = candidates({"a": [1]}, 5)
    assert picked == [1] and used == {"a": 1}


def test_confirmed_order_ranks_measured_heads_first():
    alone = {4: (-0.10, -0.5), 2: (-0.30, -0.1), 7: (-0.10, -0.9), 5: (0.02, 0.1)}
    # harm: 2 (0.30), then 7 and 4 tie at 0.10 -> bigger logprob drop first (7), then 5.
    assert confirmed_order(alone, [9, 4, 0, 2, 1], True) == [2, 7, 4, 5, 9, 0, 1]
    # Lower is better (a perplexity): a rise is harmful.
    assert confirmed_order({1: (0.5, 0.0), 3: (-0.2, 0.0)}, [0], False)[:2] == [1, 3]
    assert confirmed_order(alone, [9, 4, 0], True, exclude=[2, 0]) == [7, 4, 5, 9]
    assert confirmed_top(alone, [4, 5, 2], 5, True) == [2, 4]  # 5 helps: left out


def test_bootstrap_of_a_confirmation_counts_what_refits_would_confirm():
    """The selector's counts equal a hand-written loop over the same resamples."""
    rng = np.random.default_rng(3)
    design = rng.random((30, 12)) < 0.25
    truth = np.zeros(12)
    truth[[2, 7]] = -1.0
    scores = 3 + design @ truth + 0.3 * rng.standard_normal(30)
    alone = {2: (-0.9, 0.0), 7: (-0.6, 0.0), 5: (-0.2, 0.0), 0: (0.1, 0.0)}
    prior = [5, 0, 11, 10]
    selector = confirm_selector(alone, prior, own_count=3, others=[], higher_is_better=True,
                                top_k=2)
    stability = bootstrap_stability(HeadLasso(alpha=0.05), design, scores, 2,
                                    resamples=40, seed=1, select=selector)
    counts = np.zeros(12)
    draw = np.random.default_rng(1)
    for _ in range(40):
        rows = draw.integers(0, 30, size=30)
        y = scores[rows]
        scale = y.std()
        fit = Lasso(alpha=0.05, max_iter=10000).fit(design[rows].astype(float), y / scale)
        screen = list(np.argsort(fit.coef_, kind="stable"))  # most negative first
        own = []  # prior, screen alternately: 3 heads
        queues = [list(prior), screen]
        while len(own) < 3:
            for queue in queues:
                head = next(h for h in queue if h not in own)
                if len(own) < 3:
                    own.append(head)
        measured = [h for h in own if h in alone]
        harmful = sorted((h for h in measured if alone[h][0] < 0), key=lambda h: alone[h][0])
        counts[harmful[:2]] += 1
    np.testing.assert_array_equal(stability.selected, counts / 40)
    # Heads the prior names are confirmed in every refit; 2 and 7 only when the screen
    # puts them first.
    assert stability.selected[5] > 0
