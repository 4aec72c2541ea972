"""headloc-harness locate on tiny random models: the run folder it writes (and
hf-headablate reads), its default budget, its options (--design-seed, --masks auto,
--masks-per-pass, --num-samples, tags, unsafe tasks), tasks that cannot load, and the
stability and fit its report states."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    LASSO_ONLY,
    TASKS,
    assert_names,
    harness,
    last_error,
    measurement_lines,
    read_run,
    strict_json,
    tiny_args,
)

from lm_eval_headloc.runs import plan
from lm_eval_headloc.runs import setup as engine
from lm_eval_headloc.runs.spec import RunSpec


def test_a_fit_that_tells_no_heads_apart_says_so(tiny_model_dir, tmp_path, capsys):
    """Two masks that knock out the same heads' complements: every head in mask 0 has the
    same evidence as every other, so the ranking is ties, not an order."""
    out = tmp_path / "flat"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "2", "--sparsity", "0.5", "--num-samples", "4", "--top-k", "3",
                   "--prior", "none", "--confirm", "0", "--out", str(out)) == 0
    heads = strict_json(out / "heads.json")
    design = np.load(out / "design_matrix.npy")
    records = {r["key"]: r for r in read_run(out)[0]}
    y = [records[f"mask-{i:04d}"]["scores"]["tiny_copy"] for i in range(2)]
    entries = heads["heads"]
    # By hand: with every effect 0 a head's evidence is its contrast, the score of the
    # mask that knocks it out minus the other's (each head is in exactly one mask).
    assert all(e["effect"] == 0 for e in entries)

    def contrast(entry):
        row = int(np.flatnonzero(design[:, entry["layer"] * 4 + entry["head_in_layer"]])[0])
        return y[row] - y[1 - row]

    for above, below in zip(entries, entries[1:], strict=False):
        assert below["tied_with_above"] == (contrast(above) == contrast(below))
    report = (out / "report.md").read_text()
    printed = capsys.readouterr().out
    if y[0] == y[1]:  # nothing tells any head apart
        assert "No head stands out" in report and "no head stands out" in printed
        assert "1. L0H0" not in printed
    else:  # two groups of four: the top-3 all come from the more harmful mask
        assert "Tied (the same evidence" in report


def test_locate_writes_a_run_folder_hf_headablate_can_read(tiny_model_dir, tmp_path, capsys,
                                                           caplog):
    folder = tiny_model_dir("qwen2")
    out = tmp_path / "run"
    code = harness("locate", *tiny_args(folder), "--tasks", "tiny_copy,tiny_choice",
                   "--masks", "10", "--sparsity", "0.25", "--num-samples", "8", "--top-k", "3",
                   "--out", str(out))
    assert code == 0
    # Two tasks: heads.json, what ablate_file= reads, is said to be the first one's.
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == (
        f"Results in {out}/ (report.md, heatmap.png, heads-<task>.json for each task; "
        "heads.json is tiny_copy's)")
    assert printed[-1].startswith("Time: ")  # where the time went, last
    # The automatic masks per pass (one on a CPU for log-likelihoods), as recorded.
    assert printed[-3] == "Masks per pass: 1 (automatic; --masks-per-pass sets it)"
    assert strict_json(out / "config.json")["masks_per_pass"] == 1
    for name in ["config.json", "design_matrix.npy", "measurements.jsonl", "heads.json",
                 "heads.csv", "heads-tiny_choice.json", "heatmap.png", "report.md"]:
        assert (out / name).is_file(), name
    records, heads = read_run(out)
    design = np.load(out / "design_matrix.npy")
    assert design.shape == (10, 8) and (design.sum(axis=1) == 2).all()
    # The defaults confirm up to 25 heads: all 8 of this model, each alone, after the masks.
    confirmed = strict_json(out / "config.json")["confirm"]["heads"]
    assert sorted(confirmed) == [f"L{i // 4}H{i % 4}" for i in range(8)]
    assert [r["key"] for r in records] == ["baseline"] + [f"mask-{i:04d}" for i in range(10)] \
        + [f"alone-{h}" for h in confirmed]
    assert all(r["mask"] == r["key"][len("alone-"):] for r in records[11:])
    # Each record's mask is its design row.
    for row, record in zip(design, records[1:11], strict=True):
        assert record["mask"] == "+".join(f"L{i // 4}H{i % 4}" for i in np.flatnonzero(row))
    assert set(records[1]["scores"]) == {"tiny_copy", "tiny_choice"}
    config = strict_json(out / "config.json")
    assert config["example_subset"]["tiny_copy"] == sorted(config["example_subset"]["tiny_copy"])
    assert len(config["example_subset"]["tiny_copy"]) == 8
    assert config["versions"]["lm_eval"]
    assert heads["task"] == "tiny_copy" and len(heads["heads"]) == 8
    assert all(h["head"] == f"L{h['layer']}H{h['head_in_layer']}" for h in heads["heads"])
    assert heads["heads_per_layer"] == 4
    # The masks really were applied: a mask's score matches a fresh evaluation under it.
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate=records[3]["mask"])
    setup = engine.prepare(RunSpec(model_args=f"pretrained={folder},dtype=float32",
                                   tasks=("tiny_copy",), include_path=(TASKS,)))
    measure = plan.open_measurement(setup, lm, num_samples=8)
    assert measure([*lm.knocked_out])["tiny_copy"].value == records[3]["scores"]["tiny_copy"]
    # hf-headablate reads heads.json directly, and says what it took from it.
    caplog.set_level("INFO", logger="lm_eval.models.hf_headablate")
    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate_file=str(out / "heads.json"), ablate_top=3)
    assert [str(h) for h in lm.knocked_out] == sorted(heads["top_k"])
    # A top head the ranking records as doing no harm (effect >= 0) is said to be one.
    harmless = [e["head"] for e in heads["heads"][:3]
                if e["effect"] is not None and e["effect"] >= 0]
    assert (f"knocking out {'+'.join(heads['top_k'])}: the top 3 of {out / 'heads.json'} "
            "(ranked for task tiny_copy)"
            + (f"; of them {'+'.join(harmless)} did not hurt the task in the run (its "
               "ranking records no harm)" if harmless else "")) in caplog.messages
    # Without ablate_top, the run's own top-k (3), not all 8 heads it ranks.
    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate_file=str(out / "heads.json"))
    assert [str(h) for h in lm.knocked_out] == sorted(heads["top_k"])


def test_num_samples_beyond_a_task_is_recorded_and_said(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "2", "--sparsity", "0.25", "--num-samples", "50",
                   "--out", str(out)) == 0
    from lm_eval_headloc.tasks import make_task_manager

    loaded = make_task_manager([TASKS]).load(["tiny_choice"])
    docs = len(loaded["tasks"]["tiny_choice"].eval_docs)
    config = strict_json(out / "config.json")
    assert config["examples_used"] == {"tiny_choice": docs} and docs < 50
    assert f"tiny_choice has only {docs} documents; all {docs} are used" in \
        capsys.readouterr().err
    assert f"used tiny_choice {docs}" in (out / "report.md").read_text()


def test_the_default_budget_is_split_by_whether_the_run_has_a_prior(tiny_model_dir, tmp_path):
    """--masks and --confirm left out: 54 measurement-equivalents, 8 for atp-path's prior
    then 12 masks + 34 alone; without a prior (--prior none, or auto on a task without gold
    answers) 27 masks + 27 alone. The tiny model has 8 heads, so every head is measured
    alone either way. (`--group-tests 0`, which changes nothing on 8 heads all measured
    alone, keeps the default plan: with no budget option given a model this small
    measures every head alone after 2 masks instead, test_confirm checks.)"""
    common = [*tiny_args(tiny_model_dir("llama")), "--sparsity", "0.25", "--num-samples", "4",
              "--group-tests", "0"]
    runs = {"prior": ["--tasks", "tiny_choice"],
            "none": ["--tasks", "tiny_choice", "--prior", "none"],
            "auto-none": ["--tasks", "tiny_rolling"]}
    for name, args in runs.items():
        assert harness("locate", *common, *args, "--out", str(tmp_path / name)) == 0
    expected = {"prior": (12, 34, True), "none": (27, 27, False), "auto-none": (27, 27, False)}
    for name, (masks, confirm, prior) in expected.items():
        out = tmp_path / name
        config = strict_json(out / "config.json")
        assert (config["spec"]["masks"], config["spec"]["confirm"]) == (masks, confirm), name
        assert (config["settings"]["masks"], config["settings"]["confirm"]) == (masks, confirm)
        assert config["prior_used"] is prior
        assert np.load(out / "design_matrix.npy").shape == (masks, 8)
        assert len(config["confirm"]["heads"]) == 8  # all 8 heads: fewer than either
        keys = [r["key"] for r in read_run(out)[0]]
        assert sum(k.startswith("mask-") for k in keys) == masks
        report = (out / "report.md").read_text()
        assert f"stratified, {masks} masks" in report
        # Who named the heads measured alone: the prior's rankings only where there is one.
        named = ("the attribution prior's rankings and the masks' fit's likeliest in turn ("
                 if prior else "in 2 rounds of 5 (the last of 3), the masks' fit's likeliest"
                                " (the fit")  # 8 heads: 5 + 3
        assert named in report and "the the" not in report


def test_a_task_of_the_users_that_cannot_load_gets_no_hint_about_the_hub(tiny_model_dir,
                                                                         tmp_path, capsys,
                                                                         no_model_loading):
    """The Hub hint is for lm-eval's built-in tasks: a YAML of the user's whose data file
    is missing is about that file."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path / 'missing.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(folder), "--tasks", "mine", "--out", str(tmp_path / "run")) == 2
    message = last_error(capsys)
    assert "'mine'" in message and "Hugging Face Hub" not in message


@pytest.mark.parametrize("data", ["empty", "zero rows"])
def test_a_task_without_documents_is_one_line(tiny_model_dir, tmp_path, capsys,
                                              no_model_loading, data):
    """An empty data file: lm-eval's loader raised a StopIteration, which has no message,
    and the error's own formatting then failed (IndexError). A loader that gives zero rows
    loads; either way the task has no documents to measure."""
    folder = tmp_path / "mine"
    folder.mkdir()
    if data == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        source = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                  f"{tmp_path / 'empty.jsonl'}\n")
    else:
        (folder / "utils.py").write_text(
            "import datasets\n\ndef load_docs(**kwargs):\n    return datasets.DatasetDict("
            "{'test': datasets.Dataset.from_dict({'q': [], 'a': []})})\n")
        source = "custom_dataset: !function utils.load_docs\n"
    (folder / "mine.yaml").write_text(
        f"task: mine\n{source}test_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(folder), "--tasks", "mine", "--out", str(tmp_path / "run")) == 2
    assert (line := last_error(capsys)).startswith("headloc-harness: error: ") and "'mine'" in line
    # The same task as mean ablation's reference set.
    from lm_eval_headloc.intervention.ablation import AblationError, reference_texts
    from lm_eval_headloc.tasks import make_task_manager

    with pytest.raises(AblationError, match="ablation_data='mine'"):
        reference_texts("mine", task_manager=make_task_manager([str(folder)]))


def test_unsafe_tasks_run_only_when_confirmed(tiny_model_dir, tmp_path):
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_unsafe",
                   "--masks", "2", "--sparsity", "0.25", "--num-samples", "2",
                   "--confirm-run-unsafe-code", "--out", str(tmp_path / "run")) == 0


def test_every_locate_run_carries_per_head_stability(tiny_locate_run, tmp_path,
                                                      no_model_loading):
    import csv
    import shutil

    from lm_eval_headloc.method.lasso import HeadLasso, bootstrap_stability

    out = shutil.copytree(tiny_locate_run, tmp_path / "run")
    heads = strict_json(out / "heads.json")
    assert heads["bootstrap"]["resamples"] == 200
    # The files hold the bootstrap of the stored measurements (the run's seed).
    design = np.load(out / "design_matrix.npy")
    records = {r["key"]: r for r in read_run(out)[0]}
    scores = [records[f"mask-{i:04d}"]["scores"]["tiny_choice"] for i in range(len(design))]
    expected = bootstrap_stability(HeadLasso(alpha=0.01), design, scores, 3, resamples=200,
                                   seed=0)
    by_head = {h["head"]: h for h in heads["heads"]}
    for flat in range(8):
        entry = by_head[f"L{flat // 4}H{flat % 4}"]
        assert entry["selected"] == pytest.approx(expected.selected[flat])
        assert entry["effect_interval"] == pytest.approx([expected.low[flat],
                                                          expected.high[flat]])
    # Every refit puts at most top-k (3) heads in its top-k.
    assert 0 < sum(h["selected"] for h in heads["heads"]) <= 3
    with open(out / "heads.csv") as f:
        rows = {row["head"]: row for row in csv.DictReader(f)}
    assert all(float(rows[h]["selected"]) == pytest.approx(by_head[h]["selected"])
               for h in by_head)
    assert "bootstrap refits" in (out / "report.md").read_text()
    # refit recomputes it with its own number of resamples.
    assert harness("refit", str(out), "--bootstrap", "20") == 0
    refitted = strict_json(out / "heads.json")
    assert refitted["bootstrap"]["resamples"] == 20
    assert strict_json(out / "config.json")["settings"]["bootstrap"] == 20
    assert harness("refit", str(out), "--bootstrap", "0") == 2


def test_design_seed_draws_other_masks_on_the_same_examples(tiny_model_dir, tmp_path):
    from lm_eval_headloc.method.designs import design_matrix

    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "6", "--sparsity", "0.25", "--num-samples", "5", "--seed", "1"]
    assert harness(*args, "--out", str(tmp_path / "a")) == 0
    assert harness(*args, "--design-seed", "9", "--out", str(tmp_path / "b")) == 0
    config_a, config_b = (strict_json(tmp_path / f / "config.json") for f in "ab")
    assert config_a["example_subset"] == config_b["example_subset"]
    np.testing.assert_array_equal(np.load(tmp_path / "a" / "design_matrix.npy"),
                                  design_matrix("stratified", 6, 8, 0.25, 1))
    np.testing.assert_array_equal(np.load(tmp_path / "b" / "design_matrix.npy"),
                                  design_matrix("stratified", 6, 8, 0.25, 9))


def test_masks_auto_stops_at_the_first_stable_round(tiny_model_dir, tmp_path):
    from lm_eval_headloc.method.locate_loop import auto_rounds

    assert auto_rounds(100) == [20, 30, 40, 50, 62, 77, 96, 100]
    assert auto_rounds(7) == [7]
    out = tmp_path / "auto"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--sparsity", "0.25", "--num-samples", "12", "--top-k", "1",
                   "--bootstrap", "50", "--masks", "auto", "--max-masks", "60", *LASSO_ONLY,
                   "--out", str(out)) == 0
    used = strict_json(out / "config.json")["masks_used"]
    records, heads = read_run(out)
    assert used in auto_rounds(60) and len(records) == used + 1
    assert heads["measurements"] == used

    def settled(heads) -> bool:  # every top-k head in the top-k, hurting, in 90 % of refits
        return all(h["selected"] >= heads["bootstrap"]["stable_at"] for h in heads["heads"][:1])

    assert settled(heads) or used == 60
    # One round earlier (refit on fewer masks: an independent look) it was not settled.
    earlier = auto_rounds(60)[auto_rounds(60).index(used) - 1] if used > 20 else None
    if earlier is not None:
        assert harness("refit", str(out), "--masks", str(earlier)) == 0
        assert not settled(strict_json(out / "heads.json"))


def test_masks_auto_stopped_by_max_masks_is_not_said_stable(tiny_model_dir, tmp_path):
    """A --masks auto run that reached --max-masks with a top-k head unstable was said to
    have "measured until every top-k head was stable"."""
    out = tmp_path / "auto"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--signal", "logprob", "--sparsity", "0.25", "--num-samples", "12",
                   "--bootstrap", "20", "--masks", "auto", "--max-masks", "20", *LASSO_ONLY,
                   "--out", str(out)) == 0
    assert strict_json(out / "config.json")["masks_used"] == 20
    heads = strict_json(out / "heads.json")
    assert not all(h["selected"] >= heads["bootstrap"]["stable_at"]
                   for h in heads["heads"][:5])
    report = (out / "report.md").read_text()
    assert "measured until every top-k head was stable" not in report
    assert "20 masks (--masks auto: stopped at --max-masks 20" in report


@pytest.mark.parametrize("options", [
    ["--signal", "logprob"],
    ["--masks", "auto", "--max-masks", "30", "--top-k", "2"],
    ["--sparsity", "auto", "--masks", "14"],
    ["--prior", "atp", "--signal", "logprob", "--design-seed", "5"],
])
def test_new_options_give_equal_results_with_k_masks_per_pass_and_refit(
        tiny_model_dir, tmp_path, options):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy,tiny_choice",
            "--masks", "12", "--sparsity", "0.25", "--num-samples", "6", "--bootstrap", "30",
            *options]
    one, three = tmp_path / "one", tmp_path / "three"
    assert harness(*args, "--masks-per-pass", "1", "--out", str(one)) == 0
    assert harness(*args, "--masks-per-pass", "3", "--out", str(three)) == 0
    records_one, heads_one = read_run(one)
    records_three, heads_three = read_run(three)
    assert [r["key"] for r in records_one] == [r["key"] for r in records_three]
    for a, b in zip(records_one, records_three, strict=True):
        assert a["mask"] == b["mask"]
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-9)
    assert [h["head"] for h in heads_one["heads"]] == [h["head"] for h in heads_three["heads"]]
    # refit with the run's own settings writes the same ranking and stability.
    assert harness("refit", str(three)) == 0
    assert strict_json(three / "heads.json") == heads_three


def test_a_tag_is_the_mean_of_its_tasks(tiny_model_dir, tmp_path):
    # --tasks headloc (a tag of the three headloc_* tasks) failed after the model loaded:
    # lm-eval 0.4.13 no longer dumps a task's tags into the results.
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--num-samples", "3", "--masks",
            "2", "--sparsity", "0.25", *LASSO_ONLY]
    assert harness(*args, "--tasks", "headloc", "--out", str(tmp_path / "tag")) == 0
    assert harness(*args, "--tasks", "headloc_induction,headloc_ioi,headloc_arith",
                   "--out", str(tmp_path / "each")) == 0
    tag, each = (measurement_lines(tmp_path / name)[0] for name in ("tag", "each"))
    assert tag["metrics"] == {"headloc": "acc,none"}
    assert tag["scores"]["headloc"] == pytest.approx(sum(each["scores"].values()) / 3)


def test_a_tag_whose_tasks_score_by_different_metrics_is_refused_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_loading):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, metric, aggregation, higher in (("mixed_acc", "acc", "mean", "true"),
                                              ("mixed_ppl", "perplexity", "perplexity",
                                               "false")):
        (tasks / f"{name}.yaml").write_text(
            f"include: {TASKS}/tiny_copy/tiny_copy.yaml\ntask: {name}\ntag: mixed\n"
            f"metric_list:\n  - metric: {metric}\n    aggregation: {aggregation}\n"
            f"    higher_is_better: {higher}\n")
    (tasks / "group.yaml").write_text("group: mixed_group\ntask: [mixed_acc, mixed_ppl]\n")
    (tasks / "nested.yaml").write_text("group: nested_group\ntask: [mixed_group]\n")
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks", "mixed",
                   "--out", str(tmp_path / "run")) == 2
    line = last_error(capsys)  # names the task, each task's metric and the way to choose one
    # No metric is produced by both: naming the tasks is the way, not mixed:METRIC (which
    # no metric would pass).
    assert all(value in line for value in ("'mixed'", "mixed_acc: acc,none",
                                           "mixed_ppl: perplexity,none", "no metric in common",
                                           "--tasks mixed_acc,mixed_ppl")), line
    assert "mixed:METRIC" not in line
    # A metric only one of them produces: the tag's mean has no value of the other, which
    # was found after the model loaded and measured.
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks",
                   "mixed:acc", "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "--tasks mixed:acc,none", "mixed_ppl", "no metric in common")
    assert not (tmp_path / "run").exists()
    # A group that aggregates nothing has no score of its own either: the same, before the
    # load, not after the first measurement.
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks",
                   "mixed_group", "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "'mixed_group'", "mixed_ppl: perplexity,none",
                 "no metric in common")
    # Nor has a group whose subgroup aggregates nothing: its score is the mean of the
    # subgroup's mean of its tasks.
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks",
                   "nested_group", "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "'nested_group'", "mixed_ppl: perplexity,none",
                 "no metric in common", "--tasks mixed_acc,mixed_ppl")
    assert not (tmp_path / "run").exists()
    # Where the tasks share a metric, it is what is offered.
    (tasks / "mixed_ppl.yaml").write_text(
        f"include: {TASKS}/tiny_copy/tiny_copy.yaml\ntask: mixed_ppl\ntag: mixed\n"
        "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks", "mixed",
                   "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "give one they all produce (mixed:acc,none)")
