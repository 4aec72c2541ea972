"""headloc-harness on tiny random models: every subcommand, resume, and bad arguments."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lm_eval_headloc import analyses, driver
from lm_eval_headloc.cli import main

TASKS = str(Path(__file__).parent / "tasks")


def harness(*args: str) -> int:
    return main([*args])


def tiny_args(folder) -> list[str]:
    return ["--model-args", f"pretrained={folder},dtype=float32", "--include-path", TASKS]


@pytest.fixture
def no_model_loading(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(driver, "load_model", refuse)
    monkeypatch.setattr(analyses, "load_model", refuse)


@pytest.mark.parametrize("extra, message", [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--tasks", "tiny_choice", "--sparsity", "1.5"], "--sparsity 1.5: must be strictly between"),
    (["--tasks", "tiny_choice", "--sparsity", "0"], "--sparsity 0.0: must be strictly between"),
    (["--tasks", "tiny_choice", "--masks", "0"], "argument --masks: '0' must be >= 1"),
    (["--tasks", "tiny_choice", "--top-k", "9"], "--top-k 9: the model has only 8 heads"),
    (["--tasks", "tiny_choice", "--exclude", "L29H8"], "--exclude: head L29H8 is outside"),
    (["--tasks", "tiny_choice", "--never-ablate", "L0H5"], "--never-ablate: head L0H5 is outside"),
    (["--tasks", "tiny_choice", "--design", "random"], "invalid choice: 'random'"),
    (["--tasks", "tiny_choice:bleu"], "produces no metric 'bleu,none'; it produces: acc,none"),
    (["--tasks", "tiny_unsafe"], "task 'tiny_unsafe' executes model-written code; rerun with "
                                 "--confirm-run-unsafe-code"),
])
def test_bad_arguments_fail_before_the_model_loads(tiny_model_dir, tmp_path, capsys,
                                                   no_model_loading, extra, message):
    try:
        code = harness("locate", *tiny_args(tiny_model_dir("llama")), "--out",
                       str(tmp_path / "run"), *extra)
    except SystemExit as exit_:  # argparse's own type errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_unsafe_tasks_run_only_when_confirmed(tiny_model_dir, tmp_path):
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_unsafe",
                   "--masks", "2", "--sparsity", "0.25", "--num-samples", "2",
                   "--confirm-run-unsafe-code", "--out", str(tmp_path / "run")) == 0


def read_run(folder: Path) -> tuple[list[dict], dict]:
    lines = [json.loads(x) for x in (folder / "measurements.jsonl").read_text().splitlines()]
    return lines, json.loads((folder / "heads.json").read_text())


def test_locate_writes_a_run_folder_hf_headablate_can_read(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("qwen2")
    out = tmp_path / "run"
    code = harness("locate", *tiny_args(folder), "--tasks", "tiny_copy,tiny_choice",
                   "--masks", "10", "--sparsity", "0.25", "--num-samples", "8", "--top-k", "3",
                   "--out", str(out))
    assert code == 0
    for name in ["config.json", "design_matrix.npy", "measurements.jsonl", "heads.json",
                 "heads.csv", "heads-tiny_choice.json", "heatmap.png", "report.md"]:
        assert (out / name).is_file(), name
    records, heads = read_run(out)
    design = np.load(out / "design_matrix.npy")
    assert design.shape == (10, 8) and (design.sum(axis=1) == 2).all()
    assert [r["key"] for r in records] == ["baseline"] + [f"mask-{i:04d}" for i in range(10)]
    assert set(records[1]["scores"]) == {"tiny_copy", "tiny_choice"}
    config = json.loads((out / "config.json").read_text())
    assert config["example_subset"]["tiny_copy"] == sorted(config["example_subset"]["tiny_copy"])
    assert len(config["example_subset"]["tiny_copy"]) == 8
    assert config["versions"]["lm_eval"]
    assert heads["task"] == "tiny_copy" and len(heads["heads"]) == 8
    # The masks really were applied: a mask's score matches a fresh evaluation under it.
    from lm_eval_headloc.model import HFHeadAblateLM

    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate=records[3]["mask"])
    measure = driver.open_measurement(driver.prepare(
        f"pretrained={folder},dtype=float32", ["tiny_copy"], [TASKS]), lm, 8, 0, None, False)
    assert measure([*lm.knocked_out])["tiny_copy"].value == records[3]["scores"]["tiny_copy"]
    # hf-headablate reads heads.json directly.
    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate_file=str(out / "heads.json"), ablate_top=3)
    assert [str(h) for h in lm.knocked_out] == sorted(heads["top_k"])


def test_resume_after_a_kill_equals_an_uninterrupted_run(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    args = ["locate", *tiny_args(folder), "--tasks", "tiny_copy", "--masks", "40",
            "--sparsity", "0.25", "--num-samples", "12", "--seed", "3"]
    code = ("import sys; from lm_eval_headloc.cli import main; "
            f"sys.exit(main({args!r} + sys.argv[1:]))")
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "-c", code, "--out", str(killed)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = killed / "measurements.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= 6:
            process.kill()
            break
        time.sleep(0.02)
    process.wait()
    partial = len(log.read_text().splitlines())
    assert 6 <= partial < 41, "the run was not interrupted part-way"
    assert harness(*args, "--out", str(killed)) == 0
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    resumed_records, resumed_heads = read_run(killed)
    full_records, full_heads = read_run(full)
    assert len(resumed_records) == 41
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in resumed_records]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in full_records]
    assert resumed_heads == full_heads


def test_a_folder_of_another_run_is_refused_unless_forced(tiny_model_dir, tmp_path, capsys):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out",
            str(tmp_path / "run")]
    assert harness(*args) == 0
    assert harness(*args, "--seed", "1") == 2
    assert "was made with seed=0, not 1" in capsys.readouterr().err
    assert harness(*args, "--seed", "1", "--force") == 0


def test_refit_changes_alpha_without_the_model(tiny_model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "12", "--sparsity", "0.25", "--num-samples", "12",
                   "--out", str(out)) == 0
    monkeypatch.setattr(driver, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert harness("refit", str(out), "--exclude", "L0H0+L1H3") == 0
    ranked = [h["head"] for h in json.loads((out / "heads.json").read_text())["heads"]]
    assert len(ranked) == 6 and "L0H0" not in ranked and "L1H3" not in ranked
    assert harness("refit", str(out), "--alpha", "0.5", "--top-k", "2") == 0
    config = json.loads((out / "config.json").read_text())
    heads = json.loads((out / "heads.json").read_text())
    assert config["settings"]["alpha"] == 0.5 and heads["alpha"] == 0.5
    assert len(heads["top_k"]) == 2
    assert all(h["effect"] == 0 for h in heads["heads"])  # a huge penalty zeroes everything


def test_greedy_one_shot_and_iterative(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("gpt2")
    one = tmp_path / "one"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--top-k", "3", "--out", str(one)) == 0
    records, heads = read_run(one)
    assert len(records) == 1 + 8  # baseline + every head alone
    base = records[0]["scores"]["tiny_copy"]
    drops = {r["mask"]: base - r["scores"]["tiny_copy"] for r in records[1:]}
    ranked = [h["head"] for h in heads["heads"]]
    assert ranked[0] == max(drops, key=lambda h: (drops[h], -ranked.index(h)))
    it = tmp_path / "iterative"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--rounds", "2", "--top-k", "3", "--out", str(it)) == 0
    records, heads = read_run(it)
    assert len(records) == 1 + 8 + 7
    winner = heads["winners"][0]
    assert all(r["mask"].count("+") == 1 and winner in r["mask"]
               for r in records if r["key"].startswith("round2-"))


def test_verify_universal_and_sweep(tiny_model_dir, tmp_path, capsys):
    args = tiny_args(tiny_model_dir("llama"))
    runs = []
    for task in ["tiny_choice", "tiny_copy"]:
        runs.append(tmp_path / task)
        assert harness("locate", *args, "--tasks", task, "--masks", "8", "--sparsity", "0.25",
                       "--num-samples", "4", "--out", str(runs[-1])) == 0
    assert harness("verify", str(runs[0]), "--top-k", "3", "--general", "tiny_copy") == 0
    table = json.loads((runs[0] / "verify" / "verify.json").read_text())
    rows = table["rows"]["tiny_choice"]
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert rows[2]["heads"] == json.loads((runs[0] / "heads.json").read_text())["top_k"][:3]
    base = table["baseline"]["tiny_choice"]
    assert rows[0]["task_drop"] == pytest.approx((base - rows[0]["score"]) / base)
    assert "| k | heads | score | Task drop | Gen drop | tiny_copy |" in (
        runs[0] / "verify" / "verify.md").read_text()

    universal = tmp_path / "universal.json"
    assert harness("universal", *map(str, runs), "--top-k", "8", "--min-tasks", "2",
                   "--out", str(universal)) == 0
    result = json.loads(universal.read_text())
    assert len(result["heads"]) == 8  # top-8 of 8 heads: every head is in both
    assert harness("locate", *args, "--tasks", "tiny_copy", "--masks", "4", "--sparsity", "0.25",
                   "--num-samples", "4", "--never-ablate", str(universal),
                   "--out", str(tmp_path / "x")) == 2
    assert "covers every head" in capsys.readouterr().err
    assert harness("locate", *args, "--tasks", "tiny_copy", "--masks", "6", "--sparsity", "0.25",
                   "--num-samples", "4", "--never-ablate", "L0H1+L1H2",
                   "--out", str(tmp_path / "protected")) == 0
    design = np.load(tmp_path / "protected" / "design_matrix.npy")
    assert not design[:, [1, 6]].any() and design.any(axis=0).sum() == 6

    sweep = tmp_path / "sweep"
    assert harness("sweep", *args, "--tasks", "tiny_choice", "--masks", "4,6", "--sparsity",
                   "0.2,0.4", "--num-samples", "4", "--top-k", "2", "--out", str(sweep)) == 0
    result = json.loads((sweep / "sweep.json").read_text())
    assert len(result["cells"]) == 4
    assert (sweep / "m6-p0.4" / "heads.json").is_file()
    assert result["best"]["drop"] == max(c["drop"] for c in result["cells"])
    assert "Best: --masks" in capsys.readouterr().out


def test_chat_template_goes_to_generation_tasks_when_the_model_has_one(tiny_model_dir):
    from types import SimpleNamespace

    from lm_eval_headloc.measure import HarnessMeasurement

    setup = driver.prepare(f"pretrained={tiny_model_dir('llama')},dtype=float32",
                           ["swear", "tiny_copy"], [TASKS])
    with_template = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ x }}"))
    without = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))

    def chat(lm, override=None):
        return HarnessMeasurement(lm, setup.tasks, setup.loaded, num_samples=2,
                                  apply_chat_template=override).chat_template

    assert chat(with_template) == {"swear": True, "tiny_copy": False}
    assert chat(without) == {"swear": False, "tiny_copy": False}
    assert chat(with_template, override=False) == {"swear": False, "tiny_copy": False}
    assert chat(without, override=True) == {"swear": True, "tiny_copy": True}
