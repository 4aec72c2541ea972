"""lm-eval's index of its own task YAMLs, parsed once and kept on disk
(``lm_eval_headloc.tasks.index_cache``)."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import TaskIndex

from lm_eval_headloc.tasks import index_cache

TASK = "task: {name}\ndataset_path: json\noutput_type: loglikelihood\ndoc_to_text: q\n" \
       "doc_to_target: a\ntag: {tag}\n"


def entries(index: dict) -> dict:
    """An index as plain values (Entry has no equality of its own)."""
    return {name: (e.name, e.kind, str(e.yaml_path), e.cfg, sorted(e.tags))
            for name, e in index.items()}


@pytest.fixture
def root(tmp_path):
    folder = tmp_path / "tasks"
    (folder / "family").mkdir(parents=True)
    (folder / "family" / "one.yaml").write_text(TASK.format(name="one", tag="both"))
    (folder / "family" / "two.yaml").write_text(TASK.format(name="two", tag="both"))
    (folder / "group.yaml").write_text("group: pair\ntask: [one, two]\n")
    # lm-eval's YAMLs include templates not named *.yaml, which may decide a tag.
    (folder / "family" / "_template_yaml").write_text("tag: old_tag\n")
    (folder / "family" / "four.yaml").write_text("include: _template_yaml\ntask: four\n"
                                                 "dataset_path: json\n")
    return folder


NAMES = {"one", "two", "pair", "both", "four", "old_tag"}


@pytest.fixture
def builds(monkeypatch):
    """The folders TaskIndex.build parses, call by call."""
    calls: list[list[str]] = []
    build = TaskIndex.build

    def counting(paths, **kwargs):
        paths = list(paths)
        calls.append([p.name for p in paths])
        return build(paths, **kwargs)

    monkeypatch.setattr(TaskIndex, "build", staticmethod(counting))
    return calls


def test_a_folder_is_parsed_once_then_read_back_until_a_file_changes(root, tmp_path, builds):
    cache = tmp_path / "cache"
    first = index_cache.cached_index(root, cache)
    assert entries(first) == entries(TaskIndex.build([root]))
    assert set(first) == NAMES
    assert len(builds) == 2  # ours, and the comparison's
    stored = list(cache.iterdir())
    assert len(stored) == 1 and stored[0].name.startswith("task-index-")
    os.utime(stored[0], (time.time() - 3600, time.time() - 3600))
    assert entries(index_cache.cached_index(root, cache)) == entries(first)
    assert len(builds) == 2  # read back, not parsed
    assert stored[0].stat().st_mtime > time.time() - 60  # used now: the last to go

    (root / "family" / "two.yaml").write_text(TASK.format(name="three", tag="both"))
    changed = index_cache.cached_index(root, cache)
    assert len(builds) == 3 and "three" in changed and "two" not in changed
    assert len(list(cache.iterdir())) == 2  # the old one stays (another install's, maybe)

    (root / "family" / "_template_yaml").write_text("tag: new_tag\n")
    retagged = index_cache.cached_index(root, cache)
    assert len(builds) == 4 and "new_tag" in retagged and "old_tag" not in retagged


def test_a_torn_or_unwritable_cache_only_costs_a_rebuild(root, tmp_path, builds):
    cache = tmp_path / "cache"
    index_cache.cached_index(root, cache)
    (stored,) = cache.iterdir()
    stored.write_bytes(b"\x80\x05not a pickle")
    assert set(index_cache.cached_index(root, cache)) == NAMES
    assert len(builds) == 2
    assert set(index_cache.cached_index(root, cache)) == NAMES
    assert len(builds) == 2  # rewritten whole

    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    assert set(index_cache.cached_index(root, blocked)) == NAMES
    assert blocked.read_text() == "not a folder"


def test_a_cache_read_back_is_used_though_its_time_cannot_be_set(root, tmp_path, builds,
                                                                 monkeypatch):
    """Another user's cache file, or a read-only one: reading it is enough."""
    cache = tmp_path / "cache"
    index_cache.cached_index(root, cache)

    def refused(*args, **kwargs):
        raise PermissionError("Operation not permitted")

    monkeypatch.setattr(index_cache.os, "utime", refused)
    assert set(index_cache.cached_index(root, cache)) == NAMES and len(builds) == 1


class _RunsCode:
    """Unpickled, it makes a folder: proof that reading the cache ran code."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _stored_name(root, cache):
    return cache / f"{index_cache._PREFIX}{index_cache.index_digest(root)}{index_cache._SUFFIX}"


def test_reading_the_cache_runs_no_code_whoever_owns_the_file(root, tmp_path, builds):
    """A shared cache folder: another user's symlink, under the index's own name, to a
    pickle the victim owns (mode 600, so an ownership check passes) must not run code; the
    index is data, and what is not a valid index costs a rebuild."""
    import pickle

    cache, marker = tmp_path / "cache", tmp_path / "ran"
    cache.mkdir()
    payload = tmp_path / "victims-own.pickle"
    payload.write_bytes(pickle.dumps({"one": _RunsCode(marker)}))
    payload.chmod(0o600)
    _stored_name(root, cache).symlink_to(payload)
    assert set(index_cache.cached_index(root, cache)) == NAMES and len(builds) == 1
    assert not marker.exists()
    assert payload.read_bytes() == pickle.dumps({"one": _RunsCode(marker)})  # not written


def test_a_stored_index_naming_files_outside_the_folder_is_rebuilt(root, tmp_path, builds):
    """The index says which YAML each name loads (and a YAML may name Python to import): a
    stored one that points outside the indexed folder, or is not an index, is not used."""
    cache = tmp_path / "cache"
    index_cache.cached_index(root, cache)
    (stored,) = cache.iterdir()
    data = json.loads(stored.read_text())
    good = json.dumps(data)
    for bad in ("../evil/evil.yaml", str(tmp_path / "evil.yaml"), "family/../../x.yaml"):
        entries_ = data["entries"]
        entries_["one"]["yaml"] = bad
        stored.write_text(json.dumps(data))
        before = len(builds)
        index = index_cache.cached_index(root, cache)
        assert len(builds) == before + 1, bad  # rebuilt, not read
        assert index["one"].yaml_path == root / "family" / "one.yaml"
        data = json.loads(good)
    for junk in ("[]", '{"entries": {"one": {"kind": "NOPE"}}}', "null", '{"format": 0}'):
        stored.write_text(junk)
        before = len(builds)
        assert set(index_cache.cached_index(root, cache)) == NAMES
        assert len(builds) == before + 1, junk


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_a_fifo_under_the_caches_name_does_not_hang_the_reader(root, tmp_path, builds):
    from helpers import without_waiting_on

    cache = tmp_path / "cache"
    cache.mkdir()
    fifo = _stored_name(root, cache)
    os.mkfifo(fifo)
    found = without_waiting_on(fifo, lambda: index_cache.cached_index(root, cache), 30)
    assert set(found) == NAMES


def test_without_a_home_folder_the_index_is_built_uncached(root, builds, monkeypatch):
    """A uid without a passwd entry and no HOME (docker --user N): Path.home() fails."""
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(index_cache.Path, "home", staticmethod(no_home))
    assert set(index_cache.cached_index(root)) == NAMES and len(builds) == 1


def test_a_relative_xdg_cache_home_is_ignored_as_the_spec_says(monkeypatch, tmp_path):
    from lm_eval_headloc.common.files import cache_root

    monkeypatch.setattr(index_cache.Path, "home", staticmethod(lambda: tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cache_root() == tmp_path / ".cache" / "lm_eval_headloc"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "abs"))
    assert cache_root() == tmp_path / "abs" / "lm_eval_headloc"


def test_only_the_most_recently_used_indexes_are_kept_and_nothing_else_removed(
        root, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    theirs = cache / "notes.txt"
    theirs.write_text("someone else's")
    old = []
    for i in range(index_cache.KEEP + 2):
        path = cache / f"task-index-old{i}.json"
        path.write_bytes(b"x")
        os.utime(path, (time.time() - 1000 + i, time.time() - 1000 + i))
        old.append(path)
    # What earlier versions wrote (about 16 MB each): gone whatever its age.
    pickled = cache / "task-index-0123456789abcdef01234567.pickle"
    pickled.write_bytes(b"x")
    index_cache.cached_index(root, cache)
    kept = sorted(p.name for p in cache.glob("task-index-*.json"))
    assert len(kept) == index_cache.KEEP and theirs.read_text() == "someone else's"
    # The newest old ones stay; the oldest go.
    assert [p.exists() for p in old] == [False, False, False] + [True] * (len(old) - 3)
    assert not pickled.exists()


@pytest.mark.slow
def test_a_task_manager_with_the_cached_builtins_equals_lm_evals_own(
        tmp_path, monkeypatch, caplog):
    """The whole built-in index, then the user's folder overriding a built-in name as
    lm-eval's own merge does (its warning included)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "gsm8k.yaml").write_text(TASK.format(name="gsm8k", tag="mine"))
    own = TaskManager(include_path=[str(mine)])
    for attempt in ("parsed", "read back"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lm_eval.tasks._index"), \
                index_cache.builtin_index_cached():
            cached = TaskManager(include_path=[str(mine)])
        assert entries(cached.task_index) == entries(own.task_index), attempt
        assert (cached.all_tasks, cached.all_groups, cached.all_tags, cached.all_subtasks) \
            == (own.all_tasks, own.all_groups, own.all_tags, own.all_subtasks)
        assert cached.task_index["gsm8k"].yaml_path == mine / "gsm8k.yaml"
        assert any("Task 'gsm8k' from" in r.getMessage() and "overrides" in r.getMessage()
                   for r in caplog.records), attempt
    assert len(list((tmp_path / "xdg" / "lm_eval_headloc").glob("task-index-*"))) == 1
    from lm_eval.tasks import manager
    assert manager.TaskIndex is TaskIndex  # put back


def test_a_forged_entry_with_an_inline_config_is_refused_before_a_task_is_built(
        root, tmp_path, builds):
    """lm-eval builds a task from an entry's inline ``cfg`` where it names no YAML, and
    renders its ``doc_to_text`` with an unsandboxed Jinja: a stored index rewritten so,
    whoever wrote it, must cost a rebuild, never a task built from its text. Every entry
    of a folder's index names a YAML inside it, but a tag (no YAML, no config)."""
    cache, marker = tmp_path / "cache", tmp_path / "ran"
    index_cache.cached_index(root, cache)
    (stored,) = cache.iterdir()
    data = json.loads(stored.read_text())
    payload = (f"{{{{ lipsum.__globals__['os'].system('touch {marker}') }}}}")
    forged = {"task": "one", "dataset_path": "json", "output_type": "loglikelihood",
              "doc_to_text": payload, "doc_to_target": "a"}
    data["entries"]["one"].update(yaml=None, cfg=forged)
    data["entries"]["both"].update(cfg=forged)  # a tag carrying a config
    stored.write_text(json.dumps(data))
    before = len(builds)
    index = index_cache.cached_index(root, cache)
    assert len(builds) == before + 1  # refused: rebuilt from the YAMLs
    assert index["one"].yaml_path == root / "family" / "one.yaml"
    assert index["both"].cfg is None
    data["entries"]["both"]["cfg"] = None
    data["entries"]["one"]["yaml"] = "family/missing.yaml"  # inside, but no such file
    data["entries"]["one"]["cfg"] = None
    stored.write_text(json.dumps(data))
    before = len(builds)
    index_cache.cached_index(root, cache)
    assert len(builds) == before + 1
    assert not marker.exists()
