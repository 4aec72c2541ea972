"""benchmarks/<name>.py, one per benchmark: each runs ``headloc_bench.<name>``'s ``main``
and nothing else, every module of the package with a ``main`` has one, and one runs from
the repository root as the docs show it (the package found beside it, not installed)."""

from __future__ import annotations

import ast
import subprocess
import sys

from headloc_bench import ROOT

BENCHMARKS = ROOT / "benchmarks"


def _has_main(path) -> bool:
    return any(isinstance(node, ast.FunctionDef) and node.name == "main"
               for node in ast.parse(path.read_text(encoding="utf-8")).body)


def test_each_entry_point_imports_its_modules_main_and_nothing_else():
    entries = sorted(BENCHMARKS.glob("*.py"))
    with_main = {p.stem for p in (BENCHMARKS / "headloc_bench").glob("*.py") if _has_main(p)}
    assert len(with_main) > 10
    assert {p.stem for p in entries} == with_main
    for path in entries:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imports = [(node.module, [alias.name for alias in node.names]) for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom | ast.Import)]
        assert imports == [(f"headloc_bench.{path.stem}", ["main"])], path.name


def test_an_entry_point_runs_from_the_repository_root():
    done = subprocess.run([sys.executable, "benchmarks/bench_store.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: bench_store.py")
