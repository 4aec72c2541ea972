"""The package's structure: folders that are its layers, imports pointing down, no cycle;
and the benchmarks' package beside it (benchmarks/headloc_bench), which imports the
package and is never imported by it.

The contracts live in pyproject.toml ([tool.importlinter]); these tests run them, show
they catch what they are for (a planted back-import, a planted cycle, the package planted
importing the benchmarks), and check what they do not say: no cycle through a package's
root, and the public API importable from the top. (A module's length is no measure of its
idea: no ceiling.)
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from helpers import BENCHMARKS, bench_module

import lm_eval_headloc

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lm_eval_headloc"


def lint_imports(package_parent: Path, bench_parent: Path = BENCHMARKS
                 ) -> subprocess.CompletedProcess:
    """import-linter over the package found in ``package_parent`` and the benchmarks'
    package found in ``bench_parent``, with our pyproject's contracts (a fresh process:
    grimp finds the packages by import)."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command;"
         " sys.exit(lint_imports_command())", "--no-cache",
         "--config", str(ROOT / "pyproject.toml")],
        cwd=package_parent, capture_output=True, text=True, timeout=120,
        env={"PYTHONPATH": os.pathsep.join([str(package_parent), str(bench_parent)]),
             "PATH": "/usr/bin:/bin"})


def test_the_layer_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.fixture()
def package_copy(tmp_path: Path) -> Path:
    shutil.copytree(PACKAGE, tmp_path / "lm_eval_headloc",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(package_parent: Path, module: str, line: str) -> None:
    path = package_parent / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _planted():\n    {line}\n")


def test_a_back_import_inside_a_function_breaks_the_layers(package_copy):
    # The notation (intervention) reaching up to the command line, where a lazy import
    # would hide it from anyone reading the top of the file.
    _plant(package_copy, "lm_eval_headloc.intervention.components",
           "from lm_eval_headloc.cli.main import main  # noqa: F401")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "layers: imports point down BROKEN" in result.stdout
    assert "lm_eval_headloc.intervention.components -> lm_eval_headloc.cli.main" in result.stdout


def test_a_cycle_inside_a_layer_breaks_the_acyclic_contract(package_copy):
    # runs.folder imports runs.folder_checks; the checks importing the folder back closes a
    # cycle the layers contract cannot see (both are in runs/).
    _plant(package_copy, "lm_eval_headloc.runs.folder_checks",
           "from lm_eval_headloc.runs.folder import RunFolder  # noqa: F401")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "no cycles among the modules of any folder BROKEN" in result.stdout
    assert "layers: imports point down KEPT" in result.stdout


def test_the_package_importing_the_benchmarks_breaks_their_contract(package_copy):
    # The simulator is research code outside the wheel: a module of the package reaching
    # for it would fail on every installed copy.
    _plant(package_copy, "lm_eval_headloc.method.confirm",
           "from headloc_bench.simulation import planted_world  # noqa: F401")
    result = lint_imports(package_copy)
    assert result.returncode != 0
    assert "the package never imports the benchmarks BROKEN" in result.stdout
    assert "lm_eval_headloc.method.confirm -> headloc_bench.simulation" in result.stdout


def test_a_cycle_among_the_benchmarks_breaks_the_acyclic_contract(tmp_path):
    # bench_measure imports bench_scale (its --config); bench_scale importing bench_measure
    # back (what both time with lives in measuring) closes a cycle.
    shutil.copytree(BENCHMARKS / "headloc_bench", tmp_path / "headloc_bench",
                    ignore=shutil.ignore_patterns("__pycache__"))
    _plant(tmp_path, "headloc_bench.bench_scale",
           "from headloc_bench.bench_measure import render  # noqa: F401")
    result = lint_imports(ROOT, bench_parent=tmp_path)
    assert result.returncode != 0
    assert "no cycles among the modules of any folder BROKEN" in result.stdout
    assert "the package never imports the benchmarks KEPT" in result.stdout


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(
                        child)))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_cycle_anywhere_in_the_package_root_included():
    """The acyclic contract compares siblings; a module importing the package root (whose
    names import the commands) would close a cycle through the root it cannot see. The
    benchmarks' package is in the graph too (found by import: imported first)."""
    bench_module("measuring")
    assert _cycles(grimp.build_graph("lm_eval_headloc", "headloc_bench", cache_dir=None)) == []
    graph = grimp.build_graph("lm_eval_headloc", cache_dir=None)
    # The finder finds one: the root (which imports the notation, and it the errors)
    # imported back by the errors.
    graph.add_import(importer="lm_eval_headloc.common.errors", imported="lm_eval_headloc")
    (cycle,) = _cycles(graph)
    assert {"lm_eval_headloc", "lm_eval_headloc.common.errors",
            "lm_eval_headloc.intervention.components"} <= set(cycle)


def test_the_public_api_is_importable_from_the_top():
    from lm_eval_headloc import HeadLasso, RunSpec, locate, verify
    from lm_eval_headloc.commands.locate import locate as defined_locate
    from lm_eval_headloc.method.lasso import HeadLasso as defined_lasso

    assert locate is defined_locate and HeadLasso is defined_lasso
    assert callable(verify) and RunSpec().tasks
    for name in lm_eval_headloc.__all__:
        assert getattr(lm_eval_headloc, name) is not None, name
    assert set(lm_eval_headloc.__all__) <= set(dir(lm_eval_headloc))
    with pytest.raises(AttributeError, match="no attribute 'locat'"):
        lm_eval_headloc.locat  # noqa: B018


def test_a_spec_and_its_option_choices_load_nothing_heavy():
    """RunSpec, the option choices (common.options) and the budget's defaults import no
    torch, scikit-learn, Ray or lm-eval (a spec once imported torch and scikit-learn for a
    few constants); checking a spec's numbers adds scikit-learn's scalar check alone."""
    code = ("import sys\nfrom lm_eval_headloc.runs.spec import RunSpec\n"
            "import lm_eval_headloc.common.options, lm_eval_headloc.method.budget\n"
            "heavy = ('torch', 'sklearn', 'ray', 'lm_eval', 'transformers')\n"
            "spec = RunSpec(tasks=('a',), masks=10)\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n"
            "spec.validate()\n"
            "print(sorted(m for m in heavy if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "['sklearn']"]


def test_no_test_file_imports_another():
    """Shared helpers live in tests/helpers.py and fixtures in conftest.py: a test module
    (or conftest) imported by another would run its tests twice or hide where a helper is."""
    tests = Path(__file__).resolve().parent
    importing = {}
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found = [n for n in names if n.split(".")[0].startswith("test_")
                     or n.split(".")[0] == "conftest"]
            if found:
                importing[path.name] = found
    assert len(list(tests.glob("test_*.py"))) > 50
    assert importing == {}
