"""Where a run's time goes: each phase's seconds in config.json, report.md and the last
line of the command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TASKS, harness

from lm_eval_headloc.common import timing


class FakeTime:
    """A perf_counter that moves only when told: every charge is known exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def fake_time(monkeypatch):
    clock = FakeTime()
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    return clock


def test_time_is_charged_to_the_innermost_phase_only(fake_time):
    clock = timing.PhaseClock(started=fake_time.now - 3.0, first=timing.STARTUP)
    fake_time.now += 1.0  # start-up until the first phase: 3 + 1 s
    with clock.phase("measurements"):
        fake_time.now += 2.0
        with clock.phase("fit and bootstrap"):  # a refit between rounds
            fake_time.now += 0.5
        fake_time.now += 2.0
    fake_time.now += 0.25  # in no phase
    with clock.phase("fit and bootstrap"):
        fake_time.now += 1.0
    snapshot = clock.snapshot()
    assert snapshot == {"whole": 9.75, "other": 0.25,
                        "phases": {"start-up and imports": 4.0, "measurements": 4.0,
                                   "fit and bootstrap": 1.5}}
    assert list(snapshot["phases"]) == ["start-up and imports", "measurements",
                                        "fit and bootstrap"]  # the order first entered


def test_a_nested_run_clock_keeps_its_own_phases_and_adds_them_to_the_outer(fake_time):
    with timing.run_clock() as outer:
        with timing.phase("model load"):
            fake_time.now += 5.0
        with timing.run_clock() as cell:  # a sweep's cell
            assert timing.current() is cell
            with timing.phase("measurements"):
                fake_time.now += 7.0
            fake_time.now += 1.0  # the cell's own other time
        assert timing.current() is outer
    assert cell.snapshot()["phases"] == {"measurements": 7.0}
    assert outer.snapshot()["phases"] == {"model load": 5.0, "measurements": 7.0}
    assert outer.snapshot()["whole"] == 13.0
    assert timing.current() is None
    with timing.phase("anything"):  # no command running: nothing recorded, no error
        pass


def test_the_timings_line_puts_the_largest_phase_first_and_counts_sessions():
    one = {"whole": 97.0, "other": 0.4,
           "phases": {"model load": 12.0, "measurements": 37.04, "prior": 0.01}}
    assert timing.timings_line([one]) == (
        "1.6 min whole: measurements 37 s, model load 12 s, other 0.4 s")
    assert timing.timings_line([one, {"whole": 3.0, "phases": {}, "other": 3.0}]) == (
        "3.0 s whole: other 3.0 s (this session; the run took 2 sessions, 1.7 min in all)")


def test_process_age_counts_from_the_start_of_the_process():
    code = ("import time; time.sleep(1.0); from lm_eval_headloc.common.timing import process_age; "
            "print(process_age())")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               check=True).stdout)
    assert 1.0 <= age < 30.0


def _locate(model_dir, out, *extra):
    return harness("locate", "--model-args", f"pretrained={model_dir},dtype=float32",
                   "--include-path", TASKS, "--tasks", "tiny_choice", "--masks", "8",
                   "--sparsity", "0.25", "--num-samples", "6", "--top-k", "2",
                   "--prior", "atp-path", "--confirm", "4", *extra, "--out", str(out))


def test_a_locate_run_records_each_phase_and_says_them(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _locate(tiny_model_dir("llama"), out) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    config = json.loads((out / "config.json").read_text())
    [session] = config["timings"]
    phases = session["phases"]
    assert set(phases) == {"start-up and imports", "tasks and checks", "model load",
                           "measurement set-up", "prior", "head types", "design",
                           "measurements", "fit and bootstrap", "report"}
    assert all(seconds >= 0 for seconds in phases.values())
    # The phases and the rest add up to the whole (each rounded to 0.01 s).
    assert sum(phases.values()) + session["other"] == pytest.approx(session["whole"],
                                                                    abs=0.06)
    report = (out / "report.md").read_text()
    # The report's own time is in what it says (recorded as report.md is written).
    assert phases["report"] > 0
    assert f"- time: {timing.timings_line([session])} (config.json's timings)" in report
    # The last line: the same phases, the whole command (its report written) included.
    assert printed[-1].startswith("Time: ")
    whole = printed[-1].removeprefix("Time: ").split(" whole")[0]
    assert float(whole.split()[0]) * (60 if whole.endswith("min") else 1) >= \
        session["whole"] - 0.05


def test_a_resumed_run_adds_a_session(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    assert _locate(tiny_model_dir("llama"), out, "--masks", "4") == 0
    assert _locate(tiny_model_dir("llama"), out, "--masks", "8") == 0
    sessions = json.loads((out / "config.json").read_text())["timings"]
    assert len(sessions) == 2
    assert "measurements" in sessions[1]["phases"]
    assert "2 sessions" in (out / "report.md").read_text()


def test_the_console_script_counts_start_up_from_the_process_start(tiny_model_dir, tmp_path,
                                                                   monkeypatch):
    from lm_eval_headloc.cli import console

    monkeypatch.setattr(timing, "process_age", lambda: 50.0)  # as if started 50 s ago
    out = tmp_path / "types"
    assert console.main(["types", "--model-args",
                         f"pretrained={tiny_model_dir('llama')},dtype=float32",
                         "--include-path", TASKS, "--tasks", "tiny_choice", "--num-samples",
                         "4", "--probe-rows", "4", "--out", str(out)]) == 0
    [session] = json.loads((out / "config.json").read_text())["timings"]
    assert session["phases"]["start-up and imports"] >= 50.0
    assert {"model load", "head types"} <= set(session["phases"])
    assert session["whole"] >= 50.0


def test_verify_records_its_phases(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    assert _locate(tiny_model_dir("llama"), run) == 0
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "2", "--random-draws", "1", "--general",
                   "tiny_copy", "--out", str(out)) == 0
    [session] = json.loads((out / "config.json").read_text())["timings"]
    assert {"tasks and checks", "model load", "measurements"} <= set(session["phases"])
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("Time: ")


def test_a_program_a_script_execs_counts_its_start_up_from_its_own_start():
    """scripts/run_default.sh ran pip, then exec'd headloc-harness: the process's age
    counted the install as "start-up and imports" (3.2 min on a first run)."""
    probe = "from lm_eval_headloc.common.timing import process_age; print(process_age())"
    script = f"sleep 2.5; exec {sys.executable} -c '{probe}'"
    age = float(subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                               check=True).stdout)
    assert 0.0 <= age < 1.5
    # Without the start-up hook's note (python -S: no .pth file read), the process's age.
    root = Path(__file__).resolve().parent.parent
    bare = f"sleep 1.5; PYTHONPATH={root} exec {sys.executable} -S -c '{probe}'"
    assert float(subprocess.run(["bash", "-c", bare], capture_output=True, text=True,
                                check=True).stdout) >= 1.5
