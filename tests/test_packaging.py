"""A normal (non-editable) install ships the task configs and the start-up hook and none
of the benchmarks' code, the package finds its own task configs, never a stray folder of
that name, and nothing of the package imports the benchmarks."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: The benchmarks' package (not installed, not in the wheel).
BENCH = ROOT / "benchmarks" / "headloc_bench"


@pytest.mark.slow
def test_wheel_ships_tasks_and_startup_hook(tmp_path, tiny_model_dir):
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("lm_eval_headloc-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for required in ["lm_eval_headloc_startup.pth", "_lm_eval_headloc_startup.py",
                     "lm_eval_headloc/task_configs/swear/swear.yaml",
                     "lm_eval_headloc/task_configs/swear/swear_prompts.jsonl",
                     "lm_eval_headloc/task_configs/rhyme/rhyme_words.jsonl",
                     "lm_eval_headloc/task_configs/headloc_induction/headloc_induction.jsonl",
                     "lm_eval_headloc/task_configs/headloc_ioi/utils.py"]:
        assert required in names, required
    # No benchmark code: no lm_eval_headloc/bench, no headloc_bench, and no module of it
    # under any other folder.
    bench_files = {p.name for p in BENCH.glob("*.py")} - {"__init__.py"}
    assert len(bench_files) > 10
    shipped = [n for n in names if n.startswith(("lm_eval_headloc/bench/", "headloc_bench/",
                                                  "benchmarks/"))
               or n.rsplit("/", 1)[-1] in bench_files]
    assert shipped == []

    # Installed as a plain package (not from this checkout), our tasks are found.
    site = tmp_path / "site"
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site),
         str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    probe = subprocess.run(
        [sys.executable, "-c",
         f"import sys; sys.path.insert(0, {str(site)!r})\n"
         "import lm_eval_headloc\n"
         "from lm_eval_headloc.tasks import make_task_manager, task_configs_dir\n"
         "print(task_configs_dir())\n"
         "manager = make_task_manager()\n"
         "print(all(t in manager.all_tasks for t in ['swear', 'rhyme', 'headloc_induction']))"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert probe.returncode == 0, probe.stderr[-2000:]
    folder, found = probe.stdout.split()
    assert folder.startswith(str(site)) and found == "True"

    # The stock `lm_eval` command with the wheel as the installed package: its .pth file
    # processed as site-packages' are, this environment's own hook and package left out
    # (-S: no .pth of site-packages runs, its folders go on the path as plain folders;
    # -I: nor does PYTHONPATH, which may name a checkout).
    import site as site_module

    out = tmp_path / "results"
    stock = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         "import site, sys\n"
         f"site.addsitedir({str(site)!r})\n"
         f"sys.path.extend({site_module.getsitepackages()!r})\n"
         "from lm_eval.__main__ import cli_evaluate\n"
         "sys.argv = ['lm_eval', *sys.argv[1:]]\n"
         "cli_evaluate()\n",
         "--model", "hf-headablate", "--device", "cpu", "--model_args",
         f"pretrained={tiny_model_dir('llama')},dtype=float32,ablate=L0H1",
         "--tasks", "headloc_induction", "--limit", "2", "--output_path", str(out)],
        capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert stock.returncode == 0, stock.stderr[-3000:]
    saved = json.loads(next(out.rglob("results_*.json")).read_text())
    assert saved["n-samples"]["headloc_induction"]["effective"] == 2
    source = saved["configs"]["headloc_induction"]["metadata"]["config_source"]
    assert source.startswith(str(site / "lm_eval_headloc" / "task_configs")), source
    assert saved["config"]["model_args"]["ablate"] == "L0H1"


def test_no_module_of_the_package_imports_the_benchmarks():
    """``import lm_eval_headloc``, then every module of the package, in a fresh process
    that could import the benchmarks (benchmarks/ on its path): none of them pulls in
    ``headloc_bench``."""
    package = ROOT / "lm_eval_headloc"
    modules = sorted(
        ".".join(("lm_eval_headloc", *path.relative_to(package).with_suffix("").parts))
        .removesuffix(".__init__") for path in package.rglob("*.py"))
    assert {"lm_eval_headloc", "lm_eval_headloc.intervention.model",
            "lm_eval_headloc.method.confirm", "lm_eval_headloc.cli.main",
            "lm_eval_headloc.commands.locate"} <= set(modules)
    loaded = "sorted(m for m in sys.modules if m.split('.')[0] == 'headloc_bench')"
    done = subprocess.run(
        [sys.executable, "-c",
         f"import sys\nsys.path.append({str(BENCH.parent)!r})\n"
         "import importlib.util\nassert importlib.util.find_spec('headloc_bench')\n"
         f"import lm_eval_headloc\nprint({loaded})\n"
         f"for name in {modules!r}:\n    importlib.import_module(name)\n"
         f"print({loaded})\n"],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "[]"]


def test_every_subcommand_is_a_function_of_the_python_api():
    """The CLI is a thin layer over functions a notebook imports from one place."""
    import argparse

    import lm_eval_headloc.commands as api
    from lm_eval_headloc.cli.main import build_parser

    sub = next(a for a in build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    # `export` writes one format per function (write_mib); every other is its own name.
    names = {"export": "write_mib"}
    for command in sub.choices:
        name = names.get(command, command)
        assert name in api.__all__ and callable(getattr(api, name)), command


# --- our task configs, not a stray folder of that name ------------------------------------

def test_stray_task_configs_is_never_taken_for_ours(tmp_path):
    from lm_eval_headloc.tasks import task_configs_dir

    site = tmp_path / "site-packages"
    (site / "task_configs").mkdir(parents=True)  # somebody else's folder
    (site / "lm_eval_headloc" / "task_configs").mkdir(parents=True)
    assert task_configs_dir(site / "lm_eval_headloc") == site / "lm_eval_headloc" / \
        "task_configs"
    checkout = tmp_path / "repo"
    (checkout / "task_configs").mkdir(parents=True)
    (checkout / "lm_eval_headloc").mkdir()
    (checkout / "pyproject.toml").write_text("")
    assert task_configs_dir(checkout / "lm_eval_headloc") == checkout / "task_configs"
