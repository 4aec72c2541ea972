"""hf-headablate through lm-eval: registration, stock CLI, simple_evaluate, cache, GGUF."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lm_eval_headloc  # noqa: F401  (registers hf-headablate)

TASKS = str(Path(__file__).parent / "tasks")
LM_EVAL = str(Path(sys.executable).parent / "lm_eval")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")


def test_startup_hook_imports_nothing_heavy():
    result = run_python(
        "import sys, json, collections\n"
        "print(sorted(m for m in ('torch', 'lm_eval', 'transformers', 'lm_eval_headloc')"
        " if m in sys.modules))\n"
        "print([type(f).__name__ for f in sys.meta_path])"
    )
    assert result.returncode == 0, result.stderr
    loaded, finders = result.stdout.splitlines()
    assert loaded == "[]"
    assert "_WatchLmEvalModels" in finders  # the hook is installed, waiting


def test_stock_registry_finds_the_model_lazily_and_keeps_hf():
    # get_model as the very first lm-eval call (the path the CLI takes).
    result = run_python(
        "import sys\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "cls = get_model('hf-headablate')\n"
        "print(cls.__module__ + ':' + cls.__name__)\n"
        "print(get_model('hf').__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["lm_eval_headloc.model:HFHeadAblateLM", "HFLM"]
    result = run_python(
        "import sys\nimport lm_eval.models\n"
        "from lm_eval.api.registry import model_registry\n"
        "print(model_registry._objs['hf-headablate'], 'torch' in sys.modules)"
    )
    assert result.stdout.split() == ["lm_eval_headloc.model:HFHeadAblateLM", "False"]


def test_import_registers_without_the_startup_hook_and_entry_point_is_declared():
    result = run_python(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path"
        " if type(f).__name__ != '_WatchLmEvalModels']\n"
        "import lm_eval_headloc\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('hf-headablate').__name__, get_model('hf').__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["HFHeadAblateLM", "HFLM"]
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="lm_eval.models", name="hf-headablate")
    assert entry.value == "lm_eval_headloc.model:HFHeadAblateLM"


def _per_sample_loglikelihoods(results: dict) -> list[float]:
    """Every choice's loglikelihood, sample by sample, flattened."""
    return [float(r[0]) for s in results["samples"]["tiny_choice"] for r in s["filtered_resps"]]


def _simple_evaluate(model_args: str | None = None, model=None, **kwargs) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model if model is not None else "hf-headablate", model_args=model_args,
        tasks=["tiny_choice"], task_manager=TaskManager(include_path=TASKS),
        log_samples=True, **kwargs,
    )


def test_stock_cli_applies_the_mask(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    args = f"pretrained={folder},dtype=float32"
    cli = subprocess.run(
        [LM_EVAL, "--model", "hf-headablate", "--model_args", f"{args},ablate=L0H1+L1H2",
         "--device", "cpu",
         "--tasks", "tiny_choice", "--include_path", TASKS, "--output_path", str(tmp_path),
         "--log_samples"],
        capture_output=True, text=True, timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    samples_file = next(tmp_path.rglob("samples_tiny_choice_*.jsonl"))
    cli_ll = [float(r[0]) for line in samples_file.read_text().splitlines()
              for r in json.loads(line)["filtered_resps"]]
    masked = _per_sample_loglikelihoods(_simple_evaluate(f"{args},ablate=L1H2+L0H1",
                                                         device="cpu"))
    plain = _per_sample_loglikelihoods(_simple_evaluate(args, device="cpu"))
    assert cli_ll == pytest.approx(masked, abs=1e-5)
    assert cli_ll != pytest.approx(plain, abs=1e-5)
    results_file = next(tmp_path.rglob("results_*.json"))
    config = json.loads(results_file.read_text())["config"]
    assert config["model_args"]["ablate"] == "L0H1+L1H2"


@pytest.mark.parametrize("bad, message", [
    ("ablate=L99H0", r"hf-headablate: error: head L99H0 is outside the model: layer 99 not in"),
    ("ablate=L0H1+X1", r"hf-headablate: error: bad head name 'X1'"),
    ("ablate_file=/no/such/heads.json", r"hf-headablate: error: head file not found"),
])
def test_stock_cli_bad_heads_one_line_nonzero_exit(tiny_model_dir, bad, message):
    folder = tiny_model_dir("llama")
    cli = subprocess.run(
        [LM_EVAL, "--model", "hf-headablate", "--model_args",
         f"pretrained={folder},{bad}", "--device", "cpu", "--tasks", "tiny_choice",
         "--include_path", TASKS],
        capture_output=True, text=True, timeout=300,
    )
    assert cli.returncode != 0
    assert "Traceback" not in cli.stderr
    import re

    assert re.search(message, cli.stderr.strip().splitlines()[-1])


def test_simple_evaluate_by_name_and_live_switching(tiny_model_dir):
    from lm_eval_headloc.model import HFHeadAblateLM

    folder = tiny_model_dir("gpt2")
    args = f"pretrained={folder},device=cpu,dtype=float32"
    by_name = _per_sample_loglikelihoods(_simple_evaluate(f"{args},ablate=L1H0"))
    live = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    plain = _per_sample_loglikelihoods(_simple_evaluate(model=live))
    live.set_heads("L1H0")
    switched = _per_sample_loglikelihoods(_simple_evaluate(model=live))
    assert switched == pytest.approx(by_name, abs=1e-6)
    assert switched != pytest.approx(plain, abs=1e-5)


def test_response_cache_never_crosses_masks(tiny_model_dir, tmp_path):
    from lm_eval_headloc.model import HFHeadAblateLM

    folder = tiny_model_dir("llama")
    cache = str(tmp_path / "cache" / "responses")
    truth = {}
    reference = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    for spec in ["", "L0H1", "L1H3"]:
        reference.set_heads(spec)
        truth[spec] = _per_sample_loglikelihoods(_simple_evaluate(model=reference))
    assert truth["L0H1"] != pytest.approx(truth[""], abs=1e-5)

    # One live object, one cache file, masks switched in between and repeated.
    live = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    for spec in ["", "L0H1", "", "L1H3", "L0H1"]:
        live.set_heads(spec)
        got = _per_sample_loglikelihoods(_simple_evaluate(model=live, use_cache=cache))
        assert got == pytest.approx(truth[spec], abs=1e-6), spec
    # Fresh processes' worth of objects built by name with a mask, same cache file.
    for spec in ["L1H3", "L0H1"]:
        got = _per_sample_loglikelihoods(_simple_evaluate(
            f"pretrained={folder},device=cpu,dtype=float32,ablate={spec}", use_cache=cache))
        assert got == pytest.approx(truth[spec], abs=1e-6), spec

    # The cache was really used: a mask's table holds its answers.
    from sqlitedict import SqliteDict

    tables = SqliteDict.get_tablenames(cache + "_rank0.db")
    assert "unnamed" in tables and len(tables) == 3
    live.set_heads("L0H1")
    with SqliteDict(cache + "_rank0.db", tablename=live.cache_table()) as db:
        assert len(db) == 8  # 4 questions x 2 choices


@pytest.mark.slow
def test_embedded_smollm2_gguf(smollm2):
    from lm_eval_headloc.model import HFHeadAblateLM

    folder, gguf = smollm2
    lm = HFHeadAblateLM(pretrained=folder, gguf_file=gguf, device="cpu", dtype="float32")
    assert (lm.num_layers, lm.num_heads) == (30, 9)
    ids = lm.tok_batch_encode(["When Mary and John went to the store, John gave a drink to"])[0]
    with torch.no_grad():
        plain = lm.model(ids).logits[0, -1]
        # Independent check: zero the o_proj columns of L5H4 by hand, no hooks.
        o_proj = lm.model.model.layers[5].self_attn.o_proj
        saved = o_proj.weight[:, 4 * 64:5 * 64].clone()
        o_proj.weight[:, 4 * 64:5 * 64] = 0
        by_hand = lm.model(ids).logits[0, -1]
        o_proj.weight[:, 4 * 64:5 * 64] = saved
        lm.set_heads("L5H4")
        hooked = lm.model(ids).logits[0, -1]
        lm.set_heads([])
        restored = lm.model(ids).logits[0, -1]
    assert torch.allclose(hooked, by_hand, atol=1e-4)
    assert not torch.allclose(hooked, plain, atol=1e-3)
    assert torch.equal(restored, plain)
    # The model answers the IOI prompt with the indirect object.
    mary, john = (lm.tok_encode(" Mary")[0], lm.tok_encode(" John")[0])
    assert plain[mary] > plain[john]
