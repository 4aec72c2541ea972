"""cross: each run's top-k knocked out, every task measured (CNL's cross-task matrix), on a
tiny random Llama (2 layers x 4 heads) and two continuous tasks (perplexities)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import (
    TASKS,
    assert_names,
    error_line,
    finished_run,
    harness,
    last_error,
    needs_ray,
)
from helpers import measurement_lines as lines

from lm_eval_headloc.method.ranking import relative_drop

PPL = ("L1H2", "L0H0", "L0H3", "L1H0")
ROLLING = ("L0H1", "L1H3", "L1H2", "L0H2")
METRIC = {"tiny_copy_ppl": "perplexity,none", "tiny_rolling": "word_perplexity,none"}


@pytest.fixture(scope="module")
def matrix(tiny_model_dir, tmp_path_factory):
    """cross of two runs (one task each) with --scale 2: erase and enhance matrices."""
    root = tmp_path_factory.mktemp("cross")
    model = tiny_model_dir("llama")
    runs = [finished_run(root / "ppl", model, "tiny_copy_ppl", PPL),
            finished_run(root / "rolling", model, "tiny_rolling", ROLLING)]
    out = root / "cross"
    # --num-samples 12: every document of the two 12-document tasks.
    assert harness("cross", *map(str, runs), "--top-k", "2", "--scale", "2",
                   "--num-samples", "12", "--out", str(out)) == 0
    return runs, out


def _evaluate(model_dir: Path, heads: list[str], scale: float, task: str) -> float:
    """The task's score from a separate hf-headablate model (lm-eval's own evaluation)."""
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.tasks import make_task_manager

    lm = HFHeadAblateLM(pretrained=str(model_dir), dtype="float32", device="cpu",
                        ablate="+".join(heads) or None, scale=scale)
    results = lm_eval.simple_evaluate(model=lm, tasks=[task],
                                      task_manager=make_task_manager([TASKS]))
    return results["results"][task][METRIC[task]]


def test_cross_matrix(tiny_model_dir, matrix):
    runs, out = matrix
    table = json.loads((out / "cross.json").read_text())
    labels = [f"{runs[0]}:tiny_copy_ppl", f"{runs[1]}:tiny_rolling"]
    assert table["tasks"] == ["tiny_copy_ppl", "tiny_rolling"]  # the runs' own, by default
    assert [s["label"] for s in table["sets"]] == labels
    assert [s["heads"] for s in table["sets"]] == [list(PPL[:2]), list(ROLLING[:2])]
    assert [(m["name"], m["scale"]) for m in table["ablations"]] == [("erase", 0.0),
                                                                      ("enhance", 2.0)]
    # Every cell from the stored records: the set's record against the baseline's.
    records = {r["key"]: r for r in lines(out)}
    assert sorted(records) == ["baseline", "set1", "set1-erase", "set2", "set2-erase"]
    assert records["set1-erase"]["scale"] == 0.0 and "scale" not in records["set1"]
    base = records["baseline"]
    for matrix_ in table["ablations"]:
        suffix = "-erase" if matrix_["name"] == "erase" else ""
        for i, label in enumerate(labels, start=1):
            for task in table["tasks"]:
                score = records[f"set{i}{suffix}"]["scores"][task]
                assert matrix_["scores"][label][task] == score
                assert matrix_["drops"][label][task] == pytest.approx(
                    relative_drop(base["scores"][task], score, False))
        # A set is general where it hurts another task at least as much as its own.
        for s in table["sets"]:
            drops = matrix_["drops"][s["label"]]
            if drops[s["task"]] > 0:
                assert matrix_["hurts_others"][s["label"]] == [
                    t for t in table["tasks"] if t != s["task"] and drops[t] >= drops[s["task"]]]
            else:
                assert s["label"] not in matrix_["hurts_others"]
    # One cell per ablation against lm-eval's own evaluation of a separate model.
    model = tiny_model_dir("llama")
    erase, enhance = table["ablations"]
    assert erase["scores"][labels[0]]["tiny_rolling"] == pytest.approx(
        _evaluate(model, list(PPL[:2]), 0.0, "tiny_rolling"))
    assert enhance["scores"][labels[1]]["tiny_copy_ppl"] == pytest.approx(
        _evaluate(model, list(ROLLING[:2]), 2.0, "tiny_copy_ppl"))
    assert table["baseline"]["tiny_copy_ppl"] == pytest.approx(
        _evaluate(model, [], 0.0, "tiny_copy_ppl"))
    text = (out / "cross.md").read_text()
    assert "| set knocked out | heads | tiny_copy_ppl | tiny_rolling |" in text
    assert "## erase (×0)" in text and "## enhance (×2)" in text
    assert all(f"- {label}: " in text for label in labels)
    assert (out / "cross.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # What each run's ranking says of its set is carried, from the run's own file.
    from lm_eval_headloc.commands.cross import cross_markdown
    from lm_eval_headloc.commands.verify import ranking_notes
    from lm_eval_headloc.runs.folder import RunFolder

    assert table["ranking_notes"] == {
        s["label"]: notes for s in table["sets"]
        if (notes := ranking_notes(RunFolder(s["run"]), s["task"], table["top_k"]))}
    table["ranking_notes"] = {labels[0]: ["L0H1: recorded to do no harm"]}
    assert (f"What the runs' rankings say of their sets (each run's report.md):\n"
            f"- {labels[0]}: L0H1: recorded to do no harm\n") in cross_markdown(table)


def test_cross_resumes_without_measuring_again(matrix):
    runs, out = matrix
    before = lines(out)
    assert harness("cross", *map(str, runs), "--top-k", "2", "--scale", "2",
                   "--num-samples", "12", "--out", str(out)) == 0
    assert lines(out) == before
    # Other sets (another --top-k) are other measurements: the folder is refused.
    assert harness("cross", *map(str, runs), "--top-k", "3", "--scale", "2",
                   "--num-samples", "12", "--out", str(out)) == 2


def test_cross_of_chosen_tasks_erases_only(tiny_model_dir, tmp_path):
    run = finished_run(tmp_path / "ppl", tiny_model_dir("llama"), "tiny_copy_ppl", PPL)
    out = tmp_path / "cross"
    assert harness("cross", str(run), "--tasks", "tiny_rolling", "--top-k", "1",
                   "--num-samples", "4", "--out", str(out)) == 0
    table = json.loads((out / "cross.json").read_text())
    assert table["tasks"] == ["tiny_rolling"]
    (erase,) = table["ablations"]
    assert erase["name"] == "erase" and erase["hurts_others"] == {}  # own task not measured
    assert all("scale" not in r for r in lines(out))
    assert "its own task is not measured" in (out / "cross.md").read_text()
    assert math.isfinite(erase["drops"][f"{run}:tiny_copy_ppl"]["tiny_rolling"])


def test_a_full_disk_while_cross_png_is_written_is_one_line(tiny_model_dir, tmp_path,
                                                            capsys, monkeypatch):
    """cross.png was written outside the folder's one-line errors: a full disk there
    ended the command in a traceback."""
    import errno
    import os

    from matplotlib.figure import Figure

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run = finished_run(tmp_path / "ppl", tiny_model_dir("llama"), "tiny_copy_ppl", PPL)
    out = tmp_path / "cross"
    monkeypatch.setattr(Figure, "savefig", full)
    assert harness("cross", str(run), "--tasks", "tiny_rolling", "--top-k", "1",
                   "--num-samples", "4", "--out", str(out)) == 2
    assert_names(last_error(capsys), f"cannot write {out / 'cross.png'}",
                 "No space left on device")


def test_cross_checks_its_arguments_before_loading(tiny_model_dir, tmp_path, capsys,
                                                   no_model_loading):
    model = tiny_model_dir("llama")
    a = finished_run(tmp_path / "a", model, "tiny_copy", PPL)
    b = finished_run(tmp_path / "b", model, "tiny_choice", ROLLING,
                     model_args=f"pretrained={model},dtype=bfloat16,device=cpu")
    c = finished_run(tmp_path / "c", model, "tiny_choice", ROLLING)
    out = str(tmp_path / "out")
    for args, values in [  # the values each refusal names
        ([a, b], (str(a), f"'pretrained={model},dtype=float32,device=cpu'",
                  str(b), f"'pretrained={model},dtype=bfloat16,device=cpu'")),
        ([a, c, "--tasks", "no_such_task", "--top-k", "2"], ("'no_such_task'",)),
        ([a, c, "--top-k", "5"], ("--top-k 5", "heads-tiny_copy.json", "4 heads")),
        ([a, c, "--top-k", "0"], ("--top-k 0", ">= 1")),
        ([a, a], (str(a),)),
        ([a, tmp_path / "nothing"], (str(tmp_path / "nothing"),)),
        ([a, c, "--num-samples", "0"], ("--num-samples 0", ">= 1")),
    ]:
        assert harness("cross", *map(str, args), "--out", out) == 2, args
        assert_names(last_error(capsys), *values)
    before = sorted(p.name for p in a.iterdir())
    for inside in (a, tmp_path):  # the run itself, or a folder holding it
        assert harness("cross", str(a), str(c), "--out", str(inside), "--force") == 2
        assert_names(last_error(capsys), f"--out {inside}", str(a))  # and the run it reads
    assert not Path(out).exists() and sorted(p.name for p in a.iterdir()) == before


@pytest.mark.slow
@needs_ray
def test_cross_on_workers_equals_one_process(matrix, tmp_path):
    """The erase entries' own scale reaches the workers' models (run_plan hands it on)."""
    import ray

    runs, one = matrix
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        assert harness("cross", *map(str, runs), "--top-k", "2", "--scale", "2",
                       "--num-samples", "12", "--workers", "2",
                       "--out", str(tmp_path / "two")) == 0
    finally:
        if started:
            ray.shutdown()
    two = {r["key"]: r for r in lines(tmp_path / "two")}
    for record in lines(one):
        assert two[record["key"]]["mask"] == record["mask"]
        assert two[record["key"]].get("scale") == record.get("scale")
        assert two[record["key"]]["scores"] == pytest.approx(record["scores"], rel=1e-5)


def _located_with(run: Path, **options) -> Path:
    """``run``'s config.json as if located with these prompt options."""
    config = json.loads((run / "config.json").read_text())
    for part in ("spec", "identity"):
        config[part].update(options)
    (run / "config.json").write_text(json.dumps(config))
    return run


def test_cross_asks_the_tasks_as_the_runs_located_them(tiny_model_dir, tmp_path, capsys):
    """The runs' few-shot count, system instruction, chat-template setting and generation
    arguments are the matrix's unless given: the matrix used to ask every task zero-shot,
    without the system prompt, whatever the runs were located with."""
    model = tiny_model_dir("llama")
    prompts = {"num_fewshot": 1, "system_instruction": "Copy."}
    a = _located_with(finished_run(tmp_path / "a", model, "tiny_copy_ppl", PPL), **prompts)
    b = _located_with(finished_run(tmp_path / "b", model, "tiny_rolling", ROLLING), **prompts)
    out = tmp_path / "cross"
    assert harness("cross", str(a), str(b), "--top-k", "1", "--num-samples", "4",
                   "--out", str(out)) == 0
    spec = json.loads((out / "config.json").read_text())["spec"]
    assert (spec["num_fewshot"], spec["system_instruction"]) == (1, "Copy.")
    given = tmp_path / "given"
    assert harness("cross", str(a), str(b), "--top-k", "1", "--num-samples", "4",
                   "--num-fewshot", "0", "--out", str(given)) == 0
    spec = json.loads((given / "config.json").read_text())["spec"]
    assert (spec["num_fewshot"], spec["system_instruction"]) == (0, "Copy.")
    # Runs located otherwise: which one the matrix asks is the user's to say.
    _located_with(b, num_fewshot=3)
    capsys.readouterr()
    assert harness("cross", str(a), str(b), "--top-k", "1", "--out",
                   str(tmp_path / "mixed")) == 2
    assert_names(error_line(capsys), str(a), "--num-fewshot=1", str(b), "--num-fewshot=3")
    _located_with(b, num_fewshot=None)
    assert harness("cross", str(a), str(b), "--top-k", "1", "--out",
                   str(tmp_path / "mixed")) == 2
    assert_names(last_error(capsys), str(b), "--num-fewshot left out")
    _located_with(b, num_fewshot=1)

    # The runs' generation arguments, with --tasks that do not generate, change nothing:
    # the matrix goes without them rather than refusing an option nobody gave.
    _located_with(b, num_fewshot=1, gen_kwargs='{"max_gen_toks": 4}')
    _located_with(a, gen_kwargs='{"max_gen_toks": 4}')
    plain = tmp_path / "plain"
    capsys.readouterr()
    assert harness("cross", str(a), str(b), "--top-k", "1", "--num-samples", "4",
                   "--out", str(plain)) == 0
    assert json.loads((plain / "config.json").read_text())["spec"]["gen_kwargs"] is None
    assert ("warning: cross: leaving out the runs' --gen-kwargs (--gen-kwargs: none of the "
            "tasks generates") in capsys.readouterr().err


def test_cross_says_which_runs_ranked_by_the_logprob_signal(tiny_model_dir, tmp_path, capsys):
    """cross scores every task by its metric, whatever its runs ranked by: a set a run found
    by the gold answers' log-likelihood (--signal logprob) read as no drop where the metric
    held, and nothing said the matrix measured by another signal (verify.md says it)."""
    model = tiny_model_dir("llama")
    a = _located_with(finished_run(tmp_path / "a", model, "tiny_copy_ppl", PPL),
                      signal="logprob")
    b = finished_run(tmp_path / "b", model, "tiny_rolling", ROLLING)
    out = tmp_path / "cross"
    capsys.readouterr()
    assert harness("cross", str(a), str(b), "--top-k", "1", "--num-samples", "4",
                   "--out", str(out)) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "logprob" in line]
    assert said == [f"Run {a} ranked its sets by the gold answers' log-likelihood (--signal "
                    "logprob); this matrix scores every task by its metric, which can stay "
                    "where the log-likelihood moved."]
    table = json.loads((out / "cross.json").read_text())
    assert table["located_by"] == {str(a): "logprob", str(b): "metric"}
    from lm_eval_headloc.commands.cross import cross_markdown

    table["located_by"][str(a)] = "metric"  # runs ranked by the metric: nothing to say
    assert "logprob" not in cross_markdown(table)


def test_a_knockout_two_sets_share_is_measured_and_written_once(tiny_model_dir, tmp_path):
    """Two runs that found the same top heads: their sets are one knockout, measured once
    (the second record a copy, said by same_as) and written to one lm-eval file."""
    model = tiny_model_dir("llama")
    runs = [finished_run(tmp_path / "ppl", model, "tiny_copy_ppl", PPL),
            finished_run(tmp_path / "rolling", model, "tiny_rolling", PPL)]
    out, results = tmp_path / "cross", tmp_path / "lm-eval"
    assert harness("cross", *map(str, runs), "--top-k", "2", "--num-samples", "4",
                   "--out", str(out), "--output-path", str(results)) == 0
    records = {r["key"]: r for r in lines(out)}
    assert sorted(records) == ["baseline", "set1", "set2"]
    assert records["set2"]["same_as"] == "set1" and "same_as" not in records["set1"]
    assert records["set2"]["mask"] == records["set1"]["mask"] == "L0H0+L1H2"
    assert records["set2"]["scores"] == records["set1"]["scores"]
    index = json.loads((out / "lm_eval_files.json").read_text())
    assert index["set2"] == index["set1"] != index["baseline"]
    assert len(list(results.rglob("results_*.json"))) == 2  # baseline and the one knockout
    # The copy is what measuring it again gives: a cross of the second run alone.
    alone = tmp_path / "alone"
    assert harness("cross", str(runs[1]), "--tasks", "tiny_copy_ppl,tiny_rolling",
                   "--top-k", "2", "--num-samples", "4", "--out", str(alone)) == 0
    assert {r["key"]: r for r in lines(alone)}["set1"]["scores"] == records["set2"]["scores"]


def test_a_set_is_not_called_specific_with_no_other_task_measured():
    """With its own task the only one measured, cross said 'specific: hurts no other task
    as much as its own' of a set that was never measured on another task."""
    from lm_eval_headloc.commands.cross import _verdict

    matrix = {"drops": {"r:a": {"a": 0.5, "b": 0.1}}, "hurts_others": {"r:a": []}}
    only = _verdict({"label": "r:a", "task": "a"}, matrix, ["a"])
    assert "specific" not in only.replace("whether it is specific", "")
    assert "no other task is measured" in only and "50.0 %" in only
    assert "specific: hurts no other task" in _verdict({"label": "r:a", "task": "a"},
                                                        matrix, ["a", "b"])


def test_a_score_that_held_drops_by_zero_not_minus_zero():
    """cross.json recorded a drop of -0.0 (a higher-is-better score that held)."""
    import json

    from lm_eval_headloc.method.ranking import relative_drop

    for higher in (True, False):
        assert json.dumps(relative_drop(0.5, 0.5, higher)) == "0.0"
    assert relative_drop(0.5, 0.25, True) == 0.5 and relative_drop(0.5, 0.75, False) == 0.5
