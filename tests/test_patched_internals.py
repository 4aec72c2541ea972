"""The private surfaces of lm-eval, transformers and gguf that our patches rely on.

Each patch of another library's internals (docs/development.md, "Patches of other
libraries") has its tests here. They check what the patch relies on, not what it does
(the tests of each module do that), so that an upgrade which breaks a patch fails here,
naming the patch, why it no longer fits, and the versions: the ones it was checked on
(``CHECKED_ON``: lm_eval 0.4.13, transformers 5.24.0, gguf 0.19.0) and the ones installed.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata as md
import importlib.util
import inspect
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

#: The versions the patches were checked on.
CHECKED_ON = {"lm_eval": "0.4.13", "transformers": "5.24.0", "gguf": "0.19.0"}

TASK_MANAGER_PATCH = ("registration.register_tasks (lm_eval_headloc/intervention/"
                      "registration.py: replaces lm-eval's TaskManager.__init__)")
TASK_INDEX_PATCH = ("index_cache.builtin_index_cached (lm_eval_headloc/tasks/index_cache.py: "
                    "subclasses lm-eval's private TaskIndex)")
GGUF_PATCH = ("gguf_reads.cached_gguf_reads (lm_eval_headloc/intervention/gguf_reads.py: "
              "replaces gguf.GGUFReader, gguf.get_tensor_name_map and transformers' "
              "load_gguf_checkpoint)")
TEMPLATE_PATCH = ("harness.templates_compiled_once (lm_eval_headloc/measurement/harness.py: "
                  "replaces lm_eval.utils.apply_template during a measurement)")
TQDM_PATCH = ("harness.quiet_harness (lm_eval_headloc/measurement/harness.py: replaces the "
              "module-level tqdm of lm_eval.api.task, lm_eval.api.model and "
              "lm_eval.models.huggingface during a measurement)")
HOOK = ("the start-up hook (startup/_lm_eval_headloc_startup.py, loaded by "
        "lm_eval_headloc_startup.pth)")


def installed(package: str) -> str:
    """The installed version of ``package``, or "absent"."""
    try:
        return md.version(package)
    except md.PackageNotFoundError:
        return "absent"


def broken(patch: str, why: str, *packages: str) -> str:
    """A failure's message: which patch, why it no longer fits, and the versions."""
    versions = "; ".join(f"{name} {CHECKED_ON[name]} checked, {installed(name)} installed"
                         for name in packages)
    return (f"{patch} no longer fits: {why} ({versions}). Adapt or retire the patch: "
            "docs/development.md, 'Patches of other libraries'.")


class Looked(Exception):
    """Raised by a stand-in: the library looked the name up at the call."""


def stand_in(*args: Any, **kwargs: Any) -> Any:
    raise Looked(args, kwargs)


# --- TaskManager.__init__, replaced by registration.register_tasks --------------------------

def unpatched_init() -> Any:
    """lm-eval's own ``TaskManager.__init__`` (the hook may have wrapped it already)."""
    from lm_eval.tasks import manager

    init = manager.TaskManager.__init__
    return getattr(init, "__wrapped__", init)


class RecordingIndex:
    """Stands in for lm-eval's ``TaskIndex``: records the folders a manager indexes."""

    built: list[list[Path]] = []

    @staticmethod
    def build(paths: Any, *, resolve_includes: bool = True) -> dict:
        RecordingIndex.built.append([Path(p) for p in paths])
        return {}


def test_task_manager_init_takes_what_register_tasks_binds():
    """Checked on lm_eval 0.4.13: ``register_tasks`` patches ``TaskManager`` in
    ``lm_eval.tasks.manager`` (the module the hook watches), binds every call to its
    signature, reads ``include_defaults`` and rewrites ``include_path``, then sets the
    ``include_path`` attribute back to what the caller gave."""
    import lm_eval.tasks
    from lm_eval.tasks import manager

    assert lm_eval.tasks.TaskManager is manager.TaskManager, broken(
        TASK_MANAGER_PATCH, "lm_eval.tasks.TaskManager is no longer defined in "
        "lm_eval.tasks.manager, the module the hook waits for", "lm_eval")
    parameters = inspect.signature(unpatched_init()).parameters
    for name, default in (("include_path", None), ("include_defaults", True)):
        assert name in parameters and parameters[name].default == default, broken(
            TASK_MANAGER_PATCH, f"TaskManager.__init__ takes no {name}={default!r} "
            f"(its parameters: {list(parameters)})", "lm_eval")
    attribute = inspect.getattr_static(manager.TaskManager, "include_path", None)
    assert attribute is None or not hasattr(attribute, "__set__"), broken(
        TASK_MANAGER_PATCH, "TaskManager.include_path is a descriptor, not the plain "
        "attribute the patch sets back", "lm_eval")


def test_task_manager_indexes_the_builtins_then_include_path_through_task_index(
        monkeypatch):
    """Checked on lm_eval 0.4.13: a manager indexes lm-eval's own folder first (where
    ``include_defaults``), then each folder of ``include_path`` in order, through the
    ``TaskIndex`` of its module. ``register_tasks`` puts our folder first in
    ``include_path`` (after the built-ins, before the user's); ``builtin_index_cached``
    swaps that ``TaskIndex`` and recognises the built-ins as the first folder."""
    from lm_eval.tasks import manager

    from lm_eval_headloc.tasks.index_cache import builtin_tasks_dir

    monkeypatch.setattr(manager, "TaskIndex", RecordingIndex)
    monkeypatch.setattr(RecordingIndex, "built", [])
    init = unpatched_init()
    made = manager.TaskManager.__new__(manager.TaskManager)
    init(made, include_path=["first", "second"])
    init(manager.TaskManager.__new__(manager.TaskManager), include_path="only",
         include_defaults=False)
    expected = [[builtin_tasks_dir(), Path("first"), Path("second")], [Path("only")]]
    built = [[p.resolve() if p.is_absolute() else p for p in paths]
             for paths in RecordingIndex.built]
    assert built == expected, broken(
        f"{TASK_MANAGER_PATCH} and {TASK_INDEX_PATCH}", f"TaskManager indexed {built}, "
        f"expected {expected} (the built-ins, then include_path, through "
        "lm_eval.tasks.manager.TaskIndex)", "lm_eval")
    assert vars(made).get("include_path") == ["first", "second"], broken(
        TASK_MANAGER_PATCH, "TaskManager keeps include_path elsewhere", "lm_eval")


# --- TaskIndex, subclassed by index_cache.builtin_index_cached --------------------------------

def test_task_index_build_is_the_static_method_the_subclass_overrides():
    """Checked on lm_eval 0.4.13: ``CachedBuiltins.build(paths, *, resolve_includes=True)``
    overrides ``TaskIndex.build``, a static method that the manager's module imports from
    ``lm_eval.tasks._index``; ``index_digest`` hashes ``_index`` and ``_yaml_loader``."""
    from lm_eval.tasks import _index, _yaml_loader, manager

    assert manager.TaskIndex is _index.TaskIndex, broken(
        TASK_INDEX_PATCH, "lm_eval.tasks.manager.TaskIndex is not lm_eval.tasks._index's",
        "lm_eval")
    build = inspect.getattr_static(_index.TaskIndex, "build", None)
    assert isinstance(build, staticmethod), broken(
        TASK_INDEX_PATCH, "TaskIndex.build is no static method", "lm_eval")
    signature = inspect.signature(_index.TaskIndex.build)
    shape = [(p.name, p.kind, p.default) for p in signature.parameters.values()]
    assert shape == [("paths", inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty),
                     ("resolve_includes", inspect.Parameter.KEYWORD_ONLY, True)], broken(
        TASK_INDEX_PATCH, f"TaskIndex.build{signature} is not build(paths, *, "
        "resolve_includes=True)", "lm_eval")
    for module in (_index, _yaml_loader):
        assert Path(module.__file__).is_file(), broken(
            TASK_INDEX_PATCH, f"{module.__name__} has no source file to hash", "lm_eval")


def test_task_index_entries_are_what_the_stored_index_holds():
    """Checked on lm_eval 0.4.13: the stored index holds each ``Entry``'s ``name``,
    ``kind`` (a ``Kind`` member's name), ``yaml_path``, ``cfg`` and ``tags``; an ``Entry``
    with more would lose them (then ``cached_index`` only builds: slower, not wrong)."""
    from lm_eval.tasks._index import Entry, Kind

    from lm_eval_headloc.tasks import index_cache

    fields = {field.name for field in dataclasses.fields(Entry)}
    assert fields == index_cache.ENTRY_FIELDS and index_cache.entry_fields_known(), broken(
        TASK_INDEX_PATCH, f"lm-eval's Entry has the fields {sorted(fields)}, the stored index "
        f"{sorted(index_cache.ENTRY_FIELDS)}: the index is no longer cached", "lm_eval")
    assert {"TASK", "GROUP", "TAG"} <= set(Kind.__members__), broken(
        TASK_INDEX_PATCH, f"lm-eval's Kind is {list(Kind.__members__)}", "lm_eval")


def test_an_entry_of_other_fields_is_built_never_cached(tmp_path, monkeypatch):
    """Where lm-eval's ``Entry`` is not what the stored index holds, ``cached_index``
    builds the index and stores nothing: slower, never an index missing a field."""
    from lm_eval_headloc.tasks import index_cache

    root, cache = tmp_path / "tasks", tmp_path / "cache"
    root.mkdir()
    (root / "one.yaml").write_text("task: one\ndataset_path: json\n")
    monkeypatch.setattr(index_cache, "ENTRY_FIELDS", index_cache.ENTRY_FIELDS | {"new"})
    assert not index_cache.entry_fields_known()
    assert list(index_cache.cached_index(root, cache)) == ["one"]
    assert not cache.exists()


def test_a_later_folder_overrides_an_earlier_one_as_the_subclass_says(tmp_path, caplog):
    """Checked on lm_eval 0.4.13: ``TaskIndex.build`` lets a later folder's name win, with
    a warning through ``lm_eval.tasks._index``'s logger; ``CachedBuiltins`` merges the
    cached built-ins with the other folders alike, and says it in the same words."""
    from lm_eval.tasks._index import TaskIndex

    from lm_eval_headloc.tasks import index_cache

    first, second = tmp_path / "first", tmp_path / "second"
    for folder in (first, second):
        folder.mkdir()
        (folder / "one.yaml").write_text("task: one\ndataset_path: json\n"
                                         "output_type: loglikelihood\n")
    with caplog.at_level(logging.WARNING, logger=index_cache._INDEX_LOG.name):
        index = TaskIndex.build([first, second])
    said = f"Task 'one' from {second / 'one.yaml'} overrides existing task from " \
           f"{first / 'one.yaml'}"
    assert index["one"].yaml_path == second / "one.yaml", broken(
        TASK_INDEX_PATCH, "an earlier folder's task wins a name clash", "lm_eval")
    assert [r.getMessage() for r in caplog.records if r.name == index_cache._INDEX_LOG.name] \
        == [said], broken(TASK_INDEX_PATCH, f"lm-eval no longer says {said!r} through the "
                          f"logger {index_cache._INDEX_LOG.name!r}", "lm_eval")


# --- gguf and transformers' GGUF loading, patched by gguf_reads.cached_gguf_reads --------------

def test_gguf_reader_is_made_as_the_cached_reader_makes_it():
    """Checked on gguf 0.19.0: ``CachedReader.__new__`` makes the object with
    ``object.__new__`` and runs ``GGUFReader.__init__(reader, path, mode)``."""
    import gguf

    assert gguf.GGUFReader.__new__ is object.__new__, broken(
        GGUF_PATCH, "gguf.GGUFReader has a __new__ of its own", "gguf")
    parameters = inspect.signature(gguf.GGUFReader.__init__).parameters
    shape = [(p.name, p.default) for p in parameters.values()]
    assert shape == [("self", inspect.Parameter.empty), ("path", inspect.Parameter.empty),
                     ("mode", "r")], broken(
        GGUF_PATCH, f"gguf.GGUFReader.__init__ takes {shape}, not (path, mode='r')", "gguf")


def test_load_gguf_checkpoint_takes_a_path_then_return_tensors():
    """Checked on transformers 5.24.0: ``load_once`` reads ``load_gguf_checkpoint``'s first
    two arguments as the file and ``return_tensors`` (False: the metadata alone, which it
    keeps); with another signature the metadata is left unpatched."""
    from transformers import modeling_gguf_pytorch_utils as loading

    from lm_eval_headloc.intervention.gguf_reads import takes_path_then_return_tensors

    load = loading.load_gguf_checkpoint
    assert takes_path_then_return_tensors(load), broken(
        GGUF_PATCH, f"load_gguf_checkpoint{inspect.signature(load)} does not take "
        "(path, return_tensors=False, ...): its parse is no longer kept",
        "transformers")


def test_a_load_gguf_checkpoint_of_another_signature_is_left_unpatched(monkeypatch):
    """Where ``load_gguf_checkpoint`` takes its arguments otherwise, ``cached_gguf_reads``
    leaves it as it is (the readers and the name map are still kept), and puts all back."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loading

    from lm_eval_headloc.intervention.gguf_reads import cached_gguf_reads

    def other(path: Any, model: Any = None, return_tensors: bool = False) -> Any:
        return None

    monkeypatch.setattr(loading, "load_gguf_checkpoint", other)
    name_map, reader = gguf.get_tensor_name_map, gguf.GGUFReader
    with cached_gguf_reads():
        assert loading.load_gguf_checkpoint is other
        assert gguf.get_tensor_name_map is not name_map and gguf.GGUFReader is not reader
    assert (gguf.get_tensor_name_map, gguf.GGUFReader) == (name_map, reader)


def test_transformers_looks_the_gguf_names_up_at_each_call(tmp_path, monkeypatch):
    """Checked on transformers 5.24.0 and gguf 0.19.0: ``load_gguf_checkpoint`` takes
    ``gguf.GGUFReader`` and ``get_gguf_hf_weights_map`` takes ``gguf.get_tensor_name_map``
    from the gguf module at each call (so the patched ones), the latter with hashable
    arguments (it is wrapped in an lru_cache)."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as loading

    monkeypatch.setattr(gguf, "GGUFReader", stand_in)
    with pytest.raises(Looked):
        loading.load_gguf_checkpoint(str(tmp_path / "model.gguf"))
    monkeypatch.setattr(gguf, "get_tensor_name_map", stand_in)
    try:
        loading.get_gguf_hf_weights_map(None, None, model_type="llama", num_layers=2)
    except Looked as looked:
        args, kwargs = looked.args
        hash((args, tuple(sorted(kwargs.items()))))  # an unhashable argument raises here
    else:
        pytest.fail(broken(GGUF_PATCH, "get_gguf_hf_weights_map no longer takes "
                           "gguf.get_tensor_name_map at the call", "transformers", "gguf"))


def write_gguf(path: Path) -> None:
    """A tiny GGUF of the llama architecture (which transformers 5.24 reads through
    ``load_gguf_checkpoint``: it is not among ``GGUF_CONFIG_ARCHS``)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("test.value", 1)
    writer.add_tensor("weight", np.arange(8, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_transformers_reads_a_gguf_config_and_tokenizer_through_the_module_attribute(
        tmp_path, monkeypatch):
    """Checked on transformers 5.24.0: the config and the tokenizer of a llama GGUF are
    read by ``modeling_gguf_pytorch_utils.load_gguf_checkpoint`` as it is at the call (the
    patched one), and no other loaded transformers module keeps a reference of its own."""
    from transformers import AutoTokenizer, PretrainedConfig
    from transformers import modeling_gguf_pytorch_utils as loading
    from transformers.quantizers import quantizer_gguf  # noqa: F401  (the weights' reader)

    own = [name for name, module in list(sys.modules.items())
           if name.startswith("transformers") and module is not loading
           and vars(module).get("load_gguf_checkpoint") is not None]
    assert not own, broken(GGUF_PATCH, f"{own} keep load_gguf_checkpoint of their own: the "
                           "patched one is not what they call", "transformers")
    write_gguf(tmp_path / "model.gguf")
    monkeypatch.setattr(loading, "load_gguf_checkpoint", stand_in)
    for what, read in (
            ("config", lambda: PretrainedConfig.get_config_dict(str(tmp_path),
                                                               gguf_file="model.gguf")),
            ("tokenizer", lambda: AutoTokenizer.from_pretrained(str(tmp_path),
                                                                gguf_file="model.gguf"))):
        try:
            read()
        except Looked:
            continue
        except Exception as err:  # noqa: BLE001 — another way through is the finding
            pytest.fail(broken(GGUF_PATCH, f"transformers read a llama GGUF's {what} "
                               f"without load_gguf_checkpoint ({err!r})", "transformers"))
        pytest.fail(broken(GGUF_PATCH, f"transformers read a llama GGUF's {what} without "
                           "load_gguf_checkpoint", "transformers"))


# --- the start-up hook, for an lm-eval that reads no plugin entry points ----------------------

def test_the_modules_the_hook_waits_for_exist_and_load_through_exec_module():
    """Checked on lm_eval 0.4.13: the hook waits for ``lm_eval.models`` and
    ``lm_eval.tasks.manager`` and wraps their loaders' ``exec_module``; ``registration``
    acts after the same modules."""
    from lm_eval_headloc.intervention import registration

    hook = pytest.importorskip("_lm_eval_headloc_startup",
                               reason="the package is not installed (no start-up hook)")

    assert set(hook._WATCHED) == set(registration._AFTER_IMPORT), (
        "the start-up hook and registration name different modules")
    for name in hook._WATCHED:
        spec = importlib.util.find_spec(name)
        assert spec is not None and hasattr(spec.loader, "exec_module"), broken(
            HOOK, f"lm-eval has no module {name} loaded through exec_module", "lm_eval")


NO_HOOK = """
import json, sys
from pathlib import Path
sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_WatchLmEvalModels"]
import lm_eval.models
from lm_eval.api.registry import model_registry
from lm_eval.tasks import manager
built = []
class RecordingIndex:
    @staticmethod
    def build(paths, **kwargs):
        built.extend(str(p) for p in paths)
        return {}
manager.TaskIndex = RecordingIndex
manager.TaskManager()
print(json.dumps({"model": "hf-headablate" in model_registry, "folders": built,
                  "builtins": str(Path(manager.__file__).parent)}))
"""


def test_this_lm_eval_reads_no_plugin_entry_points_so_the_hook_is_needed(tmp_path):
    """Checked on lm_eval 0.4.13: without the hook, lm-eval neither registers
    ``hf-headablate`` nor indexes our tasks (it reads no ``lm_eval.models`` or
    ``lm_eval.tasks`` entry point). An lm-eval that does needs no hook, and the hook's own
    registration could clash with it: this test then says so."""
    result = subprocess.run([sys.executable, "-c", NO_HOOK], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    assert not seen["model"], broken(
        HOOK, "lm-eval registers hf-headablate without the hook (from the lm_eval.models "
        "entry point?): the hook's register() is not needed for it, and lm-eval's Registry "
        "refuses a second, different target", "lm_eval")
    assert seen["folders"] == [seen["builtins"]], broken(
        HOOK, f"without the hook lm-eval indexes {seen['folders']}, more than its own "
        "tasks (from the lm_eval.tasks entry point?): register_tasks would add ours twice",
        "lm_eval")


# --- the entry points, for an lm-eval that reads them -------------------------------------------

def our_entry_points(group: str) -> dict[str, md.EntryPoint]:
    """This package's entry points of ``group``, as a plugin discovery would find them."""
    found = {ep.name: ep for ep in md.entry_points(group=group)
             if ep.dist is not None and ep.dist.name.replace("_", "-") == "lm-eval-headloc"}
    assert found, (f"the installed lm-eval-headloc declares no {group!r} entry point: its "
                   "metadata is older than pyproject.toml; reinstall (pip install -e .)")
    return found


def test_the_models_entry_point_loads_hf_headablate_as_lm_evals_registry_takes_it():
    """The ``lm_eval.models`` entry point loads the model class, also through lm-eval's
    ``Registry``, which takes an entry point as a lazy placeholder (lm_eval 0.4.13)."""
    from lm_eval.api.model import LM
    from lm_eval.api.registry import Registry

    from lm_eval_headloc.intervention.model import HFHeadAblateLM
    from lm_eval_headloc.intervention.registration import MODEL_NAME, MODEL_TARGET

    entry = our_entry_points("lm_eval.models")[MODEL_NAME]
    assert entry.value == MODEL_TARGET
    assert entry.load() is HFHeadAblateLM
    registry: Registry = Registry("models (test)", base_cls=LM)
    registry.register(entry.name, target=entry)
    assert registry.get(MODEL_NAME) is HFHeadAblateLM


def test_the_tasks_entry_point_gives_our_task_folder():
    """The ``lm_eval.tasks`` entry point loads a function that gives the folder of our
    task YAMLs (what ``include_path`` takes)."""
    from lm_eval_headloc.tasks import task_configs_dir

    (entry,) = our_entry_points("lm_eval.tasks").values()
    folder = Path(entry.load()())
    assert folder == task_configs_dir() and folder.is_dir()
    assert (folder / "headloc_induction" / "headloc_induction.yaml").is_file()


# --- lm_eval.utils.apply_template and lm-eval's tqdm, replaced during a measurement --------

def test_tasks_render_through_utils_apply_template_looked_up_at_each_call(task_manager,
                                                                          monkeypatch):
    """Checked on lm_eval 0.4.13: a task renders its Jinja fields with
    ``lm_eval.utils.apply_template(template, doc)``, looked up in ``lm_eval.utils`` at each
    call, as ``env.from_string(template).render(**doc)``: what ``_apply_template`` does
    with one compiled copy per template."""
    from lm_eval import utils

    from lm_eval_headloc.measurement.harness import _apply_template

    parameters = list(inspect.signature(utils.apply_template).parameters)
    assert parameters == ["template", "doc"], broken(
        TEMPLATE_PATCH, f"apply_template takes {parameters}, not (template, doc)", "lm_eval")
    doc = {"question": "2 + 2 =", "choices": ["3", "4"], "answer": 1}
    template = "Q: {{question | trim}} {{choices[answer]}}"
    assert _apply_template(template, doc) == utils.apply_template(template, doc), broken(
        TEMPLATE_PATCH, "lm_eval.utils.apply_template renders otherwise than "
        "utils.env.from_string(template).render(**doc)", "lm_eval")
    task = task_manager.load(["tiny_choice"])["tasks"]["tiny_choice"]
    monkeypatch.setattr(utils, "apply_template", stand_in)
    with pytest.raises(Looked):
        task.doc_to_text(doc)
        pytest.fail(broken(TEMPLATE_PATCH, "a task's doc_to_text no longer looks "
                           "lm_eval.utils.apply_template up at the call", "lm_eval"))


def test_lm_evals_bars_are_drawn_by_each_modules_own_tqdm():
    """Checked on lm_eval 0.4.13: the bars of a measurement (building the requests,
    tokenizing, scoring) are drawn by the ``tqdm`` each of these modules imports by name,
    looked up in the module at the call: what ``quiet_harness`` swaps."""
    import importlib

    from tqdm import tqdm

    from lm_eval_headloc.measurement.harness import _HARNESS_TQDM_MODULES

    for name in _HARNESS_TQDM_MODULES:
        module = importlib.import_module(name)
        assert getattr(module, "tqdm", None) is tqdm, broken(
            TQDM_PATCH, f"{name} has no module-level tqdm", "lm_eval")
        assert "tqdm(" in inspect.getsource(module), broken(
            TQDM_PATCH, f"{name} draws no bar with its tqdm", "lm_eval")
