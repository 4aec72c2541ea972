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


def test_ranking_files_write_numbers_as_a_reader_expects(committed_benchmarks, tmp_path):
    """heads.json held 112 `"effect": -0.0` and `"bound": 0.16999999999999998`; heads.csv's
    `selected` read as int64 on one run and float64 on another. Today's writers, given the
    committed rankings with such numbers planted in them, write neither."""
    import io
    import re
    import shutil

    import pandas as pd

    from lm_eval_headloc import read_rankings
    from lm_eval_headloc.common.files import strict_json
    from lm_eval_headloc.method.ranking import ranked_heads_json, tidy_numbers
    from lm_eval_headloc.report.pages import heads_table

    assert tidy_numbers({"e": -0.0, "b": 0.48 - 0.31, "x": [0.1 + 0.2, 1e-300, 7]}) == \
        {"e": 0.0, "b": 0.17, "x": [0.3, 1e-300, 7]}
    assert str(tidy_numbers(-0.0)) == "0.0"
    folders = [committed_benchmarks / "exhaustive",
               *sorted((committed_benchmarks / "recovery-runs").glob("*/certified/seed0"))]
    planted = []
    for number, source in enumerate(folders):
        # A copy of each folder with the numbers an older writer left planted in it: a
        # -0.0 effect, a difference of two means written as round-off, in every ranking,
        # each where it keeps the ranking's order (a reader refuses a file out of order):
        # the -0.0 for an effect of 0, the round-off beyond the first (most harmful) one.
        folder = shutil.copytree(source, tmp_path / f"{number}-{source.name}")
        for path in folder.glob("heads-*.json"):
            data = json.loads(path.read_text())
            for entry in data["heads"]:
                if entry["effect"] == 0:
                    entry["effect"] = -0.0
            if data["heads"][0]["effect"] is not None:  # -0.32 is -0.320000000000001
                data["heads"][0]["effect"] -= 1e-15 if data["higher_is_better"] else -1e-15
            if isinstance(data.get("certificate"), dict) and data["certificate"]["ruled_out"]:
                data["certificate"]["bound"] = 0.48 - 0.31  # 0.16999999999999998
            path.write_text(json.dumps(data))
        planted.append(folder)
    noisy = 0
    for folder in planted:
        for task, ranking in read_rankings(folder).items():
            before = (folder / f"heads-{task}.json").read_text()
            noisy += bool(re.search(r"-0\.0(?![0-9])|\d\.\d*(?:0{7}|9{7})\d\b", before))
            text = strict_json(ranked_heads_json(ranking, 5))
            assert not re.search(r"-0\.0(?![0-9])", text), (folder, task)
            assert not re.search(r"\d\.\d*(?:0{7}|9{7})\d\b", text), (folder, task)
            heads = pd.DataFrame(json.loads(text)["heads"])  # as docs/run-folder.md reads it
            assert len(heads) == len(ranking.order)
            table = pd.read_csv(io.StringIO(heads_table(ranking)))
            for column in ("effect", "selected", "effect_low", "effect_high"):
                if column in table and table[column].notna().any():
                    assert table[column].dtype == "float64", (folder, column)
    assert noisy  # the planted files hold such numbers: the writers were tried on them
    doc = (Path(__file__).parents[1] / "docs" / "run-folder.md").read_text(encoding="utf-8")
    assert 'pd.DataFrame(json.load(open("heads.json"))["heads"])' in doc
