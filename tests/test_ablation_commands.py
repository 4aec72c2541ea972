"""Ablation kinds through headloc-harness: flags, run identity, verify.

Expected scores come from lm-eval itself answering with a separately built
``hf-headablate`` model (``simple_evaluate``), never from the harness's own files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import (
    TASKS,
    assert_names,
    harness,
    last_error,
    strict_json,
    tiny_args,
)

TEXTS = ["the cat sat on the mat", "Mary and John went to the store",
         "one plus two equals three", "the dog gave a drink to the cat when it sat"]


def _records(folder):
    return {r["key"]: r for r in map(json.loads,
                                     (folder / "measurements.jsonl").read_text().splitlines())}


@pytest.fixture
def reference(tmp_path):
    path = tmp_path / "reference.txt"
    path.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("kind", ["mean", "resample"])
def test_greedy_under_a_kind_scores_what_lm_eval_scores_with_that_model(
        kind, tiny_model_dir, tmp_path, reference):
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.tasks import make_task_manager

    folder = tiny_model_dir("llama")
    out = tmp_path / "run"
    # 100 samples > tiny_choice's 4 documents: every document, as simple_evaluate below.
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_choice", "--ablation", kind,
                   "--ablation-data", str(reference), "--scale", "0.25",
                   "--out", str(out)) == 0
    config = strict_json(out / "config.json")
    assert config["identity"]["ablation"] == kind and config["identity"]["scale"] == 0.25
    assert config["ablation"]["reference"] == str(reference)
    assert config["ablation"]["reference_examples"] == len(TEXTS)
    records = _records(out)
    manager = make_task_manager([TASKS])
    for heads in ("L0H1", "L1H3"):
        record = next(r for r in records.values() if r["mask"] == heads)
        lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                            ablate=heads, ablation=kind, scale=0.25,
                            ablation_data=str(reference),
                            **({"ablation_cache": str(tmp_path / "c")} if kind == "mean" else {}))
        results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice"],
                                          task_manager=manager)
        assert record["scores"]["tiny_choice"] == pytest.approx(
            results["results"]["tiny_choice"]["acc,none"])


def test_a_jsonl_field_names_the_reference_set(tiny_model_dir, tmp_path, reference):
    jsonl = tmp_path / "reference.jsonl"
    jsonl.write_text("".join(json.dumps({"text": "other words " * (i + 1), "prompt": text}) + "\n"
                             for i, text in enumerate(TEXTS)), encoding="utf-8")
    common = ["greedy", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
              "--ablation", "mean"]
    assert harness(*common, "--ablation-data", str(reference), "--out",
                   str(tmp_path / "txt")) == 0
    assert harness(*common, "--ablation-data", str(jsonl), "--ablation-field", "prompt",
                   "--out", str(tmp_path / "field")) == 0
    assert harness(*common, "--ablation-data", str(jsonl), "--out", str(tmp_path / "text")) == 0
    txt, field, text = (_records(tmp_path / name) for name in ("txt", "field", "text"))
    # The field's texts are the text file's lines: the same means, the same answers.
    assert {k: r["logprob"] for k, r in field.items()} == {k: r["logprob"] for k, r in txt.items()}
    # Without --ablation-field the JSONL's "text" is read: other means, other answers.
    assert any(abs(text[k]["logprob"]["tiny_choice"] - txt[k]["logprob"]["tiny_choice"]) > 1e-6
               for k in txt if k != "baseline")
    config = strict_json(tmp_path / "field" / "config.json")
    assert config["identity"]["ablation_field"] == "prompt"
    assert config["ablation"]["reference"] == f"{jsonl} (field 'prompt')"


def _same_with_k_masks_per_pass(args: list[str], tmp_path: Path, k: int) -> dict:
    """Run ``args`` one mask per pass (to tmp_path/one) and ``k`` per pass; assert every
    measurement agrees; the one-per-pass records."""
    assert harness(*args, "--out", str(tmp_path / "one"), "--masks-per-pass", "1") == 0
    assert harness(*args, "--out", str(tmp_path / "k"), "--masks-per-pass", str(k)) == 0
    one, shared = _records(tmp_path / "one"), _records(tmp_path / "k")
    assert one.keys() == shared.keys()
    for key in one:
        assert one[key]["scores"] == pytest.approx(shared[key]["scores"], abs=1e-5)
    return one


def test_locate_mean_by_default_on_the_runs_examples_with_k_masks_per_pass(
        tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    args = ["locate", *tiny_args(folder), "--tasks", "tiny_copy_ppl", "--masks", "12",
            "--sparsity", "0.25", "--num-samples", "6", "--ablation", "mean"]
    one = _same_with_k_masks_per_pass(args, tmp_path, 4)
    config = strict_json(tmp_path / "one" / "config.json")
    assert config["ablation"]["reference"].startswith("the run's tasks on its example subset")
    assert config["ablation"]["reference_examples"] == 6  # the subset, not every document
    means = config["ablation"]["means_file"]
    assert means.startswith(str(tmp_path / "one" / "means"))
    # report.md says what a knockout did (it said nothing: mean read as zeroed heads).
    assert ("- knockout: mean ablation: a knocked-out head's output is replaced by its mean "
            "over the reference set, the run's tasks on its example subset (--ablation mean, "
            "--scale 0)") in (tmp_path / "one" / "report.md").read_text()
    # Mean ablation is not zero ablation: the same masks score otherwise.
    assert harness(*args[:-2], "--out", str(tmp_path / "zero")) == 0
    assert ("- knockout: a knocked-out head's output is zeroed (--ablation zero, --scale 0)"
            in (tmp_path / "zero" / "report.md").read_text())
    zero = _records(tmp_path / "zero")
    assert any(abs(zero[k]["scores"]["tiny_copy_ppl"] - one[k]["scores"]["tiny_copy_ppl"])
               > 1e-4 for k in one if k != "baseline")


@pytest.mark.parametrize("design", ["stratified", "bernoulli"])
def test_resample_with_the_logprob_signal_and_k_masks_per_pass(tiny_model_dir, tmp_path,
                                                               design):
    # tiny_copy is a generation task: the logprob signal teacher-forces its answers as
    # loglikelihood requests, so K masks share a pass under resample too.
    args = ["locate", *tiny_args(tiny_model_dir("qwen2")), "--tasks", "tiny_copy",
            "--signal", "logprob", "--design", design, "--masks", "10", "--sparsity", "0.3",
            "--num-samples", "6", "--ablation", "resample"]
    one = _same_with_k_masks_per_pass(args, tmp_path, 5)
    assert len({round(r["scores"]["tiny_copy"], 6) for r in one.values()}) > 3


def test_verify_checks_heads_under_another_kind(tiny_model_dir, tmp_path, capsys):
    folder = tiny_model_dir("llama")
    run = tmp_path / "run"
    assert harness("locate", *tiny_args(folder), "--tasks", "tiny_copy_ppl", "--masks", "8",
                   "--sparsity", "0.25", "--num-samples", "5", "--out", str(run)) == 0
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_choice",
                   "--out", str(tmp_path / "zero")) == 0
    assert harness("verify", str(run), "--top-k", "2", "--general", "tiny_choice",
                   "--ablation", "mean", "--out", str(tmp_path / "mean")) == 0
    zero = strict_json(tmp_path / "zero" / "verify.json")
    mean = strict_json(tmp_path / "mean" / "verify.json")
    rows = "tiny_copy_ppl"
    assert zero["rows"][rows][1]["heads"] == mean["rows"][rows][1]["heads"]
    assert strict_json(tmp_path / "zero" / "config.json")["ablation"]["kind"] == "zero"
    config = strict_json(tmp_path / "mean" / "config.json")
    assert config["identity"]["ablation"] == "mean"
    assert config["ablation"]["reference_examples"] == 5  # the run's example subset
    assert zero["baseline"] == mean["baseline"]  # nothing knocked out: no kind at all
    assert all(abs(a["score"] - b["score"]) > 1e-6
               for a, b in zip(zero["rows"][rows], mean["rows"][rows], strict=True))


def test_verify_refuses_another_reference_set_of_the_runs_name(tiny_model_dir, tmp_path,
                                                                monkeypatch, capsys):
    """A run made with --ablation-data ref.txt (relative) verified from a folder whose
    ref.txt holds other examples: verify knocked the heads out against those, silently,
    as if they were the run's reference set. Refused; where the file is the run's, or
    verify is given its own, it measures."""
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    (here / "ref.txt").write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    (there / "ref.txt").write_text("\n".join(reversed(TEXTS[1:])) + "\n", encoding="utf-8")
    folder, run = tiny_model_dir("llama"), tmp_path / "run"
    monkeypatch.chdir(here)
    assert harness("locate", *tiny_args(folder), "--tasks", "tiny_copy_ppl", "--masks", "6",
                   "--sparsity", "0.25", "--num-samples", "4", "--ablation", "mean",
                   "--ablation-data", "ref.txt", "--confirm", "0", "--prior", "none",
                   "--out", str(run)) == 0
    verify = ["verify", str(run), "--top-k", "1", "--general", "tiny_choice",
              "--random-draws", "0", "--limit", "2"]
    monkeypatch.chdir(there)
    capsys.readouterr()
    assert harness(*verify, "--out", str(tmp_path / "v-there")) == 2
    assert_names(last_error(capsys), str(run), "--ablation-data ref.txt",
                 "not those the run was made with")
    assert not (tmp_path / "v-there" / "verify.json").exists()
    assert harness(*verify, "--ablation-data", "ref.txt",  # its own: measured as asked
                   "--out", str(tmp_path / "v-own")) == 0
    monkeypatch.chdir(here)
    assert harness(*verify, "--out", str(tmp_path / "v-here")) == 0


@pytest.mark.parametrize("extra, values", [  # the values each refusal names
    (["--ablation", "median"], ("'median'", "'zero', 'mean', 'resample'")),
    (["--scale", "inf"], ("--scale inf",)),
    (["--ablation-data", "ref.txt"], ("--ablation-data 'ref.txt'", "mean", "resample")),
    (["--ablation", "mean", "--ablation-data", "no_such_task"],
     ("--ablation-data", "ablation_data='no_such_task'")),
    (["--ablation", "resample", "--ablation-data", "ONE"],
     ("--ablation-data", "ablation=resample", "two", "has 1")),
    (["--model-args", "pretrained=x,ablation=mean"], ("--model-args ablation=", "--ablation")),
    (["--model-args", "pretrained=x,ablation_include_path=/d"],
     ("--model-args ablation_include_path=", "--include-path")),
    (["--model-args", "pretrained=x,ablation_cache=/d"],
     ("--model-args ablation_cache=", "means/")),
    (["--model-args", "pretrained=x,ablate_top=3,ablate_file=h.json"],
     ("--model-args ablate_file=", "--exclude", "--never-ablate")),  # what to use instead
    (["--model-args", "pretrained=x,ablate=L0H1"],
     ("--model-args ablate=", "--exclude", "--never-ablate")),
    (["--ablation", "mean", "--ablation-field", "body"],
     ("--ablation-field 'body'", "--ablation-data")),
    (["--ablation", "mean", "--ablation-data", "JSONL", "--ablation-field", "body"],
     ("--ablation-data", "ablation_data='JSONL'", "line 1", "'body'", "prompt, text")),
    (["--ablation", "mean", "--ablation-data", "JSONL", "--ablation-field", ""],
     ("ablation_field=''", "'text'")),
    (["--ablation", "mean", "--ablation-data", "ONE", "--ablation-field", "prompt"],
     ("ablation_field='prompt'", "JSONL", "'ONE'")),
])
@pytest.mark.usefixtures("no_model_loading")
def test_bad_ablation_flags_are_one_line_before_loading(tiny_model_dir, tmp_path, capsys,
                                                        extra, values):
    one = tmp_path / "one.txt"
    one.write_text("a single example\n", encoding="utf-8")
    jsonl = tmp_path / "ref.jsonl"
    jsonl.write_text(json.dumps({"text": "a", "prompt": "b"}) + "\n", encoding="utf-8")
    extra = [{"ONE": str(one), "JSONL": str(jsonl)}.get(arg, arg) for arg in extra]
    values = [value.replace("'JSONL'", repr(str(jsonl))).replace("'ONE'", repr(str(one)))
              for value in values]
    out = tmp_path / "run"
    for command in ("locate", "greedy"):
        code = harness(command, *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                       "--out", str(out), *extra)
        assert code == 2
        assert_names(last_error(capsys), " error: ", *values)
        assert not out.exists()


def test_sweep_cells_measure_and_record_the_kind(tiny_model_dir, tmp_path, reference):
    out = tmp_path / "sweep"
    assert harness("sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy_ppl",
                   "--masks", "6", "--sparsity", "0.25,0.5", "--num-samples", "4",
                   "--confirm", "2", "--ablation", "resample", "--ablation-data",
                   str(reference), "--out", str(out)) == 0
    for cell in ("m6-p0.25", "m6-p0.5"):
        config = strict_json(out / cell / "config.json")
        assert config["identity"]["ablation"] == "resample"
        assert config["ablation"]["reference_examples"] == len(TEXTS)
    assert strict_json(out / "config.json")["ablation"]["kind"] == "resample"
