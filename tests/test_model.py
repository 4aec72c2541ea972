"""hf-headablate through lm-eval: registration, stock CLI, simple_evaluate, cache, GGUF."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TASKS, per_sample_loglikelihoods, raises_naming, simple_evaluate

import lm_eval_headloc  # noqa: F401  (registers hf-headablate)

ROOT = Path(__file__).resolve().parent.parent
LM_EVAL = str(Path(sys.executable).parent / "lm_eval")


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd="/")


def test_startup_hook_imports_nothing_heavy():
    result = run_python(
        "import sys, json, collections\n"
        "print(sorted(m for m in ('torch', 'lm_eval', 'transformers', 'lm_eval_headloc')"
        " if m in sys.modules))\n"
        "print([type(f).__name__ for f in sys.meta_path])"
    )
    assert result.returncode == 0, result.stderr
    loaded, finders = result.stdout.splitlines()
    assert loaded == "[]"
    assert "_WatchLmEvalModels" in finders  # the hook is installed, waiting


def assert_the_installed_hook_is_this_checkouts() -> None:
    """The hook is a copy in site-packages, made at install time (an editable install's
    too): a test of what it does tests that copy."""
    hook = run_python("import _lm_eval_headloc_startup as m; print(m.__file__)")
    installed = Path(hook.stdout.strip())
    assert installed.read_bytes() == (ROOT / "startup" / installed.name).read_bytes(), (
        f"{installed} is not this checkout's start-up hook: reinstall (pip install -e .)")


def test_the_hook_registers_our_tasks_when_lm_eval_loads_its_task_manager():
    """Either module first; the watcher leaves once both are in."""
    assert_the_installed_hook_is_this_checkouts()
    for first, second in [("lm_eval.tasks", "lm_eval.models"),
                          ("lm_eval.models", "lm_eval.tasks")]:
        result = run_python(
            f"import sys\nimport {first}\nimport {second}\n"
            "from lm_eval.tasks import TaskManager\n"
            "from lm_eval.api.registry import model_registry\n"
            "print(getattr(TaskManager.__init__, '_headloc_tasks', False),"
            " 'hf-headablate' in model_registry,"
            " [type(f).__name__ for f in sys.meta_path].count('_WatchLmEvalModels'))")
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == ["True", "True", "0"], first


def test_task_managers_index_our_folder_after_the_built_ins_and_before_the_users(
        monkeypatch, tmp_path):
    from lm_eval.tasks import TaskManager, manager

    from lm_eval_headloc.intervention.registration import register_tasks
    from lm_eval_headloc.tasks import task_configs_dir

    register_tasks()
    register_tasks()  # once is enough; twice changes nothing
    built: list[list[str]] = []

    def build(paths, **kwargs):
        built.append([str(p) for p in paths])
        return {}

    monkeypatch.setattr(manager.TaskIndex, "build", staticmethod(build))
    builtins, ours = str(Path(manager.__file__).parent), str(task_configs_dir())
    mine = str(tmp_path)
    assert TaskManager().include_path is None
    assert TaskManager(include_path=mine).include_path == mine  # as given
    TaskManager(None, [mine])  # positionally
    # Our folder named already, spelled another way: indexed once, as given.
    spelled = str(Path(ours) / ".." / Path(ours).name)
    TaskManager(include_path=[spelled, mine])
    TaskManager(include_path=mine, include_defaults=False)  # only what it asks for
    assert built == [[builtins, ours], [builtins, ours, mine], [builtins, ours, mine],
                     [builtins, spelled, mine], [mine]]


def test_the_startup_hook_imports_no_module_at_all():
    """Python runs the hook at every start in the environment: it imports nothing (not
    even importlib.abc, about 25 ms of pathlib, tempfile and typing)."""
    result = subprocess.run(
        [sys.executable, "-I", "-S", "-c",
         f"import sys\nsys.path.insert(0, {str(ROOT / 'startup')!r})\n"
         "before = set(sys.modules)\n"
         "import _lm_eval_headloc_startup\n"
         "print(sorted(set(sys.modules) - before))\n"
         "print(type(sys.meta_path[0]).__name__)"],
        capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["['_lm_eval_headloc_startup']", "_WatchLmEvalModels"]


def test_stock_registry_finds_the_model_lazily_and_keeps_hf():
    # get_model as the very first lm-eval call (the path the CLI takes).
    result = run_python(
        "import sys\n"
        "from lm_eval.api.registry import get_model, model_registry\n"
        "cls = get_model('hf-headablate')\n"
        "print(cls.__module__ + ':' + cls.__name__)\n"
        "print(get_model('hf').__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["lm_eval_headloc.intervention.model:HFHeadAblateLM", "HFLM"]
    result = run_python(
        "import sys\nimport lm_eval.models\n"
        "from lm_eval.api.registry import model_registry\n"
        "print(model_registry._objs['hf-headablate'], 'torch' in sys.modules)"
    )
    assert result.stdout.split() == ["lm_eval_headloc.intervention.model:HFHeadAblateLM", "False"]


# Without the start-up hook: its watcher taken out (and, for a source checkout used
# without installing, the hook module not importable at all: found in startup/ instead).
NO_HOOK = ("import sys\n"
           "sys.meta_path[:] = [f for f in sys.meta_path"
           " if type(f).__name__ != '_WatchLmEvalModels']\n")
NOT_INSTALLED = (NO_HOOK + "sys.modules.pop('_lm_eval_headloc_startup', None)\n"
                 "class Block:\n"
                 "    def find_spec(self, name, path=None, target=None):\n"
                 "        if name == '_lm_eval_headloc_startup':\n"
                 "            raise ImportError('not installed')\n"
                 "sys.meta_path.insert(0, Block())\n")


@pytest.mark.parametrize("without_hook", [NO_HOOK, NOT_INSTALLED], ids=["watcher", "module"])
def test_import_registers_without_the_startup_hook_and_entry_point_is_declared(without_hook):
    result = run_python(
        without_hook +
        "import lm_eval_headloc\n"
        "from lm_eval.api.registry import get_model\n"
        "print(get_model('hf-headablate').__name__, get_model('hf').__name__)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["HFHeadAblateLM", "HFLM"]
    from importlib.metadata import entry_points

    (entry,) = entry_points(group="lm_eval.models", name="hf-headablate")
    assert entry.value == "lm_eval_headloc.intervention.model:HFHeadAblateLM"


def test_lm_eval_free_modules_do_not_import_lm_eval():
    result = run_python(
        "import sys\n"
        "import lm_eval_headloc, lm_eval_headloc.intervention.components\n"
        "import lm_eval_headloc.common.checks\n"
        "import lm_eval_headloc.method.designs, lm_eval_headloc.method.lasso\n"
        "print(sorted(m for m in ('lm_eval', 'torch') if m in sys.modules))\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]"]


@pytest.mark.parametrize("module, registered", [
    ("lm_eval.models", "'hf-headablate' in "
                       "__import__('lm_eval.api.registry').api.registry.model_registry"),
    ("lm_eval.tasks", "getattr(__import__('lm_eval.tasks').tasks.TaskManager.__init__, "
                      "'_headloc_tasks', False)")])
def test_import_after_lm_eval_registers_at_once(module, registered):
    # The other order: lm-eval's module already imported, no start-up hook to catch it.
    result = run_python(
        NO_HOOK +
        f"import {module}\n"
        f"print({registered})\n"
        "import lm_eval_headloc\n"
        f"print({registered})\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"]


def test_excepthook_is_left_alone_outside_the_lm_eval_command():
    # Importing the model (and lm-eval) in any other program changes no global hook.
    result = run_python(
        "import sys\n"
        "before = sys.excepthook\n"
        "import lm_eval.models, lm_eval_headloc, lm_eval_headloc.intervention.model\n"
        "print(sys.excepthook is before)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True"]


def test_lm_eval_command_hook_handles_only_head_errors():
    # As if this were the `lm_eval` console script: our errors get one line, everything
    # else goes to the hook that was installed before.
    result = run_python(
        "import sys\n"
        "seen = []\n"
        "sys.excepthook = lambda kind, value, tb: seen.append(kind.__name__)\n"
        "sys.argv[0] = '/somewhere/bin/lm_eval'\n"
        "import lm_eval.models\n"
        "from lm_eval_headloc.intervention.components import ComponentSpecError\n"
        "for err in (ComponentSpecError('bad head name X1'), KeyError('k'), SystemError('s')):\n"
        "    sys.excepthook(type(err), err, None)\n"
        "print(seen)\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "['KeyError', 'SystemError']"
    assert result.stderr.strip() == "hf-headablate: error: bad head name X1"


@pytest.fixture
def no_weight_loading(monkeypatch):
    """HFLM.__init__ (which loads the weights) fails loudly if reached."""
    from lm_eval.models.huggingface import HFLM

    def refuse(self, *args, **kwargs):
        raise AssertionError("weights are loading")

    monkeypatch.setattr(HFLM, "__init__", refuse)


@pytest.mark.parametrize("kwargs, values", [  # the bad value and, where it helps, the form
    (dict(ablate="X1"), ("'X1'",)),
    (dict(ablate="l0h0"), ("'l0h0'",)),
    (dict(ablate="L*H1"), ("'L*H1'",)),
    (dict(ablate="L0H1++L1H2"), ("empty component name", "ablate=L0H1++L1H2:")),
    (dict(ablate="L0H0+"), ("empty component name", "ablate=L0H0+:")),  # named: it was not
    # What lm-eval's model_args parser makes of ablate=1 and ablate=True.
    (dict(ablate=1), ("ablate=1", "ablate=L0H29+L1H31")),
    (dict(ablate=True), ("ablate=True", "ablate=L0H29+L1H31")),
    (dict(ablate_file="h.txt", ablate_top=True), ("ablate_top=True", ">= 1")),
    (dict(ablate_file="h.txt", ablate_top=0), ("ablate_top=0", ">= 1")),
    (dict(ablate_file="h.txt", ablate_top=1.5), ("ablate_top=1.5",)),
    (dict(ablate_top=2), ("ablate_top=2", "ablate_file=")),
    (dict(ablate_file=1), ("ablate_file=1",)),
    (dict(ablate_file="nope.json"), ("nope.json",)),
    (dict(ablate="L0H1", ablate_file="bad.txt"), ("bad.txt", "'L0H**'")),
    (dict(attn_out=1), ("attn_out=1",)),
])
def test_head_arguments_fail_before_the_weights_load(no_weight_loading, tmp_path, monkeypatch,
                                                     kwargs, values):
    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    monkeypatch.chdir(tmp_path)
    (tmp_path / "h.txt").write_text("L0H1\nL1H2\n")
    (tmp_path / "bad.txt").write_text("L0H**\n")
    with raises_naming(ComponentSpecError, *values) as info:
        HFHeadAblateLM(pretrained="never-loaded", **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, said", [
    # What lm-eval's model_args parser makes of batch_size=-1 (-1.0), =abc, =0, ...: lm-eval
    # stopped on a bare AssertionError or ValueError, or took 0.
    (dict(batch_size=-1.0), "batch_size=-1:"), (dict(batch_size="abc"), "batch_size=abc:"),
    (dict(batch_size=0), "batch_size=0:"), (dict(batch_size="auto:0"), "batch_size=auto:0:"),
    (dict(batch_size=2.5), "batch_size=2.5:"), (dict(max_batch_size="auto"),
                                                "max_batch_size=auto:"),
    (dict(max_batch_size=-3), "max_batch_size=-3:"),
])
def test_a_bad_batch_size_is_one_line_before_the_weights_load(no_weight_loading, kwargs,
                                                              said):
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    with raises_naming(UsageError, said, "whole number >= 1") as info:
        HFHeadAblateLM(pretrained="never-loaded", **kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, said", [
    # HFLM took max_length=0 as unset, stopped on a bare AssertionError for -5, and read
    # softmax_dtype and mixed_precision_dtype after the load (an AttributeError).
    (dict(max_length=0), "max_length=0:"), (dict(max_length=-5.0), "max_length=-5:"),
    (dict(max_length="abc"), "max_length='abc':"), (dict(max_length=2.5), "max_length=2.5"),
    (dict(softmax_dtype="float17"), "softmax_dtype=float17:"),
    (dict(mixed_precision_dtype="bf16"), "mixed_precision_dtype=bf16:"),
])
def test_a_bad_length_or_dtype_is_one_line_before_the_weights_load(no_weight_loading,
                                                                   kwargs, said):
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    with raises_naming(UsageError, said) as info:
        HFHeadAblateLM(pretrained="never-loaded", **kwargs)
    assert "\n" not in str(info.value)


def test_a_good_batch_size_reaches_the_load(no_weight_loading):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    for kwargs in (dict(batch_size=4), dict(batch_size="auto"), dict(batch_size="auto:2"),
                   dict(batch_size="8", max_batch_size=16), dict(max_length=64),
                   dict(softmax_dtype="float32", mixed_precision_dtype="bfloat16")):
        with pytest.raises(AssertionError, match="weights are loading"):
            HFHeadAblateLM(pretrained="never-loaded", **kwargs)


def test_head_ranges_are_checked_after_the_weights_load(no_weight_loading):
    # L99H0 is well-formed: only the loaded model can say it is out of range.
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    with pytest.raises(AssertionError, match="weights are loading"):
        HFHeadAblateLM(pretrained="never-loaded", ablate="L99H0+L3H*")


@pytest.mark.slow
def test_stock_cli_applies_the_mask(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("llama")
    args = f"pretrained={folder},dtype=float32"
    cli = subprocess.run(
        [LM_EVAL, "--model", "hf-headablate", "--model_args", f"{args},ablate=L0H1+L1H2",
         "--device", "cpu",
         "--tasks", "tiny_choice", "--include_path", TASKS, "--output_path", str(tmp_path),
         "--log_samples"],
        capture_output=True, text=True, timeout=300,
    )
    assert cli.returncode == 0, cli.stderr[-3000:]
    samples_file = next(tmp_path.rglob("samples_tiny_choice_*.jsonl"))
    cli_ll = [float(r[0]) for line in samples_file.read_text().splitlines()
              for r in json.loads(line)["filtered_resps"]]
    masked = per_sample_loglikelihoods(simple_evaluate(f"{args},ablate=L1H2+L0H1",
                                                       device="cpu"))
    plain = per_sample_loglikelihoods(simple_evaluate(args, device="cpu"))
    assert cli_ll == pytest.approx(masked, abs=1e-5)
    assert cli_ll != pytest.approx(plain, abs=1e-5)
    results_file = next(tmp_path.rglob("results_*.json"))
    config = json.loads(results_file.read_text())["config"]
    assert config["model_args"]["ablate"] == "L0H1+L1H2"


@pytest.mark.slow
def test_stock_cli_finds_our_tasks_by_name_next_to_the_built_ins(tiny_model_dir, tmp_path):
    """With the package installed, `lm_eval --tasks headloc_induction` needs no
    --include_path: the start-up hook adds our task folder to lm-eval's TaskManager, after
    the built-ins; a folder of the user's still wins a name clash."""
    assert_the_installed_hook_is_this_checkouts()
    folder = tiny_model_dir("llama")
    mine = tmp_path / "mine"
    mine.mkdir()
    # The user's own task of the same name (a clash): theirs is taken, as lm-eval takes a
    # later folder's over a built-in.
    (mine / "rhyme.yaml").write_text(
        f"include: {Path(TASKS) / 'tiny_copy' / 'tiny_copy.yaml'}\ntask: rhyme\n")
    common = [LM_EVAL, "--model", "hf-headablate", "--device", "cpu", "--model_args",
              f"pretrained={folder},dtype=float32"]
    running = {
        "ours": subprocess.Popen([*common, "--tasks", "headloc_induction", "--limit", "2",
                                  "--output_path", str(tmp_path / "ours")],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
        "clash": subprocess.Popen([*common, "--tasks", "rhyme", "--limit", "2",
                                   "--include_path", str(mine),
                                   "--output_path", str(tmp_path / "clash")],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)}
    done = {name: (process.communicate(timeout=600), process.returncode)
            for name, process in running.items()}
    for name, ((_, err), code) in done.items():
        assert code == 0, f"{name}: {err[-3000:]}"
    ours = json.loads(next((tmp_path / "ours").rglob("results_*.json")).read_text())
    assert ours["n-samples"]["headloc_induction"]["effective"] == 2
    assert "acc,none" in ours["results"]["headloc_induction"]
    clash = json.loads(next((tmp_path / "clash").rglob("results_*.json")).read_text())
    assert clash["configs"]["rhyme"]["output_type"] == "loglikelihood"  # theirs, not ours
    # lm-eval says whose task was overridden: ours, by the user's.
    assert re.search(r"Task 'rhyme' from \S*mine/rhyme\.yaml overrides existing task from "
                     r"\S*task_configs/rhyme/rhyme\.yaml", done["clash"][0][1])


BAD_HEADS = {
    "ablate=L99H0": r"hf-headablate: error: head L99H0 is outside the model: layer 99 not in",
    "ablate=L0H1+X1": r"hf-headablate: error: bad component name 'X1'",
    "ablate_file=/no/such/heads.json": r"hf-headablate: error: head file not found",
    "ablate=1": r"hf-headablate: error: ablate=1: expected heads like ablate=L0H29\+L1H31",
    "ablate_file=/no/such/heads.json,ablate_top=True":
        r"hf-headablate: error: ablate_top=True: must be a whole number >= 1",
    "-m lm_eval: ablate=L0H1+X1": r"hf-headablate: error: bad component name 'X1'",
    "ablate=L0H1+L1N64": r"hf-headablate: error: neuron L1N64 is outside the model: neuron "
                         r"64 not in 0\.\.63",
    "ablate=L0N1+L1Nx": r"hf-headablate: error: bad component name 'L1Nx'",
    # lm-eval's command line merges --model_args into a dict, keeping the last: L1H2 alone.
    "ablate=L0H1,ablate=L1H2": r"hf-headablate: error: model_args ablate= is given twice",
}
#: Through real ``lm_eval`` processes (each spends ~15 s importing lm-eval and indexing its
#: tasks): both entry points, and an error the model raises from a missing file (a
#: FileNotFoundError underneath). The others' messages go through the same hook in-process.
STOCK_CLI = ("ablate=L99H0", "-m lm_eval: ablate=L0H1+X1", "ablate_file=/no/such/heads.json",
             "ablate=L0H1,ablate=L1H2")


@pytest.fixture(scope="module")
def stock_cli_errors(tiny_model_dir) -> dict[str, tuple[int, str]]:
    """Each of ``STOCK_CLI`` through the stock CLI, all started at once."""
    folder = tiny_model_dir("llama")
    running = {}
    for bad in STOCK_CLI:
        command, args = [LM_EVAL], bad
        if bad.startswith("-m lm_eval: "):  # python -m lm_eval, not the console script
            command, args = [sys.executable, "-m", "lm_eval"], bad.removeprefix("-m lm_eval: ")
        running[bad] = subprocess.Popen(
            [*command, "--model", "hf-headablate", "--model_args", f"pretrained={folder},{args}",
             "--device", "cpu", "--tasks", "tiny_choice", "--include_path", TASKS],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    errors = {bad: process.communicate(timeout=300)[1] for bad, process in running.items()}
    return {bad: (running[bad].returncode, stderr) for bad, stderr in errors.items()}


@pytest.mark.slow
@pytest.mark.parametrize("bad", STOCK_CLI)
def test_stock_cli_bad_heads_one_line_nonzero_exit(stock_cli_errors, bad):
    import re

    returncode, stderr = stock_cli_errors[bad]
    assert returncode != 0
    assert "Traceback" not in stderr
    assert re.search(BAD_HEADS[bad], stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("bad", [bad for bad in BAD_HEADS if bad not in STOCK_CLI])
def test_bad_heads_in_model_args_are_one_line_through_the_cli_hook(tiny_model_dir, bad,
                                                                  monkeypatch, capsys):
    """What the stock CLI does with the model's error (``lm_eval`` builds the model from
    its --model_args; the start-up hook's excepthook prints a UserError in one line)."""
    _assert_one_line_through_the_hook(f"pretrained={tiny_model_dir('llama')},{bad}",
                                      BAD_HEADS[bad], monkeypatch, capsys)


@pytest.mark.parametrize("bad, message", [
    # `lm-eval run` reads [] as an empty list: nothing was knocked out, without a word.
    ("ablate=[]", r"hf-headablate: error: ablate=\[\] names no heads"),
    ("ablate=()", r"hf-headablate: error: ablate=\(\) names no heads"),
    # An empty pattern was taken as none: the modules were found automatically, unasked.
    ("attn_out=", r"hf-headablate: error: attn_out='': expected a module-name pattern"),
    ("mlp_out=", r"hf-headablate: error: mlp_out='': expected a module-name pattern"),
    ("mlp_out= ", r"hf-headablate: error: mlp_out=' ': expected a module-name pattern"),
])
def test_empty_knockout_args_from_lm_evals_command_line_are_one_line_before_the_load(
        tiny_model_dir, bad, message, monkeypatch, capsys):
    from lm_eval._cli.utils import key_val_to_dict  # what `lm-eval run` gives the model
    from lm_eval.models.huggingface import HFLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    _assert_one_line_through_the_hook(f"pretrained={tiny_model_dir('llama')},{bad}",
                                      message, monkeypatch, capsys, parse=key_val_to_dict)


def test_backend_seq2seq_on_a_decoder_only_model_is_one_line_before_the_load(
        tiny_model_dir, monkeypatch, capsys):
    """backend=seq2seq on a causal model was transformers' traceback from
    AutoModelForSeq2SeqLM ("Unrecognized configuration class")."""
    from lm_eval.models.huggingface import HFLM

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loaded before the backend was checked")

    monkeypatch.setattr(HFLM, "_create_model", refuse)
    _assert_one_line_through_the_hook(
        f"pretrained={tiny_model_dir('llama')},backend=seq2seq",
        r"hf-headablate: error: backend=seq2seq: llama is not an encoder-decoder model",
        monkeypatch, capsys)


def _assert_one_line_through_the_hook(args: str, message: str, monkeypatch, capsys,
                                      parse=None) -> None:
    """``HFHeadAblateLM`` built from ``args`` as lm_eval builds it fails, and the start-up
    hook's excepthook prints one line matching ``message``, no traceback. ``parse``: how
    the command line reads ``args`` into a dict (``lm-eval run``'s), else the text."""
    import re

    from lm_eval_headloc.intervention import registration
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    monkeypatch.setattr(sys, "excepthook", sys.__excepthook__)
    registration._install_cli_excepthook()
    try:
        if parse is None:
            HFHeadAblateLM.create_from_arg_string(args, {"device": "cpu"})
        else:
            HFHeadAblateLM.create_from_arg_obj(parse(args), {"device": "cpu"})
    except Exception:  # noqa: BLE001 — as an uncaught exception reaches the hook
        sys.excepthook(*sys.exc_info())
    else:
        pytest.fail(f"{args} was accepted")
    stderr = capsys.readouterr().err
    assert "Traceback" not in stderr
    assert re.search(message, stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args, message", [
    # HFLM's TypeError (a missing argument), and a Hub error for '' (a $MODEL unset)
    # after the head file was read.
    ("dtype=float32,ablate=L0H1", r"hf-headablate: error: pretrained=: give a model"),
    ("pretrained=,ablate_file=/no/such/heads.json",
     r"hf-headablate: error: pretrained='': give a model"),
    ("pretrained={folder},ablate_file=", r"hf-headablate: error: ablate_file= is empty"),
])
def test_a_missing_model_or_head_file_is_one_line_through_the_cli_hook(
        tiny_model_dir, args, message, monkeypatch, capsys):
    _assert_one_line_through_the_hook(args.format(folder=tiny_model_dir("llama")), message,
                                      monkeypatch, capsys)


def test_simple_evaluate_by_name_and_live_switching(tiny_model_dir):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder = tiny_model_dir("gpt2")
    args = f"pretrained={folder},device=cpu,dtype=float32"
    by_name = per_sample_loglikelihoods(simple_evaluate(f"{args},ablate=L1H0"))
    live = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    plain = per_sample_loglikelihoods(simple_evaluate(model=live))
    live.set_heads("L1H0")
    switched = per_sample_loglikelihoods(simple_evaluate(model=live))
    assert switched == pytest.approx(by_name, abs=1e-6)
    assert switched != pytest.approx(plain, abs=1e-5)


def test_response_cache_never_crosses_masks(tiny_model_dir, tmp_path):
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder = tiny_model_dir("llama")
    cache = str(tmp_path / "cache" / "responses")
    truth = {}
    reference = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    for spec in ["", "L0H1", "L1H3"]:
        reference.set_heads(spec)
        truth[spec] = per_sample_loglikelihoods(simple_evaluate(model=reference))
    assert truth["L0H1"] != pytest.approx(truth[""], abs=1e-5)

    # One live object, one cache file, masks switched in between and repeated.
    live = HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32")
    for spec in ["", "L0H1", "", "L1H3", "L0H1"]:
        live.set_heads(spec)
        got = per_sample_loglikelihoods(simple_evaluate(model=live, use_cache=cache))
        assert got == pytest.approx(truth[spec], abs=1e-6), spec
    # Fresh processes' worth of objects built by name with a mask, same cache file.
    for spec in ["L1H3", "L0H1"]:
        got = per_sample_loglikelihoods(simple_evaluate(
            f"pretrained={folder},device=cpu,dtype=float32,ablate={spec}", use_cache=cache))
        assert got == pytest.approx(truth[spec], abs=1e-6), spec

    # The cache was really used: a mask's table holds its answers.
    from sqlitedict import SqliteDict

    tables = SqliteDict.get_tablenames(cache + "_rank0.db")
    assert "unnamed" in tables and len(tables) == 3
    live.set_heads("L0H1")
    with SqliteDict(cache + "_rank0.db", tablename=live.cache_table()) as db:
        assert len(db) == 8  # 4 questions x 2 choices


def test_a_shared_model_is_put_back_as_loaded(tiny_model_dir):
    """What conftest's embedded_lm does after each test that shares the embedded model,
    here on a tiny one: it puts back what a test changed (knockouts, the ablation, scale,
    batch size, weights edited by hand, training mode) and says what it cannot put back
    (a hook left on a module; anything else that changes the model's answers)."""
    from helpers import as_loaded, last_logits, load_lm, put_back

    from lm_eval_headloc.method.head_types import attention_patterns

    lm = load_lm(tiny_model_dir("llama"))
    loaded = as_loaded(lm)
    assert put_back(lm, loaded) == []
    # The hooks transformers installs to return attention weights, and keeps, are idle.
    attention_patterns(lm.model, torch.tensor([[1, 5, 6, 7]]))
    assert any(m._forward_hooks for m in lm.model.modules())
    assert put_back(lm, loaded) == []
    lm.set_heads("L0H1+L1N3")
    lm.set_ablation("resample", ["the cat sat on the mat", "one two three four"])
    lm.scale, lm.batch_size_per_gpu = 0.5, 7
    with torch.no_grad():
        lm.model.model.layers[0].self_attn.o_proj.weight[:, :8] = 0
    lm.model.train()
    assert not torch.equal(last_logits(lm), loaded["logits"])
    assert put_back(lm, loaded) == []
    assert (lm.knocked_out, lm.ablation, lm.scale, lm.batch_size, lm.model.training) == (
        (), "zero", 0.0, 4, False)
    assert torch.equal(last_logits(lm), loaded["logits"])
    handle = lm.model.lm_head.register_forward_hook(lambda module, args, out: out * 2)
    assert put_back(lm, loaded) == ["hooks: 1, loaded 0", "its answer to "
                                    "'When Mary and John went to the store, John gave a "
                                    "drink to' is not the loaded model's"]
    handle.remove()
    rotary = lm.model.model.rotary_emb.inv_freq  # a buffer, not among the weights
    rotary.mul_(2)
    assert put_back(lm, loaded) == ["its answer to 'When Mary and John went to the store, "
                                    "John gave a drink to' is not the loaded model's"]
    rotary.div_(2)
    assert put_back(lm, loaded) == []


@pytest.mark.slow
def test_embedded_smollm2_gguf(embedded_lm):
    lm = embedded_lm  # hf-headablate on the GGUF file, float32 on the CPU
    assert (lm.num_layers, lm.heads_per_layer) == (30, 9)
    ids = lm.tok_batch_encode(["When Mary and John went to the store, John gave a drink to"])[0]
    with torch.no_grad():
        plain = lm._model_call(ids)[0, -1]
        # Independent check: zero the o_proj columns of L5H4 by hand, no hooks.
        o_proj = lm.model.model.layers[5].self_attn.o_proj
        saved = o_proj.weight[:, 4 * 64:5 * 64].clone()
        o_proj.weight[:, 4 * 64:5 * 64] = 0
        by_hand = lm._model_call(ids)[0, -1]
        o_proj.weight[:, 4 * 64:5 * 64] = saved
        lm.set_heads("L5H4")
        hooked = lm._model_call(ids)[0, -1]
        lm.set_heads([])
        restored = lm._model_call(ids)[0, -1]
    assert torch.allclose(hooked, by_hand, atol=1e-4)
    assert not torch.allclose(hooked, plain, atol=1e-3)
    assert torch.equal(restored, plain)
    # The model answers the IOI prompt with the indirect object.
    mary, john = (lm.tok_encode(" Mary")[0], lm.tok_encode(" John")[0])
    assert plain[mary] > plain[john]


def test_a_ranking_knocked_out_otherwise_than_it_was_ranked_is_said(
        no_weight_loading, tmp_path, caplog):
    """A run by mean ablation at scale 2 records it in heads.json (``knockout``);
    ablate_file= knocked its heads out by zeroing, silently."""
    import json
    import logging

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    ranked = tmp_path / "heads.json"
    ranked.write_text(json.dumps({"task": "t", "knockout": {"ablation": "mean", "scale": 2.0},
                                  "heads": [{"head": "L0H1"}, {"head": "L1H0"}]}))
    with caplog.at_level(logging.WARNING, logger="lm_eval.models.hf_headablate"):
        with pytest.raises(AssertionError, match="weights are loading"):
            HFHeadAblateLM(pretrained="never-loaded", ablate_file=str(ranked))
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert said == [f"{ranked} was ranked with --ablation mean --scale 2; these knock its "
                    "components out by ablation=zero,scale=0 (give ablation=mean,scale=2 "
                    "for the run's)"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lm_eval.models.hf_headablate"):
        with pytest.raises(AssertionError, match="weights are loading"):
            HFHeadAblateLM(pretrained="never-loaded", ablate_file=str(ranked), scale=2,
                           ablation="mean", ablation_data=str(ranked))
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_a_ranking_of_a_model_with_other_heads_per_layer_is_refused(tiny_model_dir,
                                                                    tmp_path):
    """A heads.json ranked on a model of 9 heads per layer named L1H3 and L0H2, which fall
    inside a 4-heads-per-layer model: they were knocked out there, other heads, silently."""
    import json

    from helpers import HEADS

    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    other = tmp_path / "other.json"
    other.write_text(json.dumps({"task": "t", "heads_per_layer": HEADS + 5,
                                 "top_k": ["L1H3", "L0H2"],
                                 "heads": [{"head": "L1H3"}, {"head": "L0H2"}]}))
    with raises_naming(ComponentSpecError, str(other), f"{HEADS + 5} heads per layer",
                       f"this one has {HEADS}"):
        HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu",
                       ablate_file=str(other))
    mine = tmp_path / "mine.json"
    mine.write_text(other.read_text().replace(f'"heads_per_layer": {HEADS + 5}',
                                              f'"heads_per_layer": {HEADS}'))
    lm = HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu",
                        ablate_file=str(mine))
    assert [str(h) for h in lm.knocked_out] == ["L0H2", "L1H3"]


def test_a_knockout_setting_with_nothing_named_says_the_answers_are_the_plain_models(
        tiny_model_dir, caplog):
    """ablation=/scale= without ablate= evaluated the plain model without a word, and the
    results file was then read as a knockout's."""
    import logging

    from helpers import last_logits, load_lm

    folder = tiny_model_dir("llama")
    plain = last_logits(load_lm(folder))

    def warnings(lm, passes) -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lm_eval.models.hf_headablate"):
            for run_pass in passes:
                run_pass(lm)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    scaled = load_lm(folder, scale=2)
    said = warnings(scaled, [last_logits, last_logits])
    assert len(said) == 1 and "scale=2 with no heads or neurons named" in said[0]
    assert torch.equal(last_logits(scaled), plain)  # what it says is so
    # A knockout of the product's own (knocking_out), heads named, or the defaults: silent.
    def inside_knockout(lm) -> None:
        with lm.knocking_out([]):
            last_logits(lm)

    assert warnings(load_lm(folder, scale=2), [inside_knockout]) == []
    assert warnings(load_lm(folder, scale=2, ablate="L0H1"), [last_logits]) == []
    assert warnings(load_lm(folder), [last_logits]) == []


@pytest.mark.parametrize("device, named", [
    ("gpu", "takes cpu, cuda, cuda:N or mps"), ("cpu:0", "takes cpu, cuda, cuda:N or mps"),
    ("mps:1", "device=mps (or mps:0)"),
    *([] if torch.backends.mps.is_available() else [("mps", "no MPS")])])
def test_a_device_hflm_would_swap_or_fail_on_late_is_refused_before_the_load(
        no_weight_loading, tiny_model_dir, device, named):
    """HFLM ran device=gpu or cpu:0 on cuda or the CPU (said only in its log), and device=mps
    without MPS failed after the weights loaded."""
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    with raises_naming(UsageError, f"device={device}", named):
        HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device=device)
