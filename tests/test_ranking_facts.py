"""A ranking's facts (heads.json's keys about the ranking as a whole), typed: RankingFacts
reads every committed ranking file and writes its keys back as they were, in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_eval_headloc.method.ranking import CertificateRecord, GroupTestRecord, RankingFacts

#: heads.json's keys that are the ranking itself, not its facts.
RANKING_KEYS = {"task", "metric", "higher_is_better", "baseline", "heads_per_layer", "top_k",
                "bootstrap", "heads"}


def _committed_rankings(benchmarks: Path) -> list[Path]:
    return sorted(path for path in benchmarks.rglob("heads*.json")
                  if path.name == "heads.json" or path.name.startswith("heads-"))


def test_every_committed_ranking_file_round_trips_in_order(committed_benchmarks):
    """Written by the code before the facts were typed (and by locate, greedy and refit
    since): the keys come back the same, in the same order, nothing moved to ``other``."""
    files = _committed_rankings(committed_benchmarks)
    assert len(files) > 100  # the benchmarks' runs, locate's and greedy's
    methods = set()
    certified = 0
    for path in files:
        data = json.loads(path.read_text())
        keys = {k: v for k, v in data.items() if k not in RANKING_KEYS}
        facts = RankingFacts.from_json(keys)
        assert list(facts.to_json().items()) == list(keys.items()), path
        assert facts.other == {}, path
        if "certificate" in keys:  # typed too, its group tests included
            assert isinstance(facts.certificate, CertificateRecord)
            assert all(isinstance(g, GroupTestRecord) for g in facts.certificate.group_tests)
            certified += 1
        methods.add(facts.method.split(",")[0])
    assert {"compressed sensing (Lasso)", "one-shot greedy"} <= methods
    assert certified > 50


def test_presence_rules():
    # A Lasso's R²s are written, null or not, wherever it was fitted (its alpha), and only
    # there; every other fact only where recorded; an unknown key kept, last.
    fitted = RankingFacts(method="m", alpha=0.01, measurements=3, r2=None, r2_held_out=None)
    assert list(fitted.to_json()) == ["method", "r2", "r2_held_out", "alpha", "measurements"]
    assert RankingFacts(method="g", rounds=1).to_json() == {"method": "g", "rounds": 1}
    assert RankingFacts(prior_found_nothing=False).to_json() == {}
    assert RankingFacts(prior_found_nothing=True).to_json() == {"prior_found_nothing": True}
    read = RankingFacts.from_json({"method": "m", "later_key": 1, "r2": 0.5})
    assert read.other == {"later_key": 1, "r2": 0.5}  # an R² without a fit's alpha: as read
    assert read.to_json() == {"method": "m", "later_key": 1, "r2": 0.5}


@pytest.mark.parametrize("confirmed", [None, [], ["L0H1"]])
def test_no_confirmation_differs_from_one_that_confirmed_nothing(confirmed):
    facts = RankingFacts.from_json(RankingFacts(confirmed=confirmed).to_json())
    assert facts.confirmed == confirmed
