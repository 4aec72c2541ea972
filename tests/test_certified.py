"""A default run measures until it is certified: every head measured alone or ruled out.

The locate loop itself (``method.locate_loop``, every default of ``RunSpec``) runs on a
simulated world whose documents are fixed (``headloc_bench.simulated_run``, the benchmarks'
code): a mask's score is the share of documents right, each document's outcome its
per-example value, so the noise rule sees what it sees on a model. The world's exhaustive
ranking (every head knocked out alone on the same documents) is computed here from the
world, independently of the run.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import bench_module

from lm_eval_headloc.runs.spec import RunSpec

simulated_prior = bench_module("defaults").simulated_prior
simulated_locate = bench_module("simulated_run").simulated_locate
planted_world = bench_module("simulation").planted_world


def _hidden_world():
    """A world with five strong planted heads and a light tail, and a prior that misses
    the second strongest (it estimates no change for it)."""
    world = planted_world(270, np.random.default_rng(0), noise="documents", tail_mass=1.0,
                          tail_helpful=0.0, heterogeneity=0.5, planted_drops=(0.15, 0.45))
    hidden = int(world.planted[1])
    prior = simulated_prior(world, np.random.default_rng(100), points=2)
    prior[:, hidden] = 0.0
    return world, hidden, prior


def _exhaustive_top(world, k=5):
    base = world.documents.scores(np.zeros((1, world.n_heads)))[0]
    changes = world.documents.single_scores() - base
    return [int(h) for h in np.argsort(changes, kind="stable")[:k]], changes


@pytest.fixture(scope="module")
def hidden():
    world, head, prior = _hidden_world()
    settings = RunSpec(bootstrap=1, progress=False).budgeted("atp-path")
    short = simulated_locate(world, settings.replace(max_measurements=54), prior=prior)
    full = simulated_locate(world, settings, prior=prior)
    return world, head, short, full


def test_today_s_budget_misses_the_hidden_head_and_says_so(hidden):
    world, head, short, _ = hidden
    name = str(short.ranking.columns[head])
    cert = short.certificate
    # The premise: neither the prior (it estimates 0 for it) nor the masks' fit named it,
    # so the confirmation did not measure it alone.
    assert name not in (short.ranking.facts.confirmed or [])
    assert head in _exhaustive_top(world)[0][:2]
    # --max-measurements 54 is today's budget: 8 + 12 masks + 34 alone, no group tests.
    assert cert.measurements_spent == 54 and cert.group_tests_run == 0
    assert not cert.certified and name in cert.unchecked
    assert cert.max_measurements_to_finish > 54
    assert name not in [str(h) for h in short.ranking.top(5)]


def test_the_default_run_finds_it_and_is_certified_with_the_exhaustive_top5(hidden):
    world, head, _, full = hidden
    name = str(full.ranking.columns[head])
    cert = full.certificate
    top, changes = _exhaustive_top(world)
    assert cert.certified and not cert.unchecked
    # Found by the group tests and measured alone: its measured change is the truth's.
    assert name in full.ranking.facts.confirmed
    assert full.ranking.effect(full.ranking.columns[head]) == pytest.approx(changes[head])
    assert [full.ranking.columns.index(h) for h in full.ranking.top(5)] == top
    # Within the default cap (half of 270), and every measurement counted.
    assert cert.measurements_spent == full.spent <= 135
    assert cert.measured_alone + cert.ruled_out == 270


def test_a_ruled_out_heads_bound_holds_for_its_true_harm(hidden):
    """Each ruled-out head's bound (its ruling set's harm plus 1.645 standard errors) is
    at least what it measures alone on the same documents."""
    world, _, _, full = hidden
    _, changes = _exhaustive_top(world)
    bound = full.certificate.bound
    measured = set(full.ranking.facts.confirmed or [])
    others = [h for h in range(world.n_heads) if str(full.ranking.columns[h]) not in measured]
    assert bound is not None and max(-changes[h] for h in others) <= bound


def test_the_reports_counts_of_the_unchecked_add_up(hidden):
    """"not checked: 113 heads (0 never knocked out, 97 in one mask only, 80 only in masks
    beside ...)": sub-counts that overlapped and added to 177. The three mask counts part
    the unchecked; the one that overlaps them says so."""
    import re

    from lm_eval_headloc.report.locate_report import certificate_words

    _, _, short, _ = hidden
    text = " ".join(certificate_words(short.ranking))
    found = re.search(r"not checked: (\d+) heads\*\*.*?Of them, (\d+) were never knocked out "
                      r"by a mask, (\d+) by one mask only and (\d+) by two or more", text)
    assert found, text
    total, *parts = map(int, found.groups())
    assert total == len(short.certificate.unchecked) and sum(parts) == total
