"""Run folders (``runs.folder``): a command never touches what is not its own (a
user's files, another run, the run it reads), --force deletes only what the commands wrote,
one process at a time holds a folder, a run's identity decides whether a folder resumes or
is refused, and the measurements on disk keep every good line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import (
    LASSO_ONLY,
    TASKS,
    assert_names,
    fake_run,
    harness,
    last_error,
    raises_naming,
    strict_json,
    tiny_args,
    write_heads,
)

from lm_eval_headloc.runs.spec import RunSpec


def test_force_never_clears_a_folder_that_is_not_a_run(tiny_model_dir, tmp_path, capsys,
                                                        no_model_loading):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for force in ([], ["--force"]):
        code = harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--out", str(precious), *force)
        assert code == 2
        assert_names(last_error(capsys), str(precious))
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in precious.iterdir()) == ["thesis.tex"]


@pytest.mark.parametrize("config_text", ["", '{"command": "loc', '{"a": 1}', "[1, 2]"])
def test_unreadable_or_foreign_config_is_one_line_and_kept(tiny_model_dir, tmp_path, capsys,
                                                           no_model_loading, config_text):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(config_text)
    model = tiny_args(tiny_model_dir("llama"))
    for args in (["locate", *model, "--tasks", "tiny_copy", "--out", str(run), "--force"],
                 ["refit", str(run)], ["verify", str(run)]):
        assert harness(*args) == 2, args
        message = last_error(capsys)
        assert "config.json" in message and "headloc-harness" in message, message
    assert (run / "config.json").read_text() == config_text


def test_out_that_is_a_file_or_cannot_be_created(tiny_model_dir, tmp_path, capsys,
                                                 no_model_loading):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    model = tiny_args(tiny_model_dir("llama"))
    assert harness("locate", *model, "--tasks", "tiny_copy", "--out", str(a_file)) == 2
    assert_names(last_error(capsys), f"--out {a_file}")
    assert harness("locate", *model, "--tasks", "tiny_copy",
                   "--out", str(a_file / "run")) == 2
    assert_names(last_error(capsys), str(a_file / "run"))
    assert a_file.read_text() == "keep"


def test_verify_never_writes_into_the_run_it_reads(tiny_model_dir, tmp_path, capsys,
                                                   no_model_loading):
    run = fake_run(tmp_path / "runs" / "a", tiny_model_dir("llama"))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for out in (run, tmp_path / "runs", tmp_path):
        assert harness("verify", str(run), "--out", str(out), "--force") == 2
        assert_names(last_error(capsys), f"--out {out}", str(run))  # and the run it reads
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_lm_eval_files_never_go_into_a_run_the_command_reads(tiny_model_dir, tmp_path,
                                                               capsys, no_model_loading):
    # lm-eval's results folders in RUN would make RUN a folder --force refuses to clear.
    run = fake_run(tmp_path / "runs" / "a", tiny_model_dir("llama"))
    before = sorted(p.name for p in run.iterdir())
    for where in (run, run / "lm_eval", run / "results.json"):
        assert harness("verify", str(run), "--output-path", str(where),
                       "--out", str(tmp_path / "v")) == 2
        assert_names(last_error(capsys), f"--output-path {where}", str(run),
                     f"--out {tmp_path / 'v'}")  # where it may write instead
    assert harness("cross", str(run), "--output-path", str(run / "lm_eval"),
                   "--out", str(tmp_path / "c")) == 2
    assert_names(last_error(capsys), f"--output-path {run / 'lm_eval'}", str(run))
    assert sorted(p.name for p in run.iterdir()) == before
    # Nor into another run folder of ours, which they do not read.
    other = fake_run(tmp_path / "runs" / "b", tiny_model_dir("llama"))
    assert harness("verify", str(run), "--output-path", str(other / "lm"),
                   "--out", str(tmp_path / "v")) == 2
    assert_names(last_error(capsys), f"--output-path {other / 'lm'}", str(other.resolve()),
                 f"--out {tmp_path / 'v'}")
    assert not (tmp_path / "v").exists() and not (tmp_path / "c").exists()


def test_a_second_process_on_the_same_folder_is_refused(tiny_model_dir, tmp_path, capsys,
                                                        no_model_loading):
    from lm_eval_headloc.runs.folder import RunFolder

    out = tmp_path / "run"
    spec = RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32",
                   tasks=("tiny_copy",), include_path=(TASKS,))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from lm_eval_headloc.runs.folder import RunFolder\n"
         "f = RunFolder(sys.argv[1]); f.start('locate', {}, {}); print('held', flush=True)\n"
         "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--out", str(out), "--force") == 2
        assert_names(last_error(capsys), str(out), f"PID {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    # Released with its process: the folder can be taken now.
    with RunFolder(out) as folder:
        folder.start("locate", spec.identity("locate"), {}, force=True)


def test_changing_any_identity_field_refuses_the_folder(tmp_path):
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.spec import RESULT, SETTING

    base = RunSpec()
    changed_values = {
        "model_args": "pretrained=other", "tasks": ("tiny_copy",), "include_path": ("/x",),
        "num_samples": 7, "seed": 3, "apply_chat_template": False, "never_ablate": "L0H0",
        "signal": "logprob", "bootstrap": 9, "design_seed": 4, "max_masks": 12, "prior": "atp",
        "design": "bernoulli", "masks": 7, "sparsity": 0.3, "alpha": 0.5, "top_k": 2,
        "exclude": "L0H1", "rounds": 2, "general": ("boolq",), "limit": 3, "confirm": 3,
        "ablation": "mean", "scale": 2.0, "ablation_data": "reference.txt",
        "ablation_field": "prompt", "random_draws": 2, "components": "heads+neurons",
        "candidates": 9, "examples_part": "1/2", "neuron_groups": 2, "num_fewshot": 5,
        "gen_kwargs": '{"max_gen_toks": 8}', "system_instruction": "Be brief.",
        "probe_rows": 8, "group_tests": 3, "max_measurements": 80,
    }
    from dataclasses import fields

    roles = {f.name: f.metadata["role"] for f in fields(RunSpec)}
    assert set(changed_values) == {n for n, r in roles.items() if r in (RESULT, SETTING)}
    # What each command's measurements depend on, written out: the options every
    # measuring command shares, and its own (a refittable setting resumes).
    shared = {"model_args", "tasks", "include_path", "num_samples", "seed", "examples_part",
              "apply_chat_template", "num_fewshot", "gen_kwargs", "system_instruction",
              "signal", "never_ablate", "exclude", "top_k", "ablation", "scale",
              "ablation_data", "ablation_field"}
    design = {"design", "design_seed", "prior", "confirm", "alpha", "bootstrap",
              "components", "candidates", "neuron_groups"}
    refusing = {"locate": (shared | design | {"sparsity"}) - {"alpha", "top_k", "exclude",
                                                                "bootstrap", "confirm"},
                "greedy": (shared - {"top_k"}) | {"rounds"},
                "sweep": shared | design,
                "verify": shared | {"general", "limit"}, "cross": shared,
                "types": shared | {"probe_rows"}}
    for command in ("locate", "greedy", "sweep", "verify", "cross", "types"):
        folder = tmp_path / command
        with RunFolder(folder) as run:
            run.start(command, base.identity(command), base.settings(command))
        # A measurement on disk: a folder that recorded nothing past its start would be
        # started over (test_user_mistakes), not refused.
        (folder / "measurements.jsonl").write_text('{"key": "baseline"}\n')
        for name, value in changed_values.items():
            other = base.replace(**{name: value})
            resumable = name not in refusing[command]
            with RunFolder(folder) as run:
                if resumable:
                    assert run.start(command, other.identity(command), other.settings(command))
                else:
                    with raises_naming(RunFolderError, name):
                        run.start(command, other.identity(command), other.settings(command))
        # Runtime options never refuse a folder.
        fast = base.replace(batch_size=4, masks_per_pass=8, verbose=True, progress=False,
                            confirm_run_unsafe_code=True)
        with RunFolder(folder) as run:
            assert run.start(command, fast.identity(command), fast.settings(command))


def test_measurement_log_keeps_every_good_line(tmp_path, caplog):
    from lm_eval_headloc.runs.folder import RunFolder

    folder = RunFolder(tmp_path)
    records = [{"key": f"mask-{i:04d}", "mask": f"L0H{i}", "scores": {"t": i / 10}}
               for i in range(6)]
    lines = [json.dumps(r) for r in records]
    lines[2] = lines[2][:15]  # corrupt in the middle
    lines.insert(4, "{}")  # valid JSON, not a measurement
    (tmp_path / "measurements.jsonl").write_text("\n".join(lines) + "\n" + '{"key": "ma')
    with caplog.at_level("WARNING", logger="lm_eval_headloc"):
        folder._acquire()  # the lock's holder cuts a torn last line
        kept = folder.measurements()
        folder.release()
    assert [r["key"] for r in kept] == ["mask-0000", "mask-0001", "mask-0003", "mask-0004",
                                        "mask-0005"]
    warnings = [r.getMessage() for r in caplog.records]
    assert any("line 3 is not a measurement" in w for w in warnings)
    assert any("line 5 is not a measurement" in w for w in warnings)
    assert any("unfinished last line" in w for w in warnings)
    # Only the torn tail was cut; the bad middle lines stay for the user to see.
    assert (tmp_path / "measurements.jsonl").read_text() == "\n".join(lines) + "\n"


def test_run_folder_json_puts_a_list_of_numbers_on_one_line_and_reads_back_exactly(
        tmp_path):
    from lm_eval_headloc.runs.folder import RunFolder

    awkward = [1e-300, -0.0, 0.1 + 0.2, 5e-324, 2**70, -(10**30), 1.7976931348623157e308,
               True, 0, float("nan"), float("inf")]
    data = {"effects": [1.5, -0.25, *awkward], "at": {"points": [[0.5, 1], [2]],
            "names": ["L0H1", "L2H3"], "empty": [], "none": {}}, 7: 0.1}
    RunFolder(tmp_path).write_json("prior.json", data)
    text = (tmp_path / "prior.json").read_text()
    lines = text.splitlines()
    assert lines[1] == ('  "effects": [1.5, -0.25, 1e-300, -0.0, 0.30000000000000004, '
                        '5e-324, 1180591620717411303424, -1000000000000000000000000000000, '
                        '1.7976931348623157e+308, true, 0, null, null],')
    # Objects, and lists of anything but numbers, stay one item a line.
    assert lines[2:12] == ['  "at": {', '    "points": [', '      [0.5, 1],', '      [2]',
                           '    ],', '    "names": [', '      "L0H1",', '      "L2H3"',
                           '    ],', '    "empty": [],']
    back = strict_json(tmp_path / "prior.json")
    expected = json.loads(json.dumps(data).replace("NaN", "null").replace("Infinity", "null"))
    assert back == expected and list(back) == ["effects", "at", "7"]
    # float for float: -0.0 == 0.0 and 5e-324 == 5e-324 hide nothing from repr.
    assert [repr(x) for x in back["effects"]] == [repr(x) for x in expected["effects"]]
    assert [type(x) for x in back["effects"]] == [type(x) for x in expected["effects"]]
    # Without a list of numbers the layout is json's indent=2, byte for byte.
    rest = {k: v for k, v in data["at"].items() if k != "points"}
    RunFolder(tmp_path).write_json("sweep.json", rest)
    assert (tmp_path / "sweep.json").read_text() == json.dumps(rest, indent=2) + "\n"


def test_a_folder_of_another_run_is_refused_unless_forced(tiny_model_dir, tmp_path, capsys):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out",
            str(tmp_path / "run")]
    assert harness(*args) == 0
    assert harness(*args, "--seed", "1") == 2
    assert_names(last_error(capsys), "seed=0", "1")
    assert harness(*args, "--seed", "1", "--force") == 0
    assert strict_json(tmp_path / "run" / "config.json")["identity"]["seed"] == 1


def test_force_deletes_only_what_the_commands_wrote(tiny_model_dir, tmp_path, capsys):
    """--force deleted everything in a run folder but its lock: a user's notes, their
    analysis folder, a nested run another process was working in. Now it refuses while
    anything there is not the commands' own, and deletes nothing then."""
    from lm_eval_headloc.runs.folder import RunFolder

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out", str(run)]
    assert harness(*args) == 0
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                   "--random-draws", "0", "--limit", "4") == 0  # into run/verify
    written = sorted(p.relative_to(run) for p in run.rglob("*"))
    (run / "notes.md").write_text("mine")
    (run / "verify" / "plot.py").write_text("mine too")
    assert harness(*args, "--seed", "1", "--force") == 2
    assert_names(last_error(capsys), "--force", str(run), "notes.md, verify/plot.py")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == sorted(
        [*written, Path("notes.md"), Path("verify/plot.py")])
    (run / "notes.md").unlink()
    (run / "verify" / "plot.py").unlink()
    # A nested run another process holds is not deleted under it.
    with RunFolder(run / "verify").lock():
        assert harness(*args, "--seed", "1", "--force") == 2
        assert_names(last_error(capsys), str(run / "verify"), f"PID {os.getpid()}")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == written
    # Only its own files: cleared, the nested verify with them, and the run starts over.
    assert harness(*args, "--seed", "1", "--force") == 0
    assert not (run / "verify").exists()
    assert strict_json(run / "config.json")["identity"]["seed"] == 1


def test_force_deletes_only_what_this_run_wrote(tiny_model_dir, tmp_path, capsys):
    """--force deleted a user's heads-mine.json and heads-notes.csv (named like a ranking,
    of no task of the run), their timing.json (named like the recovery benchmark's file)
    and a copy of another run put inside the folder (a run folder of
    ours, not this run's). Only the run's own tasks' rankings and its own nested runs (its
    verify/, a sweep's cells) are its to delete."""
    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out", str(run)]
    assert harness(*args) == 0
    shutil.copytree(run, tmp_path / "backup")
    shutil.copytree(tmp_path / "backup", run / "backup")
    (run / "heads-mine.json").write_text("[]")
    (run / "heads-notes.csv").write_text("mine")
    # The recovery benchmark's file name, in a locate run's folder: the user's own.
    (run / "timing.json").write_text('{"locate_seconds": 12}')
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert harness(*args, "--seed", "1", "--force") == 2
    assert_names(last_error(capsys), "--force", str(run), "backup", "heads-mine.json",
                 "heads-notes.csv", "timing.json")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    shutil.rmtree(run / "backup")
    (run / "heads-mine.json").unlink()
    (run / "heads-notes.csv").unlink()
    (run / "timing.json").unlink()
    assert (run / "heads-tiny_copy.json").is_file()  # the run's own: cleared
    assert harness(*args, "--seed", "1", "--force") == 0
    assert strict_json(run / "config.json")["identity"]["seed"] == 1


def test_force_clears_a_nested_run_killed_before_it_started(tiny_model_dir, tmp_path,
                                                            capsys):
    """A verify/ (or a sweep's cell) killed before its first config.json was written,
    holding nothing or only its lock and our partial file, made --force refuse the run as
    holding what it did not write. It is the run's own; anything else in it is not."""
    from lm_eval_headloc.runs import folder as folders

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out", str(run)]
    assert harness(*args) == 0
    (run / "verify").mkdir()
    (run / "verify" / ".lock").write_text("123\n")
    (run / "verify" / ".config.json.123.partial").write_text('{"command": "ver')
    (run / "other").mkdir()  # empty, but named as no nested run of this one
    assert harness(*args, "--seed", "1", "--force") == 2
    assert_names(last_error(capsys), "--force", str(run), "(other)")
    (run / "other").rmdir()
    (run / "verify" / "notes.md").write_text("mine")
    assert harness(*args, "--seed", "1", "--force") == 2
    assert_names(last_error(capsys), "--force", str(run), "(verify)")
    (run / "verify" / "notes.md").unlink()
    assert harness(*args, "--seed", "1", "--force") == 0
    assert not (run / "verify").exists()
    assert strict_json(run / "config.json")["identity"]["seed"] == 1
    # A sweep's cell, empty: its own; a folder of another name is not.
    sweep = {"command": "sweep", "identity": {"masks": [3], "sparsity": [0.25]}}
    for name in ("m3-p0.25", "m4-p0.25"):
        (tmp_path / name).mkdir()
    assert folders._nested_run(tmp_path / "m3-p0.25", sweep) is not None
    assert folders._nested_run(tmp_path / "m4-p0.25", sweep) is None


@pytest.mark.parametrize("field", ["higher_is_better", "metrics"])
def test_a_baseline_without_its_direction_or_metric_is_skipped(tiny_model_dir, tmp_path,
                                                              capsys, field):
    """A baseline record edited to drop higher_is_better (or metrics) ended refit and a
    resumed run in a KeyError traceback. It is skipped with a line naming the file and
    the record, as other unusable records are, and measured again."""
    from lm_eval_headloc.measurement.store import MemoryStore, StoreError

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", *LASSO_ONLY,
            "--out", str(run)]
    assert harness(*args) == 0
    path = run / "measurements.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["key"] == "baseline":
            del record[field]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert harness("refit", str(run)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert_names(err, f"{path} line 1 (baseline)", field)
    assert harness(*args) == 0  # measured again
    with pytest.raises(StoreError, match=f"records\\[0\\] \\(baseline\\).*{field}"):
        MemoryStore(records[:1])


def test_a_kill_during_the_first_config_write_leaves_a_usable_folder(tiny_model_dir, tmp_path):
    """A kill between writing config.json's partial file and its rename left a folder of
    .lock and .config.json.<pid>.partial, refused for ever ("not a run folder")."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").write_text("123\n")
    (run / ".config.json.123.partial").write_text('{"command": "loc')
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out",
                   str(run)) == 0
    assert not list(run.glob("*.partial"))
    assert strict_json(run / "config.json")["command"] == "locate"


def _started_run(folder: Path) -> Path:
    from lm_eval_headloc.runs.folder import RunFolder

    with RunFolder(folder) as run:
        run.start("locate", {"seed": 0}, {})
    return folder


def test_force_refuses_a_users_entry_under_one_of_our_names(tmp_path):
    """--force cleared any entry whose name the commands write: a user's notes in means/
    (a folder of cached means, ours only by name) and a folder named heads-archive.json
    were deleted whole. Only our kind of entry, holding only our files, is ours."""
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError

    run = _started_run(tmp_path / "run")
    (run / "means").mkdir()
    (run / "means" / "my-notes.txt").write_text("mine")
    (run / "heads-archive.json").mkdir()
    (run / "heads-archive.json" / "run1.txt").write_text("old")
    with RunFolder(run) as folder, raises_naming(RunFolderError, "--force", str(run),
                                                 "heads-archive.json, means"):
        folder.start("locate", {"seed": 1}, {}, force=True)
    assert (run / "means" / "my-notes.txt").read_text() == "mine"
    assert (run / "heads-archive.json" / "run1.txt").read_text() == "old"
    # Our cached means (and a killed write's partial of one) are ours: cleared.
    (run / "means" / "my-notes.txt").unlink()
    shutil.rmtree(run / "heads-archive.json")
    (run / "means" / f"means-{'0' * 20}.pt").write_bytes(b"x")
    (run / "means" / f".means-{'0' * 20}.pt.77.partial").write_bytes(b"x")
    with RunFolder(run) as folder:
        folder.start("locate", {"seed": 1}, {}, force=True)
    assert not (run / "means").exists()


def test_only_our_own_partial_files_are_cleared(tmp_path, capsys, tiny_model_dir):
    """Any .*.partial counted as ours: a user's .thesis.partial made a folder 'empty' and
    was deleted when the run started. Ours are .<a file we write>.<pid>.partial."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / ".thesis.partial").write_text("my draft")
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "3", "--num-samples", "4", "--out", str(folder)) == 2
    assert_names(last_error(capsys), str(folder))
    assert (folder / ".thesis.partial").read_text() == "my draft"


def test_a_lock_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    """The lock was opened through a link and truncated: a .lock linked to a user's file
    replaced its content with a process id."""
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError

    run = _started_run(tmp_path / "run")
    precious = tmp_path / "precious.txt"
    precious.write_text("important data\n")
    (run / ".lock").unlink(missing_ok=True)  # released: removed already
    (run / ".lock").symlink_to(precious)
    with raises_naming(RunFolderError, str(run / ".lock")):
        RunFolder(run).lock()
    assert precious.read_text() == "important data\n"
    (run / ".lock").unlink()
    (run / ".lock").mkdir()
    with raises_naming(RunFolderError, str(run / ".lock")):
        RunFolder(run).lock()


def test_a_torn_last_line_is_cut_only_by_the_locks_holder(tmp_path):
    """A refused second process (reading before it asked for the lock) cut the live run's
    half-written last line, so the rest of that line landed as garbage."""
    from lm_eval_headloc.runs.folder import RunFolder

    run = _started_run(tmp_path / "run")
    whole = json.dumps({"key": "mask-0000", "mask": "L0H1", "scores": {"t": 0.5}}) + "\n"
    (run / "measurements.jsonl").write_text(whole + '{"key": "mask-00')
    assert [r["key"] for r in RunFolder(run).measurements()] == ["mask-0000"]
    assert (run / "measurements.jsonl").read_text() == whole + '{"key": "mask-00'
    with RunFolder(run).lock() as holder:
        assert [r["key"] for r in holder.measurements()] == ["mask-0000"]
    assert (run / "measurements.jsonl").read_text() == whole


def test_no_file_command_writes_into_another_run_folder(tmp_path, capsys, tiny_locate_run):
    """universal, overlap and export wrote their files into any run folder they did not
    read: a heads-mine.json there then read as that run's ranking of a task 'mine', and a
    --force on it deleted the file unasked."""
    runs = [write_heads(tmp_path / "a", "t", ["L0H1", "L1H0"]),
            write_heads(tmp_path / "b", "t", ["L1H0", "L0H1"])]
    other = write_heads(tmp_path / "c", "t", ["L0H0"])
    for args in (["universal", *map(str, runs), "--min-tasks", "1", "--out",
                  str(other / "heads-mine.json")],
                 ["overlap", *map(str, runs), "--out", str(other / "sub" / "o.json")],
                 ["export", str(tiny_locate_run), "--out", str(other / "heads-mib.json")]):
        assert harness(*args) == 2
        assert_names(last_error(capsys), str(other.resolve()))
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "heads-t.json"]
    # A link as --out is refused, not replaced by a file (its target left stale).
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    for args in (["universal", *map(str, runs), "--out", str(tmp_path / "link.json")],
                 ["overlap", *map(str, runs), "--out", str(tmp_path / "link.json")],
                 ["export", str(tiny_locate_run), "--out", str(tmp_path / "link.json")]):
        assert harness(*args) == 2
        assert_names(last_error(capsys), str(tmp_path / "link.json"))
        assert (tmp_path / "link.json").is_symlink()
    (tmp_path / "table.md").symlink_to(tmp_path / "real.json")  # overlap's second file
    assert harness("overlap", *map(str, runs), "--top-k", "2", "--out",
                   str(tmp_path / "table.json")) == 2
    assert_names(last_error(capsys), str(tmp_path / "table.md"))
    # A heads-x.json that is not one of the run's tasks is not read as a ranking.
    (other / "heads-planted.json").write_text(json.dumps(["L9H9"]))
    assert harness("universal", str(other), str(runs[0]), "--min-tasks", "1", "--top-k",
                   "2", "--out", str(tmp_path / "u.json")) == 0
    assert not any("planted" in label for label in strict_json(tmp_path / "u.json")["rankings"])


def test_a_run_folder_made_unwritable_is_one_line(tiny_locate_run, tmp_path, capsys,
                                                   monkeypatch):
    import lm_eval_headloc.runs.folder as runfolder

    def refused(path, write):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runfolder, "write_atomically", refused)
    assert harness("refit", str(tiny_locate_run), "--alpha", "0.05") == 2
    assert_names(last_error(capsys), str(tiny_locate_run / "config.json"), "Permission denied")


def test_an_empty_out_is_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--out", "") == 2
    assert_names(last_error(capsys), "--out", "''")
    assert list(tmp_path.iterdir()) == []


def test_a_run_resumes_with_its_model_args_in_another_order(tmp_path):
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.record import start_run

    first = RunSpec(model_args="pretrained=m,dtype=float32,device=cuda", tasks=("t",))
    with RunFolder(tmp_path / "run") as folder:
        start_run(folder, "locate", first)
        folder.append_measurement({"key": "mask-0000", "mask": "", "scores": {"t": 1.0}})
    again = first.replace(model_args="dtype=float32,pretrained=m,device=cpu")
    with RunFolder(tmp_path / "run") as folder:
        start_run(folder, "locate", again)  # resumed, not refused
        assert [r["key"] for r in folder.measurements()] == ["mask-0000"]
    changed = first.replace(model_args="pretrained=m,dtype=bfloat16")
    with RunFolder(tmp_path / "run") as folder, raises_naming(RunFolderError,
                                                              "model_args"):
        start_run(folder, "locate", changed)


def test_a_folder_made_before_an_option_existed_resumes_as_it_was_made(tmp_path):
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError

    # A folder made before --signal, --prior and --confirm existed: it measured the task
    # metric with no prior and confirmed nothing, which is not what today's defaults do.
    # (--confirm is a setting now: resuming with one confirms on top of the masks.)
    legacy = RunSpec(prior="none", confirm=0)
    old = {**legacy.identity("locate"), "confirm": 0}
    del old["signal"], old["prior"], old["confirm"]
    folder = tmp_path / "old"
    with RunFolder(folder) as run:
        run.start("locate", old, {})
    # It measured: a folder that recorded nothing would be started over, not refused.
    (folder / "measurements.jsonl").write_text('{"key": "baseline"}\n')
    with RunFolder(folder) as run:
        assert run.start("locate", legacy.identity("locate"), {},
                         assumed=RunSpec.assumed_for_old_runs())
    with RunFolder(folder) as run, raises_naming(RunFolderError, "prior='none'"):
        run.start("locate", RunSpec(confirm=0).identity("locate"), {},
                  assumed=RunSpec.assumed_for_old_runs())
    stored = RunSpec.from_config({"identity": old})
    assert (stored.signal, stored.prior, stored.confirm) == ("metric", "none", 0)
    # A greedy folder from when every command recorded locate's design (masks=100, ...)
    # resumes though those defaults changed: they never made its measurements.
    wide = {**RunSpec().identity("greedy"), "masks": 100, "sparsity": 0.02, "alpha": 0.01}
    with RunFolder(tmp_path / "greedy") as run:
        run.start("greedy", wide, {})
    with RunFolder(tmp_path / "greedy") as run:
        assert run.start("greedy", RunSpec().identity("greedy"), {},
                         assumed=RunSpec.assumed_for_old_runs())
    with RunFolder(folder) as run, raises_naming(RunFolderError, "signal='metric'"):
        run.start("locate", legacy.replace(signal="logprob").identity("locate"), {},
                  assumed=RunSpec.assumed_for_old_runs())


def test_a_refused_run_folder_leaves_no_output_path_behind(tiny_model_dir, tmp_path, capsys,
                                                           no_model_loading):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                   "--random-draws", "0", "--out", str(mine),
                   "--output-path", str(tmp_path / "brand" / "new")) == 2
    assert_names(last_error(capsys), str(mine))
    assert not (tmp_path / "brand").exists()


def test_a_whole_last_measurement_without_its_newline_is_kept(tmp_path):
    """A last line that parses as a whole measurement lost only its newline (an editor, a
    copy): it was cut as "unfinished" and measured again, gone even where the model then
    failed to load. It is kept, and the lock's holder adds the newline."""
    from lm_eval_headloc.runs.folder import RunFolder

    run = _started_run(tmp_path / "run")
    first = json.dumps({"key": "mask-0000", "mask": "L0H1", "scores": {"t": 0.5}})
    last = json.dumps({"key": "mask-0001", "mask": "L1H0", "scores": {"t": 0.25}})
    (run / "measurements.jsonl").write_text(first + "\n" + last)
    assert [r["key"] for r in RunFolder(run).measurements()] == ["mask-0000", "mask-0001"]
    assert (run / "measurements.jsonl").read_text() == first + "\n" + last  # reader: as is
    with RunFolder(run).lock() as holder:
        assert [r["key"] for r in holder.measurements()] == ["mask-0000", "mask-0001"]
        holder.append_measurement({"key": "mask-0002", "mask": "L1H1", "scores": {"t": 0.0}})
        assert [r["key"] for r in holder.measurements()] == ["mask-0000", "mask-0001",
                                                             "mask-0002"]
    assert (run / "measurements.jsonl").read_text().startswith(first + "\n" + last + "\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_in_place_of_a_runs_file_is_refused_not_waited_on(tmp_path):
    """A FIFO as measurements.jsonl hung locate for ever after the baseline (the append
    waits for a reader)."""
    from lm_eval_headloc.runs.folder import RunFolder, RunFolderError

    run = _started_run(tmp_path / "run")
    (run / "measurements.jsonl").unlink(missing_ok=True)
    os.mkfifo(run / "measurements.jsonl")
    for call in (lambda f: f.measurements(),
                 lambda f: f.append_measurement({"key": "baseline", "mask": "",
                                                 "scores": {"t": 0.5}})):
        with pytest.raises(RunFolderError, match="not a regular file"):
            call(RunFolder(run))


def test_no_lock_is_left_behind_and_a_stale_one_is_taken_over(tmp_path):
    """A .lock with a dead PID stayed in runs/locate/ after every successful run."""
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError

    run = _started_run(tmp_path / "run")
    assert not (run / ".lock").exists()
    (run / ".lock").write_text("999999999\n")  # left by a killed process: no flock on it
    with RunFolder(run).lock():
        assert (run / ".lock").read_text() == f"{os.getpid()}\n"
        with raises_naming(RunFolderError, str(run), str(os.getpid())):
            RunFolder(run).lock()  # held: a second holder is refused
        assert (run / ".lock").is_file()
    assert not (run / ".lock").exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_in_place_of_a_runs_output_is_refused_when_it_resumes(tmp_path):
    """A FIFO as report.md was refused only when the report was written, after every
    measurement of the resumed run; it is refused as the run resumes now."""
    from lm_eval_headloc.runs.folder import RunFolder, RunFolderError

    run = _started_run(tmp_path / "run")
    os.mkfifo(run / "report.md")
    with RunFolder(run) as folder, pytest.raises(RunFolderError,
                                                 match="report.md is a FIFO, not a regular"):
        folder.start("locate", {"seed": 0}, {})


def test_a_full_disk_while_a_measurement_is_written_is_one_line(tiny_model_dir, tmp_path,
                                                                capsys, monkeypatch):
    """A disk that filled up during a run ended it in a traceback of some 30 lines
    (OSError: No space left on device) out of measurements.jsonl's append; the rerun
    keeps the lines before it."""
    import errno

    real = os.fsync
    calls = []

    def full(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--prior", "none", "--confirm", "0", "--masks", "5",
            "--out", str(run)]
    with monkeypatch.context() as patched:
        patched.setattr(os, "fsync", full)
        assert harness(*args) == 2
    assert_names(last_error(capsys), str(run / "measurements.jsonl"),
                 "No space left on device")
    assert harness(*args) == 0


@pytest.mark.parametrize("name", ["heatmap.png", "design_matrix.npy"])
def test_a_full_disk_while_a_figure_or_the_design_is_written_is_one_line(
        tiny_model_dir, tmp_path, capsys, monkeypatch, name):
    """heatmap.png and design_matrix.npy were written outside the folder's one-line
    errors: a full disk there ended the run in a traceback."""
    import errno
    import importlib

    from matplotlib.figure import Figure

    locating = importlib.import_module("lm_eval_headloc.commands.locate")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--prior", "none", "--confirm", "0", "--masks", "3",
            "--out", str(run)]
    with monkeypatch.context() as patched:
        if name == "heatmap.png":
            patched.setattr(Figure, "savefig", full)
        else:
            patched.setattr(locating, "_save_array", full)
        assert harness(*args) == 2
    assert_names(last_error(capsys), f"cannot write {run / name}",
                 "No space left on device")


def test_a_force_cut_short_while_clearing_leaves_a_folder_force_clears(tiny_model_dir,
                                                                       tmp_path, monkeypatch):
    """--force stopped (Ctrl-C) while it cleared the run's files left a folder without its
    config.json, holding the rest of the run's files: refused for ever as no run of ours,
    --force included. config.json goes last, so a second --force clears it."""
    from lm_eval_headloc.runs import folder as folders

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out", str(run)]
    assert harness(*args) == 0
    deleted: list[str] = []
    real = folders._delete

    def cut_short(entry):
        if len(deleted) == 2:
            raise KeyboardInterrupt
        deleted.append(entry.name)
        real(entry)

    with monkeypatch.context() as patched:
        patched.setattr(folders, "_delete", cut_short)
        with pytest.raises(KeyboardInterrupt), folders.RunFolder(run) as folder:
            folder.start("locate", {"seed": 1}, {}, force=True)
    assert "config.json" not in deleted and (run / "config.json").is_file()
    assert harness(*args, "--seed", "1", "--force") == 0
    assert strict_json(run / "config.json")["identity"]["seed"] == 1
