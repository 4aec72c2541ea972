"""headloc-harness sweep: cells of --masks x --sparsity over one set of measurements, the
folder it resumes or refuses, and a --never-ablate file."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import numpy as np
import pytest
from helpers import (
    assert_names,
    harness,
    last_error,
    lose_last_measurement_and_count_loads,
    measurement_lines,
    shown_bars,
    strict_json,
    tiny_args,
)


def test_sweep_refuses_a_folder_made_with_another_chat_template_setting(
        tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"  # the tiny model, its tokenizer given a chat template
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["sweep", *tiny_args(model), "--tasks", "tiny_choice",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--out", str(tmp_path / "sweep")]
    assert harness(*args) == 0
    assert harness(*args, "--apply-chat-template") == 2
    assert_names(last_error(capsys), "apply_chat_template left out", "True")  # made; given


def test_a_sweep_rerun_without_confirm_keeps_the_sweeps_own(tiny_model_dir, tmp_path):
    """--confirm left out of a rerun resumes the sweep as it was made (a sweep made with
    --confirm 2, or before its default depended on the prior, recorded 34), not refused."""
    out = tmp_path / "sweep"
    args = ["sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--out", str(out)]
    assert harness(*args, "--confirm", "2") == 0
    made = (out / "sweep.json").read_text()
    assert strict_json(out / "m3-p0.25" / "config.json")["spec"]["confirm"] == 2
    assert harness(*args) == 0
    assert (out / "sweep.json").read_text() == made
    assert strict_json(out / "config.json")["identity"]["confirm"] == 2
    assert strict_json(out / "m3-p0.25" / "config.json")["spec"]["confirm"] == 2


def test_a_finished_sweep_rerun_prints_its_table_without_loading_the_model(
        tiny_model_dir, tmp_path, capsys, monkeypatch):
    """A rerun of a finished sweep (its folder, its grid) loaded the model and refitted its
    cells through it: every cell is finished, so it fits them from disk, as a finished
    locate rerun does, and prints the same table. A check lost is measured again."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    out = tmp_path / "sweep"
    args = ["sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "3,4", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--confirm", "2", "--out", str(out)]

    def table() -> list[str]:  # what the command printed, less the time it took
        return [line for line in capsys.readouterr().out.splitlines()
                if not line.startswith("Time:")]

    capsys.readouterr()
    assert harness(*args) == 0
    printed, made = table(), (out / "sweep.json").read_text()
    assert any(line.startswith("| 3 |") for line in printed)

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patched:
        patched.setattr(HFHeadAblateLM, "create_from_arg_string", classmethod(refuse))
        patched.setattr(HFHeadAblateLM, "__init__", refuse)
        assert harness(*args) == 0
    assert table() == printed
    assert (out / "sweep.json").read_text() == made
    # A cell's check lost, a copy of what a cell measured (its top head, measured
    # alone): copied again without the model, the table the same. It loaded the model.
    lost = json.loads((out / "measurements.jsonl").read_text().splitlines()[-1])
    assert lost["key"] == "m4-p0.25-top1" and "/alone-" in lost["same_as"]
    with monkeypatch.context() as patched:
        loads = lose_last_measurement_and_count_loads(out, patched)
        assert harness(*args) == 0
    assert loads == [] and table() == printed
    assert (out / "sweep.json").read_text() == made
    assert json.loads((out / "measurements.jsonl").read_text().splitlines()[-1]) == lost
    # One measured nowhere else (no head measured alone): the model loads to measure it
    # again (once).
    alone = [*args[:args.index("--confirm")], "--confirm", "0", "--out", str(tmp_path / "0")]
    assert harness(*alone) == 0
    made = (tmp_path / "0" / "sweep.json").read_text()
    lost = json.loads((tmp_path / "0" / "measurements.jsonl").read_text().splitlines()[-1])
    assert "same_as" not in lost
    loads = lose_last_measurement_and_count_loads(tmp_path / "0", monkeypatch)
    assert harness(*alone) == 0
    assert loads == [1] and (tmp_path / "0" / "sweep.json").read_text() == made


def test_never_ablate_file_and_sweep(tiny_model_dir, tmp_path, capsys):
    args = tiny_args(tiny_model_dir("llama"))
    universal = tmp_path / "universal.json"
    universal.write_text(json.dumps({"heads": [{"head": "L0H1"}, {"head": "L1H2"}]}))
    assert harness("locate", *args, "--tasks", "tiny_copy", "--masks", "6", "--sparsity", "0.25",
                   "--num-samples", "4", "--never-ablate", str(universal),
                   "--out", str(tmp_path / "protected")) == 0
    design = np.load(tmp_path / "protected" / "design_matrix.npy")
    assert not design[:, [1, 6]].any() and design.any(axis=0).sum() == 6
    # Never knocked out, so nothing was measured of them: not ranked (as "no harm" they were).
    ranking = strict_json(tmp_path / "protected" / "heads.json")
    assert ranking["never_knocked_out"] == ["L0H1", "L1H2"]
    assert {h["head"] for h in ranking["heads"]} == {
        f"L{layer}H{head}" for layer in (0, 1) for head in range(4)} - {"L0H1", "L1H2"}
    assert "(not ranked: no measurement knocked them out)" in \
        (tmp_path / "protected" / "report.md").read_text()

    sweep = tmp_path / "sweep"
    assert harness("sweep", *args, "--tasks", "tiny_choice", "--masks", "4,6", "--sparsity",
                   "0.2,0.4", "--num-samples", "4", "--top-k", "2", "--out", str(sweep)) == 0
    result = strict_json(sweep / "sweep.json")
    assert len(result["cells"]) == 4
    records = {r["key"]: r for r in map(json.loads,
                                         (sweep / "measurements.jsonl").read_text().splitlines())}
    base = records["baseline"]["scores"]["tiny_choice"]
    for cell in result["cells"]:
        name = f"m{cell['masks']}-p{cell['sparsity']:g}"
        top = strict_json(sweep / name / "heads.json")["top_k"]
        assert cell["heads"] == top
        check = records[f"{name}-top2"]
        assert check["mask"] == "+".join(sorted(top))
        assert cell["drop"] == pytest.approx(base - check["scores"]["tiny_choice"])
    assert result["best"]["drop"] == max(c["drop"] for c in result["cells"])
    # The verdict, from the drops recomputed above: a best cell, a tie, or nothing found.
    drops = [base - records[f"m{c['masks']}-p{c['sparsity']:g}-top2"]["scores"]["tiny_choice"]
             for c in result["cells"]]
    printed = capsys.readouterr().out
    if max(drops) <= 0:
        assert "Nothing found: no cell's top-2 heads hurt tiny_choice" in printed
    elif drops.count(max(drops)) > 1:
        assert f"Best, tied: {drops.count(max(drops))} cells drop it by" in printed
    else:
        assert "Best: --masks" in printed


def test_the_sweep_table_names_what_its_cells_knock_out():
    """A neuron sweep's table said its cells' 'heads'."""
    from lm_eval_headloc.commands.sweep import sweep_table

    def result(best):
        return {"task": "t", "baseline": 0.5, "top_k": 2, "best": {
            "masks": 10, "sparsity": 0.1, "heads": best, "drop": 0.2},
            "cells": [{"masks": 10, "sparsity": 0.1, "heads": best, "drop": 0.2}]}

    heads = sweep_table(result(["L0H1", "L1H0"]))
    assert "when the top-2 heads of each cell" in heads and "(heads L0H1+L1H0, " in heads
    neurons = sweep_table(result(["L0N1", "L1N7"]))
    assert "when the top-2 MLP neurons of each cell" in neurons
    assert "(MLP neurons L0N1+L1N7, drop +0.2000)" in neurons and "heads" not in neurons


def _grid(drops: list[float], baseline: float = 0.5) -> dict:
    cells = [{"masks": m, "sparsity": 0.1, "heads": [f"L0H{i}", "L1H0"], "drop": d}
             for i, (m, d) in enumerate(zip((10, 20, 30), drops, strict=False))]
    return {"task": "t", "baseline": baseline, "higher_is_better": True, "top_k": 2,
            "cells": cells, "best": max(cells, key=lambda c: c["drop"])}


def test_the_sweep_says_a_tie_at_the_best_drop_and_a_grid_that_found_nothing():
    """A grid whose cells all dropped the task by 0 printed 'Best: --masks 4 --sparsity
    0.2 (..., drop -0.0000)': the first cell, as if chosen, and a negative zero."""
    from lm_eval_headloc.commands.sweep import sweep_table

    assert sweep_table(_grid([0.1, 0.3, 0.2])).endswith(
        "Best: --masks 20 --sparsity 0.1 (heads L0H1+L1H0, drop +0.3000)")
    assert sweep_table(_grid([0.3, 0.1, 0.3])).endswith(
        "Best, tied: 2 cells drop it by +0.3000: --masks 10 --sparsity 0.1 (heads "
        "L0H0+L1H0); --masks 30 --sparsity 0.1 (heads L0H2+L1H0).")
    nothing = sweep_table(_grid([0.0, -0.1, 0.0]))
    assert nothing.endswith("Nothing found: no cell's top-2 heads hurt t (the largest drop: "
                            "+0.0000), so no cell is best.")
    assert "Best" not in nothing
    floor = sweep_table(_grid([0.0, 0.0, 0.0], baseline=0.0))
    assert "t scores 0 with nothing knocked out" in floor and "--signal logprob" in floor
    assert "-0.0000" not in floor


def test_a_score_that_held_drops_by_zero_not_negative_zero():
    from lm_eval_headloc.commands.sweep import drop

    assert not np.signbit(drop(0.5, 0.5, True)) and not np.signbit(drop(0.5, 0.5, False))
    assert f"{drop(0.0, 0.0, True):+.4f}" == "+0.0000"
    assert drop(0.3, 0.5, True) == pytest.approx(0.2)  # accuracy fell: worse
    assert drop(0.3, 0.5, False) == pytest.approx(-0.2)  # perplexity fell: better


@pytest.mark.parametrize("grid, named", [
    (["--masks", "4,4"], ["--masks 4,4", "4 given twice"]),
    (["--sparsity", "0.1,0.10"], ["--sparsity 0.1,0.1", "0.1 given twice"]),
    (["--sparsity", "0.12345671,0.12345672"],
     ["0.12345671 and 0.12345672", "p0.123457"]),
    (["--masks", "1,4"], ["--masks 1", ">= 2"]),
    (["--sparsity", "0"], ["--sparsity 0:", "strictly between 0 and 1"]),
    # An empty entry was dropped: '4,,8' ran the cells of 4,8.
    (["--masks", "4,,8"], ["--masks", "'4,,8'", "empty entry"]),
    (["--sparsity", "0.1,"], ["--sparsity", "'0.1,'", "empty entry"]),
])
def test_a_grid_value_no_cell_can_take_is_refused_before_the_load(
        grid, named, tiny_model_dir, tmp_path, capsys, no_model_loading):
    """'--masks 4,4' ran one cell and recorded a grid of two; '--masks 1' was refused as
    "a whole number >= 2 or 'auto'", which a grid does not take, and '--sparsity 0' was
    said as '0.0'."""
    out = tmp_path / "sweep"
    capsys.readouterr()
    assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   *grid, "--out", str(out)) == 2
    error = last_error(capsys)
    assert_names(error, *named)
    assert "auto" not in error and "0.0" not in error
    assert not out.exists()


@pytest.mark.parametrize("grid, named", [
    ({"masks": "100"}, "masks='100'"), ({"sparsity": "0.05"}, "sparsity='0.05'"),
    ({"masks": None}, "masks=None")])
def test_a_grid_given_from_python_as_text_is_refused_as_given(grid, named, tmp_path,
                                                              no_model_loading):
    """sweep(out, masks="100") was a grid of the characters "1", "0", "0", refused as
    "--masks '1'"; masks=None was Python's "'NoneType' object is not iterable"."""
    from lm_eval_headloc.commands.sweep import sweep
    from lm_eval_headloc.common.checks import UsageError

    with pytest.raises(UsageError) as error:
        sweep(tmp_path / "sweep", tasks=("tiny_choice",), **grid)
    assert_names(str(error.value), named)
    assert not (tmp_path / "sweep").exists()


def test_verify_and_cross_of_a_sweeps_folder_name_its_cells(tiny_model_dir, tmp_path, capsys):
    """verify said a finished sweep 'has no heads-tiny_choice.json; finish the run first'."""
    out = tmp_path / "sweep"
    args = tiny_args(tiny_model_dir("llama"))
    assert harness("sweep", *args, "--tasks", "tiny_choice", "--masks", "3", "--sparsity",
                   "0.25", "--num-samples", "3", "--top-k", "1", "--out", str(out)) == 0
    for command in (["verify", str(out), "--general", "tiny_copy"],
                    ["cross", str(out), str(out / "m3-p0.25")]):
        capsys.readouterr()
        assert harness(*command, "--out", str(tmp_path / command[0])) == 2
        error = last_error(capsys)
        assert_names(error, str(out), "sweep run", "m<M>-p<P>/")
        assert "finish the run" not in error


def test_force_on_a_sweep_clears_its_cells_and_nothing_else(tiny_model_dir, tmp_path,
                                                            capsys):
    """A sweep's cells are its own run folders, cleared by --force; a run folder of ours
    named like no cell of its grid (a copy of another run) is not its to delete."""
    out = tmp_path / "sweep"
    args = ["sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "3,4", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--confirm", "2", "--out", str(out)]
    assert harness(*args) == 0
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["m3-p0.25", "m4-p0.25"]
    shutil.copytree(out / "m3-p0.25", out / "m3-copy")
    assert harness(*args, "--seed", "1", "--force") == 2
    assert_names(last_error(capsys), "--force", "m3-copy")
    assert (out / "m4-p0.25" / "heads.json").is_file()
    shutil.rmtree(out / "m3-copy")
    assert harness(*args, "--seed", "1", "--force") == 0
    assert strict_json(out / "m3-p0.25" / "config.json")["identity"]["seed"] == 1


def test_cells_the_noise_cannot_tell_from_the_best_are_no_best():
    """A sweep on a 4 x 16-head model said "Best: --masks 6" where the two cells' drops
    differed by 0.00006 (both shown as +0.0066). Derived here: the paired standard error
    of two checks' difference is the spread of the per-example differences over sqrt(n)."""
    from statistics import NormalDist

    from lm_eval_headloc.commands.sweep import sweep_table, within_noise_of_best

    z = NormalDist().inv_cdf(0.95)
    base = [0.1 * i for i in range(8)]
    best = [v - 0.5 for v in base]  # drop 0.5
    near = [v - 0.5 + (0.02 if i % 2 else -0.01) for i, v in enumerate(base)]
    far = [v - 0.2 for v in base]  # drop 0.2, the same difference on every example: se 0
    cells = [{"masks": m, "sparsity": 0.1, "heads": [h], "drop": d}
             for m, h, d in ((6, "L0H1", 0.5), (10, "L1H0", 0.5 - 0.005), (14, "L1H2", 0.2))]
    diffs = [a - b for a, b in zip(best, near, strict=True)]
    mean = sum(diffs) / len(diffs)
    se = (sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1) / len(diffs)) ** 0.5
    assert 0.005 <= z * se  # the case: the second cell is within the noise
    flags = within_noise_of_best(cells, [[best], [near], [far]])
    assert flags == [False, True, False]
    assert within_noise_of_best(cells, [[best], None, [far]]) == [False, False, False]
    result = {"task": "t", "baseline": 1.0, "top_k": 1, "higher_is_better": True,
              "best": cells[0], "cells": [{**c, "within_noise_of_best": f}
                                          for c, f in zip(cells, flags, strict=True)]}
    verdict = sweep_table(result).splitlines()[-1]
    assert verdict.startswith("Best, within the noise: 2 cells") and "none is best" in verdict
    assert "--masks 10" in verdict and "--masks 14" not in verdict


def test_a_sweep_of_a_metric_that_goes_below_0_has_no_floor_at_0(tiny_model_dir, tmp_path):
    """The sweep said "scores 0 with nothing knocked out, so no knockout can lower it" of
    a Matthews correlation or a *_diff metric at 0, which can fall below 0: it had no
    metric to go on. sweep.json keeps the task's metric, and the verdict follows locate's
    rule (``scores_at_floor``)."""
    from lm_eval_headloc.commands.sweep import sweep_table

    out = tmp_path / "sweep"
    assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "3", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
                   "--confirm", "2", "--out", str(out)) == 0
    made = strict_json(out / "sweep.json")
    base = json.loads((out / "measurements.jsonl").read_text().splitlines()[0])
    assert made["metric"] == base["metrics"]["tiny_choice"] == "acc,none"
    for metric, floor in (("acc,none", True), ("mcc,none", False), ("bleu_diff,none", False),
                          ("logprob", False)):
        verdict = sweep_table({**_grid([0.0, 0.0, 0.0], baseline=0.0), "metric": metric})
        assert ("t scores 0 with nothing knocked out" in verdict) == floor, metric


def test_a_cells_bar_counts_its_masks(tiny_model_dir, tmp_path, monkeypatch):
    """Each cell's bar said "locate 4/4" for 3 masks: it counted the baseline measured
    with them, which the sweep's own bar counts. A cell's bar counts its masks, as
    locate's does."""
    with shown_bars(monkeypatch) as shown:
        assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks",
                       "tiny_choice", "--masks", "3,5", "--sparsity", "0.25",
                       "--num-samples", "3", "--top-k", "1", "--confirm", "2",
                       "--out", str(tmp_path / "sweep")) == 0
    assert shown == [("baseline", 1, 1), ("locate", 3, 3), ("confirm", 2, 2),
                     ("locate", 5, 5), ("confirm", 2, 2)], shown


def test_a_sweep_measures_its_baseline_once_for_every_cell(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    """Each cell measured the baseline again in its own folder (3 baselines for 2 cells):
    the same model, examples and nothing knocked out as the sweep's own. A cell keeps the
    sweep's record as its copy (``same_as`` naming it), and stays a run folder of its own:
    a rerun there fits it from disk."""
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    masks: list[str] = []  # each mask the model measured
    original = HarnessMeasurement.measure_chunks

    def counted(self, chunks, *args, **kwargs):
        masks.extend("+".join(map(str, mask)) for chunk in chunks for mask in chunk)
        return original(self, chunks, *args, **kwargs)

    monkeypatch.setattr(HarnessMeasurement, "measure_chunks", counted)
    out = tmp_path / "sweep"
    assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "3,4", "--sparsity", "0.25", "--num-samples", "3",
                   "--top-k", "1", "--confirm", "2", "--out", str(out)) == 0
    assert masks.count("") == 1, masks
    made = measurement_lines(out)[0]
    for cell in ("m3-p0.25", "m4-p0.25"):
        assert measurement_lines(out / cell)[0] == {**made, "same_as": "../baseline"}
    # A cell is a run folder of its own: one that lost a measurement resumes there,
    # measuring that one.
    cell = out / "m3-p0.25"
    lines = (cell / "measurements.jsonl").read_text().splitlines(keepends=True)
    (cell / "measurements.jsonl").write_text("".join(lines[:-1]))
    masks.clear()
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "3", "--sparsity", "0.25", "--num-samples", "3",
                   "--top-k", "1", "--confirm", "2", "--out", str(cell)) == 0
    assert len(masks) == 1 and masks != [""], masks


def count_what_the_model_is_asked(monkeypatch, stop_after: int | None = None
                                  ) -> tuple[list[str], list[str]]:
    """(each knockout the model measured, formatted; each attribution prior's kind it
    computed), from now on; ``stop_after``: a Ctrl-C once it has measured that many."""
    from lm_eval_headloc.intervention.components import format_heads
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    asked: list[str] = []
    priors: list[str] = []
    measure_chunks, attribution = (HarnessMeasurement.measure_chunks,
                                   HarnessMeasurement.attribution)

    def counted(self, chunks, *args, **kwargs):
        for index, scores, seconds in measure_chunks(self, chunks, *args, **kwargs):
            if stop_after is not None and len(asked) >= stop_after:
                raise KeyboardInterrupt
            asked.extend(format_heads(mask) for mask in chunks[index])
            yield index, scores, seconds

    def computed(self, *args, **kwargs):
        priors.append(kwargs.get("kind", "heads"))
        return attribution(self, *args, **kwargs)

    monkeypatch.setattr(HarnessMeasurement, "measure_chunks", counted)
    monkeypatch.setattr(HarnessMeasurement, "attribution", computed)
    return asked, priors


def stripped_records(folder) -> list[dict]:
    """A run folder's measurements, but where each was made and what it took."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "same_as")}
            for r in measurement_lines(folder)]


#: A sweep whose cells of one sparsity share their first masks, measure some heads alone
#: that an earlier cell did, and whose first cell's check is its last mask.
SHARING = ["--tasks", "tiny_choice", "--num-samples", "4", "--top-k", "2", "--confirm", "3"]


def test_a_sweep_asks_the_model_each_knockout_once(tiny_model_dir, tmp_path, monkeypatch):
    """Each cell measured what the sweep had measured already: cells of one sparsity
    draw the same first masks (the 6-mask cell measured the 3-mask cell's 3 again), cells
    measured the same heads alone, and every cell computed the attribution prior again,
    which depends on the model and examples alone. A cell takes a knockout (the prior)
    the sweep or an earlier cell made as a copy naming where it was made; its
    measurements and ranking are those of the cell run alone as a locate."""
    from lm_eval_headloc.runs import types_file

    asked, priors = count_what_the_model_is_asked(monkeypatch)
    typed: list[int] = []  # the head types computed (probe rows), a function of the same
    head_types_of = types_file.head_types_of
    monkeypatch.setattr(types_file, "head_types_of",
                        lambda lm, texts, rows: typed.append(rows) or head_types_of(lm, texts,
                                                                                    rows))
    args = [*tiny_args(tiny_model_dir("llama")), *SHARING]
    out = tmp_path / "sweep"
    assert harness("sweep", *args, "--masks", "3,6", "--sparsity", "0.25,0.5",
                   "--out", str(out)) == 0
    twice = {mask: n for mask, n in Counter(asked).items() if n > 1}
    assert not twice, twice
    assert priors == ["heads"], priors  # the first cell's
    assert len(typed) == 1, typed  # likewise the head types
    cell = out / "m6-p0.25"
    assert [r.get("same_as") for r in measurement_lines(cell)[:5]] == [
        "../baseline", "../m3-p0.25/mask-0000", "../m3-p0.25/mask-0001",
        "../m3-p0.25/mask-0002", None]
    assert strict_json(cell / "prior.json")["same_as"] == "../m3-p0.25/prior.json"
    assert strict_json(cell / "types.json")["same_as"] == "../m3-p0.25/types.json"
    assert measurement_lines(out)[1]["same_as"] == "m3-p0.25/mask-0002"  # the first check
    alone = tmp_path / "alone"  # the cell run alone: its own masks, heads alone and prior
    assert harness("locate", *args, "--masks", "6", "--sparsity", "0.25", "--group-tests",
                   "0", "--out", str(alone)) == 0
    assert stripped_records(cell) == stripped_records(alone)
    assert strict_json(cell / "heads.json") == strict_json(alone / "heads.json")
    assert ({**strict_json(cell / "types.json"), "same_as": None}
            == {**strict_json(alone / "types.json"), "same_as": None})
    # A cell is a run folder of its own: one that lost its copies resumes there, and
    # refits, to the same ranking.
    heads = strict_json(cell / "heads.json")
    lines = (cell / "measurements.jsonl").read_text().splitlines(keepends=True)
    (cell / "measurements.jsonl").write_text("".join(lines[:2]))
    asked.clear()
    assert harness("locate", *args, "--masks", "6", "--sparsity", "0.25", "--group-tests",
                   "0", "--out", str(cell)) == 0
    assert len(asked) == len(lines) - 2 and strict_json(cell / "heads.json") == heads
    assert harness("refit", str(cell)) == 0
    assert strict_json(cell / "heads.json") == heads


def test_an_interrupted_sweep_rerun_measures_nothing_twice(tiny_model_dir, tmp_path,
                                                           monkeypatch):
    """A sweep stopped in its second cell and rerun takes, in each cell, what the cells
    before it made, on disk: over both sessions each knockout is measured once, and the
    cells end as those of a sweep never stopped."""
    args = ["sweep", *tiny_args(tiny_model_dir("llama")), *SHARING, "--masks", "3,6",
            "--sparsity", "0.25"]
    whole = tmp_path / "whole"
    assert harness(*args, "--out", str(whole)) == 0
    out = tmp_path / "sweep"
    with monkeypatch.context() as stopped:
        first, _ = count_what_the_model_is_asked(stopped, stop_after=9)
        assert harness(*args, "--out", str(out)) == 130
    assert (out / "m6-p0.25" / "measurements.jsonl").is_file()  # stopped in the second
    asked, priors = count_what_the_model_is_asked(monkeypatch)
    assert harness(*args, "--out", str(out)) == 0
    twice = {mask: n for mask, n in Counter(first + asked).items() if n > 1}
    assert not twice and not priors, (twice, priors)
    for name in ("m3-p0.25", "m6-p0.25"):
        assert stripped_records(out / name) == stripped_records(whole / name)
        assert strict_json(out / name / "heads.json") == strict_json(whole / name / "heads.json")
    assert strict_json(out / "sweep.json") == strict_json(whole / "sweep.json")
