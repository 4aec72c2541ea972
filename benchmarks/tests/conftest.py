"""The benchmarks' tests: the package ``headloc_bench`` (benchmarks/, not installed) and
tests/helpers.py importable by name, and the two fixtures these tests need (tests/
conftest.py's fixtures are the package tests' own).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
for folder in (ROOT / "tests", ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

# helpers.py's asserts are reported as a test module's are (it is imported below).
pytest.register_assert_rewrite("helpers")

from helpers import save_tiny_tokenizer, tiny_config, unpacked_benchmarks  # noqa: E402

for variable in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(variable, "1")


@pytest.fixture(scope="session")
def committed_benchmarks(tmp_path_factory) -> Path:
    """The committed run folders (benchmarks/'s archives) unpacked once a session into a
    temporary folder, laid out as ``bench_store`` names them (``exhaustive/``,
    ``recovery-runs/<task>/...``). Read them there; copy a folder before changing it."""
    return unpacked_benchmarks(tmp_path_factory.mktemp("store") / "benchmarks")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A saved tiny random Llama (``helpers.tiny_config``) with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(folder)
    save_tiny_tokenizer(folder)
    return folder
