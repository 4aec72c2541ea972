"""headloc-harness refit: a run's ranking fitted again from its measurements with other
settings, without the model, and the summary line it prints."""

from __future__ import annotations

import shutil
from pathlib import Path

from helpers import harness, strict_json


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
