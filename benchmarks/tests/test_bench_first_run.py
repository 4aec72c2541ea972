"""benchmarks/bench_first_run.py: a locate twice, in processes of their own, phase by phase."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import TASKS

from headloc_bench import bench_first_run as bench


@pytest.mark.slow
def test_a_first_and_a_later_run_are_timed_phase_by_phase(tiny_llama_dir, tmp_path,
                                                          monkeypatch):
    seen = []
    real = bench.timed_run

    def spy(arguments, out, environment):
        result = real(arguments, out, environment)
        seen.append((environment, result))
        return result

    monkeypatch.setattr(bench, "timed_run", spy)
    out = tmp_path / "BENCH.md"
    assert bench.main(["--out", str(out), "--", "--model-args",
                       f"pretrained={tiny_llama_dir},dtype=float32",
                       "--include-path", TASKS, "--tasks", "tiny_choice", "--masks", "6",
                       "--sparsity", "0.25", "--num-samples", "4", "--prior", "none",
                       "--confirm", "0"]) == 0
    (first_env, first), (later_env, later) = seen
    # The same fresh caches for both: filled by the first, found by the later one.
    assert first_env == later_env
    assert all(name in first_env and "headloc-first-" in first_env[name]
               for name in bench.CACHES)
    for result in (first, later):
        recorded = result["recorded"]
        # Counted from the process's start (the console script): the interpreter and the
        # imports of torch and lm-eval take well over half a second, and the whole the run
        # recorded (before its report) fits inside the wall clock seen from outside.
        assert recorded["phases"]["start-up and imports"] > 0.5
        assert recorded["whole"] <= result["wall"]
        assert result["last_line"].startswith("Time: ")
    text = out.read_text()
    assert text.startswith("<!-- first run: start -->")
    # What the first run's task index read is said: the test environment's lm-eval is a
    # whole install, with its thousands of task configs.
    said = int(re.search(r"task configs here, which the first run's task index reads: "
                         r"([\d,]+) YAML files", text).group(1).replace(",", ""))
    assert said > 5000
    row = next(line for line in text.splitlines() if line.startswith("| measurements |"))
    cells = [float(cell) for cell in row.strip("|").split("|")[1:]]
    assert cells[0] == round(first["recorded"]["phases"]["measurements"], 2)
    assert cells[1] == round(later["recorded"]["phases"]["measurements"], 2)
    assert abs(cells[2] - (cells[0] - cells[1])) <= 0.011
    # The run folders and caches were the script's own, in a temporary folder it removed.
    assert not Path(first_env["XDG_CACHE_HOME"]).parents[1].exists()
