"""headloc-harness refit: a run's ranking fitted again from its measurements with other
settings, without the model, and the summary line it prints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import harness, measurement_lines, strict_json, tiny_args


def test_the_summary_line_does_not_show_a_bare_negative_r2(tmp_path, capsys,
                                                           committed_benchmarks):
    """The default job's last lines read 'R² 0.992 (held out -0.70)', which a
    newcomer takes for a failed run. The committed run of today's defaults (the top 5
    measured alone) is refitted and its summary line read."""
    source = (committed_benchmarks / "recovery-runs" / "headloc_induction"
              / "stratified-p0.1-atp-path" / "m54-seed0")
    run = Path(shutil.copytree(source, tmp_path / "run"))
    heads = strict_json(run / "heads.json")
    assert heads["r2_held_out"] < 0 and all(e["measured_alone"] for e in heads["heads"][:5])
    assert harness("refit", str(run)) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("headloc_induction (acc,none): baseline 0.4800"), line
    assert "-0.70" not in line and "R²" not in line, line
    assert "the top 5 measured alone: their order is measured, not fitted" in line, line
    # Where the fit does order the top-k, its held-out R² below 0 comes with its meaning.
    from lm_eval_headloc.report.locate_report import BELOW_ZERO, fit_summary
    from lm_eval_headloc.runs.record import read_rankings

    ranking = read_rankings(run)["headloc_induction"]
    ranking.facts.confirmed = []
    words = fit_summary(ranking, 5)
    assert words == f", fit R² 0.992 in-sample, -0.70 held out ({BELOW_ZERO})", words
    assert "(below 0: " in (run / "report.md").read_text()


def test_refit_changes_settings_without_the_model(tiny_locate_run, tmp_path, capsys,
                                                  no_model_loading):
    import shutil

    out = shutil.copytree(tiny_locate_run, tmp_path / "run")
    assert harness("refit", str(out)) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("  ") and ". L" in line]
    assert len(printed) == 3  # the run's stored --top-k, not a default of 5
    assert harness("refit", str(out), "--exclude", "L0H0+L1H3") == 0
    ranked = [h["head"] for h in strict_json(out / "heads.json")["heads"]]
    assert len(ranked) == 6 and "L0H0" not in ranked and "L1H3" not in ranked
    assert harness("refit", str(out), "--alpha", "0.5", "--top-k", "2") == 0
    config = strict_json(out / "config.json")
    heads = strict_json(out / "heads.json")
    assert config["settings"]["alpha"] == 0.5 and heads["alpha"] == 0.5
    assert len(heads["top_k"]) == 2
    assert all(h["effect"] == 0 for h in heads["heads"])  # a huge penalty zeroes everything
    # --exclude '' takes the exclusion back (left out, the run's own is kept).
    assert harness("refit", str(out)) == 0
    assert strict_json(out / "heads.json")["excluded"] == ["L0H0", "L1H3"]
    assert harness("refit", str(out), "--exclude", "") == 0
    heads = strict_json(out / "heads.json")
    assert heads["excluded"] == [] and len(heads["heads"]) == 8
    assert strict_json(out / "config.json")["settings"]["exclude"] is None
    # A top-3 of 2 heads: refused, as locate refuses it (it wrote a top-3 of 2).
    assert harness("refit", str(out), "--exclude", "L0H*+L1H0+L1H1", "--top-k", "3") == 2
    assert "--top-k 3: the run ranks only 2 of its 8" in capsys.readouterr().err
    assert strict_json(out / "config.json")["settings"]["exclude"] is None


def test_refit_exclude_leaves_the_excluded_out_of_the_certificate(tiny_model_dir, tmp_path):
    """refit --exclude of heads measured alone left them in heads.json's `confirmed` and
    `tied_at_k` (the top line "tied at the 5th place: L1H1, ..." named an excluded head)
    and let their harm set the top-k's entry bar. Derived here from the measurements: the
    bar is the 5th largest harm of the heads still ranked."""
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "8", "--signal", "logprob", "--prior", "none",
                   "--out", str(out)) == 0
    records = {r["key"]: r for r in measurement_lines(out)}
    base = records["baseline"]["scores"]["tiny_copy"]
    harms = {key[len("alone-"):]: base - r["scores"]["tiny_copy"]
             for key, r in records.items() if key.startswith("alone-")}
    assert len(harms) == 8
    strongest = max(harms, key=harms.get)
    assert harms[strongest] > 0  # it set the top-1's bar before
    assert harness("refit", str(out), "--exclude", strongest, "--top-k", "1") == 0
    heads = strict_json(out / "heads.json")
    cert = heads["certificate"]
    named = {*heads["confirmed"], *cert["tied_at_k"], *(h["head"] for h in heads["heads"])}
    assert strongest not in named
    # entry_bar: the k-th largest harm measured alone, 0 where it does not hurt.
    second = max(v for h, v in harms.items() if h != strongest)
    assert cert["entry_bar"] == pytest.approx(max(second, 0.0), abs=1e-9)
    assert cert["measured_alone"] == 7 and cert["certified"]
