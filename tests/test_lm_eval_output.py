"""A knockout's results written as lm-eval writes its own (``lm_eval_output``), read
back with lm-eval's own readers: ``lm_eval.utils``' file-name functions, which its Hub
logger lists a results folder with, and ``datasets.load_dataset("json", …)``, which it
loads a results file (and a Hub details dataset) with."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from helpers import TASKS, assert_names, load_lm, raises_naming

from lm_eval_headloc.intervention.ablation import reference_texts
from lm_eval_headloc.measurement.lm_eval_output import (
    HASH_DIGITS,
    MAX_LISTED,
    evaluate_knockout,
    knockout_model_args,
    knockout_model_name,
    save_lm_eval_results,
)

TASK = "tiny_copy_ppl"  # 12 documents; perplexity moves with every knockout
KNOCKOUT = "L1H2+L0H1"  # written out of order: names and arguments sort it
SORTED = "L0H1+L1H2"
METRIC = "perplexity,none"
# What the issue lists, and lm-eval's result_schema.EvalResults says a saved run holds.
RESULT_KEYS = {"results", "configs", "versions", "n-shot", "higher_is_better", "n-samples",
               "config"}
# lm-eval's date_id: datetime.now().isoformat() with ':' made '-'.
DATE = r"\d{4}-\d{2}-\d{2}T\d{2}-\d{2}-\d{2}(\.\d{6})?"


def _model_args(model_dir: Path) -> dict:
    return {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"}


def _files(folder: Path) -> list[str]:
    """Every file under ``folder``, as the paths lm-eval's readers are given."""
    return sorted(str(p) for p in folder.rglob("*") if p.is_file())


def _load_json(path: str | Path, cache: Path):
    """A results or samples file as lm-eval's Hub logger loads one."""
    from datasets import load_dataset

    return load_dataset("json", data_files=str(path), split="train", cache_dir=str(cache))


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def lm(model_dir):
    return load_lm(model_dir, batch_size=12)


@pytest.fixture(scope="module")
def knockout(lm, model_dir, task_manager):
    """The knockout evaluated once, with its samples."""
    return evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out=KNOCKOUT,
                             log_samples=True, model_args=_model_args(model_dir),
                             bootstrap_iters=0)


@pytest.fixture(scope="module")
def plain_hf(model_dir, task_manager, tmp_path_factory):
    """The plain model as lm-eval's CLI evaluates and saves it (``_cli/run.py``'s calls,
    in order, with ``--model hf --output_path OUT --log_samples``): the layout to match."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    out = tmp_path_factory.mktemp("plain-hf")
    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(
        model="hf", model_args={**_model_args(model_dir), "batch_size": 12}, tasks=[TASK],
        task_manager=task_manager, log_samples=True, evaluation_tracker=tracker,
        bootstrap_iters=0)
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for task_name in results["configs"]:
        tracker.save_results_samples(task_name=task_name, samples=samples[task_name])
    return out, results


# --- the files, read back ------------------------------------------------------------------

def test_saved_knockout_reads_back_with_lm_eval_readers(knockout, model_dir, tmp_path):
    from lm_eval.utils import (
        get_file_datetime,
        get_file_task_name,
        get_latest_filename,
        get_results_filenames,
        get_sample_results_filenames,
        handle_non_serializable,
        sanitize_model_name,
    )

    before = json.dumps(knockout, default=handle_non_serializable, sort_keys=True)
    out = tmp_path / "out"
    saving = time.time()
    path = save_lm_eval_results(knockout, out, log_samples=True)
    # The results dict is the caller's still (the tracker adds its fields to what it gets).
    assert json.dumps(knockout, default=handle_non_serializable, sort_keys=True) == before

    files = _files(out)
    assert get_results_filenames(files) == [str(path)]
    assert get_latest_filename(get_results_filenames(files)) == str(path)
    [samples_file] = get_sample_results_filenames(files)
    assert len(files) == 2
    assert get_file_task_name(Path(samples_file).name) == TASK
    date = get_file_datetime(Path(samples_file).name)
    assert re.fullmatch(DATE, date)
    # One folder per model, named by lm-eval's sanitization of the knockout's name.
    name = f"{model_dir},ablate={SORTED}"
    assert path.parent == Path(samples_file).parent == out / sanitize_model_name(name)
    assert path.name == f"results_{date}.json"

    saved = json.loads(path.read_text(encoding="utf-8"))
    assert RESULT_KEYS <= set(saved)
    expected = json.loads(json.dumps(knockout["results"], default=handle_non_serializable))
    assert saved["results"][TASK] == expected[TASK]
    assert saved["model_name"] == name and saved["model_source"] == "hf-headablate"
    assert saved["model_name_sanitized"] == path.parent.name
    assert saved["config"]["model"] == "hf-headablate"
    assert saved["config"]["model_args"] == {**_model_args(model_dir), "ablate": SORTED}
    assert saved["config"]["ablate"] == SORTED  # the model's own account of its knockout
    assert saved["n-samples"][TASK] == {"original": 12, "effective": 12}
    assert "samples" not in saved and set(saved["task_hashes"]) == {TASK}
    # The evaluation's time, from simple_evaluate's start ("date"), not the save's.
    assert float(saved["total_evaluation_time_seconds"]) >= saving - knockout["date"] > 0

    # As lm-eval's Hub logger reads the newest results: a one-row dataset.
    loaded = _load_json(path, tmp_path / "cache")
    assert loaded.num_rows == 1
    assert loaded["results"][0][TASK][METRIC] == pytest.approx(
        knockout["results"][TASK][METRIC], rel=1e-12)
    assert loaded["model_name"][0] == name

    lines = [json.loads(line) for line in Path(samples_file).read_text().splitlines()]
    assert sorted(line["doc_id"] for line in lines) == list(range(12))  # one per document
    by_id = {s["doc_id"]: s for s in knockout["samples"][TASK]}
    for line in lines:
        assert line["doc"] == by_id[line["doc_id"]]["doc"]
        assert line["doc_hash"] == by_id[line["doc_id"]]["doc_hash"]
        assert set(line["arguments"]) == {"gen_args_0"}  # lm-eval's sanitized form
    assert _load_json(samples_file, tmp_path / "cache").num_rows == 12


def test_layout_and_keys_match_a_plain_hf_evaluation(knockout, plain_hf, model_dir, tmp_path):
    from lm_eval.utils import get_results_filenames, get_sample_results_filenames

    plain_out, plain_results = plain_hf
    out = tmp_path / "out"
    path = save_lm_eval_results(knockout, out, log_samples=True)
    [plain_path] = get_results_filenames(_files(plain_out))
    [plain_samples] = get_sample_results_filenames(_files(plain_out))
    [samples] = get_sample_results_filenames(_files(out))
    rel = [Path(p).relative_to(base).parts for p, base in
           ((plain_path, plain_out), (plain_samples, plain_out), (path, out),
            (samples, out))]
    # <model folder>/results_<date>.json and <model folder>/samples_<task>_<date>.jsonl
    for parts, pattern in zip(rel, [f"results_{DATE}.json", f"samples_{TASK}_{DATE}.jsonl"] * 2,
                              strict=True):
        assert len(parts) == 2 and re.fullmatch(pattern, parts[1]), parts
    plain_folder, folder = rel[0][0], rel[2][0]
    assert folder == f"{plain_folder},ablate={SORTED}"  # the plain model's, plus the knockout

    plain, ours = (json.loads(Path(p).read_text()) for p in (plain_path, path))
    assert set(ours) == set(plain)
    assert set(plain["config"]) <= set(ours["config"])
    assert plain["model_name"] == str(model_dir) and plain["model_source"] == "hf"
    for key in ("configs", "versions", "n-shot", "higher_is_better", "n-samples"):
        assert ours[key] == plain[key], key
    assert set(ours["results"][TASK]) == set(plain["results"][TASK])
    plain_line, line = (json.loads(Path(p).read_text().splitlines()[0])
                        for p in (plain_samples, samples))
    assert set(line) == set(plain_line)
    # The knockout changed the model's answers: the score is not the plain model's.
    assert ours["results"][TASK][METRIC] != pytest.approx(
        plain_results["results"][TASK][METRIC])


def test_saves_never_replace_files(knockout, lm, model_dir, task_manager, tmp_path):
    from lm_eval.utils import get_latest_filename, get_results_filenames

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    other = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="L1H3",
                              model_args=_model_args(model_dir), bootstrap_iters=0)
    first = save_lm_eval_results(knockout, out, log_samples=True)
    first_text = first.read_text()
    second = save_lm_eval_results(other, out)
    again = save_lm_eval_results(knockout, out, log_samples=True)

    assert first.parent != second.parent  # two knockouts, two folders
    assert second.parent.name.endswith(",ablate=L1H3")
    assert again.parent == first.parent and again != first  # a newer file beside it
    assert first.read_text() == first_text and (out / "notes.txt").read_text() == "mine"
    assert get_latest_filename(get_results_filenames(_files(first.parent))) == str(again)
    assert sorted(p.name.split("_")[0] for p in first.parent.iterdir()) == \
        ["results", "results", "samples", "samples"]
    assert [p.name.split("_")[0] for p in second.parent.iterdir()] == ["results"]
    assert json.loads(second.read_text())["config"]["ablate"] == "L1H3"
    # The model is as it was: nothing stays knocked out after an evaluation.
    assert lm.knocked_out == () and lm.scale == 0.0


def test_saved_score_equals_an_independent_evaluation(knockout, model_dir, task_manager,
                                                      tmp_path):
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    path = save_lm_eval_results(knockout, tmp_path / "out")
    separate = HFHeadAblateLM(pretrained=str(model_dir), ablate=SORTED, dtype="float32",
                              device="cpu", batch_size=12)
    alone = lm_eval.simple_evaluate(model=separate, tasks=[TASK], task_manager=task_manager,
                                    bootstrap_iters=0, log_samples=False)
    saved = json.loads(path.read_text())
    assert saved["results"][TASK][METRIC] == pytest.approx(alone["results"][TASK][METRIC],
                                                           rel=1e-9)


def test_scale_is_named_and_applied(lm, model_dir, task_manager, tmp_path):
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    results = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="L0H1",
                                scale=2, model_args=_model_args(model_dir), limit=4,
                                bootstrap_iters=0)
    assert lm.scale == 0.0  # the model's own scale again
    path = save_lm_eval_results(results, tmp_path / "out.json")  # lm-eval's file form
    assert re.fullmatch(f"out_{DATE}.json", path.name) and path.parent == tmp_path
    saved = json.loads(path.read_text())
    assert saved["model_name"] == f"{model_dir},ablate=L0H1,scale=2"
    assert saved["config"]["model_args"]["scale"] == 2 and saved["config"]["scale"] == 2.0
    separate = HFHeadAblateLM(pretrained=str(model_dir), ablate="L0H1", scale=2,
                              dtype="float32", device="cpu", batch_size=12)
    alone = lm_eval.simple_evaluate(model=separate, tasks=[TASK], task_manager=task_manager,
                                    bootstrap_iters=0, log_samples=False, limit=4)
    assert saved["results"][TASK][METRIC] == pytest.approx(alone["results"][TASK][METRIC],
                                                           rel=1e-9)


def test_refusals_write_nothing(knockout, tmp_path):
    no_samples = {k: v for k, v in knockout.items() if k != "samples"}
    with pytest.raises(ValueError, match="no samples"):
        save_lm_eval_results(no_samples, tmp_path / "out", log_samples=True)
    assert not (tmp_path / "out").exists()
    blocker = tmp_path / "file"
    blocker.write_text("")
    # lm-eval's tracker only logs a failed write; the caller hears of it.
    with raises_naming(OSError, str(blocker / "out")):
        save_lm_eval_results(knockout, blocker / "out")


# --- names -----------------------------------------------------------------------------

def test_names_say_what_was_knocked_out():
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.utils import sanitize_model_name

    args = "pretrained=EleutherAI/pythia-14m,dtype=float32"
    assert knockout_model_name(args, "L3H2+L0H1+L0H1") == "EleutherAI/pythia-14m,ablate=L0H1+L3H2"
    assert knockout_model_name(args, ["L3H2", "L0H1"]) == "EleutherAI/pythia-14m,ablate=L0H1+L3H2"
    assert knockout_model_name(args, "L3N5+L0H1") == "EleutherAI/pythia-14m,ablate=L0H1+L3N5"
    assert knockout_model_name(args, "L3N5", scale=2) == "EleutherAI/pythia-14m,ablate=L3N5,scale=2"
    assert knockout_model_name(args, "L3N5", 0.5).endswith(",scale=0.5")
    assert knockout_model_name(args + ",scale=2", "L1H0").endswith("ablate=L1H0,scale=2")
    assert knockout_model_name(args + ",scale=2", "L1H0", scale=0).endswith("ablate=L1H0")
    assert knockout_model_name(args + ",ablation=mean", "L1H0") == \
        "EleutherAI/pythia-14m,ablate=L1H0,ablation=mean"
    assert knockout_model_name(args, "L2H*") == "EleutherAI/pythia-14m,ablate=L2H*"
    # An ablate= in the arguments is replaced by the knockout's.
    assert knockout_model_name(args + ",ablate=L9H9", "L0H0") == \
        "EleutherAI/pythia-14m,ablate=L0H0"
    # The model part is lm-eval's own name for the arguments (peft before pretrained) …
    peft = "pretrained=base/model,peft=me/adapter"
    assert knockout_model_name(peft, "L0H0") == "me/adapter,ablate=L0H0"
    # … and with nothing knocked out it says so: the plain model's own name (lm-eval's for
    # `--model hf` of the same arguments) would file this evaluation in that run's folder.
    tracker = GeneralConfigTracker()
    tracker.log_experiment_args(model_source="hf", model_args=args, system_instruction=None,
                                chat_template=None, fewshot_as_multiturn=False)
    assert knockout_model_name(args, []) == knockout_model_name(args, "") == \
        f"{tracker.model_name},ablate=none"
    assert knockout_model_name(args + ",scale=2,ablation=mean", "") == \
        f"{tracker.model_name},ablate=none"  # nothing knocked out: no kind, no scale
    assert sanitize_model_name(knockout_model_name(args, "L0H1")) == \
        "EleutherAI__pythia-14m,ablate=L0H1"


def test_long_lists_are_shortened_with_a_stable_hash():
    from lm_eval.utils import sanitize_model_name

    args = {"pretrained": "org/model"}
    neurons = [f"L{layer}N{n}" for layer in (0, 3) for n in range(0, 400, 3)]
    whole = "+".join(neurons)  # already in parse order: layer, then index
    name = knockout_model_name(args, list(reversed(neurons)))
    digest = hashlib.sha256(whole.encode()).hexdigest()[:HASH_DIGITS]
    listed = name.removeprefix("org/model,ablate=")
    assert len(listed) <= MAX_LISTED and listed.endswith(f"more-{digest}")
    shown, tail = listed.rsplit("+", 1)
    count = int(tail.split("more-")[0])
    assert shown.split("+") == neurons[:len(neurons) - count] and len(shown) > 20
    assert knockout_model_name(args, neurons) == name  # any order, any run: one name
    # Same first components and count, another list: another name.
    changed = neurons[:-1] + ["L3N400"]
    assert knockout_model_name(args, changed) != name
    # A folder name any file system takes: lm-eval's sanitization leaves no separator.
    folder = sanitize_model_name(name)
    assert re.fullmatch(r"[A-Za-z0-9_.,=+\-]+", folder) and len(folder) < 100
    # A list that fits is spelled out.
    assert knockout_model_name(args, neurons[:5]) == f"org/model,ablate={'+'.join(neurons[:5])}"


def test_model_args_as_the_cli_records_them():
    args = "pretrained=org/model,dtype=float32,batch_size=4,ablate=L9H9,ablate_top=3,scale=2"
    assert knockout_model_args(args, "L1H0+L0H3") == {
        "pretrained": "org/model", "dtype": "float32", "batch_size": 4,
        "ablate": "L0H3+L1H0", "scale": 2}
    assert knockout_model_args(args, "L1H0", scale=0.5)["scale"] == 0.5
    assert knockout_model_args({"pretrained": "m", "scale": 2}, [], scale=0) == \
        {"pretrained": "m"}
    # Nothing knocked out: no scale either (a rerun would warn of a knockout of nothing).
    assert knockout_model_args({"pretrained": "m", "scale": 2}, []) == {"pretrained": "m"}
    assert knockout_model_args({"pretrained": "m"}, [], scale=0.5) == {"pretrained": "m"}


# --- verify --output_path / --log_samples ----------------------------------------------

def test_verify_writes_each_knockout_as_lm_evals_own_results(tiny_model_dir, tmp_path,
                                                             capsys):
    from helpers import finished_run
    from lm_eval.utils import (
        get_results_filenames,
        get_sample_results_filenames,
        sanitize_model_name,
    )

    from lm_eval_headloc.cli.main import main

    def harness(*args: str) -> int:
        try:
            return main([*args])
        except SystemExit as exit_:
            return exit_.code

    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "run", model, "tiny_copy_ppl", ("L1H2", "L0H0"), seed=3)
    out, results_dir = tmp_path / "verify", tmp_path / "lm-eval"
    args = ["verify", str(run), "--top-k", "2", "--general", "tiny_copy", "--random-draws",
            "0", "--out", str(out), "--output_path", str(results_dir), "--log_samples"]
    assert harness(*args) == 0
    index = json.loads((out / "lm_eval_files.json").read_text())
    assert sorted(index) == ["baseline", "tiny_copy_ppl-top1", "tiny_copy_ppl-top2"]
    measured = {json.loads(line)["key"]: json.loads(line) for line in
                (out / "measurements.jsonl").read_text().splitlines()}
    for key, path in index.items():
        saved = json.loads(Path(path).read_text())
        # The file lm-eval writes, its score the one verify measured for this knockout.
        assert {"results", "configs", "versions", "n-shot", "higher_is_better",
                "n-samples", "config"} <= set(saved)
        assert saved["results"]["tiny_copy_ppl"]["perplexity,none"] == pytest.approx(
            measured[key]["scores"]["tiny_copy_ppl"])
        knocked = measured[key]["mask"]
        folder = Path(path).parent
        # Never the folder a plain `lm_eval --model hf --model_args pretrained=<model>`
        # run writes to: the baseline too is filed as what it is.
        assert folder.name != sanitize_model_name(str(model))
        assert saved["model_name"] == f"{model},ablate={knocked or 'none'}"
        # lm-eval writes the batch size the evaluation ran with (verify's default, 32).
        assert saved["config"]["batch_size"] == 32
        files = [str(p) for p in folder.iterdir()]
        assert get_results_filenames(files) and len(get_sample_results_filenames(files)) == 2
    # A rerun measures nothing and writes no file again.
    before = sorted(p for p in results_dir.rglob("*") if p.is_file())
    assert harness(*args) == 0
    assert sorted(p for p in results_dir.rglob("*") if p.is_file()) == before
    # --log_samples without --output_path is refused, as lm-eval refuses it.
    capsys.readouterr()
    assert harness("verify", str(run), "--log-samples", "--out", str(tmp_path / "v2")) == 2
    assert_names(capsys.readouterr().err, "--log-samples", "--output-path")


def test_output_path_on_a_generation_task_with_auto_batch_size_probes_once(
        tiny_model_dir, tmp_path, monkeypatch):
    """lm-eval's own evaluations for --output-path generate in the measurement's batch
    (resolved once from the requests), never probing max_length-wide rows per call."""
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    probes = []
    detect = HFHeadAblateLM._detect_batch_size

    def spy(self, requests=None, pos=0):
        assert requests is not None, "probed with max_length-wide rows"
        probes.append(len(requests[pos][1]) + len(requests[pos][2]))
        return detect(self, requests, pos)

    monkeypatch.setattr(HFHeadAblateLM, "_detect_batch_size", spy)
    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_generate",
                       ("L1H2", "L0H0"))
    out, results_dir = tmp_path / "verify", tmp_path / "lm-eval"
    assert main(["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                 "--random-draws", "0", "--batch-size", "auto", "--out", str(out),
                 "--output-path", str(results_dir)]) == 0
    index = json.loads((out / "lm_eval_files.json").read_text())
    assert sorted(index) == ["baseline", "tiny_generate-top1"]
    measured = {json.loads(line)["key"]: json.loads(line) for line in
                (out / "measurements.jsonl").read_text().splitlines()}
    for key, path in index.items():
        saved = json.loads(Path(path).read_text())
        assert saved["results"]["tiny_generate"]["exact_match,none"] == pytest.approx(
            measured[key]["scores"]["tiny_generate"])
        # The batch it generated in, resolved from --batch-size auto: a number.
        assert isinstance(saved["config"]["batch_size"], int)
        assert saved["config"]["batch_size"] >= 1
    # Once for the loglikelihood batch (tiny_copy's requests, several masks per pass) and
    # once for the generate batch, each narrower than max_length (128), not once per call.
    assert len(probes) == 2 and max(probes) < 128


def test_a_rerun_with_another_output_path_or_log_samples_writes_them(tiny_model_dir,
                                                                     tmp_path):
    """A finished verify rerun with a new --output-path, or adding --log-samples, used to
    write nothing (the files of the first --output-path counted as done) while its
    config.json named the new folder."""
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main

    run = finished_run(tmp_path / "run", tiny_model_dir("llama"), "tiny_copy_ppl",
                       ("L1H2", "L0H0"))
    out = tmp_path / "verify"
    common = ["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
              "--random-draws", "0", "--out", str(out)]

    def files(folder: Path) -> list[Path]:
        return sorted(p for p in folder.rglob("*") if p.is_file()) if folder.exists() else []

    first, second = tmp_path / "first", tmp_path / "second"
    assert main([*common, "--output-path", str(first)]) == 0
    assert len(files(first)) == 2 and not [p for p in files(first) if "samples_" in p.name]
    assert main([*common, "--output-path", str(second)]) == 0
    index = json.loads((out / "lm_eval_files.json").read_text())
    assert all(second in Path(path).parents for path in index.values())
    assert len(files(second)) == 2 and len(files(first)) == 2  # the first ones kept
    assert main([*common, "--output-path", str(second), "--log-samples"]) == 0
    samples = [p for p in files(second) if p.name.startswith("samples_")]
    assert len(samples) == 4  # two tasks, two knockouts
    before = files(second)
    assert main([*common, "--output-path", str(second), "--log-samples"]) == 0
    assert files(second) == before  # all there: nothing written again


def test_output_path_names_a_mean_knockout_as_one(tiny_model_dir, tmp_path):
    """A knockout under --ablation mean is recorded and filed as one: its model_args say
    ablation=mean (with the reference it was given), so rerunning them with lm_eval gives
    this evaluation, not a zero knockout's; its name and folder differ from a zero
    knockout's of the same heads."""
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main

    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "run", model, "tiny_copy_ppl", ("L1H2", "L0H0"))
    reference = tmp_path / "reference.txt"
    reference.write_text("the cat sat on the mat\nMary and John went to the store\n")
    names = {}
    for kind in ("zero", "mean"):
        out, results_dir = tmp_path / f"verify-{kind}", tmp_path / "lm-eval"
        extra = ["--ablation-data", str(reference)] if kind == "mean" else []
        assert main(["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                     "--random-draws", "0", "--ablation", kind, *extra, "--out", str(out),
                     "--output-path", str(results_dir)]) == 0
        index = json.loads((out / "lm_eval_files.json").read_text())
        saved = json.loads(Path(index["tiny_copy_ppl-top1"]).read_text())
        args = saved["config"]["model_args"]
        if kind == "mean":
            assert args["ablation"] == "mean" and args["ablation_data"] == str(reference)
            assert saved["model_name"].endswith(",ablate=L1H2,ablation=mean")
        else:
            assert "ablation" not in args
        names[kind] = (saved["model_name"], Path(index["tiny_copy_ppl-top1"]).parent)
        baseline = json.loads(Path(index["baseline"]).read_text())
        assert "ablate" not in baseline["config"]["model_args"]
    assert names["zero"][0] != names["mean"][0] and names["zero"][1] != names["mean"][1]


def test_evaluate_knockout_records_the_live_ablation(tiny_model_dir, task_manager, tmp_path):
    """From Python: a model whose ablation kind was switched on the live model (as a run
    does, with its own examples) records that kind, and the file of those examples as its
    ablation_data (no model argument names texts handed over; without the file the
    evaluation is refused before it runs)."""
    from lm_eval_headloc.measurement.lm_eval_output import save_reference_set

    lm = load_lm(tiny_model_dir("llama"))
    texts = ["the cat sat on the mat", "Mary and John went to the store"]
    lm.set_ablation("mean", texts)
    with raises_naming(ValueError, "ablation=mean", "reference="):
        evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="L0H1", limit=2)
    reference = save_reference_set(tmp_path, texts)
    results = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="L0H1",
                                limit=2, reference=reference)
    assert results["config"]["model_args"]["ablation"] == "mean"
    assert results["config"]["model_args"]["ablation_data"] == str(reference)
    assert results["model_name"].endswith(",ablate=L0H1,ablation=mean")
    assert reference_texts(str(reference)) == texts
    # The same texts make the same file, written once.
    assert save_reference_set(tmp_path, texts) == reference
    assert [p.name for p in tmp_path.iterdir()] == [reference.name]


def test_a_reference_file_of_that_name_not_ours_is_refused_not_named(tmp_path):
    """A file in the output folder under the reference set's name that holds other texts
    (or is a FIFO) is not the package's: refused, left as it is, and never named by a
    results file as the reference set it does not hold."""
    import os

    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.measurement.lm_eval_output import save_reference_set

    texts = ["the cat sat on the mat", "Mary and John went to the store"]
    (tmp_path / "first").mkdir()
    name = save_reference_set(tmp_path / "first", texts).name
    (tmp_path / "forged").mkdir()
    forged = tmp_path / "forged" / name
    forged.write_text('{"text": "something else"}\n')
    with raises_naming(UsageError, str(forged), "not overwritten"):
        save_reference_set(tmp_path / "forged", texts)
    assert forged.read_text() == '{"text": "something else"}\n'
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / name)
    with raises_naming(UsageError, name, "not overwritten"):
        save_reference_set(tmp_path / "fifo", texts)


@pytest.mark.parametrize("reference", [[], ["--ablation-data", "tiny_choice"]],
                         ids=["the run's examples", "an include-path task"])
def test_verify_records_model_args_that_load_its_mean_knockout(tiny_model_dir, tmp_path,
                                                               reference):
    """Under --ablation mean with the run's own examples as the reference set (handed to
    the model as texts), or a task only the run's --include-path finds (the model is told
    no include path), the results file's model_args could not load the knockout: `lm_eval
    --model hf-headablate --model_args <them>` refused them. Read back through the model's
    own argument parsing they now load the same knockout and reference set."""
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main
    from lm_eval_headloc.intervention.components import format_heads
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "run", model, "tiny_copy", ("L1H2", "L0H0"))
    out, results_dir = tmp_path / "verify", tmp_path / "lm-eval"
    assert main(["verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                 "--random-draws", "0", "--ablation", "mean", *reference, "--out", str(out),
                 "--output-path", str(results_dir)]) == 0
    index = json.loads((out / "lm_eval_files.json").read_text())
    config = json.loads(Path(index["tiny_copy-top1"]).read_text())["config"]
    written = ",".join(f"{key}={value}" for key, value in config["model_args"].items())
    lm = HFHeadAblateLM.create_from_arg_string(written)
    assert (lm.ablation, format_heads(lm.knocked_out)) == ("mean", "L1H2")
    assert lm.reference_digest == config["reference_digest"] is not None
    assert lm.ablation_data == config["ablation_data"]


def test_output_path_asks_each_task_as_the_measurement_did(tiny_model_dir, tmp_path):
    """On a model with a chat template the measurement asks a generation task through it
    and a loglikelihood task not (the default): lm-eval's own files must ask the same, so
    each knockout gets one file per setting, each file saying its setting, each sample's
    prompt the one the measurement used."""
    from helpers import finished_run, with_chat_template
    from transformers import AutoTokenizer

    from lm_eval_headloc.cli.main import main

    model = with_chat_template(tiny_model_dir("llama"), tmp_path / "chat-model")
    run = finished_run(tmp_path / "run", model, "tiny_generate", ("L1H2", "L0H0"))
    out, results_dir = tmp_path / "verify", tmp_path / "lm-eval"
    assert main(["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                 "--random-draws", "0", "--out", str(out), "--output-path",
                 str(results_dir), "--log-samples"]) == 0
    index = json.loads((out / "lm_eval_files.json").read_text())
    assert sorted(index) == ["baseline", "tiny_generate-top1"]
    assert json.loads((out / "config.json").read_text())["chat_template"] == {
        "tiny_copy": False, "tiny_generate": True}
    measured = {json.loads(line)["key"]: json.loads(line) for line in
                (out / "measurements.jsonl").read_text().splitlines()}
    tokenizer = AutoTokenizer.from_pretrained(model)
    for key, paths in index.items():
        assert isinstance(paths, list) and len(paths) == 2
        by_task = {}
        for path in map(Path, paths):
            saved = json.loads(path.read_text())
            (task,) = saved["results"]
            by_task[task] = saved
            metric = measured[key]["metrics"][task]
            assert saved["results"][task][metric] == pytest.approx(
                measured[key]["scores"][task])
            (samples,) = path.parent.glob(f"samples_{task}_{path.stem[len('results_'):]}"
                                          ".jsonl")
            for line in samples.read_text().splitlines():
                sample = json.loads(line)
                prompt = sample["arguments"]["gen_args_0"]["arg_0"]
                context = sample["doc"]["context"]
                expected = (tokenizer.apply_chat_template(
                    [{"role": "user", "content": context}], tokenize=False,
                    add_generation_prompt=True) if task == "tiny_generate" else context)
                assert prompt == expected
        assert sorted(by_task) == ["tiny_copy", "tiny_generate"]
        assert by_task["tiny_generate"]["chat_template"] is not None
        assert by_task["tiny_copy"]["chat_template"] is None
    # Resumed: every file is there, so nothing is evaluated or written again.
    before = sorted(p for p in results_dir.rglob("*") if p.is_file())
    assert main(["verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                 "--random-draws", "0", "--out", str(out), "--output-path",
                 str(results_dir), "--log-samples"]) == 0
    assert sorted(p for p in results_dir.rglob("*") if p.is_file()) == before


def test_cross_writes_each_set_as_lm_evals_own_results(tiny_model_dir, tmp_path):
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main

    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "run", model, "tiny_copy_ppl", ("L1H2", "L0H0"), seed=3)
    out, results_dir = tmp_path / "cross", tmp_path / "lm-eval"
    assert main(["cross", str(run), "--top-k", "1", "--num-samples", "12", "--out", str(out),
                 "--output-path", str(results_dir)]) in (0, None)
    index = json.loads((out / "lm_eval_files.json").read_text())
    measured = {json.loads(line)["key"]: json.loads(line) for line in
                (out / "measurements.jsonl").read_text().splitlines()}
    assert sorted(index) == sorted(measured) == ["baseline", "set1"]
    saved = json.loads(Path(index["set1"]).read_text())
    assert saved["results"]["tiny_copy_ppl"]["perplexity,none"] == pytest.approx(
        measured["set1"]["scores"]["tiny_copy_ppl"])
    assert saved["model_name"].endswith(",ablate=L1H2")


@pytest.mark.parametrize("options, message", [
    (["--output-path", ""], "--output-path '': give a folder"),
    (["--output-path", "NOT_OURS"], "exists and is not a folder"),
    (["--log_samples"], "--log-samples: give --output-path too"),
])
def test_bad_output_paths_are_refused_before_loading(tmp_path, capsys, options, message):
    from helpers import finished_run

    from lm_eval_headloc.cli.main import main

    not_ours = tmp_path / "notes.txt"
    not_ours.write_text("someone's notes\n")
    run = finished_run(tmp_path / "run", tmp_path / "no-model-needed", "tiny_copy_ppl",
                       ("L1H2",), seed=3)
    out = tmp_path / "verify"
    args = [str(not_ours) if o == "NOT_OURS" else o for o in options]
    try:
        code = main(["verify", str(run), "--out", str(out), *args])
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]
    assert not out.exists() and not_ours.read_text() == "someone's notes\n"


def test_lm_evals_prints_go_to_the_log_not_the_output(lm, model_dir, task_manager, capsys,
                                                      caplog, monkeypatch):
    """verify --output_path printed 18 lines of lm-eval's "bootstrapping for stddev:
    perplexity" into the run's output: they go to the log (--verbose shows it)."""
    import lm_eval

    evaluate = lm_eval.simple_evaluate

    def chatty(**kwargs):
        print("bootstrapping for stddev: perplexity")
        return evaluate(**kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", chatty)
    with caplog.at_level("INFO", logger="lm_eval_headloc"):
        evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out=KNOCKOUT,
                          model_args=_model_args(model_dir), bootstrap_iters=0)
    assert "bootstrapping" not in capsys.readouterr().out
    assert any("bootstrapping for stddev: perplexity" in r.getMessage()
               for r in caplog.records)


def _git(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=cwd, capture_output=True, text=True, check=False)


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_outside_a_git_checkout_git_says_nothing_and_inside_it_records_the_commit(
        lm, model_dir, task_manager, tmp_path, monkeypatch, capfd):
    """lm-eval's simple_evaluate runs ``git describe`` with the process's stderr to record
    a commit: outside a git checkout every --output-path evaluation (verify's, cross's)
    printed git's "fatal: not a git repository". Captured at the file descriptor, where
    git writes."""
    import os

    outside, checkout = tmp_path / "outside", tmp_path / "checkout"
    outside.mkdir()
    checkout.mkdir()
    # Nothing above tmp_path is looked at: outside stays outside any checkout.
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert _git("init", "-q", cwd=checkout).returncode == 0
    assert _git("commit", "-q", "--allow-empty", "-m", "x", cwd=checkout).returncode == 0
    commit = _git("rev-parse", "--short", "HEAD", cwd=checkout).stdout.strip()
    complaint = _git("describe", "--always", cwd=outside).stderr
    assert "not a git repository" in complaint  # what used to reach the terminal

    def evaluate(cwd: Path) -> tuple[dict, str]:
        monkeypatch.chdir(cwd)
        capfd.readouterr()
        results = evaluate_knockout(lm, [TASK], task_manager=task_manager,
                                    knocked_out=KNOCKOUT, model_args=_model_args(model_dir),
                                    bootstrap_iters=0)
        os.write(2, b"stderr is the terminal's again\n")
        return results, capfd.readouterr().err

    results, err = evaluate(outside)
    assert "not a git repository" not in err and "fatal" not in err
    assert "Running loglikelihood requests" in err  # lm-eval's own progress still shown
    assert err.endswith("stderr is the terminal's again\n")
    assert results["git_hash"] is None  # lm-eval's own answer there: no commit
    results, err = evaluate(checkout)
    assert results["git_hash"] == commit
    assert err.endswith("stderr is the terminal's again\n")


def test_the_batch_size_is_recorded_as_lm_evals_cli_records_it(model_dir, task_manager):
    """`lm_eval --batch_size auto:4` (the size detected again 4 times) records "auto:4";
    HFLM keeps the 4 apart from its batch_size, "auto", which the file said."""
    lm = load_lm(model_dir, batch_size="auto:4")
    results = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="L0H1",
                                bootstrap_iters=0)
    assert results["config"]["batch_size"] == "auto:4"


def test_no_gen_kwargs_are_recorded_as_lm_evals_cli_records_them(knockout):
    # lm_eval's CLI passes and records {} without --gen_kwargs (its EvaluatorConfig's
    # default), where None was recorded.
    assert knockout["config"]["gen_kwargs"] == {}


@pytest.mark.parametrize("kind", ["mean", "resample"])
def test_a_baselines_config_is_what_its_model_args_record(model_dir, task_manager, kind):
    """With nothing knocked out no means or donors act, and the baseline's model_args
    name no ablation: its config said the live model's kind and reference set (digest,
    means file) all the same, which a rerun of those arguments does not record."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lm = load_lm(model_dir)
    lm.set_ablation(kind, ["the cat sat on the mat", "Mary and John went to the store"])
    config = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="",
                               limit=2, bootstrap_iters=0,
                               model_args=_model_args(model_dir))["config"]
    rerun = HFHeadAblateLM.create_from_arg_obj(config["model_args"]).get_model_info()
    for key in ("ablate", "ablation", "ablation_data", "means_file", "reference_digest",
                "neuron_means_file", "resample_seed"):
        assert config.get(key) == rerun.get(key), key


def test_a_jsonl_reference_sets_field_is_recorded(model_dir, tmp_path):
    """A model built in Python (no model_args in the results) recorded ablation_data= but
    not ablation_field=: a rerun from the record read another field of the file (or
    none), with other means."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    data = tmp_path / "reference.jsonl"
    data.write_text("".join(json.dumps({"text": "x", "body": body}) + "\n"
                            for body in ("the cat sat on the mat", "Mary and John went")))
    lm = load_lm(model_dir, ablate="L0H1", ablation="mean", ablation_data=str(data),
                 ablation_field="body", ablation_cache=str(tmp_path / "cache"))
    info = lm.get_model_info()
    assert info["ablation_field"] == "body"
    rerun = HFHeadAblateLM(pretrained=str(model_dir), dtype="float32", device="cpu",
                           **{key: info[key] for key in ("ablate", "ablation", "ablation_data",
                                                         "ablation_field")},
                           ablation_cache=str(tmp_path / "cache"))
    assert rerun.get_model_info()["reference_digest"] == info["reference_digest"]
    assert "ablation_field" not in load_lm(model_dir).get_model_info()


def test_projections_and_a_reference_tasks_folder_are_recorded(model_dir, tmp_path):
    """A model built in Python recorded neither attn_out=/mlp_out= (the projections named by
    hand) nor ablation_include_path= (where its reference task was found): a rerun from
    the record found the modules itself, and the task not at all."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    given = dict(attn_out="model.layers.*.self_attn.o_proj",
                 mlp_out="model.layers.*.mlp.down_proj", ablation_include_path=TASKS)
    lm = load_lm(model_dir, ablate="L0H1+L1N2", ablation="mean", ablation_data="tiny_copy",
                 ablation_cache=str(tmp_path / "cache"), **given)
    info = lm.get_model_info()
    assert {key: info.get(key) for key in given} == given
    rerun = HFHeadAblateLM(pretrained=str(model_dir), dtype="float32", device="cpu",
                           ablation_cache=str(tmp_path / "cache"),
                           **{key: info[key] for key in ("ablate", "ablation", "ablation_data",
                                                         *given)})
    assert rerun.get_model_info()["reference_digest"] == info["reference_digest"]
    assert not set(given) & set(load_lm(model_dir).get_model_info())


def test_a_baseline_at_a_scale_records_no_scale(model_dir, task_manager):
    """A --scale run's baseline: no component is scaled, so its model_args name no scale
    (a rerun of them warned "nothing is knocked out") and its config says the scale a
    rerun of them records."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lm = load_lm(model_dir)
    config = evaluate_knockout(lm, [TASK], task_manager=task_manager, knocked_out="",
                               scale=2, limit=2, bootstrap_iters=0,
                               model_args={**_model_args(model_dir), "scale": 2})["config"]
    assert "scale" not in config["model_args"]
    rerun = HFHeadAblateLM.create_from_arg_obj(config["model_args"]).get_model_info()
    assert config["scale"] == rerun["scale"] == 0.0
