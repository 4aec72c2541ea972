"""locate stopped part-way (killed, a measurement corrupted, interrupted before its design)
or run again (finished, with more masks or confirmation, with options left out) comes to
the run an unbroken one makes, measuring only what is missing."""

from __future__ import annotations

import json
import signal

import numpy as np
import pytest
from helpers import (
    LASSO_ONLY,
    assert_same_run,
    harness,
    last_error,
    read_run,
    stopped_part_way,
    strict_json,
    tiny_args,
)


def test_resume_recomputes_only_a_corrupted_measurement(tiny_model_dir, tmp_path, capsys):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "8", "--sparsity", "0.25", "--num-samples", "6", "--out",
            str(tmp_path / "run")]
    assert harness(*args) == 0
    log = tmp_path / "run" / "measurements.jsonl"
    lines = log.read_text().splitlines()
    lost = json.loads(lines[3])
    lines[3] = "garbage"
    log.write_text("\n".join(lines) + "\n")
    assert harness(*args) == 0
    # Said once, though the run reads the file several times (it was said six times).
    assert capsys.readouterr().err.count("line 4 is not a measurement") == 1
    after = log.read_text().splitlines()
    assert after[:len(lines)] == lines and len(after) == len(lines) + 1  # only one redone
    redone = json.loads(after[-1])
    assert (redone["key"], redone["mask"], redone["scores"]) == (
        lost["key"], lost["mask"], lost["scores"])


def killed_then_resumed(args: list[str], tmp_path, after: int, below: int):
    """``args`` run killed (-9) after ``after`` measurements (it must have stored fewer
    than ``below``) and resumed into ``killed``, and run unbroken into ``full``:
    (killed, full)."""
    killed = tmp_path / "killed"
    partial = stopped_part_way(args, killed, after=after, stop=signal.SIGKILL)
    assert after <= partial < below, "the run was not interrupted where meant"
    assert harness(*args, "--out", str(killed)) == 0
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    assert_same_run(killed, full)
    return killed, full


@pytest.mark.parametrize("options", [[], ["--signal", "logprob"],
                                     ["--masks", "auto", "--max-masks", "40", "--top-k", "2"],
                                     ["--sparsity", "auto"], ["--ablation", "mean"],
                                     ["--ablation", "resample", "--scale", "0.5"]])
def test_resume_after_a_kill_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, options):
    folder = tiny_model_dir("llama")
    args = ["locate", *tiny_args(folder), "--tasks", "tiny_copy", "--masks", "40",
            "--sparsity", "0.25", "--num-samples", "12", "--seed", "3", *options]
    _, full = killed_then_resumed(args, tmp_path, after=6, below=41)
    assert len(read_run(full)[0]) >= 21


def test_a_kill_mid_confirmation_resumes_to_the_same_picks(tiny_model_dir, tmp_path):
    """Killed (-9) in the second round of confirmation (8 heads, rounds of 5 and 2): the
    resumed run makes the same picks in the same order, and ranks as an unbroken run."""
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "10", "--sparsity", "0.25", "--num-samples", "12", "--seed", "3",
            "--prior", "atp-path", "--confirm", "7"]
    # baseline + 10 masks + round 1's 5 heads + 1 of round 2
    killed, full = killed_then_resumed(args, tmp_path, after=17, below=18)
    assert len(read_run(full)[0]) == 1 + 10 + 7
    assert strict_json(killed / "config.json")["confirm"] == \
        strict_json(full / "config.json")["confirm"]


def test_a_larger_confirm_measures_only_the_new_heads(tiny_model_dir, tmp_path):
    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "10", "--sparsity", "0.25", "--num-samples", "12", "--seed", "3",
            "--prior", "atp"]
    grown = tmp_path / "grown"
    assert harness(*base, "--confirm", "3", "--out", str(grown)) == 0
    first = read_run(grown)[0]
    assert harness(*base, "--confirm", "7", "--out", str(grown)) == 0
    after = read_run(grown)[0]
    assert after[:len(first)] == first  # nothing measured again, nothing rewritten
    assert len(after) == len(first) + 4
    fresh = tmp_path / "fresh"
    assert harness(*base, "--confirm", "7", "--out", str(fresh)) == 0
    strip = [[{k: v for k, v in r.items() if k != "seconds"} for r in read_run(folder)[0]]
             for folder in (grown, fresh)]
    assert strip[0] == strip[1]
    assert read_run(grown)[1] == read_run(fresh)[1]
    config = strict_json(grown / "config.json")["confirm"]
    assert config["heads"][:3] == [r["key"][len("alone-"):] for r in first[11:]]
    assert config["rounds"] == [config["heads"][:5], config["heads"][5:]]


def test_a_finished_run_resumes_without_loading_the_model(tiny_model_dir, tiny_locate_run,
                                                         tmp_path, capsys, no_model_loading):
    """Rerunning the command of a finished run measures nothing, so the user does not
    wait for the weights: the files are fitted again from disk (with the ranking settings
    given, as refit would); asking for more measurements does load the model."""
    import shutil

    args = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice", "--masks", "12",
            "--sparsity", "0.25", "--num-samples", "12", "--top-k", "3", *LASSO_ONLY]
    again = shutil.copytree(tiny_locate_run, tmp_path / "again")
    assert harness("locate", *args, "--out", str(again)) == 0
    for name in ("heads.json", "heads.csv", "measurements.jsonl", "config.json"):
        assert (again / name).read_bytes() == (tiny_locate_run / name).read_bytes(), name
    # Other ranking settings: the same files as refit writes with them.
    resumed = shutil.copytree(tiny_locate_run, tmp_path / "resumed")
    refitted = shutil.copytree(tiny_locate_run, tmp_path / "refitted")
    assert harness("locate", *args, "--alpha", "0.05", "--out", str(resumed)) == 0
    assert harness("refit", str(refitted), "--alpha", "0.05") == 0
    capsys.readouterr()
    for name in ("heads.json", "report.md", "config.json"):
        assert (resumed / name).read_text() == (refitted / name).read_text().replace(
            str(refitted), str(resumed)), name
    assert strict_json(resumed / "heads.json")["alpha"] == 0.05
    # More masks than measured: the model is needed (and here refused by the fixture).
    more = shutil.copytree(tiny_locate_run, tmp_path / "more")
    with pytest.raises(AssertionError, match="the model was loaded"):
        harness("locate", *args, "--masks", "14", "--out", str(more))


def test_a_rerun_without_masks_or_confirm_keeps_the_runs_own(tiny_model_dir, tiny_locate_run,
                                                           tmp_path, no_model_loading):
    """--masks and --confirm left out of a rerun mean the run's own, not the defaults: a
    finished --confirm 0 run is not confirmed (nor the model loaded) by a bare rerun, and
    one last fitted on 10 of its masks stays fitted on 10."""
    import shutil

    args = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice", "--sparsity",
            "0.25", "--num-samples", "12", "--top-k", "3", "--prior", "none"]
    again = shutil.copytree(tiny_locate_run, tmp_path / "again")
    assert harness("locate", *args, "--out", str(again)) == 0
    for name in ("heads.json", "measurements.jsonl", "config.json"):
        assert (again / name).read_bytes() == (tiny_locate_run / name).read_bytes(), name
    assert harness("refit", str(again), "--masks", "10") == 0
    assert strict_json(again / "heads.json")["measurements"] == 10
    assert harness("locate", *args, "--out", str(again)) == 0
    assert strict_json(again / "heads.json")["measurements"] == 10
    spec = strict_json(again / "config.json")["spec"]
    assert (spec["masks"], spec["confirm"]) == (10, 0)


def test_a_bare_rerun_keeps_the_masks_given_to_a_run_stopped_before_its_design(
        tiny_model_dir, tmp_path, monkeypatch):
    """A run stopped between its start and its design recorded --masks 5 and no --confirm;
    the bare rerun kept neither (only both were kept) and measured the default budget."""
    import importlib

    locate_module = importlib.import_module("lm_eval_headloc.commands.locate")
    real = locate_module.ensure_types

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the head types are measured

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--prior", "none", "--out", str(run)]
    monkeypatch.setattr(locate_module, "ensure_types", stopped)
    assert harness(*args, "--masks", "5") == 130  # interrupted
    assert strict_json(run / "config.json")["spec"]["masks"] == 5
    assert not (run / "design_matrix.npy").exists()
    monkeypatch.setattr(locate_module, "ensure_types", real)
    assert harness(*args) == 0  # the same command, --masks left out
    assert np.load(run / "design_matrix.npy").shape[0] == 5
    assert strict_json(run / "config.json")["spec"]["masks"] == 5


def test_more_masks_extend_a_run_and_refit_can_take_fewer(tiny_model_dir, tmp_path, capsys):
    # Without confirmation: a confirming run's refit keeps the heads it measured alone.
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--sparsity", "0.25", "--num-samples", "6", "--top-k", "3", *LASSO_ONLY]
    grown, short, full = tmp_path / "grown", tmp_path / "short", tmp_path / "full"
    assert harness(*args, "--masks", "6", "--out", str(grown)) == 0
    assert harness(*args, "--masks", "6", "--out", str(short)) == 0
    assert harness(*args, "--masks", "10", "--out", str(grown)) == 0
    assert harness(*args, "--masks", "10", "--out", str(full)) == 0

    def without_seconds(folder):
        records, heads = read_run(folder)
        return [{k: v for k, v in r.items() if k != "seconds"} for r in records], heads

    assert without_seconds(grown) == without_seconds(full)
    assert len(without_seconds(grown)[0]) == 11
    # refit on the first 6 masks is the 6-mask run.
    assert harness("refit", str(grown), "--masks", "6") == 0
    assert read_run(grown)[1] == read_run(short)[1]
    assert harness("refit", str(grown), "--masks", "12") == 2
    error = last_error(capsys)
    assert "--masks 12" in error and "10 masks" in error  # asked; the run has


def test_a_rerun_with_a_smaller_budget_fits_from_disk_as_a_fresh_run_with_it(
        tiny_model_dir, tmp_path, monkeypatch):
    """Fewer group tests, confirmations or masks than a finished run measured: every
    measurement is on disk, yet the rerun loaded the model (6.8 s here, minutes at 8B).
    It now measures nothing, loads nothing, and ranks as a run made with that budget
    from the start (made here, with the model, to compare)."""
    import shutil

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy_ppl",
            "--sparsity", "0.25", "--num-samples", "12", "--seed", "3", "--prior", "atp",
            "--top-k", "2", "--max-measurements", "60"]
    big = tmp_path / "big"
    assert harness(*base, "--masks", "12", "--confirm", "3", "--group-tests", "6",
                   "--out", str(big)) == 0
    groups = strict_json(big / "config.json")["confirm"]["groups"]
    assert sum(map(len, groups["rounds"])) > 2  # the group tests measured something
    smaller = {"group tests": ["--masks", "12", "--confirm", "3", "--group-tests", "2"],
               "confirmations": ["--masks", "12", "--confirm", "2", "--group-tests", "0"],
               "masks": ["--masks", "8", "--confirm", "0", "--group-tests", "0"]}
    for name, budget in smaller.items():
        assert harness(*base, *budget, "--out", str(tmp_path / f"fresh {name}")) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(HFHeadAblateLM, "create_from_arg_string", classmethod(refuse))
    monkeypatch.setattr(HFHeadAblateLM, "__init__", refuse)
    measured = (big / "measurements.jsonl").read_bytes()
    for name, budget in smaller.items():
        fresh, again = tmp_path / f"fresh {name}", tmp_path / f"again {name}"
        shutil.copytree(big, again)
        assert harness(*base, *budget, "--out", str(again)) == 0, name
        assert (again / "measurements.jsonl").read_bytes() == measured, name
        assert (again / "heads.json").read_text().replace(str(again), str(fresh)) == (
            fresh / "heads.json").read_text(), name
        replayed, made = (strict_json(folder / "config.json") for folder in (again, fresh))
        for field in ("spec", "masks_used", "row_keys", "confirm"):
            assert replayed.get(field) == made.get(field), (name, field)
        np.testing.assert_array_equal(np.load(again / "design_matrix.npy"),
                                      np.load(fresh / "design_matrix.npy"))
    # Back to the first budget: every measurement is still on disk (the rerun with fewer
    # masks loaded the model for the masks it had left out of its fit).
    again = tmp_path / "again masks"
    assert harness(*base, "--masks", "12", "--confirm", "3", "--group-tests", "6",
                   "--out", str(again)) == 0
    assert (again / "measurements.jsonl").read_bytes() == measured
    assert (again / "heads.json").read_text().replace(str(again), str(big)) == (
        big / "heads.json").read_text()


def test_a_killed_default_run_that_measures_every_head_alone_resumes_to_the_same(
        tiny_model_dir, tmp_path):
    """A default run on the tiny model's 8 heads measures them all alone after 2 masks,
    with no prior: killed among its heads, a bare rerun decides the same plan (not the
    budget it kept plus a prior) and ends as an unbroken run."""
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "12", "--seed", "3"]
    killed, full = killed_then_resumed(args, tmp_path, after=6, below=11)
    assert len(read_run(full)[0]) == 1 + 2 + 8
    for run in (killed, full):
        config = strict_json(run / "config.json")
        assert (config["spec"]["masks"], config["spec"]["confirm"]) == (2, 8)
        assert config["prior_used"] is False and not (run / "prior.json").exists()


def test_a_small_models_run_with_a_prior_keeps_its_plan_when_resumed(tiny_model_dir,
                                                                      tmp_path):
    """A run on 8 heads made with the default plan's budget and a prior (as runs were
    before a default run measured every head alone there): a bare rerun keeps its masks,
    its confirmation and its prior rather than switching plans, and measures nothing."""
    common = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
              "--num-samples", "6", "--signal", "logprob", "--out", str(tmp_path / "run")]
    assert harness(*common, "--masks", "12", "--confirm", "34") == 0
    before = read_run(tmp_path / "run")
    assert strict_json(tmp_path / "run" / "config.json")["prior_used"] is True
    assert harness(*common) == 0
    config = strict_json(tmp_path / "run" / "config.json")
    assert (config["spec"]["masks"], config["spec"]["confirm"]) == (12, 34)
    assert config["prior_used"] is True and read_run(tmp_path / "run") == before


def test_a_run_measuring_every_head_alone_keeps_that_plan_when_its_exclude_changes(
        tiny_model_dir, tmp_path):
    """A default run on 8 heads with 2 excluded measures the other 6 alone. Rerun without
    the --exclude, it kept masks 2 and confirm 6, took the default plan's prior and cap
    (4) and ended "not certified", advising a --max-measurements it then refused; killed
    and resumed with an --exclude added, it computed a prior. Now the rerun measures the
    heads it now ranks alone, as a fresh run with those options does, with no prior."""
    common = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
              "--num-samples", "6", "--signal", "logprob"]
    run = tmp_path / "run"
    assert harness(*common, "--exclude", "L0H0+L1H1", "--out", str(run)) == 0
    assert strict_json(run / "heads.json")["certificate"]["measured_alone"] == 6
    assert harness(*common, "--out", str(run)) == 0
    fresh = tmp_path / "fresh"
    assert harness(*common, "--out", str(fresh)) == 0
    for folder in (run, fresh):
        config = strict_json(folder / "config.json")
        assert (config["spec"]["masks"], config["spec"]["confirm"]) == (2, 8)
        assert config["prior_used"] is False and not (folder / "prior.json").exists()
    heads, fresh_heads = (strict_json(f / "heads.json") for f in (run, fresh))
    assert heads["certificate"]["certified"] and heads["certificate"]["measured_alone"] == 8
    assert heads["top_k"] == fresh_heads["top_k"]
    assert [h["effect"] for h in heads["heads"]] == [h["effect"] for h in fresh_heads["heads"]]
    # Killed among its heads and resumed with an --exclude added: no prior, 7 heads alone.
    killed = tmp_path / "killed"
    stopped_part_way([*common, "--seed", "3"], killed, after=6, stop=signal.SIGKILL)
    assert harness(*common, "--seed", "3", "--exclude", "L0H1", "--out", str(killed)) == 0
    config = strict_json(killed / "config.json")
    assert (config["spec"]["masks"], config["spec"]["confirm"]) == (2, 7)
    assert config["prior_used"] is False and not (killed / "prior.json").exists()
    assert strict_json(killed / "heads.json")["certificate"]["certified"]


def test_a_resumed_run_whose_tasks_or_reference_set_changed_is_refused(tiny_model_dir,
                                                                      tmp_path, capsys):
    """A run resumed after its task's prompt (or --ablation-data's file) changed mixed the
    stored measurements with ones of the new requests, silently: a baseline of the old
    prompt against masks of the new one."""
    import shutil

    from helpers import TASKS

    tasks = tmp_path / "tasks"
    shutil.copytree(f"{TASKS}/tiny_copy", tasks / "tiny_copy")
    yaml = tasks / "tiny_copy" / "tiny_copy.yaml"
    reference = tmp_path / "reference.txt"
    reference.write_text("the cat sat on the mat\none two three four five\n")
    out = tmp_path / "run"

    def locate(masks: int) -> int:
        return harness("locate", "--model-args",
                       f"pretrained={tiny_model_dir('llama')},dtype=float32",
                       "--include-path", str(tasks), "--tasks", "tiny_copy", "--signal",
                       "logprob", "--masks", str(masks), "--sparsity", "0.25",
                       "--num-samples", "6", "--ablation", "mean", "--ablation-data",
                       str(reference), *LASSO_ONLY, "--out", str(out))

    def measured() -> list[str]:
        return [json.loads(line)["key"] for line in
                (out / "measurements.jsonl").read_text().splitlines()]

    assert locate(3) == 0
    before = measured()
    assert len(strict_json(out / "config.json")["requests_fingerprint"]) == 64
    template = yaml.read_text()
    yaml.write_text(template.replace('doc_to_text: "{{context}}"',
                                     'doc_to_text: "Copy: {{context}}"'))
    assert locate(5) == 2
    error = last_error(capsys)
    assert str(out) in error and "other requests than those its measurements" in error
    assert measured() == before  # nothing of the new prompt was stored
    yaml.write_text(template)
    with reference.open("a") as more:
        more.write("a third reference line\n")
    assert locate(5) == 2
    error = last_error(capsys)
    assert str(out) in error and "reference examples are not those" in error
    assert measured() == before
    # The same requests and reference set as measured: the run resumes.
    reference.write_text("the cat sat on the mat\none two three four five\n")
    assert locate(5) == 0
    assert measured()[:len(before)] == before and len(measured()) == len(before) + 2


def test_a_session_stopped_by_ctrl_c_keeps_the_time_it_spent(tiny_model_dir, tmp_path,
                                                            monkeypatch, capsys):
    """A session interrupted between its phases' saves lost its time: the report of a run
    interrupted twice said 42 s of about 75. Ctrl-C writes the session's timings so far,
    and nothing else it had not saved."""
    import importlib
    import time

    locate_module = importlib.import_module("lm_eval_headloc.commands.locate")
    real = locate_module.ensure_types

    saved = []

    def slow_then_stopped(*args, **kwargs):
        saved.append(strict_json(run / "config.json")["timings"][-1]["whole"])
        time.sleep(1.5)  # time spent after the last save, before the Ctrl-C
        raise KeyboardInterrupt

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--prior", "none", "--masks", "5", "--out", str(run)]
    monkeypatch.setattr(locate_module, "ensure_types", slow_then_stopped)
    assert harness(*args) == 130
    assert last_error(capsys).endswith("interrupted; rerun the same command to continue")
    config = strict_json(run / "config.json")
    [session] = config["timings"]
    assert session["whole"] >= saved[0] + 1.5  # the time after the last phase's save
    assert "masks_used" not in config and not (run / "design_matrix.npy").exists()
    monkeypatch.setattr(locate_module, "ensure_types", real)
    assert harness(*args) == 0
    first, second = strict_json(run / "config.json")["timings"]
    assert first == session and second["whole"] > 0


def test_ctrl_c_before_the_run_folder_is_made_says_nothing_is_kept(tiny_model_dir, tmp_path,
                                                                   monkeypatch, capsys):
    """A Ctrl-C in the task checks, before the run folder existed, said "rerun the same
    command to continue": there was nothing to continue."""
    import importlib

    locate_module = importlib.import_module("lm_eval_headloc.commands.locate")

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(locate_module, "prepare", stopped)
    run = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--out", str(run)) == 130
    assert last_error(capsys).endswith(
        "interrupted; it had not started its run folder, so nothing is kept")
    assert not run.exists()


def test_a_chat_template_setting_given_as_the_run_decided_it_resumes(tiny_model_dir, tmp_path,
                                                                     capsys):
    """--apply-chat-template given to a run that left it out, whose tokenizer decided the
    same (a generation task, a model with a template), was refused as a change; what it
    asks is the run's. The other setting is a change, and is refused."""
    from helpers import with_chat_template

    model = with_chat_template(tiny_model_dir("llama"), tmp_path / "chat")
    out = tmp_path / "run"
    args = ["locate", *tiny_args(model), "--tasks", "tiny_generate", "--signal", "logprob",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", *LASSO_ONLY,
            "--out", str(out)]
    assert harness(*args) == 0
    assert json.loads((out / "config.json").read_text())["chat_template"] == {
        "tiny_generate": True}
    lines = (out / "measurements.jsonl").read_text()
    assert harness(*args, "--apply-chat-template") == 0
    assert (out / "measurements.jsonl").read_text() == lines
    assert harness(*args, "--no-apply-chat-template") == 2
    assert "apply_chat_template" in last_error(capsys)


def test_ctrl_c_in_a_forced_run_says_to_resume_without_force(tiny_model_dir, tmp_path,
                                                            monkeypatch, capsys):
    """A --force run stopped by Ctrl-C said "rerun the same command to continue": that
    command, --force and all, cleared what the run had measured and started over."""
    from lm_eval_headloc.runs.folder import RunFolder

    append = RunFolder.append_measurement

    def stopped(self, record):
        append(self, record)
        if len(self.measurements()) == 3:
            raise KeyboardInterrupt

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", *LASSO_ONLY, "--masks", "5", "--out", str(run)]
    with monkeypatch.context() as patched:
        patched.setattr(RunFolder, "append_measurement", stopped)
        assert harness(*args, "--force") == 130
    assert last_error(capsys).endswith("interrupted; rerun it without --force to continue")
    kept = (run / "measurements.jsonl").read_text().splitlines()
    assert len(kept) == 3
    assert harness(*args) == 0  # as it said: what was measured is kept
    assert (run / "measurements.jsonl").read_text().splitlines()[:3] == kept


def test_a_measurement_recorded_twice_with_other_scores_is_refused(tiny_model_dir, tmp_path,
                                                                  capsys):
    """measurements.jsonl holding a key twice with different scores (two runs' files
    mixed) was resumed, the later line silently taken over the first; reading the run
    (refit) refuses it, and so does a rerun now."""
    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", *LASSO_ONLY, "--masks", "5", "--out", str(run)]
    assert harness(*args) == 0
    log = run / "measurements.jsonl"
    other = json.loads(log.read_text().splitlines()[2])
    other["scores"] = {task: value + 1 for task, value in other["scores"].items()}
    log.write_text(log.read_text() + json.dumps(other) + "\n")
    assert harness(*args) == 2
    error = last_error(capsys)
    assert str(log.name) in error and f"holds {other['key']!r} twice" in error
