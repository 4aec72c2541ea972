"""headloc-harness on tiny random models: every subcommand, resume, and bad arguments."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import TASKS

from lm_eval_headloc.commands import RunSpec, engine
from lm_eval_headloc.commands.cli import main
from lm_eval_headloc.heads import read_heads_file


def harness(*args: str) -> int:
    try:
        return main([*args])
    except SystemExit as exit_:  # argparse's own errors
        return exit_.code


#: locate's ranking from the masks' Lasso alone (before --confirm and --prior auto).
LASSO_ONLY = ["--prior", "none", "--confirm", "0"]


def tiny_args(folder) -> list[str]:
    return ["--model-args", f"pretrained={folder},dtype=float32", "--include-path", TASKS]


def strict_json(path: Path):
    """json.loads that refuses NaN/Infinity, as any strict JSON parser does."""
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def measurement_lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "measurements.jsonl").read_text().splitlines()]


def read_run(folder: Path) -> tuple[list[dict], dict]:
    return measurement_lines(folder), strict_json(folder / "heads.json")


def assert_same_run(resumed: Path, full: Path) -> None:
    """The same measurements (timings aside) and the same ranking."""
    resumed_records, resumed_heads = read_run(resumed)
    full_records, full_heads = read_run(full)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in resumed_records]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in full_records]
    assert resumed_heads == full_heads


def last_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    return err[-1]


@pytest.fixture(scope="module")
def tiny_locate_run(tiny_model_dir, tmp_path_factory):
    """A finished locate run on a tiny Llama (8 heads) to read, refit and verify: the
    Lasso's ranking alone (no prior, no confirmation)."""
    out = tmp_path_factory.mktemp("runs") / "locate"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "12", "--sparsity", "0.25", "--num-samples", "12",
                   "--top-k", "3", *LASSO_ONLY, "--out", str(out)) == 0
    return out


# --- every subcommand checks everything before loading weights ------------------------

LOCATE_BAD = [
    (["--tasks", "no_such_task"], "unknown task 'no_such_task'"),
    (["--model-args="], "--model-args '': give pretrained=<model>"),
    (["--include-path="], "--include-path '': give a folder of task YAMLs"),
    (["--exclude="], "--exclude '': give components (L0H1+L2H3) or a head file"),
    (["--never-ablate", " "], "--never-ablate '': give components (L0H1+L2H3) or a head file"),
    (["--sparsity", "1.5"], "--sparsity 1.5: must be a finite number strictly between 0 and 1"),
    (["--sparsity", "0"], "--sparsity 0.0: must be a finite number strictly between"),
    (["--sparsity", "nan"], "--sparsity nan: must be"),
    (["--sparsity", "x"], "--sparsity 'x': must be a number strictly between 0 and 1, or 'auto'"),
    (["--sparsity", "auto", "--masks", "5"], "--masks 5: --sparsity auto's pilot alone takes 5"),
    (["--alpha", "nan"], "--alpha nan: must be a finite number > 0"),
    (["--alpha", "inf"], "--alpha inf: must be a finite number > 0"),
    (["--alpha", "-1"], "--alpha -1.0: must be a finite number > 0"),
    (["--masks", "0"], "--masks 0: must be a whole number >= 2"),
    (["--masks", "1"], "--masks 1: must be a whole number >= 2"),
    (["--masks", "x"], "--masks 'x': must be a whole number >= 2 or 'auto'"),
    (["--masks", "auto", "--max-masks", "0"], "--max-masks 0: must be a whole number >= 1"),
    (["--masks", "auto", "--max-masks", "100000000"], "--max-masks 100000000: the design"),
    (["--masks", "1000000000"], "at most 33554432 masks fit the 256 MiB limit"),
    (["--masks", "100000000"], "--masks 100000000: the design (100000000 masks x 8 heads)"),
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--design-seed", "-2"], "--design-seed -2: must be a whole number >= 0"),
    (["--bootstrap", "1000000000"],
     "--bootstrap 1000000000: must be a whole number with 1 <= value <= 10000"),
    (["--bootstrap", "0"], "--bootstrap 0: must be a whole number"),
    (["--num-samples", "0"], "--num-samples 0: must be a whole number >= 1"),
    (["--masks-per-pass", "0"], "--masks-per-pass 0: must be a whole number >= 1"),
    (["--batch-size", "big"], "--batch-size 'big': must be a whole number >= 1, 'auto'"),
    (["--top-k", "9"], "--top-k 9: the model has only 8 heads"),
    (["--exclude", "L29H8"], "--exclude: head L29H8 is outside"),
    (["--never-ablate", "L0H5"], "--never-ablate: head L0H5 is outside"),
    (["--exclude", "L0H*+L1H*"], "--exclude covers every head (8); nothing is left to rank"),
    (["--never-ablate", "L0H*+L1H*"], "--never-ablate covers every head"),
    (["--design", "random"], "invalid choice: 'random'"),
    (["--signal", "loud"], "invalid choice: 'loud'"),
    (["--signal", "logprob", "--tasks", "tiny_choice:acc"],
     "--tasks tiny_choice:acc,none: a metric is used only with --signal metric"),
    (["--signal", "logprob", "--tasks", "tiny_rolling"],
     "--signal logprob: task 'tiny_rolling' is loglikelihood_rolling"),
    (["--tasks", "tiny_choice:bleu"], "produces no metric 'bleu,none'; it produces: acc,none"),
    (["--tasks", "tiny_unsafe"], "task 'tiny_unsafe' executes model-written code; rerun with "
                                 "--confirm-run-unsafe-code"),
]


GREEDY_BAD = [
    (["--seed", "-1"], "--seed -1: must be a whole number >= 0"),
    (["--rounds", "0"], "--rounds 0: must be a whole number >= 1"),
    (["--rounds", "9"], "--rounds 9 / --top-k 5: only 8 heads can be knocked out"),
    (["--top-k", "9"], "--top-k 9: the model has only 8 heads"),
    (["--exclude", "L5H0"], "--exclude: head L5H0 is outside"),
    (["--never-ablate", "L0H9"], "--never-ablate: head L0H9 is outside"),
    (["--exclude", "L0H*", "--never-ablate", "L1H*"], "together cover every head"),
    (["--rounds", "2", "--tasks", "tiny_copy,tiny_choice"], "--rounds > 1 follows one task"),
    (["--num-samples", "0"], "--num-samples 0"),
    (["--tasks", "no_such_task"], "unknown task"),
]
SWEEP_BAD = [
    (["--seed", "-1"], "--seed -1"),
    (["--alpha", "nan"], "--alpha nan"),
    (["--masks", "4,1"], "--masks 1: must be a whole number >= 2"),
    (["--masks", "4,x"], "not a comma-separated list of whole numbers"),
    (["--sparsity", "0.2,1.5"], "--sparsity 1.5: must be"),
    (["--masks", "4,100000000"], "--masks 100000000: the design"),
    (["--top-k", "9"], "--top-k 9"),
    (["--design", "random"], "invalid choice"),
    (["--never-ablate", "L9H0"], "--never-ablate: head L9H0"),
]


@pytest.mark.parametrize("command, extra, message", [
    *(("locate", *case) for case in LOCATE_BAD), *(("greedy", *case) for case in GREEDY_BAD),
    *(("sweep", *case) for case in SWEEP_BAD)])
def test_measuring_commands_check_arguments_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_loading, command, extra, message):
    out = tmp_path / "run"
    code = harness(command, *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--out", str(out), *extra)
    assert code == 2
    assert message in last_error(capsys)
    assert not out.exists(), "a refused run must write nothing"


def fake_run(folder: Path, model_dir: Path, task: str = "tiny_copy",
             heads: tuple[str, ...] = ("L1H2", "L0H0", "L0H3", "L1H0", "L0H1", "L1H1"),
             model_args: str | None = None
             ) -> Path:
    """A finished-looking locate run written by hand (no model needed to make it)."""
    spec = RunSpec(model_args=model_args or f"pretrained={model_dir},dtype=float32,device=cpu",
                   tasks=(task,), include_path=(TASKS,))
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": spec.identity("locate"),
        "settings": spec.settings("locate"), "spec": spec.as_config(),
        "layers": 2, "heads_per_layer": 4}))
    (folder / f"heads-{task}.json").write_text(json.dumps(
        {"heads": [{"rank": r, "head": h} for r, h in enumerate(heads, start=1)]}))
    return folder


@pytest.mark.parametrize("extra, message", [
    (["--top-k", "0"], "--top-k 0: must be a whole number >= 1"),
    (["--top-k", "7"], "--top-k 7: heads-tiny_copy.json ranks only 6 heads"),
    (["--limit", "0"], "--limit 0: must be a whole number >= 1"),
    (["--general", "no_such_task"], "unknown task 'no_such_task'"),
    (["--general", "tiny_copy"], "--general tiny_copy: the run's own task, measured in the "
                                 "Task column"),
    (["--batch-size", "0"], "--batch-size 0"),
])
def test_verify_checks_arguments_before_loading(tiny_model_dir, tmp_path, capsys,
                                                no_model_loading, extra, message):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    assert harness("verify", str(run), *extra) == 2
    assert message in last_error(capsys)


def test_refit_and_universal_check_their_numbers(tiny_locate_run, tmp_path, capsys):
    for args, message in [
        (["refit", str(tiny_locate_run), "--alpha", "nan"], "--alpha nan: must be a finite"),
        (["refit", str(tiny_locate_run), "--alpha", "inf"], "--alpha inf"),
        (["refit", str(tiny_locate_run), "--top-k", "0"], "--top-k 0"),
        (["refit", str(tiny_locate_run), "--top-k", "9"], "the run ranks only 8 components"),
        (["refit", str(tiny_locate_run), "--exclude", "L0H*+L1H*"],
         "covers every component the run ranks (8)"),
        (["universal", str(tiny_locate_run), str(tiny_locate_run), "--min-tasks", "0"],
         "--min-tasks 0"),
    ]:
        assert harness(*args) == 2, args
        assert message in last_error(capsys), args


# --- run folders: never touch what is not ours ----------------------------------------

def test_force_never_clears_a_folder_that_is_not_a_run(tiny_model_dir, tmp_path, capsys,
                                                        no_model_loading):
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    for force in ([], ["--force"]):
        code = harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--out", str(precious), *force)
        assert code == 2
        assert "is not empty and is not a headloc-harness run folder" in last_error(capsys)
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
    assert f"--out {a_file} is a file" in last_error(capsys)
    assert harness("locate", *model, "--tasks", "tiny_copy",
                   "--out", str(a_file / "run")) == 2
    assert "cannot create run folder" in last_error(capsys)
    assert a_file.read_text() == "keep"


def test_verify_never_writes_into_the_run_it_reads(tiny_model_dir, tmp_path, capsys,
                                                   no_model_loading):
    run = fake_run(tmp_path / "runs" / "a", tiny_model_dir("llama"))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for out in (run, tmp_path / "runs", tmp_path):
        assert harness("verify", str(run), "--out", str(out), "--force") == 2
        assert "which this command reads from" in last_error(capsys)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_lm_eval_files_never_go_into_a_run_the_command_reads(tiny_model_dir, tmp_path,
                                                               capsys, no_model_loading):
    # lm-eval's results folders in RUN would make RUN a folder --force refuses to clear.
    run = fake_run(tmp_path / "runs" / "a", tiny_model_dir("llama"))
    before = sorted(p.name for p in run.iterdir())
    for where in (run, run / "lm_eval", run / "results.json"):
        assert harness("verify", str(run), "--output-path", str(where),
                       "--out", str(tmp_path / "v")) == 2
        assert last_error(capsys).endswith(
            f"--output-path {where} would write into {run}, which this command reads from; "
            f"choose another --output-path (one inside --out {tmp_path / 'v'} is fine)")
    assert harness("cross", str(run), "--output-path", str(run / "lm_eval"),
                   "--out", str(tmp_path / "c")) == 2
    assert "would write into" in last_error(capsys)
    assert sorted(p.name for p in run.iterdir()) == before
    # Nor into another run folder of ours, which they do not read.
    other = fake_run(tmp_path / "runs" / "b", tiny_model_dir("llama"))
    assert harness("verify", str(run), "--output-path", str(other / "lm"),
                   "--out", str(tmp_path / "v")) == 2
    assert last_error(capsys).endswith(
        f"--output-path {other / 'lm'} would write into {other.resolve()}, a headloc-harness "
        f"run folder, whose files are its command's alone; choose another --output-path "
        f"(one inside --out {tmp_path / 'v'} is fine)")
    assert not (tmp_path / "v").exists() and not (tmp_path / "c").exists()


def test_a_second_process_on_the_same_folder_is_refused(tiny_model_dir, tmp_path, capsys,
                                                        no_model_loading):
    from lm_eval_headloc.commands import RunFolder

    out = tmp_path / "run"
    spec = RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32",
                   tasks=("tiny_copy",), include_path=(TASKS,))
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from lm_eval_headloc.commands import RunFolder\n"
         "f = RunFolder(sys.argv[1]); f.start('locate', {}, {}); print('held', flush=True)\n"
         "time.sleep(60)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                       "--out", str(out), "--force") == 2
        assert f"in use by another headloc-harness process (PID {holder.pid})" in \
            last_error(capsys)
    finally:
        holder.kill()
        holder.wait()
    # Released with its process: the folder can be taken now.
    with RunFolder(out) as folder:
        folder.start("locate", spec.identity("locate"), {}, force=True)


def test_changing_any_identity_field_refuses_the_folder(tmp_path):
    from lm_eval_headloc.commands import RunFolder, RunFolderError
    from lm_eval_headloc.commands.spec import RESULT, SETTING

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
        "probe_rows": 8, "group_tests": 3,
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
                    with pytest.raises(RunFolderError,
                                       match=f"was made with {name}( left out|=)"):
                        run.start(command, other.identity(command), other.settings(command))
        # Runtime options never refuse a folder.
        fast = base.replace(batch_size=4, masks_per_pass=8, verbose=True, progress=False,
                            confirm_run_unsafe_code=True)
        with RunFolder(folder) as run:
            assert run.start(command, fast.identity(command), fast.settings(command))


def test_sweep_refuses_a_folder_made_with_another_chat_template_setting(
        tiny_model_dir, tmp_path, capsys):
    model = tmp_path / "model"  # the tiny model, its tokenizer given a chat template
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    args = ["sweep", *tiny_args(model), "--tasks", "tiny_choice",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--out", str(tmp_path / "sweep")]
    assert harness(*args) == 0
    assert harness(*args, "--apply-chat-template") == 2
    assert ("was made with apply_chat_template left out (its default), not True"
            in last_error(capsys))


def test_a_sweep_rerun_without_confirm_keeps_the_sweeps_own(tiny_model_dir, tmp_path):
    """--confirm left out of a rerun resumes the sweep as it was made (a sweep made with
    --confirm 2, or before its default depended on the prior, recorded 34), not refused."""
    out = tmp_path / "sweep"
    args = ["sweep", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "3", "--top-k", "1",
            "--out", str(out)]
    assert harness(*args, "--confirm", "2") == 0
    made = (out / "sweep.json").read_text()
    assert strict_json(out / "m3-p0.25" / "config.json")["spec"]["confirm"] == 2
    assert harness(*args) == 0
    assert (out / "sweep.json").read_text() == made
    assert strict_json(out / "config.json")["identity"]["confirm"] == 2
    assert strict_json(out / "m3-p0.25" / "config.json")["spec"]["confirm"] == 2


# --- measurements on disk --------------------------------------------------------------

def test_measurement_log_keeps_every_good_line(tmp_path, caplog):
    from lm_eval_headloc.commands import RunFolder

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
    from lm_eval_headloc.commands import RunFolder

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


def test_resume_recomputes_only_a_corrupted_measurement(tiny_model_dir, tmp_path, capsys):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "8", "--sparsity", "0.25", "--num-samples", "6", "--out",
            str(tmp_path / "run")]
    assert harness(*args) == 0
    log = tmp_path / "run" / "measurements.jsonl"
    lines = log.read_text().splitlines()
    lost = json.loads(lines[3])
    lines[3] = "garbage"
    log.write_text("\n".join(lines) + "\n")
    assert harness(*args) == 0
    # Said once, though the run reads the file several times (it was said six times).
    assert capsys.readouterr().err.count("line 4 is not a measurement") == 1
    after = log.read_text().splitlines()
    assert after[:len(lines)] == lines and len(after) == len(lines) + 1  # only one redone
    redone = json.loads(after[-1])
    assert (redone["key"], redone["mask"], redone["scores"]) == (
        lost["key"], lost["mask"], lost["scores"])


#: Seconds a stopped run pauses after each measurement it writes (``stopped_part_way``).
PAUSE = 0.25


def stopped_part_way(args: list[str], out: Path, after: int, stop, seconds: float = 120
                     ) -> int:
    """Run ``headloc-harness args --out out`` in a subprocess, ``stop`` it (kill, or send
    SIGINT) once ``after`` measurements are on disk; the measurements it left."""
    # SIGINT as a terminal user's process has it: a child inherits an ignored or blocked
    # SIGINT from this process (a library earlier in the suite may leave it so), and then
    # a SIGINT stop would do nothing.
    # Each measurement's line is followed by a pause, so that the stop lands before the next
    # one: a tiny model measures in milliseconds, faster than this loop looks (it once
    # finished the run before the kill).
    code = ("import signal, sys, time; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
            "from lm_eval_headloc.commands.runfolder import RunFolder; "
            "append = RunFolder.append_measurement; "
            "RunFolder.append_measurement = lambda self, record: "
            f"(append(self, record), time.sleep({PAUSE})); "
            "from lm_eval_headloc.commands.cli import main; "
            f"sys.exit(main({args!r} + sys.argv[1:]))")
    process = subprocess.Popen([sys.executable, "-c", code, "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log = out / "measurements.jsonl"
    deadline = time.time() + seconds
    while time.time() < deadline and process.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= after:
            stop(process)
            break
        time.sleep(0.02)
    process.wait(timeout=seconds)
    return len(log.read_text().splitlines())


@pytest.mark.parametrize("options", [[], ["--signal", "logprob"],
                                     ["--masks", "auto", "--max-masks", "40", "--top-k", "2"],
                                     ["--sparsity", "auto"], ["--ablation", "mean"],
                                     ["--ablation", "resample", "--scale", "0.5"]])
def test_resume_after_a_kill_equals_an_uninterrupted_run(tiny_model_dir, tmp_path, options):
    folder = tiny_model_dir("llama")
    args = ["locate", *tiny_args(folder), "--tasks", "tiny_copy", "--masks", "40",
            "--sparsity", "0.25", "--num-samples", "12", "--seed", "3", *options]
    killed = tmp_path / "killed"
    partial = stopped_part_way(args, killed, after=6, stop=subprocess.Popen.kill)
    assert 6 <= partial < 41, "the run was not interrupted part-way"
    assert harness(*args, "--out", str(killed)) == 0
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    assert len(read_run(full)[0]) >= 21
    assert_same_run(killed, full)


def test_a_kill_mid_confirmation_resumes_to_the_same_picks(tiny_model_dir, tmp_path):
    """Killed (-9) in the second round of confirmation (8 heads, rounds of 5 and 2): the
    resumed run makes the same picks in the same order, and ranks as an unbroken run."""
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "10", "--sparsity", "0.25", "--num-samples", "12", "--seed", "3",
            "--prior", "atp-path", "--confirm", "7"]
    killed = tmp_path / "killed"
    # baseline + 10 masks + round 1's 5 heads + 1 of round 2
    partial = stopped_part_way(args, killed, after=17, stop=subprocess.Popen.kill)
    assert 17 <= partial < 18, "the run was not stopped inside round 2"
    assert harness(*args, "--out", str(killed)) == 0
    full = tmp_path / "full"
    assert harness(*args, "--out", str(full)) == 0
    assert len(read_run(full)[0]) == 1 + 10 + 7
    assert_same_run(killed, full)
    assert strict_json(killed / "config.json")["confirm"] == \
        strict_json(full / "config.json")["confirm"]


def test_a_fit_that_tells_no_heads_apart_says_so(tiny_model_dir, tmp_path, capsys):
    """Two masks that knock out the same heads' complements: every head in mask 0 has the
    same evidence as every other, so the ranking is ties, not an order."""
    out = tmp_path / "flat"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "2", "--sparsity", "0.5", "--num-samples", "4", "--top-k", "3",
                   "--prior", "none", "--confirm", "0", "--out", str(out)) == 0
    heads = strict_json(out / "heads.json")
    design = np.load(out / "design_matrix.npy")
    records = {r["key"]: r for r in read_run(out)[0]}
    y = [records[f"mask-{i:04d}"]["scores"]["tiny_copy"] for i in range(2)]
    entries = heads["heads"]
    # By hand: with every effect 0 a head's evidence is its contrast, the score of the
    # mask that knocks it out minus the other's (each head is in exactly one mask).
    assert all(e["effect"] == 0 for e in entries)

    def contrast(entry):
        row = int(np.flatnonzero(design[:, entry["layer"] * 4 + entry["head_in_layer"]])[0])
        return y[row] - y[1 - row]

    for above, below in zip(entries, entries[1:], strict=False):
        assert below["tied_with_above"] == (contrast(above) == contrast(below))
    report = (out / "report.md").read_text()
    printed = capsys.readouterr().out
    if y[0] == y[1]:  # nothing tells any head apart
        assert "No head stands out" in report and "no head stands out" in printed
        assert "1. L0H0" not in printed
    else:  # two groups of four: the top-3 all come from the more harmful mask
        assert "Tied (the same evidence" in report


def test_the_confirmation_draws_one_progress_bar_for_all_its_rounds(tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """The default job drew a new bar for each of the confirmation's rounds. One
    bar per phase (as lm-eval draws one per request type): the masks, then the
    confirmation's heads alone (7: rounds of 5 and 2), each bar filled once."""
    import tqdm as tqdm_module

    bars = []

    class Recorded(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})
            if not self.disable:  # shown (close() disables it later)
                bars.append(self)

    monkeypatch.setattr(tqdm_module, "tqdm", Recorded)
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--masks", "6", "--sparsity", "0.25", "--num-samples", "6",
                   "--prior", "none", "--confirm", "7", "--out", str(tmp_path / "run")) == 0
    shown = [(bar.desc, bar.n, bar.total) for bar in bars]
    assert shown == [("locate", 7, 7), ("confirm", 7, 7)], shown
    rounds = strict_json(tmp_path / "run" / "config.json")["confirm"]["rounds"]
    assert [len(r) for r in rounds] == [5, 2]  # two rounds, one bar


def test_the_summary_line_does_not_show_a_bare_negative_r2(tmp_path, capsys,
                                                           committed_benchmarks):
    """The default job's last lines read 'R² 0.992 (held out -0.70)', which a
    newcomer takes for a failed run. The committed run of today's defaults (the top 5
    measured alone) is refitted and its summary line read."""
    source = (committed_benchmarks / "recovery-runs" / "headloc_induction"
              / "stratified-p0.1-atp-path" / "m54-seed0")
    run = Path(shutil.copytree(source, tmp_path / "run"))
    heads = strict_json(run / "heads.json")
    assert heads["r2_held_out"] < 0 and all(e["measured_alone"] for e in heads["heads"][:5])
    assert harness("refit", str(run)) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("headloc_induction (acc,none): baseline 0.4800"), line
    assert "-0.70" not in line and "R²" not in line, line
    assert "the top 5 measured alone: their order is measured, not fitted" in line, line
    # Where the fit does order the top-k, its held-out R² below 0 comes with its meaning.
    from lm_eval_headloc.commands.locate import BELOW_ZERO, fit_summary
    from lm_eval_headloc.commands.result import read_rankings

    ranking = read_rankings(run)["headloc_induction"]
    ranking.extra["confirmed"] = []
    words = fit_summary(ranking, 5)
    assert words == f", fit R² 0.992 in-sample, -0.70 held out ({BELOW_ZERO})", words
    assert "(below 0: " in (run / "report.md").read_text()


def test_a_larger_confirm_measures_only_the_new_heads(tiny_model_dir, tmp_path):
    base = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "10", "--sparsity", "0.25", "--num-samples", "12", "--seed", "3",
            "--prior", "atp"]
    grown = tmp_path / "grown"
    assert harness(*base, "--confirm", "3", "--out", str(grown)) == 0
    first = read_run(grown)[0]
    assert harness(*base, "--confirm", "7", "--out", str(grown)) == 0
    after = read_run(grown)[0]
    assert after[:len(first)] == first  # nothing measured again, nothing rewritten
    assert len(after) == len(first) + 4
    fresh = tmp_path / "fresh"
    assert harness(*base, "--confirm", "7", "--out", str(fresh)) == 0
    strip = [[{k: v for k, v in r.items() if k != "seconds"} for r in read_run(folder)[0]]
             for folder in (grown, fresh)]
    assert strip[0] == strip[1]
    assert read_run(grown)[1] == read_run(fresh)[1]
    config = strict_json(grown / "config.json")["confirm"]
    assert config["heads"][:3] == [r["key"][len("alone-"):] for r in first[11:]]
    assert config["rounds"] == [config["heads"][:5], config["heads"][5:]]


# --- locate, refit ----------------------------------------------------------------------

def test_locate_writes_a_run_folder_hf_headablate_can_read(tiny_model_dir, tmp_path, capsys,
                                                           caplog):
    folder = tiny_model_dir("qwen2")
    out = tmp_path / "run"
    code = harness("locate", *tiny_args(folder), "--tasks", "tiny_copy,tiny_choice",
                   "--masks", "10", "--sparsity", "0.25", "--num-samples", "8", "--top-k", "3",
                   "--out", str(out))
    assert code == 0
    # Two tasks: heads.json, what ablate_file= reads, is said to be the first one's.
    printed = capsys.readouterr().out.splitlines()
    assert printed[-2] == (
        f"Results in {out}/ (report.md, heatmap.png, heads-<task>.json for each task; "
        "heads.json is tiny_copy's)")
    assert printed[-1].startswith("Time: ")  # where the time went, last
    for name in ["config.json", "design_matrix.npy", "measurements.jsonl", "heads.json",
                 "heads.csv", "heads-tiny_choice.json", "heatmap.png", "report.md"]:
        assert (out / name).is_file(), name
    records, heads = read_run(out)
    design = np.load(out / "design_matrix.npy")
    assert design.shape == (10, 8) and (design.sum(axis=1) == 2).all()
    # The defaults confirm up to 25 heads: all 8 of this model, each alone, after the masks.
    confirmed = strict_json(out / "config.json")["confirm"]["heads"]
    assert sorted(confirmed) == [f"L{i // 4}H{i % 4}" for i in range(8)]
    assert [r["key"] for r in records] == ["baseline"] + [f"mask-{i:04d}" for i in range(10)] \
        + [f"alone-{h}" for h in confirmed]
    assert all(r["mask"] == r["key"][len("alone-"):] for r in records[11:])
    # Each record's mask is its design row.
    for row, record in zip(design, records[1:11], strict=True):
        assert record["mask"] == "+".join(f"L{i // 4}H{i % 4}" for i in np.flatnonzero(row))
    assert set(records[1]["scores"]) == {"tiny_copy", "tiny_choice"}
    config = strict_json(out / "config.json")
    assert config["example_subset"]["tiny_copy"] == sorted(config["example_subset"]["tiny_copy"])
    assert len(config["example_subset"]["tiny_copy"]) == 8
    assert config["versions"]["lm_eval"]
    assert heads["task"] == "tiny_copy" and len(heads["heads"]) == 8
    assert all(h["head"] == f"L{h['layer']}H{h['head_in_layer']}" for h in heads["heads"])
    assert heads["heads_per_layer"] == 4
    # The masks really were applied: a mask's score matches a fresh evaluation under it.
    from lm_eval_headloc.model import HFHeadAblateLM

    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate=records[3]["mask"])
    setup = engine.prepare(RunSpec(model_args=f"pretrained={folder},dtype=float32",
                                   tasks=("tiny_copy",), include_path=(TASKS,)))
    measure = engine.open_measurement(setup, lm, num_samples=8)
    assert measure([*lm.knocked_out])["tiny_copy"].value == records[3]["scores"]["tiny_copy"]
    # hf-headablate reads heads.json directly, and says what it took from it.
    caplog.set_level("INFO", logger="lm_eval.models.hf_headablate")
    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate_file=str(out / "heads.json"), ablate_top=3)
    assert [str(h) for h in lm.knocked_out] == sorted(heads["top_k"])
    assert (f"knocking out {'+'.join(heads['top_k'])}: the top 3 of {out / 'heads.json'} "
            "(ranked for task tiny_copy)") in caplog.messages
    # Without ablate_top, the run's own top-k (3), not all 8 heads it ranks.
    lm = HFHeadAblateLM(pretrained=str(folder), dtype="float32", device="cpu",
                        ablate_file=str(out / "heads.json"))
    assert [str(h) for h in lm.knocked_out] == sorted(heads["top_k"])


def test_the_python_api_takes_a_spec_or_keywords(tiny_model_dir, tmp_path):
    from lm_eval_headloc.commands import locate

    spec = RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},dtype=float32",
                   tasks=("tiny_copy",), include_path=(TASKS,), masks=4, sparsity=0.25,
                   num_samples=4, progress=False)
    by_spec = locate(tmp_path / "a", spec)
    by_keywords = locate(tmp_path / "b", model_args=spec.model_args, tasks=["tiny_copy"],
                         include_path=[TASKS], masks=4, sparsity=0.25, num_samples=4,
                         progress=False)
    assert by_spec["tiny_copy"].order == by_keywords["tiny_copy"].order
    assert RunSpec.from_config(strict_json(tmp_path / "a" / "config.json")).masks == 4


def test_num_samples_beyond_a_task_is_recorded_and_said(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "2", "--sparsity", "0.25", "--num-samples", "50",
                   "--out", str(out)) == 0
    from lm_eval_headloc.tasks import make_task_manager

    loaded = make_task_manager([TASKS]).load(["tiny_choice"])
    docs = len(loaded["tasks"]["tiny_choice"].eval_docs)
    config = strict_json(out / "config.json")
    assert config["examples_used"] == {"tiny_choice": docs} and docs < 50
    assert f"tiny_choice has only {docs} documents; all {docs} are used" in \
        capsys.readouterr().err
    assert f"used tiny_choice {docs}" in (out / "report.md").read_text()


def test_refit_changes_settings_without_the_model(tiny_locate_run, tmp_path, capsys,
                                                  no_model_loading):
    import shutil

    out = shutil.copytree(tiny_locate_run, tmp_path / "run")
    assert harness("refit", str(out)) == 0
    printed = [line for line in capsys.readouterr().out.splitlines()
               if line.startswith("  ") and ". L" in line]
    assert len(printed) == 3  # the run's stored --top-k, not a default of 5
    assert harness("refit", str(out), "--exclude", "L0H0+L1H3") == 0
    ranked = [h["head"] for h in strict_json(out / "heads.json")["heads"]]
    assert len(ranked) == 6 and "L0H0" not in ranked and "L1H3" not in ranked
    assert harness("refit", str(out), "--alpha", "0.5", "--top-k", "2") == 0
    config = strict_json(out / "config.json")
    heads = strict_json(out / "heads.json")
    assert config["settings"]["alpha"] == 0.5 and heads["alpha"] == 0.5
    assert len(heads["top_k"]) == 2
    assert all(h["effect"] == 0 for h in heads["heads"])  # a huge penalty zeroes everything
    # --exclude '' takes the exclusion back (left out, the run's own is kept).
    assert harness("refit", str(out)) == 0
    assert strict_json(out / "heads.json")["excluded"] == ["L0H0", "L1H3"]
    assert harness("refit", str(out), "--exclude", "") == 0
    heads = strict_json(out / "heads.json")
    assert heads["excluded"] == [] and len(heads["heads"]) == 8
    assert strict_json(out / "config.json")["settings"]["exclude"] is None


def test_rankings_read_back_to_the_files_they_were_written_as(tiny_locate_run, tiny_model_dir,
                                                             tmp_path, no_model_loading):
    from lm_eval_headloc.commands import RunFolderError, read_rankings
    from lm_eval_headloc.commands.report import ranked_heads_json

    before = {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()}
    ranking = read_rankings(tiny_locate_run)["tiny_choice"]
    written = strict_json(tiny_locate_run / "heads-tiny_choice.json")
    assert json.loads(json.dumps(ranked_heads_json(ranking, 3))) == written
    assert [str(h) for h in ranking.top(3)] == written["top_k"]
    # Read only: nothing in the folder changed.
    assert {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()} == before
    with pytest.raises(RunFolderError, match="is not a run folder"):
        read_rankings(tmp_path)


def test_a_finished_run_resumes_without_loading_the_model(tiny_model_dir, tiny_locate_run,
                                                         tmp_path, capsys, no_model_loading):
    """Rerunning the command of a finished run measures nothing, so the user does not
    wait for the weights: the files are fitted again from disk (with the ranking settings
    given, as refit would); asking for more measurements does load the model."""
    import shutil

    args = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice", "--masks", "12",
            "--sparsity", "0.25", "--num-samples", "12", "--top-k", "3", *LASSO_ONLY]
    again = shutil.copytree(tiny_locate_run, tmp_path / "again")
    assert harness("locate", *args, "--out", str(again)) == 0
    for name in ("heads.json", "heads.csv", "measurements.jsonl", "config.json"):
        assert (again / name).read_bytes() == (tiny_locate_run / name).read_bytes(), name
    # Other ranking settings: the same files as refit writes with them.
    resumed = shutil.copytree(tiny_locate_run, tmp_path / "resumed")
    refitted = shutil.copytree(tiny_locate_run, tmp_path / "refitted")
    assert harness("locate", *args, "--alpha", "0.05", "--out", str(resumed)) == 0
    assert harness("refit", str(refitted), "--alpha", "0.05") == 0
    capsys.readouterr()
    for name in ("heads.json", "report.md", "config.json"):
        assert (resumed / name).read_text() == (refitted / name).read_text().replace(
            str(refitted), str(resumed)), name
    assert strict_json(resumed / "heads.json")["alpha"] == 0.05
    # More masks than measured: the model is needed (and here refused by the fixture).
    more = shutil.copytree(tiny_locate_run, tmp_path / "more")
    with pytest.raises(AssertionError, match="the model was loaded"):
        harness("locate", *args, "--masks", "14", "--out", str(more))


def test_a_rerun_without_masks_or_confirm_keeps_the_runs_own(tiny_model_dir, tiny_locate_run,
                                                           tmp_path, no_model_loading):
    """--masks and --confirm left out of a rerun mean the run's own, not the defaults: a
    finished --confirm 0 run is not confirmed (nor the model loaded) by a bare rerun, and
    one last fitted on 10 of its masks stays fitted on 10."""
    import shutil

    args = [*tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice", "--sparsity",
            "0.25", "--num-samples", "12", "--top-k", "3", "--prior", "none"]
    again = shutil.copytree(tiny_locate_run, tmp_path / "again")
    assert harness("locate", *args, "--out", str(again)) == 0
    for name in ("heads.json", "measurements.jsonl", "config.json"):
        assert (again / name).read_bytes() == (tiny_locate_run / name).read_bytes(), name
    assert harness("refit", str(again), "--masks", "10") == 0
    assert strict_json(again / "heads.json")["measurements"] == 10
    assert harness("locate", *args, "--out", str(again)) == 0
    assert strict_json(again / "heads.json")["measurements"] == 10
    spec = strict_json(again / "config.json")["spec"]
    assert (spec["masks"], spec["confirm"]) == (10, 0)


def test_the_default_budget_is_split_by_whether_the_run_has_a_prior(tiny_model_dir, tmp_path):
    """--masks and --confirm left out: 54 measurement-equivalents, 8 for atp-path's prior
    then 12 masks + 34 alone; without a prior (--prior none, or auto on a task without gold
    answers) 27 masks + 27 alone. The tiny model has 8 heads, so every head is measured
    alone either way."""
    common = [*tiny_args(tiny_model_dir("llama")), "--sparsity", "0.25", "--num-samples", "4"]
    runs = {"prior": ["--tasks", "tiny_choice"],
            "none": ["--tasks", "tiny_choice", "--prior", "none"],
            "auto-none": ["--tasks", "tiny_rolling"]}
    for name, args in runs.items():
        assert harness("locate", *common, *args, "--out", str(tmp_path / name)) == 0
    expected = {"prior": (12, 34, True), "none": (27, 27, False), "auto-none": (27, 27, False)}
    for name, (masks, confirm, prior) in expected.items():
        out = tmp_path / name
        config = strict_json(out / "config.json")
        assert (config["spec"]["masks"], config["spec"]["confirm"]) == (masks, confirm), name
        assert (config["settings"]["masks"], config["settings"]["confirm"]) == (masks, confirm)
        assert config["prior_used"] is prior
        assert np.load(out / "design_matrix.npy").shape == (masks, 8)
        assert len(config["confirm"]["heads"]) == 8  # all 8 heads: fewer than either
        keys = [r["key"] for r in read_run(out)[0]]
        assert sum(k.startswith("mask-") for k in keys) == masks
        report = (out / "report.md").read_text()
        assert f"stratified, {masks} masks" in report
        # Who named the heads measured alone: the prior's rankings only where there is one.
        named = ("the attribution prior's rankings and the masks' fit's likeliest in turn ("
                 if prior else "in 2 rounds of 5, the masks' fit's likeliest (the fit")
        assert named in report and "the the" not in report


def test_a_folder_of_another_run_is_refused_unless_forced(tiny_model_dir, tmp_path, capsys):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "3", "--sparsity", "0.25", "--num-samples", "4", "--out",
            str(tmp_path / "run")]
    assert harness(*args) == 0
    assert harness(*args, "--seed", "1") == 2
    assert "was made with seed=0, not 1" in last_error(capsys)
    assert harness(*args, "--seed", "1", "--force") == 0
    assert strict_json(tmp_path / "run" / "config.json")["identity"]["seed"] == 1


def test_force_deletes_only_what_the_commands_wrote(tiny_model_dir, tmp_path, capsys):
    """--force deleted everything in a run folder but its lock: a user's notes, their
    analysis folder, a nested run another process was working in. Now it refuses while
    anything there is not the commands' own, and deletes nothing then."""
    from lm_eval_headloc.commands.runfolder import RunFolder

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
    assert last_error(capsys).endswith(
        f"--force: {run} holds what headloc-harness did not write (notes.md, "
        "verify/plot.py); it deletes only its own files, so move those out or choose "
        "another --out")
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == sorted(
        [*written, Path("notes.md"), Path("verify/plot.py")])
    (run / "notes.md").unlink()
    (run / "verify" / "plot.py").unlink()
    # A nested run another process holds is not deleted under it.
    with RunFolder(run / "verify").lock():
        assert harness(*args, "--seed", "1", "--force") == 2
        assert f"{run / 'verify'} is in use by another headloc-harness process" in \
            last_error(capsys)
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == written
    # Only its own files: cleared, the nested verify with them, and the run starts over.
    assert harness(*args, "--seed", "1", "--force") == 0
    assert not (run / "verify").exists()
    assert strict_json(run / "config.json")["identity"]["seed"] == 1


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
    from lm_eval_headloc.commands.runfolder import RunFolder

    with RunFolder(folder) as run:
        run.start("locate", {"seed": 0}, {})
    return folder


def test_force_refuses_a_users_entry_under_one_of_our_names(tmp_path):
    """--force cleared any entry whose name the commands write: a user's notes in means/
    (a folder of cached means, ours only by name) and a folder named heads-archive.json
    were deleted whole. Only our kind of entry, holding only our files, is ours."""
    from lm_eval_headloc.commands.runfolder import RunFolder, RunFolderError

    run = _started_run(tmp_path / "run")
    (run / "means").mkdir()
    (run / "means" / "my-notes.txt").write_text("mine")
    (run / "heads-archive.json").mkdir()
    (run / "heads-archive.json" / "run1.txt").write_text("old")
    with RunFolder(run) as folder, pytest.raises(RunFolderError) as refused:
        folder.start("locate", {"seed": 1}, {}, force=True)
    assert "holds what headloc-harness did not write (heads-archive.json, means)" in \
        str(refused.value)
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
    assert "is not empty and is not a headloc-harness run folder" in last_error(capsys)
    assert (folder / ".thesis.partial").read_text() == "my draft"


def test_a_lock_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path):
    """The lock was opened through a link and truncated: a .lock linked to a user's file
    replaced its content with a process id."""
    from lm_eval_headloc.commands.runfolder import RunFolder, RunFolderError

    run = _started_run(tmp_path / "run")
    precious = tmp_path / "precious.txt"
    precious.write_text("important data\n")
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(precious)
    with pytest.raises(RunFolderError, match=r"\.lock is not a regular file, so not the lock"):
        RunFolder(run).lock()
    assert precious.read_text() == "important data\n"
    (run / ".lock").unlink()
    (run / ".lock").mkdir()
    with pytest.raises(RunFolderError, match=r"\.lock is not a regular file"):
        RunFolder(run).lock()


def test_a_torn_last_line_is_cut_only_by_the_locks_holder(tmp_path):
    """A refused second process (reading before it asked for the lock) cut the live run's
    half-written last line, so the rest of that line landed as garbage."""
    from lm_eval_headloc.commands.runfolder import RunFolder

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
        message = last_error(capsys)
        assert f"into {other.resolve()}, a headloc-harness run folder" in message \
            or f"inside the run folder {other.resolve()}" in message
    assert sorted(p.name for p in other.iterdir()) == ["config.json", "heads-t.json"]
    # A link as --out is refused, not replaced by a file (its target left stale).
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    for args in (["universal", *map(str, runs), "--out", str(tmp_path / "link.json")],
                 ["overlap", *map(str, runs), "--out", str(tmp_path / "link.json")],
                 ["export", str(tiny_locate_run), "--out", str(tmp_path / "link.json")]):
        assert harness(*args) == 2
        assert "link.json is a link; name the file itself" in last_error(capsys)
        assert (tmp_path / "link.json").is_symlink()
    (tmp_path / "table.md").symlink_to(tmp_path / "real.json")  # overlap's second file
    assert harness("overlap", *map(str, runs), "--top-k", "2", "--out",
                   str(tmp_path / "table.json")) == 2
    assert "table.md is a link" in last_error(capsys)
    # A heads-x.json that is not one of the run's tasks is not read as a ranking.
    (other / "heads-planted.json").write_text(json.dumps(["L9H9"]))
    assert harness("universal", str(other), str(runs[0]), "--min-tasks", "1", "--out",
                   str(tmp_path / "u.json")) == 0
    assert not any("planted" in label for label in strict_json(tmp_path / "u.json")["rankings"])


def test_a_run_folder_made_unwritable_is_one_line(tiny_locate_run, tmp_path, capsys,
                                                   monkeypatch):
    import lm_eval_headloc.commands.runfolder as runfolder

    def refused(path, write):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(runfolder, "write_atomically", refused)
    assert harness("refit", str(tiny_locate_run), "--alpha", "0.05") == 2
    assert last_error(capsys).endswith(
        f"cannot write {tiny_locate_run / 'config.json'}: Permission denied")


def test_an_empty_out_is_refused(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--out", "") == 2
    assert "argument --out: '' is not a folder name" in last_error(capsys)
    assert list(tmp_path.iterdir()) == []


# --- greedy ------------------------------------------------------------------------------

def test_greedy_one_shot_and_iterative(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("gpt2")
    one = tmp_path / "one"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--top-k", "3", "--out", str(one)) == 0
    records, heads = read_run(one)
    assert len(records) == 1 + 8  # baseline + every head alone
    base = records[0]["scores"]["tiny_copy"]
    drops = {r["mask"]: base - r["scores"]["tiny_copy"] for r in records[1:]}
    base_logprob = records[0]["logprob"]["tiny_copy"]
    logprob_drops = {r["mask"]: base_logprob - r["logprob"]["tiny_copy"] for r in records[1:]}
    ranked = [h["head"] for h in heads["heads"]]
    # Most harmful first; equal accuracy drops by the gold log-likelihood's drop, then in
    # head order (L0H0 < L0H1 < ... by flat index).
    flat = {f"L{i // 4}H{i % 4}": i for i in range(8)}
    assert ranked == sorted(drops, key=lambda h: (-drops[h], -logprob_drops[h], flat[h]))
    assert len(set(drops.values())) < len(drops), "no tie: the tie-break was not tested"
    # What kind of head each is, as in a locate run's files (types.json written once).
    types = strict_json(one / "types.json")
    assert set(heads["heads"][0]["types"]) == set(types["scores"])
    head = heads["heads"][0]["head"]
    layer, index = int(head[1:head.index("H")]), int(head[head.index("H") + 1:])
    assert heads["heads"][0]["types"]["induction"] == pytest.approx(
        types["scores"]["induction"][layer][index], abs=1e-6)
    assert "type" in (one / "heads.csv").read_text().splitlines()[0].split(",")

    it = tmp_path / "iterative"
    assert harness("greedy", *tiny_args(folder), "--tasks", "tiny_copy", "--num-samples", "12",
                   "--rounds", "2", "--top-k", "3", "--out", str(it)) == 0
    records, heads = read_run(it)  # strict JSON: no NaN for the round-1 winner
    assert len(records) == 1 + 8 + 7
    winner = heads["winners"][0]
    assert all(r["mask"].count("+") == 1 and winner in r["mask"]
               for r in records if r["key"].startswith("round2-"))
    by_key = {r["key"]: r["scores"]["tiny_copy"] for r in records}
    effects = {h["head"]: h["effect"] for h in heads["heads"]}
    # The first winner's effect is what it cost in round 1; the others' their round 2 cost.
    assert effects[winner] == pytest.approx(by_key[f"round1-{winner}"] - by_key["baseline"])
    second = heads["winners"][1]
    assert effects[second] == pytest.approx(by_key[f"round2-{second}"]
                                            - by_key[f"round1-{winner}"])
    assert [h["head"] for h in heads["heads"][:2]] == heads["winners"]
    assert "nan" not in (it / "heads.csv").read_text().lower()


def test_a_finished_greedy_run_reruns_without_loading_the_model(tiny_model_dir, tmp_path,
                                                               monkeypatch):
    from lm_eval_headloc.model import HFHeadAblateLM

    out = tmp_path / "iterative"
    args = ["greedy", *tiny_args(tiny_model_dir("gpt2")), "--tasks", "tiny_copy",
            "--num-samples", "12", "--rounds", "2", "--top-k", "3", "--out", str(out)]
    assert harness(*args) == 0
    files = {name: (out / name).read_bytes() for name in
             ("heads.json", "heads.csv", "types.json", "config.json", "measurements.jsonl")}
    original = HFHeadAblateLM.__init__
    loads = []
    monkeypatch.setattr(HFHeadAblateLM, "__init__",
                        lambda self, *a, **k: loads.append(1) or original(self, *a, **k))
    assert harness(*args) == 0
    assert loads == [] and {n: (out / n).read_bytes() for n in files} == files
    # The last round's last measurement lost: the model loads to measure it again.
    lines = (out / "measurements.jsonl").read_text().splitlines(keepends=True)
    (out / "measurements.jsonl").write_text("".join(lines[:-1]))
    assert harness(*args) == 0
    assert loads == [1]
    assert (out / "heads.json").read_bytes() == files["heads.json"]


# --- verify, universal, sweep ------------------------------------------------------------

def test_verify_table(tiny_model_dir, tiny_locate_run, tmp_path, capsys):
    run = tiny_locate_run
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "3", "--general", "tiny_copy",
                   "--out", str(out)) == 0
    table = strict_json(out / "verify.json")
    rows = table["rows"]["tiny_choice"]
    assert [r["k"] for r in rows] == [1, 2, 3]
    assert rows[2]["heads"] == strict_json(run / "heads.json")["top_k"][:3]
    base = table["baseline"]["tiny_choice"]
    drop = (base - rows[0]["score"]) / base if base else None
    assert rows[0]["task_drop"] == (pytest.approx(drop) if drop is not None else None)
    assert "| k | heads | score | Task drop | Gen drop | tiny_copy |" in (
        out / "verify.md").read_text()
    assert table["located_by"] == "metric"
    assert "log-likelihood" not in (out / "verify.md").read_text()
    # What the run's ranking says of these heads travels with them (the run's own file).
    from lm_eval_headloc.commands.runfolder import RunFolder
    from lm_eval_headloc.commands.verify import ranking_notes, verification_markdown

    assert table["ranking_notes"] == {"tiny_choice": ranking_notes(RunFolder(run),
                                                                   "tiny_choice", 3)}
    table["ranking_notes"] = {"tiny_choice": ["L0H1: recorded to do no harm"]}
    assert ("What the run's ranking says of these (its report.md):\n"
            "- L0H1: recorded to do no harm\n") in verification_markdown(table)
    # verify's scores are fresh evaluations: heads knocked out by hf-headablate itself.
    from lm_eval_headloc.model import HFHeadAblateLM

    lm = HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), dtype="float32",
                        device="cpu", ablate="+".join(rows[1]["heads"]))
    import lm_eval

    from lm_eval_headloc.tasks import make_task_manager

    results = lm_eval.simple_evaluate(model=lm, tasks=["tiny_choice"],
                                      task_manager=make_task_manager([TASKS]))
    assert rows[1]["score"] == pytest.approx(results["results"]["tiny_choice"]["acc,none"])


def test_verify_of_a_logprob_run_says_it_scores_by_the_metric(tiny_model_dir, tmp_path):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    config = strict_json(run / "config.json")
    for part in ("spec", "identity"):
        config[part]["signal"] = "logprob"
    (run / "config.json").write_text(json.dumps(config))
    out = tmp_path / "verify"
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                   "--random-draws", "0", "--limit", "4", "--out", str(out)) == 0
    assert strict_json(out / "verify.json")["located_by"] == "logprob"
    assert "The run located these by the gold answers' log-likelihood" in (
        out / "verify.md").read_text()


def test_verify_of_a_run_on_part_of_the_examples_measures_whole_tasks(tiny_model_dir,
                                                                      tmp_path):
    """A run located on --examples-part 1/2 is verified on whole tasks (or --limit's first
    documents), as verify's options say: the part used to cut the general tasks too, and
    --limit silently dropped it."""
    run = tmp_path / "part"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--examples-part", "1/2", "--masks", "4", "--sparsity", "0.25",
                   *LASSO_ONLY, "--out", str(run)) == 0
    assert strict_json(run / "config.json")["examples_used"] == {"tiny_choice": 2}
    for limit, used in (([], {"tiny_choice": 4, "tiny_copy": 12}),
                        (["--limit", "3"], {"tiny_choice": 3, "tiny_copy": 3})):
        out = tmp_path / f"verify{len(limit)}"
        assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_copy",
                       "--random-draws", "0", *limit, "--out", str(out)) == 0
        config = strict_json(out / "config.json")
        assert config["examples_used"] == used
        assert config["spec"]["examples_part"] is None


def test_a_finished_verify_or_cross_reruns_without_loading_the_model(
        tiny_model_dir, tiny_locate_run, tmp_path, monkeypatch):
    """Every measurement on disk: the tables are rewritten from it, no weights loaded; one
    measurement lost: the model is loaded to measure it again."""
    from lm_eval_headloc.model import HFHeadAblateLM

    out, cross_out = tmp_path / "verify", tmp_path / "cross"
    verify_args = ["verify", str(tiny_locate_run), "--top-k", "2", "--general", "tiny_copy",
                   "--out", str(out)]
    cross_args = ["cross", str(tiny_locate_run), "--top-k", "2", "--out", str(cross_out)]
    assert harness(*verify_args) == 0 and harness(*cross_args) == 0
    tables = {path: path.read_text() for path in (out / "verify.json", out / "verify.md",
                                                  cross_out / "cross.json")}
    for path in tables:
        path.unlink()

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    with monkeypatch.context() as patched:
        patched.setattr(HFHeadAblateLM, "__init__", refuse)
        assert harness(*verify_args) == 0 and harness(*cross_args) == 0
    assert {path: path.read_text() for path in tables} == tables
    # A measurement lost: measured again, so the model loads (and the table is the same).
    lines = (out / "measurements.jsonl").read_text().splitlines(keepends=True)
    (out / "measurements.jsonl").write_text("".join(lines[:-1]))
    loads = []
    original = HFHeadAblateLM.__init__
    monkeypatch.setattr(HFHeadAblateLM, "__init__",
                        lambda self, *a, **k: loads.append(1) or original(self, *a, **k))
    assert harness(*verify_args) == 0
    assert loads == [1]
    assert (out / "verify.json").read_text() == tables[out / "verify.json"]


def test_verify_defaults_to_offline_general_tasks_for_the_embedded_model(tiny_model_dir,
                                                                        tmp_path, capsys,
                                                                        no_model_loading):
    from lm_eval_headloc.commands.verify import DEFAULT_GENERAL, OFFLINE_GENERAL
    from lm_eval_headloc.embedded import is_embedded

    assert is_embedded(None)
    assert not is_embedded(f"pretrained={tiny_model_dir('llama')}")
    assert "hellaswag" in DEFAULT_GENERAL and "headloc_ioi" in OFFLINE_GENERAL
    # Another model offline: the paper's general tasks cannot be had; one line, a hint.
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    assert harness("verify", str(run)) == 2
    message = last_error(capsys)
    assert "cannot load task" in message and "headloc_ioi" in message


def test_a_task_of_the_users_that_cannot_load_gets_no_hint_about_the_hub(tiny_model_dir,
                                                                         tmp_path, capsys,
                                                                         no_model_loading):
    """The Hub hint is for lm-eval's built-in tasks: a YAML of the user's whose data file
    is missing is about that file."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "mine.yaml").write_text(
        "task: mine\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
        f"{tmp_path / 'missing.jsonl'}\ntest_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(folder), "--tasks", "mine", "--out", str(tmp_path / "run")) == 2
    message = last_error(capsys)
    assert "cannot load task 'mine'" in message and "Hugging Face Hub" not in message


@pytest.mark.parametrize("data", ["empty", "zero rows"])
def test_a_task_without_documents_is_one_line(tiny_model_dir, tmp_path, capsys,
                                              no_model_loading, data):
    """An empty data file: lm-eval's loader raised a StopIteration, which has no message,
    and the error's own formatting then failed (IndexError). A loader that gives zero rows
    loads; either way the task has no documents to measure."""
    folder = tmp_path / "mine"
    folder.mkdir()
    if data == "empty":
        (tmp_path / "empty.jsonl").write_text("")
        source = ("dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: "
                  f"{tmp_path / 'empty.jsonl'}\n")
    else:
        (folder / "utils.py").write_text(
            "import datasets\n\ndef load_docs(**kwargs):\n    return datasets.DatasetDict("
            "{'test': datasets.Dataset.from_dict({'q': [], 'a': []})})\n")
        source = "custom_dataset: !function utils.load_docs\n"
    (folder / "mine.yaml").write_text(
        f"task: mine\n{source}test_split: test\noutput_type: loglikelihood\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--include-path",
                   str(folder), "--tasks", "mine", "--out", str(tmp_path / "run")) == 2
    assert last_error(capsys) == "headloc-harness: error: task 'mine' has no documents"
    # The same task as mean ablation's reference set.
    from lm_eval_headloc.ablation import AblationError, reference_texts
    from lm_eval_headloc.tasks import make_task_manager

    with pytest.raises(AblationError, match=r"^ablation_data='mine': task 'mine' has no "
                                            r"documents$"):
        reference_texts("mine", task_manager=make_task_manager([str(folder)]))


def write_heads(folder: Path, task: str, heads: list[str], model_args: str = "m",
                effects: list[float] | None = None, tied: tuple[str, ...] = ()) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(model_args=model_args, tasks=(task,))
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": spec.identity("locate"), "spec": spec.as_config(),
        "settings": {}}))
    effects = [-0.1] * len(heads) if effects is None else effects
    (folder / f"heads-{task}.json").write_text(json.dumps(
        {"higher_is_better": True,
         "heads": [{"head": h, "effect": e} | ({"tied_with_above": True} if h in tied else {})
                   for h, e in zip(heads, effects, strict=True)]}))
    return folder


def test_universal_heads_by_hand(tmp_path, capsys):
    # Three task rankings; top-3 of each: a: L0H1 L2H0 L1H1, b: L2H0 L3H3 L0H1, c: L0H1 ...
    runs = [write_heads(tmp_path / "r1" / "locate", "a", ["L0H1", "L2H0", "L1H1", "L3H3"]),
            write_heads(tmp_path / "r2" / "locate", "b", ["L2H0", "L3H3", "L0H1", "L1H1"]),
            write_heads(tmp_path / "r3" / "locate", "c", ["L0H1", "L1H2", "L3H0", "L2H0"])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--top-k", "3", "--min-tasks", "2",
                   "--out", str(out)) == 0
    result = strict_json(out)
    # L0H1: in all three (ranks 1+3+1); L2H0: a, b (2+1); L3H3: only b; L1H1: only a.
    assert [h["head"] for h in result["heads"]] == ["L0H1", "L2H0"]
    assert [h["tasks"] for h in result["heads"]] == [3, 2]
    # Two runs whose folders share a name are two rankings, labelled by full path.
    assert len(result["rankings"]) == 3
    assert all(str(tmp_path) in label for label in result["rankings"])
    # Rerunning overwrites our own file; a foreign file or a folder is refused.
    assert harness("universal", *map(str, runs), "--out", str(out)) == 0
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"mine": true}')
    for target, message in [(foreign, "was not written by headloc-harness universal"),
                            (tmp_path, "is a folder"),
                            # a run folder it reads (overlap refused it, universal did not)
                            (runs[0] / "u.json", "which this command reads from")]:
        assert harness("universal", *map(str, runs), "--out", str(target)) == 2
        assert message in last_error(capsys)
    assert foreign.read_text() == '{"mine": true}' and not (runs[0] / "u.json").exists()
    # Runs of different models (even of the same shape) are not compared.
    other = write_heads(tmp_path / "r4", "d", ["L0H1"], model_args="another")
    assert harness("universal", str(runs[0]), str(other), "--out", str(tmp_path / "v.json")) == 2
    assert "the runs are of different models" in last_error(capsys)


def test_universal_does_not_count_a_tie_broken_by_name(tmp_path, capsys):
    """Task a's 3rd and 4th (L3H3, L1H1) have the same evidence, so its top-3 holds one of
    them by file order only: L3H3 (2nd in b) is undecided, not universal; L1H1, in a's tie
    only, is neither."""
    runs = [write_heads(tmp_path / "r1", "a", ["L0H1", "L2H0", "L3H3", "L1H1"],
                        tied=("L1H1",)),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L3H3", "L0H1", "L1H1"]),
            write_heads(tmp_path / "r3", "c", ["L0H1", "L1H2", "L3H0", "L2H0"])]
    out = tmp_path / "u.json"
    assert harness("universal", *map(str, runs), "--top-k", "3", "--min-tasks", "2",
                   "--out", str(out)) == 0
    printed = capsys.readouterr().out
    result = strict_json(out)
    assert [h["head"] for h in result["heads"]] == ["L0H1", "L2H0"]
    [undecided] = result["undecided"]
    label_a = f"{(tmp_path / 'r1').resolve()}:a"
    assert undecided == {"head": "L3H3", "tasks": 1, "tasks_at_most": 2,
                         "ranks": {f"{(tmp_path / 'r2').resolve()}:b": 2},
                         "tied_in": [label_a]}
    assert result["ties"] == {label_a: {"group": ["L3H3", "L1H1"], "places": 1,
                                        "from_rank": 3}}
    assert "L1H1" not in result["candidates"]
    assert "| L3H3 (undecided) | 1-2 | tie | 2 |  |" in printed
    assert "1 more undecided" in printed
    # --never-ablate / ablate_file read the universal heads only.
    assert read_heads_file(out) == ["L0H1", "L2H0"]
    # A ranking shorter than the top-k is its whole self (a greedy run ranks a few heads).
    assert harness("universal", *map(str, runs), "--top-k", "5", "--out", str(out)) == 0
    assert [h["head"] for h in strict_json(out)["heads"]] == ["L0H1", "L2H0", "L3H3", "L1H1"]


def test_runs_of_one_model_are_one_model_whatever_the_order_and_device(tmp_path, capsys):
    """universal, overlap and cross compared model args as text: the same model with its
    arguments in another order, or run on another device (which a run appends itself),
    was 'different models'."""
    from lm_eval_headloc.commands.spec import same_model

    assert same_model("pretrained=m,dtype=float32,device=cpu", "dtype=float32,pretrained=m,"
                                                               "device=cuda")
    assert not same_model("pretrained=m,dtype=float32", "pretrained=m,dtype=bfloat16")
    assert not same_model("pretrained=m", "pretrained=m,peft=a")
    runs = [write_heads(tmp_path / "a", "t", ["L0H1", "L1H0"],
                        model_args="pretrained=m,dtype=float32,device=cpu"),
            write_heads(tmp_path / "b", "t", ["L1H0", "L0H1"],
                        model_args="dtype=float32,pretrained=m,device=cuda,batch_size=4")]
    assert harness("universal", *map(str, runs), "--min-tasks", "1", "--out",
                   str(tmp_path / "u.json")) == 0
    assert harness("overlap", *map(str, runs), "--top-k", "2", "--out",
                   str(tmp_path / "o.json")) == 0
    other = write_heads(tmp_path / "c", "t", ["L0H1"], model_args="pretrained=m,dtype=bfloat16")
    assert harness("overlap", str(runs[0]), str(other), "--top-k", "1", "--out",
                   str(tmp_path / "p.json")) == 2
    assert "the runs are of different models" in last_error(capsys)


def test_a_run_resumes_with_its_model_args_in_another_order(tmp_path):
    from lm_eval_headloc.commands import RunFolder, RunFolderError
    from lm_eval_headloc.commands.result import start_run

    first = RunSpec(model_args="pretrained=m,dtype=float32,device=cuda", tasks=("t",))
    with RunFolder(tmp_path / "run") as folder:
        start_run(folder, "locate", first)
        folder.append_measurement({"key": "mask-0000", "mask": "", "scores": {"t": 1.0}})
    again = first.replace(model_args="dtype=float32,pretrained=m,device=cpu")
    with RunFolder(tmp_path / "run") as folder:
        start_run(folder, "locate", again)  # resumed, not refused
        assert [r["key"] for r in folder.measurements()] == ["mask-0000"]
    changed = first.replace(model_args="pretrained=m,dtype=bfloat16")
    with RunFolder(tmp_path / "run") as folder, pytest.raises(RunFolderError,
                                                              match="was made with model_args"):
        start_run(folder, "locate", changed)


def test_a_bare_rerun_keeps_the_masks_given_to_a_run_stopped_before_its_design(
        tiny_model_dir, tmp_path, monkeypatch):
    """A run stopped between its start and its design recorded --masks 5 and no --confirm;
    the bare rerun kept neither (only both were kept) and measured the default budget."""
    import importlib

    locate_module = importlib.import_module("lm_eval_headloc.commands.locate")
    real = locate_module.ensure_types

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C while the head types are measured

    run = tmp_path / "run"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--num-samples", "4", "--prior", "none", "--out", str(run)]
    monkeypatch.setattr(locate_module, "ensure_types", stopped)
    assert harness(*args, "--masks", "5") == 130  # interrupted
    assert strict_json(run / "config.json")["spec"]["masks"] == 5
    assert not (run / "design_matrix.npy").exists()
    monkeypatch.setattr(locate_module, "ensure_types", real)
    assert harness(*args) == 0  # the same command, --masks left out
    assert np.load(run / "design_matrix.npy").shape[0] == 5
    assert strict_json(run / "config.json")["spec"]["masks"] == 5


def test_universal_counts_a_task_once_however_many_runs_rank_it(tmp_path, capsys):
    """Two runs of one task (100 and 10 examples) made its heads 'universal', in 2 tasks."""
    from lm_eval_headloc.commands import universal

    runs = [write_heads(tmp_path / "r1", "induction", ["L0H1", "L1H1", "L2H2"]),
            write_heads(tmp_path / "r2", "induction", ["L0H1", "L2H2", "L3H3"]),
            write_heads(tmp_path / "r3", "ioi", ["L3H3", "L0H0", "L1H0"])]
    result = universal(runs, tmp_path / "u.json", top_k=2, min_tasks=2)
    assert result["heads"] == []  # L0H1 is in two rankings of one task
    assert result["candidates"]["L0H1"] == {f"{(tmp_path / r).resolve()}:induction": 1
                                            for r in ("r1", "r2")}
    result = universal(runs, tmp_path / "u.json", top_k=3, min_tasks=2)
    assert [(h["head"], h["tasks"]) for h in result["heads"]] == [("L3H3", 2)]
    assert harness("universal", *map(str, runs[:2]), "--out", str(tmp_path / "v.json")) == 2
    assert last_error(capsys).endswith("--min-tasks 2: the runs rank only 1 distinct task "
                                       "(a task ranked by several runs counts once)")


def test_universal_counts_a_head_only_where_it_hurts(tmp_path):
    """A top-k place filled by a head that does no harm (fewer hurt than k) is no evidence
    that the task needs it: L0H1 is third in both top-3s, but one ranking measured it to
    change nothing, so it is in one task's set, not two."""
    from lm_eval_headloc.commands import universal

    runs = [write_heads(tmp_path / "r1", "a", ["L2H0", "L1H1", "L0H1"],
                        effects=[-0.3, -0.2, 0.0]),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L3H3", "L0H1"],
                        effects=[-0.2, -0.1, -0.05])]
    result = universal(runs, tmp_path / "u.json", top_k=3, min_tasks=2)
    assert [h["head"] for h in result["heads"]] == ["L2H0"]
    assert list(result["candidates"]["L0H1"].values()) == [3]  # task b's only


def test_universal_marks_a_head_within_a_rankings_spread(tmp_path):
    """L0H1 hurts task a by 0.01 where a single knockout gains 0.02 there: counted as
    listed, but marked as within that ranking's spread (it was said only in report.md)."""
    from lm_eval_headloc.commands import universal
    from lm_eval_headloc.commands.universal import universal_table

    runs = [write_heads(tmp_path / "r1", "a", ["L2H0", "L0H1", "L1H1"],
                        effects=[-0.3, -0.01, 0.02]),
            write_heads(tmp_path / "r2", "b", ["L2H0", "L0H1", "L3H3"],
                        effects=[-0.2, -0.1, -0.05])]
    path = runs[0] / "heads-a.json"
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "largest_single_help": {"head": "L1H1",
                                                                "change": 0.02}}))
    result = universal(runs, tmp_path / "u.json", top_k=2, min_tasks=2)
    by_head = {h["head"]: h for h in result["heads"]}
    assert sorted(by_head) == ["L0H1", "L2H0"]
    label = f"{runs[0].resolve()}:a"
    assert by_head["L0H1"]["within_spread_in"] == [label]
    assert "within_spread_in" not in by_head["L2H0"]
    table = universal_table(result)
    assert "| L0H1 | 2 | 2* | 2 |" in table
    assert "*: in that ranking the head hurts the task by no more than a single knockout" in table


def test_never_ablate_file_and_sweep(tiny_model_dir, tmp_path, capsys):
    args = tiny_args(tiny_model_dir("llama"))
    universal = tmp_path / "universal.json"
    universal.write_text(json.dumps({"heads": [{"head": "L0H1"}, {"head": "L1H2"}]}))
    assert harness("locate", *args, "--tasks", "tiny_copy", "--masks", "6", "--sparsity", "0.25",
                   "--num-samples", "4", "--never-ablate", str(universal),
                   "--out", str(tmp_path / "protected")) == 0
    design = np.load(tmp_path / "protected" / "design_matrix.npy")
    assert not design[:, [1, 6]].any() and design.any(axis=0).sum() == 6
    # Never knocked out, so nothing was measured of them: not ranked (as "no harm" they were).
    ranking = strict_json(tmp_path / "protected" / "heads.json")
    assert ranking["never_knocked_out"] == ["L0H1", "L1H2"]
    assert {h["head"] for h in ranking["heads"]} == {
        f"L{layer}H{head}" for layer in (0, 1) for head in range(4)} - {"L0H1", "L1H2"}
    assert "(not ranked: no measurement knocked them out)" in \
        (tmp_path / "protected" / "report.md").read_text()

    sweep = tmp_path / "sweep"
    assert harness("sweep", *args, "--tasks", "tiny_choice", "--masks", "4,6", "--sparsity",
                   "0.2,0.4", "--num-samples", "4", "--top-k", "2", "--out", str(sweep)) == 0
    result = strict_json(sweep / "sweep.json")
    assert len(result["cells"]) == 4
    records = {r["key"]: r for r in map(json.loads,
                                         (sweep / "measurements.jsonl").read_text().splitlines())}
    base = records["baseline"]["scores"]["tiny_choice"]
    for cell in result["cells"]:
        name = f"m{cell['masks']}-p{cell['sparsity']:g}"
        top = strict_json(sweep / name / "heads.json")["top_k"]
        assert cell["heads"] == top
        check = records[f"{name}-top2"]
        assert check["mask"] == "+".join(sorted(top))
        assert cell["drop"] == pytest.approx(base - check["scores"]["tiny_choice"])
    assert result["best"]["drop"] == max(c["drop"] for c in result["cells"])
    assert "Best: --masks" in capsys.readouterr().out


def test_chat_template_goes_to_generation_tasks_when_the_model_has_one(tiny_model_dir):
    from types import SimpleNamespace

    from lm_eval_headloc.measure import HarnessMeasurement

    setup = engine.prepare(RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},"
                                              "dtype=float32",
                                   tasks=("swear", "tiny_copy"), include_path=(TASKS,)))
    with_template = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ x }}"))
    without = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))

    def chat(lm, override=None):
        return HarnessMeasurement(lm, setup.tasks, setup.loaded, num_samples=2,
                                  apply_chat_template=override).chat_template

    assert chat(with_template) == {"swear": True, "tiny_copy": False}
    assert chat(without) == {"swear": False, "tiny_copy": False}
    assert chat(with_template, override=False) == {"swear": False, "tiny_copy": False}
    assert chat(without, override=True) == {"swear": True, "tiny_copy": True}


def test_unsafe_tasks_run_only_when_confirmed(tiny_model_dir, tmp_path):
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_unsafe",
                   "--masks", "2", "--sparsity", "0.25", "--num-samples", "2",
                   "--confirm-run-unsafe-code", "--out", str(tmp_path / "run")) == 0


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


def test_every_locate_run_carries_per_head_stability(tiny_locate_run, tmp_path,
                                                      no_model_loading):
    import csv
    import shutil

    from lm_eval_headloc.recovery import HeadLasso, bootstrap_stability

    out = shutil.copytree(tiny_locate_run, tmp_path / "run")
    heads = strict_json(out / "heads.json")
    assert heads["bootstrap"]["resamples"] == 200
    # The files hold the bootstrap of the stored measurements (the run's seed).
    design = np.load(out / "design_matrix.npy")
    records = {r["key"]: r for r in read_run(out)[0]}
    scores = [records[f"mask-{i:04d}"]["scores"]["tiny_choice"] for i in range(len(design))]
    expected = bootstrap_stability(HeadLasso(alpha=0.01), design, scores, 3, resamples=200,
                                   seed=0)
    by_head = {h["head"]: h for h in heads["heads"]}
    for flat in range(8):
        entry = by_head[f"L{flat // 4}H{flat % 4}"]
        assert entry["selected"] == pytest.approx(expected.selected[flat])
        assert entry["effect_interval"] == pytest.approx([expected.low[flat],
                                                          expected.high[flat]])
    # Every refit puts at most top-k (3) heads in its top-k.
    assert 0 < sum(h["selected"] for h in heads["heads"]) <= 3
    with open(out / "heads.csv") as f:
        rows = {row["head"]: row for row in csv.DictReader(f)}
    assert all(float(rows[h]["selected"]) == pytest.approx(by_head[h]["selected"])
               for h in by_head)
    assert "bootstrap refits" in (out / "report.md").read_text()
    # refit recomputes it with its own number of resamples.
    assert harness("refit", str(out), "--bootstrap", "20") == 0
    refitted = strict_json(out / "heads.json")
    assert refitted["bootstrap"]["resamples"] == 20
    assert strict_json(out / "config.json")["settings"]["bootstrap"] == 20
    assert harness("refit", str(out), "--bootstrap", "0") == 2


def test_heatmap_hatches_unstable_top_heads(tmp_path):
    from matplotlib.patches import Rectangle

    from lm_eval_headloc.commands.report import HeadRanking, plot_heatmap
    from lm_eval_headloc.recovery import Stability

    selected = np.array([1.0, 0.5, 0.95, 0, 0, 0, 0, 0.55])
    ranking = HeadRanking("t", "acc", True, 0.5, -selected, [0, 7, 2, 1, 3, 4, 5, 6], 4,
                          stability=Stability(selected, -selected - 0.1, -selected + 0.1, 40))
    assert [str(h) for h in ranking.unstable(3)] == ["L1H3"]
    figure = plot_heatmap([ranking], 3, tmp_path / "heatmap.png")
    hatched = [p for p in figure.axes[0].patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert [(p.get_x() + 0.5, p.get_y() + 0.5) for p in hatched] == [(3, 1)]
    assert (tmp_path / "heatmap.png").stat().st_size > 0
    # Layers and heads are whole numbers: no tick between two (2 layers drew 0.25, 0.5, ...).
    axes = figure.axes[0]
    for ticks in (axes.get_xticks(), axes.get_yticks()):
        assert len(ticks) and all(float(t).is_integer() for t in ticks)


def test_a_top_head_that_does_not_hurt_is_not_also_called_unstable():
    """A top-k place filled by a head that does not hurt: no refit counts it (``selected``
    counts refits with the head in the top-k *hurting*), so its 0 % is no instability: the
    table says "does not hurt", and unstable_in_top_k leaves it out."""
    from lm_eval_headloc.commands.report import HeadRanking, ranked_heads_json, ranking_table
    from lm_eval_headloc.recovery import Stability

    effects = np.array([-0.3, -0.1, 0.0, 0.2])  # higher is better: the first two hurt
    selected = np.array([1.0, 0.4, 0.0, 0.0])
    ranking = HeadRanking("t", "acc", True, 0.5, effects, [0, 1, 2, 3], 2,
                          stability=Stability(selected, effects - 0.1, effects + 0.1, 40))
    assert [str(h) for h in ranking.harmless(3)] == ["L1H0"]
    assert [str(h) for h in ranking.unstable(3)] == ["L0H1"]
    assert not ranking.settled(3) and not ranking.settled(2) and ranking.settled(1)
    rows = ranking_table(ranking, 3, "change")
    assert "in top-3, hurting, in 40 bootstrap refits" in rows[0]
    assert rows[2].endswith("| 100% |") and rows[3].endswith("| 40% (unstable) |")
    assert rows[4].endswith("| — (does not hurt) |")
    assert ranked_heads_json(ranking, 3)["bootstrap"]["unstable_in_top_k"] == ["L0H1"]


def test_a_hybrids_heatmap_greys_the_layers_without_heads(tmp_path):
    from lm_eval_headloc.columns import Columns
    from lm_eval_headloc.commands.report import HeadRanking, plot_heatmap

    columns = Columns.heads(4, 2, head_layers=(1, 3))
    effects = np.array([-0.4, 0.1, -0.2, 0.3])
    ranking = HeadRanking("t", "acc", True, 0.5, effects, [0, 2, 1, 3], 2, columns=columns)
    figure = plot_heatmap([ranking], 2, tmp_path / "heatmap.png")
    shown = figure.axes[0].images[0].get_array()
    assert shown.shape == (4, 2)
    assert shown.mask[[0, 2]].all() and not shown.mask[[1, 3]].any()
    np.testing.assert_allclose(shown[[1, 3]].data, effects.reshape(2, 2))  # higher is better
    assert "grey rows: layers without attention heads" in figure.axes[0].get_title()
    assert "grey: no estimate" not in figure.axes[0].get_title()
    # A head never knocked out has no estimate: grey too, and said so (white is "no change").
    effects[1] = np.nan
    unknown = plot_heatmap([HeadRanking("t", "acc", True, 0.5, effects, [0, 2, 3], 2,
                                        columns=columns)], 2, tmp_path / "heatmap.png")
    assert "grey: no estimate" in unknown.axes[0].get_title()
    assert unknown.axes[0].images[0].get_array().mask[1, 1]
    assert unknown.axes[0].get_facecolor()[:3] == pytest.approx((0.8, 0.8, 0.8))


def test_design_seed_draws_other_masks_on_the_same_examples(tiny_model_dir, tmp_path):
    from lm_eval_headloc.designs import design_matrix

    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "6", "--sparsity", "0.25", "--num-samples", "5", "--seed", "1"]
    assert harness(*args, "--out", str(tmp_path / "a")) == 0
    assert harness(*args, "--design-seed", "9", "--out", str(tmp_path / "b")) == 0
    config_a, config_b = (strict_json(tmp_path / f / "config.json") for f in "ab")
    assert config_a["example_subset"] == config_b["example_subset"]
    np.testing.assert_array_equal(np.load(tmp_path / "a" / "design_matrix.npy"),
                                  design_matrix("stratified", 6, 8, 0.25, 1))
    np.testing.assert_array_equal(np.load(tmp_path / "b" / "design_matrix.npy"),
                                  design_matrix("stratified", 6, 8, 0.25, 9))


def test_more_masks_extend_a_run_and_refit_can_take_fewer(tiny_model_dir, tmp_path, capsys):
    # Without confirmation: a confirming run's refit keeps the heads it measured alone.
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--sparsity", "0.25", "--num-samples", "6", "--top-k", "3", *LASSO_ONLY]
    grown, short, full = tmp_path / "grown", tmp_path / "short", tmp_path / "full"
    assert harness(*args, "--masks", "6", "--out", str(grown)) == 0
    assert harness(*args, "--masks", "6", "--out", str(short)) == 0
    assert harness(*args, "--masks", "10", "--out", str(grown)) == 0
    assert harness(*args, "--masks", "10", "--out", str(full)) == 0

    def without_seconds(folder):
        records, heads = read_run(folder)
        return [{k: v for k, v in r.items() if k != "seconds"} for r in records], heads

    assert without_seconds(grown) == without_seconds(full)
    assert len(without_seconds(grown)[0]) == 11
    # refit on the first 6 masks is the 6-mask run.
    assert harness("refit", str(grown), "--masks", "6") == 0
    assert read_run(grown)[1] == read_run(short)[1]
    assert harness("refit", str(grown), "--masks", "12") == 2
    error = last_error(capsys)
    assert "--masks 12: " in error and "has 10 masks" in error


def test_masks_auto_stops_at_the_first_stable_round(tiny_model_dir, tmp_path):
    from lm_eval_headloc.commands.locate import auto_rounds

    assert auto_rounds(100) == [20, 30, 40, 50, 62, 77, 96, 100]
    assert auto_rounds(7) == [7]
    out = tmp_path / "auto"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--sparsity", "0.25", "--num-samples", "12", "--top-k", "1",
                   "--bootstrap", "50", "--masks", "auto", "--max-masks", "60", *LASSO_ONLY,
                   "--out", str(out)) == 0
    used = strict_json(out / "config.json")["masks_used"]
    records, heads = read_run(out)
    assert used in auto_rounds(60) and len(records) == used + 1
    assert heads["measurements"] == used

    def settled(heads) -> bool:  # every top-k head in the top-k, hurting, in 90 % of refits
        return all(h["selected"] >= heads["bootstrap"]["stable_at"] for h in heads["heads"][:1])

    assert settled(heads) or used == 60
    # One round earlier (refit on fewer masks: an independent look) it was not settled.
    earlier = auto_rounds(60)[auto_rounds(60).index(used) - 1] if used > 20 else None
    if earlier is not None:
        assert harness("refit", str(out), "--masks", str(earlier)) == 0
        assert not settled(strict_json(out / "heads.json"))


def test_prior_atp_path_saves_both_points_and_takes_their_rankings_in_turn(tiny_model_dir,
                                                                         tmp_path):
    out = tmp_path / "path"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "6", "--sparsity", "0.25", "--num-samples", "4", "--top-k", "3",
                   "--prior", "atp-path", "--confirm", "0", "--out", str(out)) == 0
    points = strict_json(out / "prior.json")["tasks"]["tiny_choice"]["points"]
    assert [p["at"] for p in points] == [0.0, 0.5]
    assert points[0]["effects"] != points[1]["effects"]
    expected = []  # by hand: the clean run's first, the half-ablated run's first, ...
    for first, second in zip(points[0]["ranking"], points[1]["ranking"], strict=True):
        for head in (first, second):
            if head not in expected:
                expected.append(head)
    assert strict_json(out / "heads.json")["prior_top_k"] == expected[:3]
    assert "half ablated" in (out / "report.md").read_text()


def test_a_prior_that_found_no_effect_says_its_top_k_is_no_order(tiny_model_dir, tmp_path):
    """With every o_proj weight zeroed no head reaches the answer: the prior estimates 0
    for all of them, so its top-k is the head index, and the report must not list it as
    the prior's order."""
    import torch
    from transformers import AutoModelForCausalLM

    dead = tmp_path / "dead"
    shutil.copytree(tiny_model_dir("llama"), dead)  # the tokenizer; the weights replaced
    model = AutoModelForCausalLM.from_pretrained(dead)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    model.save_pretrained(dead)
    out = tmp_path / "run"
    assert harness("locate", *tiny_args(dead), "--tasks", "tiny_choice", "--masks", "6",
                   "--sparsity", "0.25", "--num-samples", "4", "--top-k", "3",
                   "--prior", "atp", "--confirm", "0", "--out", str(out)) == 0
    effects = strict_json(out / "prior.json")["tasks"]["tiny_choice"]["points"][0]["effects"]
    assert set(effects) == {0.0}
    heads = strict_json(out / "heads.json")
    assert heads["prior_found_nothing"] is True
    report = (out / "report.md").read_text()
    assert ("estimated the same change for every head: it found no effect, and its top-3 "
            f"({', '.join(heads['prior_top_k'])}) is the head index, not an order") in report
    assert "attribution prior's own top-3" not in report


def test_prior_found_nothing_only_when_every_estimate_is_equal():
    from lm_eval_headloc.confirm import prior_found_nothing

    assert prior_found_nothing(np.zeros((2, 4)))
    assert prior_found_nothing(np.array([[-0.3] * 4, [0.1 + 0.2, 0.3, 0.3, 0.3]]))  # round-off
    assert not prior_found_nothing(np.array([[0.0, 0.0, 0.0, -1e-6]]))
    assert not prior_found_nothing(np.array([[0.0] * 4, [0.0, -0.2, 0.0, 0.0]]))
    assert not prior_found_nothing(None)


def test_prior_atp_is_saved_ranked_and_eases_the_penalty(tiny_model_dir, tmp_path):
    from lm_eval_headloc.commands.locate import fit_rankings
    from lm_eval_headloc.prior import prior_penalty_weights
    from lm_eval_headloc.recovery import HeadLasso

    out = tmp_path / "prior"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
            "--masks", "10", "--sparsity", "0.25", "--num-samples", "4", "--top-k", "3",
            "--prior", "atp", "--confirm", "0", "--out", str(out)]
    assert harness(*args) == 0
    prior = strict_json(out / "prior.json")
    assert [p["at"] for p in prior["tasks"]["tiny_choice"]["points"]] == [0.0]
    clean = prior["tasks"]["tiny_choice"]["points"][0]
    effects = np.array(clean["effects"])
    assert effects.shape == (8,) and np.abs(effects).max() > 0
    heads = strict_json(out / "heads.json")
    assert heads["prior_top_k"] == clean["ranking"][:3]
    assert "attribution prior's own top-3" in (out / "report.md").read_text()
    # The fit is the weighted Lasso with the prior's weights (most harmful: most eased).
    weights = prior_penalty_weights(-effects)
    assert weights.min() == pytest.approx(0.5) and weights.max() <= 1
    records = {r["key"]: r for r in read_run(out)[0]}
    design = np.load(out / "design_matrix.npy")
    y = [records[f"mask-{i:04d}"]["scores"]["tiny_choice"] for i in range(10)]
    expected = HeadLasso(penalty_weights=weights).fit(design, y).coef_
    assert [h["effect"] for h in heads["heads"]] == pytest.approx(
        [expected[int(h["layer"]) * 4 + int(h["head_in_layer"])] for h in heads["heads"]])
    # Resuming reads prior.json back; refit keeps using it.
    before = (out / "prior.json").read_text()
    assert harness(*args) == 0 and harness("refit", str(out)) == 0
    assert (out / "prior.json").read_text() == before
    assert strict_json(out / "heads.json")["heads"] == heads["heads"]
    plain = fit_rankings(design, records, ["tiny_choice"], 4, 0.01, bootstrap=None)
    assert not np.allclose(plain["tiny_choice"].effects, expected)


@pytest.mark.parametrize("options", [
    ["--signal", "logprob"],
    ["--masks", "auto", "--max-masks", "30", "--top-k", "2"],
    ["--sparsity", "auto", "--masks", "14"],
    ["--prior", "atp", "--signal", "logprob", "--design-seed", "5"],
])
def test_new_options_give_equal_results_with_k_masks_per_pass_and_refit(
        tiny_model_dir, tmp_path, options):
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy,tiny_choice",
            "--masks", "12", "--sparsity", "0.25", "--num-samples", "6", "--bootstrap", "30",
            *options]
    one, three = tmp_path / "one", tmp_path / "three"
    assert harness(*args, "--masks-per-pass", "1", "--out", str(one)) == 0
    assert harness(*args, "--masks-per-pass", "3", "--out", str(three)) == 0
    records_one, heads_one = read_run(one)
    records_three, heads_three = read_run(three)
    assert [r["key"] for r in records_one] == [r["key"] for r in records_three]
    for a, b in zip(records_one, records_three, strict=True):
        assert a["mask"] == b["mask"]
        assert a["scores"] == pytest.approx(b["scores"], abs=1e-9)
    assert [h["head"] for h in heads_one["heads"]] == [h["head"] for h in heads_three["heads"]]
    # refit with the run's own settings writes the same ranking and stability.
    assert harness("refit", str(three)) == 0
    assert strict_json(three / "heads.json") == heads_three


def test_sparsity_auto_runs_a_pilot_that_joins_the_fit(tiny_model_dir, tmp_path):
    from lm_eval_headloc.designs import knockouts_per_mask

    out = tmp_path / "pilot"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--sparsity", "auto", "--masks", "16", "--num-samples", "6", *LASSO_ONLY,
                   "--out", str(out)) == 0
    config = strict_json(out / "config.json")
    records, heads = read_run(out)
    assert len(records) == 1 + 16  # baseline + 16 measurements, the pilot's included
    chosen = config["pilot"]["sparsity"]
    assert chosen in (0.02, 0.2) and config["masks_used"] == 16
    matrix = np.load(out / "design_matrix.npy")
    assert len(matrix) == heads["measurements"] == 15  # the floor mask is not fitted
    assert config["row_keys"][:4] == ["pilot-p0.02-0", "pilot-p0.02-1", "pilot-p0.2-0",
                                      "pilot-p0.2-1"]
    assert (matrix[4:].sum(axis=1) == knockouts_per_mask(chosen, 8)).all()
    assert "sparsity auto: " in (out / "report.md").read_text()


def test_a_folder_made_before_an_option_existed_resumes_as_it_was_made(tmp_path):
    from lm_eval_headloc.commands import RunFolder, RunFolderError

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
    with RunFolder(folder) as run, pytest.raises(RunFolderError,
                                                 match="was made with prior='none'"):
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
    with RunFolder(folder) as run, pytest.raises(RunFolderError,
                                                 match="was made with signal='metric'"):
        run.start("locate", legacy.replace(signal="logprob").identity("locate"), {},
                  assumed=RunSpec.assumed_for_old_runs())


# --- confirmation (--confirm) -----------------------------------------------------------

def test_confirm_knocks_out_the_likeliest_heads_alone_and_ranks_them_first(
        tiny_model_dir, tmp_path):
    import csv

    from sklearn.linear_model import Lasso

    out = tmp_path / "confirm"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
            "--masks", "12", "--sparsity", "0.25", "--num-samples", "8", "--top-k", "2",
            "--signal", "logprob", "--prior", "none", "--confirm", "3", "--out", str(out)]
    assert harness(*args) == 0
    records = {r["key"]: r for r in read_run(out)[0]}
    heads = strict_json(out / "heads.json")
    config = strict_json(out / "config.json")
    # Candidates without a prior: the masks' Lasso's three most harmful heads, fitted
    # here with sklearn directly (scores over their standard deviation, intercept).
    design = np.load(out / "design_matrix.npy")
    y = np.array([records[f"mask-{i:04d}"]["scores"]["tiny_copy"] for i in range(12)])
    coef = Lasso(alpha=0.01, max_iter=10000).fit(design.astype(float), y / y.std()).coef_
    screen = [f"L{i // 4}H{i % 4}" for i in np.argsort(coef, kind="stable")]
    assert config["confirm"]["heads"] == screen[:3]
    assert config["confirm"]["picked_by"] == {"tiny_copy": screen[:3]}
    assert config["confirm"]["rounds"] == [screen[:3]]  # one round (of at most 5)
    # Each was measured alone, and the ranking starts with them by measured change.
    base = records["baseline"]["scores"]["tiny_copy"]
    alone = {h: records[f"alone-{h}"]["scores"]["tiny_copy"] - base for h in screen[:3]}
    assert all(records[f"alone-{h}"]["mask"] == h for h in alone)
    first = [h["head"] for h in heads["heads"][:3]]
    assert sorted(alone.values()) == [alone[h] for h in first]
    # The rest: the masks refitted with the measured heads' changes held fixed (sklearn
    # on the residual), equal fits ordered by the residual's marginal contrast.
    flat = {f"L{i // 4}H{i % 4}": i for i in range(8)}
    held = [flat[h] for h in alone]
    residual = y - design[:, held].astype(float) @ np.array(list(alone.values()))
    free = [i for i in range(8) if i not in held]
    refit_coef = dict(zip(free, Lasso(alpha=0.01, max_iter=10000).fit(
        design[:, free].astype(float), residual / residual.std()).coef_ * residual.std(),
        strict=True))

    def contrast(i):
        inside = [r for r, row in zip(residual, design, strict=True) if row[i]]
        outside = [r for r, row in zip(residual, design, strict=True) if not row[i]]
        return np.mean(inside) - np.mean(outside) if inside and outside else 0.0

    tail = sorted(free, key=lambda i: (refit_coef[i], contrast(i), i))
    assert [h["head"] for h in heads["heads"][3:]] == [f"L{i // 4}H{i % 4}" for i in tail]
    for entry in heads["heads"]:
        assert entry["measured_alone"] == (entry["head"] in alone)
        if entry["measured_alone"]:
            assert entry["effect"] == pytest.approx(alone[entry["head"]])
            assert entry["effect_interval"] is None
        else:
            assert entry["effect"] == pytest.approx(
                refit_coef[flat[entry["head"]]], abs=1e-9)
    with open(out / "heads.csv") as f:
        rows = {row["head"]: row for row in csv.DictReader(f)}
    assert {h for h, row in rows.items() if row["measured_alone"] == "1"} == set(alone)
    report = (out / "report.md").read_text()
    assert "3 heads knocked out one at a time" in report and "measured alone" in report
    # refit measures nothing: the confirmed heads stay, the screen's fit may change.
    assert harness("refit", str(out), "--alpha", "0.05") == 0
    assert strict_json(out / "config.json")["confirm"] == config["confirm"]
    assert [h["head"] for h in strict_json(out / "heads.json")["heads"][:3]] == first
    assert harness("refit", str(out), "--alpha", "0.01") == 0
    assert strict_json(out / "heads.json") == heads


def test_confirm_with_the_prior_alternates_and_covers_small_models(tiny_model_dir, tmp_path):
    out = tmp_path / "both"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "8", "--sparsity", "0.25", "--num-samples", "4",
                   "--prior", "atp", "--confirm", "4", "--out", str(out)) == 0
    from lm_eval_headloc.prior import prior_penalty_weights
    from lm_eval_headloc.recovery import HeadLasso

    stored = strict_json(out / "prior.json")["tasks"]["tiny_choice"]["points"][0]
    prior = stored["ranking"]
    records = {r["key"]: r for r in read_run(out)[0]}
    design = np.load(out / "design_matrix.npy")
    y = [records[f"mask-{i:04d}"]["scores"]["tiny_choice"] for i in range(8)]
    # The screen: the prior-eased Lasso (checked against its definition above).
    fit = HeadLasso(penalty_weights=prior_penalty_weights(-np.array(stored["effects"])))
    screen = [f"L{i // 4}H{i % 4}" for i in fit.fit(design, y).ranking()]
    expected = []
    for source in [prior, screen, prior, screen]:  # in turn, skipping what is taken
        expected.append(next(h for h in source if h not in expected))
    assert np.count_nonzero(fit.coef_) >= 2  # the screen's picks are its fit's, not ties
    assert strict_json(out / "config.json")["confirm"]["heads"] == expected
    # --confirm above the model's 8 heads: every head alone (one-shot greedy's ranking).
    every = tmp_path / "every"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_choice",
                   "--masks", "8", "--sparsity", "0.25", "--num-samples", "4",
                   "--out", str(every)) == 0  # the defaults: --confirm 34, --prior auto
    config = strict_json(every / "config.json")
    assert len(config["confirm"]["heads"]) == 8 and config["prior_used"] is True
    records = {r["key"]: r for r in read_run(every)[0]}
    base = records["baseline"]["scores"]["tiny_choice"]
    changes = {h: records[f"alone-{h}"]["scores"]["tiny_choice"] - base
               for h in config["confirm"]["heads"]}
    ranked = [h["head"] for h in strict_json(every / "heads.json")["heads"]]
    assert [changes[h] for h in ranked] == sorted(changes.values())


def test_prior_auto_is_none_where_there_are_no_gold_answers(tiny_model_dir, tmp_path,
                                                            capsys):
    out = tmp_path / "rolling"
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_rolling",
            "--masks", "6", "--sparsity", "0.25", "--num-samples", "4", "--confirm", "2"]
    assert harness(*args, "--out", str(out)) == 0
    assert strict_json(out / "config.json")["prior_used"] is False
    assert not (out / "prior.json").exists()
    report = (out / "report.md").read_text()
    # The report says why auto computed none, naming the task.
    assert "attribution prior: none (--prior auto: task 'tiny_rolling' " in report
    assert strict_json(out / "config.json")["prior_skipped"].startswith("task 'tiny_rolling'")
    assert harness(*args, "--prior", "atp", "--out", str(tmp_path / "x")) == 2
    error = last_error(capsys)
    assert "--prior atp: task 'tiny_rolling' is loglikelihood_rolling" in error
    assert not (tmp_path / "x").exists()


def heads_top_k(run: Path) -> int:
    return strict_json(run / "config.json")["spec"]["top_k"]


def test_a_run_that_measured_every_head_alone_claims_no_fit(tiny_model_dir, tmp_path, capsys):
    """With more confirmation than heads (a small model, the default budget) every head is
    measured alone: the fit has nothing left and its R² (0) and held-out R² said nothing
    true; the report says why there is none."""
    out = tmp_path / "all"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--masks", "4",
                   "--prior", "none", "--confirm", "8", "--out", str(out)) == 0
    heads = strict_json(out / "heads.json")
    assert len(heads["confirmed"]) == 8
    assert heads["r2"] is None and heads["r2_held_out"] is None  # as the report says
    printed = capsys.readouterr().out
    assert "R²" not in printed
    # Every head measured alone: the one whose knockout helps most is the spread, and
    # top heads that hurt by no more are marked so where the ranking is printed.
    assert heads["higher_is_better"] is True  # logprob
    best = max(heads["heads"], key=lambda e: e["effect"])
    assert best["effect"] > 0  # random weights: some knockout helps (else nothing to test)
    assert heads["largest_single_help"] == {"head": best["head"], "change": best["effect"]}
    for entry in heads["heads"][:heads_top_k(out)]:
        line = next(line for line in printed.splitlines()
                    if line.strip().split()[1:2] == [entry["head"]])
        within = entry["effect"] < 0 and -entry["effect"] <= best["effect"]
        assert ("within the spread of single knockouts" in line) == within, line
    report = (out / "report.md").read_text()
    assert "Every head was measured alone, so each ranks by its measurement" in report
    assert "Fit R²" not in report
    some = tmp_path / "some"
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "6", "--signal", "logprob", "--masks", "4",
                   "--prior", "none", "--confirm", "2", "--out", str(some)) == 0
    assert "Fit R² = " in (some / "report.md").read_text()
    assert isinstance(strict_json(some / "heads.json")["r2"], float)


def test_a_refused_run_folder_leaves_no_output_path_behind(tiny_model_dir, tmp_path, capsys,
                                                           no_model_loading):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine")
    assert harness("verify", str(run), "--top-k", "1", "--general", "tiny_choice",
                   "--random-draws", "0", "--out", str(mine),
                   "--output-path", str(tmp_path / "brand" / "new")) == 2
    assert "is not empty and is not a headloc-harness run folder" in last_error(capsys)
    assert not (tmp_path / "brand").exists()


def test_a_tag_is_the_mean_of_its_tasks(tiny_model_dir, tmp_path):
    # --tasks headloc (a tag of the three headloc_* tasks) failed after the model loaded:
    # lm-eval 0.4.13 no longer dumps a task's tags into the results.
    args = ["locate", *tiny_args(tiny_model_dir("llama")), "--num-samples", "3", "--masks",
            "2", "--sparsity", "0.25", *LASSO_ONLY]
    assert harness(*args, "--tasks", "headloc", "--out", str(tmp_path / "tag")) == 0
    assert harness(*args, "--tasks", "headloc_induction,headloc_ioi,headloc_arith",
                   "--out", str(tmp_path / "each")) == 0
    tag, each = (measurement_lines(tmp_path / name)[0] for name in ("tag", "each"))
    assert tag["metrics"] == {"headloc": "acc,none"}
    assert tag["scores"]["headloc"] == pytest.approx(sum(each["scores"].values()) / 3)


def test_a_tag_whose_tasks_score_by_different_metrics_is_refused_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_loading):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, metric, aggregation, higher in (("mixed_acc", "acc", "mean", "true"),
                                              ("mixed_ppl", "perplexity", "perplexity",
                                               "false")):
        (tasks / f"{name}.yaml").write_text(
            f"include: {TASKS}/tiny_copy/tiny_copy.yaml\ntask: {name}\ntag: mixed\n"
            f"metric_list:\n  - metric: {metric}\n    aggregation: {aggregation}\n"
            f"    higher_is_better: {higher}\n")
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", TASKS, "--include-path", str(tasks), "--tasks", "mixed",
                   "--out", str(tmp_path / "run")) == 2
    assert last_error(capsys).endswith(
        "task 'mixed': its tasks are scored by different metrics (mixed_acc: acc,none, "
        "mixed_ppl: perplexity,none); give one (mixed:METRIC) or name the tasks")


def test_a_long_inline_head_list_is_heads_not_a_file_name(tmp_path, monkeypatch):
    """--never-ablate with 261 heads inline (an audit's run on the embedded model): the
    check for a file of that name raised 'File name too long' as a traceback."""
    from lm_eval_headloc.checks import UsageError
    from lm_eval_headloc.commands.engine import head_list
    from lm_eval_headloc.heads import Head

    monkeypatch.chdir(tmp_path)
    names = [f"L{layer}H{head}" for layer in range(1, 30) for head in range(9)]
    assert len("+".join(names)) > 255  # longer than a file name may be
    assert head_list("+".join(names), 30, 9, "--never-ablate") == [
        Head(layer, head) for layer in range(1, 30) for head in range(9)]
    # A file is still read as one, and a bad name is still a one-line error.
    (tmp_path / "keep.txt").write_text("L0H1\nL2H3\n")
    assert head_list("keep.txt", 30, 9, "--never-ablate") == [Head(0, 1), Head(2, 3)]
    with pytest.raises(UsageError, match="--never-ablate: "):
        head_list("+".join([*names, "L40H0"]), 30, 9, "--never-ablate")
