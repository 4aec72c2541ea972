"""The Python API as a notebook calls it: what a command does not take is refused, not
dropped; a failed switch leaves the model as it was; a removed knockout says so; the
package's top offers the public API (docs/python-api.md) and nothing more."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from helpers import (
    HIDDEN,
    TASKS,
    assert_names,
    finished_run,
    harness,
    last_logits,
    load_lm,
    raises_naming,
    strict_json,
    tiny_args,
)

from lm_eval_headloc.commands import cross, greedy, locate, sweep, types, universal
from lm_eval_headloc.commands.verify import verify
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.intervention.ablation import AblationError
from lm_eval_headloc.intervention.hooks import ComponentKnockout, Intervention
from lm_eval_headloc.runs.folder_checks import RunFolderError
from lm_eval_headloc.runs.spec import RunSpec


@pytest.mark.parametrize("command, call, ignored", [
    ("verify", lambda out: verify(out / "run", out / "v", num_samples=2), "num_samples"),
    ("greedy", lambda out: greedy(out / "g", masks=100), "masks"),
    ("locate", lambda out: locate(out / "l", rounds=3, limit=2), "limit, rounds"),
    ("types", lambda out: types(out / "t", alpha=5.0), "alpha"),
    ("sweep", lambda out: sweep(out / "s", top_k=2, general=("x",)), "general"),
    ("cross", lambda out: cross([out / "run"], out / "c", masks=4), "masks"),
])
def test_a_keyword_the_command_does_not_take_is_refused_not_dropped(tmp_path, command, call,
                                                                    ignored,
                                                                    no_model_loading):
    with raises_naming(TypeError, f"{command}()", ignored, "progress"):  # progress: taken
        call(tmp_path)
    assert list(tmp_path.iterdir()) == []  # refused before anything was written


def test_refit_refuses_what_its_command_line_does_not_change(tmp_path):
    """refit's keywords are its flags: max_masks (a locate resume setting) and confirm
    measure, which refit never does, so they were accepted and did nothing."""
    from lm_eval_headloc.commands import refit

    with raises_naming(TypeError, "refit()", "confirm, max_masks",
                       "alpha, bootstrap, exclude, masks, top_k"):  # refused, then taken
        refit(tmp_path / "run", max_masks=3, confirm=True)
    assert list(tmp_path.iterdir()) == []


def test_force_must_be_a_bool_not_a_truthy_value(tiny_locate_run, no_model_loading):
    """force="no" from Python is true: it cleared the run's measurements and started over
    (here: loaded the model)."""
    before = {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()}
    spec = RunSpec.from_config(strict_json(tiny_locate_run / "config.json"))
    with raises_naming(UsageError, "force='no'", "True or False"):
        locate(tiny_locate_run, spec, force="no")
    assert {p.name: p.read_bytes() for p in tiny_locate_run.iterdir() if p.is_file()
            } == before


def test_progress_must_be_a_bool():
    with raises_naming(UsageError, "progress='no'", "True or False"):
        RunSpec(progress="no").validate()


def test_one_run_folder_given_alone_is_one_run_not_its_characters(tmp_path):
    run = tmp_path / "a"
    # The folder (not "would write into /") is what is wrong.
    with raises_naming(RunFolderError, str(run)):
        universal(str(run), tmp_path / "u.json")
    with raises_naming(RunFolderError, str(run)):
        cross(str(run), tmp_path / "c")


def test_a_path_argument_that_is_no_path_is_named(tmp_path):
    """overlap(None, run), universal(None), verify(run, 5), write_mib(None, out) and
    read_mib(None) were pathlib's "expected str, bytes or os.PathLike object, not
    NoneType", naming neither the argument nor the value."""
    from lm_eval_headloc.commands import overlap
    from lm_eval_headloc.common.errors import UserError
    from lm_eval_headloc.report.mib import write_mib
    from lm_eval_headloc.report.mib_format import read_mib

    run, other = (finished_run(tmp_path / name, tmp_path / "model", "tiny_copy", ("L0H1",))
                  for name in ("a", "b"))
    cases = [
        (lambda: overlap(None, run), "run folder", "None"),
        (lambda: overlap(run, other, out=5), "--out", "5"),
        (lambda: universal(None, tmp_path / "u.json"), "run folders", "None"),
        (lambda: universal([run, None], tmp_path / "u.json"), "run folder", "None"),
        (lambda: universal([run, other], None), "--out", "None"),
        (lambda: cross(None, tmp_path / "c"), "run folders", "None"),
        (lambda: verify(run, 5), "--out", "5"),
        (lambda: write_mib(None, tmp_path / "m.json"), "run folder", "None"),
        (lambda: write_mib(run, None), "--out", "None"),
        (lambda: read_mib(None), "MIB file", "None"),
    ]
    for call, *named in cases:
        with pytest.raises(UserError) as info:
            call()
        assert_names(str(info.value), *named)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_file_given_as_the_run_folder_is_said_to_be_a_file(tmp_path):
    """read_rankings("runs/x/heads.json") said "runs/x/heads.json is not a run folder (no
    config.json)", as if the run's config.json were missing."""
    from lm_eval_headloc.runs.record import read_rankings

    run = finished_run(tmp_path / "run", tmp_path / "model", "tiny_copy", ("L0H1",))
    with raises_naming(RunFolderError, f"{run / 'heads-tiny_copy.json'} is a file",
                       f"run folder it is in, {run}"):
        read_rankings(run / "heads-tiny_copy.json")


def test_sweep_takes_one_value_as_a_grid_of_one(tiny_model_dir, tmp_path, monkeypatch,
                                                no_model_loading):
    import importlib

    sweep_module = importlib.import_module("lm_eval_headloc.commands.sweep")
    cells = []

    def record(masks, total):  # called once per cell, after the grid is built
        cells.append(masks)
        if len(cells) == 1:
            raise RuntimeError("stop")

    monkeypatch.setattr(sweep_module, "check_design_budget", record)
    with pytest.raises(RuntimeError, match="stop"):
        sweep(tmp_path / "s", masks=100, sparsity=0.02, tasks=("tiny_copy",),
              include_path=(TASKS,), model_args=f"pretrained={tiny_model_dir('llama')}")
    assert cells == [100]


def test_sweep_refuses_a_specs_masks_or_sparsity_the_default_grid_would_replace(
        tiny_model_dir, tmp_path, no_model_loading):
    """sweep(out, spec=RunSpec(masks=4)) ran the default grid (100 and 200 masks): the
    spec's 4 was dropped without a word. The grid is sweep's masks= (the CLI's --masks)."""
    for field, value in (("masks", 4), ("sparsity", 0.25)):
        spec = RunSpec(tasks=("tiny_copy",), include_path=(TASKS,),
                       model_args=f"pretrained={tiny_model_dir('llama')}", **{field: value})
        with raises_naming(UsageError, "sweep()", f"{field}={value}", f"{field}="):
            sweep(tmp_path / "s", spec=spec)
    assert list(tmp_path.iterdir()) == []


# --- the model from Python -------------------------------------------------------------------

TEXTS = ["the cat sat on the mat", "Mary and John went to the store"]


def _logits(lm) -> torch.Tensor:
    with torch.no_grad():
        return lm._model_call(torch.tensor([lm.tok_encode("the dog gave a drink")]))


def test_a_refused_ablation_switch_leaves_the_model_as_it_was(tiny_model_dir, tmp_path):
    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1")
    lm.set_ablation("mean", TEXTS, cache_dir=tmp_path)
    before = (lm.ablation, lm.means_file, lm.reference_digest, _logits(lm))
    with raises_naming(AblationError, "ablation=resample", "two", "has 1"):
        lm.set_ablation("resample", ["one example"])
    with raises_naming(AblationError, "ablation=mean", "texts"):
        lm.set_ablation("mean", "ab")
    after = (lm.ablation, lm.means_file, lm.reference_digest, _logits(lm))
    assert after[:3] == before[:3] and lm.get_model_info()["ablation"] == "mean"
    torch.testing.assert_close(after[3], before[3], rtol=0, atol=0)


def test_a_failed_means_pass_puts_the_old_ablation_back(tiny_model_dir, tmp_path,
                                                        monkeypatch):
    from lm_eval_headloc.intervention import model as model_module

    lm = load_lm(tiny_model_dir("llama"), ablate="L0H1")
    zero = _logits(lm)

    def broken(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C during the pass over the reference set

    monkeypatch.setattr(model_module, "cached_head_means", broken)
    with pytest.raises(KeyboardInterrupt):
        lm.set_ablation("mean", TEXTS, cache_dir=tmp_path)
    assert (lm.ablation, lm.means_file) == ("zero", None)
    torch.testing.assert_close(_logits(lm), zero, rtol=0, atol=0)


@pytest.mark.parametrize("value", [0.5, 2.0, float("nan")])
def test_a_row_mask_entry_other_than_0_or_1_is_refused(tiny_model_dir, value):
    """knocking_out(row_masks=...) cast the masks to bool: 0.5 knocked its head out
    whole, as 1 does (a partial knockout is the scale's)."""
    lm = load_lm(tiny_model_dir("llama"))
    width = lm.knockout.flat_width(["heads"])

    def logits(entry: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        masks = torch.zeros(1, width, dtype=dtype)
        masks[0, 1] = entry
        with lm.knocking_out(row_masks=masks):
            return _logits(lm)

    with raises_naming(AblationError, "row_masks", repr(value), "(0, 1)"):
        logits(value)
    assert lm.intervention.row_masks is None  # refused before it was switched on
    one = logits(True, torch.bool)
    torch.testing.assert_close(logits(1.0), one, rtol=0, atol=0)  # 1/0 still read
    torch.testing.assert_close(logits(1, torch.int64), one, rtol=0, atol=0)
    assert not torch.equal(logits(0.0), one)


def test_a_removed_knockout_refuses_rather_than_knocking_out_nothing(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    knockout = ComponentKnockout(model)
    knockout.remove()
    with raises_naming(RuntimeError, "remove()"):
        with knockout.knocking_out("L0H1"):
            pass


def test_a_failed_knockout_leaves_the_callers_model_without_hooks(tiny_model_dir):
    """A model passed in is the caller's: a bad head name (HFHeadAblateLM(pretrained=model))
    or a bad mlp_out= (ComponentKnockout) raised with hooks left on every layer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.intervention.discovery import MLPOutputNotFound
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()

    def hooks() -> int:
        return sum(len(module._forward_pre_hooks) for module in model.modules())

    with raises_naming(ComponentSpecError, "L0H9"):
        HFHeadAblateLM(pretrained=model, tokenizer=AutoTokenizer.from_pretrained(folder),
                       ablate="L0H9", device="cpu")
    assert hooks() == 0
    with raises_naming(MLPOutputNotFound, "nope.*"):
        ComponentKnockout(model, mlp_out="nope.*")
    assert hooks() == 0


def test_a_model_wrapped_again_and_again_keeps_one_set_of_hooks(tiny_model_dir):
    """HFHeadAblateLM(pretrained=model) in a notebook's loop: each wrapper hooked the model
    again (one more idle hook per layer and site, every pass slower); now they share one
    set, each wrapper's answers its own, and a failed one leaves the others' hooks."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder = tiny_model_dir("llama")
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)

    def hooks() -> int:
        return sum(len(module._forward_pre_hooks) + len(module._forward_hooks)
                   for module in model.modules())

    def wrapped(heads: str) -> HFHeadAblateLM:
        return HFHeadAblateLM(pretrained=model, tokenizer=tokenizer, device="cpu",
                              ablate=heads or None)

    first = wrapped("L0H1+L1N3")
    one_set, answer = hooks(), last_logits(first)
    later = [wrapped(heads) for heads in ("L1H2", "L0N5+L1H0", "")]
    assert hooks() == one_set
    torch.testing.assert_close(last_logits(first), answer, rtol=0, atol=0)
    for lm, heads in zip(later, ("L1H2", "L0N5+L1H0", ""), strict=True):
        with first.knocking_out(heads):
            torch.testing.assert_close(last_logits(lm), last_logits(first), rtol=0, atol=0)
    with raises_naming(ComponentSpecError, "L0H9"):
        wrapped("L0H9")
    assert hooks() == one_set
    torch.testing.assert_close(last_logits(first), answer, rtol=0, atol=0)


def test_heads_joined_by_a_comma_are_named_before_the_load(tiny_model_dir, monkeypatch):
    """ablate=L0H1,L1H2 made L1H2 an argument of its own, refused after the load as one
    neither HFLM nor the model takes, with the advice to leave it out (which drops the
    head); an unknown name with a '.' or '*' was the model's own TypeError."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.components import ComponentSpecError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    folder = tiny_model_dir("llama")
    with monkeypatch.context() as patched:
        def refuse(*args, **kwargs):
            raise AssertionError("the model was loaded before the arguments were checked")

        patched.setattr(HFLM, "__init__", refuse)
        for heads, named in (("L0H1,L1H2", "L1H2"), ("L0H1,L1N*", "L1N*")):
            with raises_naming(ComponentSpecError, f"model_args {named}", "'+'"):
                HFHeadAblateLM.create_from_arg_string(f"pretrained={folder},ablate={heads}")
    with raises_naming(UsageError, "model_args foo.bar=1", "spelling"):
        HFHeadAblateLM.create_from_arg_string(f"pretrained={folder},device=cpu,foo.bar=1")


def test_a_model_argument_given_twice_is_refused_not_overwritten(tiny_model_dir,
                                                                 monkeypatch):
    """lm-eval keeps the last of two: model_args 'ablate=L0H1,ablate=L1H2' knocked out
    L1H2 alone, and '--model-args ...,dtype=float32,dtype=float16' ran in float16."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    folder = tiny_model_dir("llama")
    with raises_naming(UsageError, "ablate= is given twice", "'+'"):
        HFHeadAblateLM.create_from_arg_string(f"pretrained={folder},ablate=L0H1,ablate=L1H2")
    with raises_naming(UsageError, "--model-args dtype= is given twice"):
        RunSpec(model_args=f"pretrained={folder},dtype=float32, dtype=float16").validate()


@pytest.mark.parametrize("given", [["pretrained={folder},ablate=L0H1,ablate=L1H2"],
                                   ["pretrained={folder},ablate=L0H1", "ablate=L1H2"],
                                   ["pretrained={folder},ablate=L0H1", "--model_args",
                                    "ablate=L1H2"]])
def test_a_model_argument_given_twice_on_the_stock_command_line_is_refused(
        tiny_model_dir, monkeypatch, given):
    """lm-eval 0.4.13's ``lm_eval`` merges --model_args into a dict, keeping the last of a
    name given twice (it only warns), and builds the model from that dict: 'ablate=L0H1,
    ablate=L1H2' ran with L1H2 alone, exit 0."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFLM, "__init__", refuse)
    folder = tiny_model_dir("llama")
    values = [value.format(folder=folder) for value in given]
    monkeypatch.setattr("sys.argv", ["/somewhere/bin/lm_eval", "--model", "hf-headablate",
                                     "--model_args", *values, "--tasks", "tiny_choice"])
    lm_evals = {"pretrained": str(folder), "ablate": "L1H2"}  # what lm-eval hands over
    with raises_naming(UsageError, "ablate= is given twice", "'+'"):
        HFHeadAblateLM.create_from_arg_obj(lm_evals, {"batch_size": 1, "device": "cpu"})
    # Given once, the arguments go on to the load.
    monkeypatch.setattr("sys.argv", ["/somewhere/bin/lm_eval", "--model_args",
                                     f"pretrained={folder},ablate=L1H2", "--device", "cpu"])
    with pytest.raises(AssertionError, match="loaded before"):
        HFHeadAblateLM.create_from_arg_obj(lm_evals, {"batch_size": 1, "device": "cpu"})


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "x", True])
def test_a_scale_that_is_not_a_finite_number_is_refused(scale):
    with raises_naming(AblationError, f"scale={scale!r}"):
        Intervention(scale=scale)


def test_a_rankings_columns_are_read_by_name_and_counts_are_checked(tmp_path):
    import numpy as np

    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.ranking import Ranking
    from lm_eval_headloc.runs.types_file import read_types

    ranking = Ranking("t", "acc", True, 0.5, np.array([-0.3, 0.0, -0.1, 0.2]),
                          [0, 2, 1, 3], 2)
    assert ranking.effect("L1H0") == ranking.effect(ranking.columns[2]) == -0.1
    assert [str(h) for h in ranking.top(2)] == ["L0H0", "L1H0"]
    with pytest.raises(ValueError, match="k=-1"):
        ranking.top(-1)  # was every head but the last
    with pytest.raises(ValueError, match="k=-1"):
        ranking.top_knocked_out(-1)  # was every head but the last, too
    assert ranking.top_knocked_out(np.int64(2)) == ranking.top(2)
    columns = Columns.heads(2, 2)
    with raises_naming(ValueError, "(4)", "(3,)"):
        columns.knocked_out(np.array([True, False, True]))
    with raises_naming(ValueError, "(4)", "(5,)"):
        columns.grid_of(np.arange(5.0))
    with raises_naming(RunFolderError, str(tmp_path / "typo")):
        read_types(tmp_path / "typo")  # was None: "this run has no types"
    assert read_types(tmp_path) is None  # a folder without types.json has none


def test_a_design_row_is_all_or_nothing_as_the_knockout_hooks_rows():
    """Columns.knocked_out counted a float design row's 0.5 as knocked out, where the
    knockout hooks refuse a row mask other than 0/1 (a partial knockout is scale=)."""
    import numpy as np

    from lm_eval_headloc.intervention.components import Head
    from lm_eval_headloc.method.columns import Columns

    columns = Columns.heads(2, 2)
    assert columns.knocked_out(np.array([1.0, 0.0, 0.0, 1.0])) == [Head(0, 0), Head(1, 1)]
    for stray, shown in ((0.5, "0.5 at 1"), (np.nan, "nan at 1"), (2, "2.0 at 1")):
        with raises_naming(ValueError, shown, "1/0"):
            columns.knocked_out(np.array([1.0, stray, 0.0, 0.0]))


def test_an_excluded_head_is_unknown_in_the_ranking_as_in_its_file():
    """locate's (and refit's) Ranking held an --exclude'd head's fitted effect and
    interval, where read_rankings of the same run reads NaN (the file lists only the
    ranked): the one ranking said two things of the head."""
    import numpy as np

    from lm_eval_headloc.intervention.components import Head
    from lm_eval_headloc.method.rank import fit_rankings
    from lm_eval_headloc.method.ranking import ranked_heads_json, ranking_from_json

    rng = np.random.default_rng(0)
    design = rng.random((30, 6)) < 0.3
    scores = 0.9 - 0.4 * design[:, 4] - 0.2 * design[:, 1]  # L1H1 and L0H1 hurt
    base = {"scores": {"t": 0.9}, "higher_is_better": {"t": True}, "metrics": {"t": "acc"}}
    records = {"baseline": base,
               **{f"mask-{i:04d}": {"scores": {"t": float(y)}} for i, y in enumerate(scores)}}
    ranking = fit_rankings(design, records, ["t"], 3, 0.01, [Head(1, 1)], bootstrap=20,
                           top_k=2)["t"]
    read = ranking_from_json(ranked_heads_json(ranking, 2), ranking.columns)
    assert "L1H1" not in map(str, ranking.top(6))
    assert np.isnan(read.effect("L1H1")) and np.isnan(ranking.effect("L1H1"))
    assert ranking.confidence("L1H1") == read.confidence("L1H1") == {
        "selected": 0.0, "effect_interval": None}
    assert np.isnan(ranking.evidence["contrast"][4])
    np.testing.assert_allclose(ranking.effects, read.effects, rtol=1e-9)  # NaN where NaN


def test_rankings_with_equal_contents_compare_equal(tiny_locate_run):
    """Ranking == Ranking raised numpy's "truth value of an array is ambiguous" (the
    dataclass compared its arrays as a tuple)."""
    import copy

    import numpy as np

    from lm_eval_headloc import read_rankings
    from lm_eval_headloc.method.ranking import Ranking

    first, again = (read_rankings(tiny_locate_run)["tiny_choice"] for _ in range(2))
    assert first.stability is not None and first.head_types is not None  # compared too
    assert first == again and not first != again
    unknown = Ranking("t", "acc", True, 0.5, np.array([-0.3, np.nan]), [0], 2)
    assert unknown == copy.deepcopy(unknown)  # an unknown effect is the same unknown
    changed = copy.deepcopy(first)
    changed.effects[changed.order[0]] += 0.1
    assert changed != first and first != "a ranking"
    changed = copy.deepcopy(first)
    changed.stability.low[0] -= 0.1
    assert changed != first


def test_bootstrap_stabilities_with_equal_contents_compare_equal():
    """Stability == Stability raised numpy's "truth value of an array is ambiguous" (a
    frozen dataclass of arrays), where Ranking == Ranking compared contents."""
    import numpy as np

    from lm_eval_headloc.method.columns import Columns
    from lm_eval_headloc.method.lasso import Stability

    def stability(high: float) -> Stability:
        return Stability(np.array([1.0, 0.5]), np.array([-0.2, np.nan]),
                         np.array([high, np.nan]), 200)

    assert stability(0.1) == stability(0.1) and not stability(0.1) != stability(0.1)
    assert stability(0.1) != stability(0.2) and stability(0.1) != "a stability"
    assert Columns.heads(2, 2) == Columns.heads(2, 2) != Columns.heads(2, 1)


def test_a_loaded_greedy_run_holds_its_rankings(tiny_model_dir, tmp_path):
    """load_run(greedy_run) was a plain RunRecord, without the .rankings a locate run's has,
    though greedy writes heads-<task>.json and read_rankings reads them."""
    from lm_eval_headloc import load_run, read_rankings

    out = tmp_path / "greedy"
    assert harness("greedy", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--num-samples", "3", "--top-k", "2", "--out", str(out)) == 0
    rankings = load_run(out).rankings
    assert list(rankings) == ["tiny_copy"]
    assert rankings["tiny_copy"] == read_rankings(out)["tiny_copy"]


def test_a_loaded_locate_run_holds_its_rankings(tiny_locate_run, tmp_path):
    """load_run(run).rankings of a finished run was {}, as if it had ranked nothing."""
    import shutil

    from lm_eval_headloc import load_run, read_rankings

    rankings = load_run(tiny_locate_run).rankings
    assert list(rankings) == ["tiny_choice"]
    assert rankings["tiny_choice"] == read_rankings(tiny_locate_run)["tiny_choice"]
    # Read on first use: a ranking file altered by hand stops only what reads it (refit
    # rewrites it from the record).
    run = Path(shutil.copytree(tiny_locate_run, tmp_path / "run"))
    data = strict_json(run / "heads-tiny_choice.json")
    data["heads"][0]["effect"] = "large"
    (run / "heads-tiny_choice.json").write_text(json.dumps(data))
    record = load_run(run)
    with raises_naming(RunFolderError, str(run / "heads-tiny_choice.json")):
        record.rankings["tiny_choice"]


def test_components_to_keep_out_may_be_a_list():
    from lm_eval_headloc.intervention.components import Head

    spec = RunSpec(exclude=["L0H1", Head(1, 2)], never_ablate=("L3N5",))
    assert (spec.exclude, spec.never_ablate) == ("L0H1+L1H2", "L3N5")
    assert RunSpec(exclude=[]).exclude is None
    assert spec == RunSpec(exclude="L0H1+L1H2", never_ablate="L3N5")  # the same run
    # A (layer, head) pair, as parse_heads and set_heads take one, was the name "(0, 1)".
    assert RunSpec(exclude=[(0, 1), "L1H*"]).exclude == "L0H1+L1H*"
    with raises_naming(UsageError, "--never-ablate", "bad head 5"):
        RunSpec(never_ablate=[5])


def test_paths_may_be_path_objects():
    """verify(run, output_path=Path(...)) failed writing config.json ("Object of type
    PosixPath is not JSON serializable", an empty --out left behind); include_path=Path(...)
    was refused as no list of names; output_path=5 was pathlib's TypeError."""
    import json
    from pathlib import Path

    given = RunSpec(output_path=Path("lm"), include_path=Path("tasks"),
                    ablation_data=Path("texts.txt"), ablation="mean")
    spec = given.validate()
    assert spec == RunSpec(output_path="lm", include_path=("tasks",),
                           ablation_data="texts.txt", ablation="mean")
    assert RunSpec(include_path=[Path("a"), "b"]).include_path == ("a", "b")
    json.dumps(spec.as_config())
    json.dumps(spec.identity("verify"))
    with raises_naming(UsageError, "--output-path 5"):
        RunSpec(output_path=5).validate()


def test_values_of_the_wrong_kind_are_named_not_tracebacks(tmp_path):
    from torch import nn

    from lm_eval_headloc.intervention.components import (
        ComponentSpecError,
        parse_heads,
        read_heads_file,
    )
    from lm_eval_headloc.intervention.discovery import AttentionOutputNotFound

    for spec in (None, 5):
        with raises_naming(ComponentSpecError, f"components {spec!r}"):
            parse_heads(spec)
    with raises_naming(ComponentSpecError, "head file None"):
        read_heads_file(None)
    with raises_naming(AttentionOutputNotFound, "Linear", ".config"):
        ComponentKnockout(nn.Linear(3, 3))
    with raises_naming(UsageError, "--tasks 5"):
        RunSpec(tasks=5)
    with raises_naming(TypeError, "locate()", "spec={'tasks'"):
        locate(tmp_path / "l", {"tasks": ["tiny_copy"]})
    # locate's order (out, spec) given to sweep, whose second argument is the masks grid:
    # "'RunSpec' object is not iterable".
    with raises_naming(TypeError, "sweep()", "masks=", "spec="):
        sweep(tmp_path / "s", RunSpec(tasks=("tiny_copy",)))
    assert list(tmp_path.iterdir()) == []


# --- a spec or keywords -------------------------------------------------------------------

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


def test_numpys_numbers_are_taken_as_pythons(tiny_model_dir, tmp_path):
    """A notebook's np.int64/np.float32 options loaded the model and then failed writing
    config.json ('Object of type int64 is not JSON serializable'); a sweep's grid from
    np.arange too."""
    import numpy as np

    model_args = f"pretrained={tiny_model_dir('llama')},dtype=float32"
    spec = RunSpec(model_args=model_args, tasks=("tiny_copy",), include_path=(TASKS,),
                   masks=np.int64(4), sparsity=np.float32(0.25), num_samples=np.int64(4),
                   top_k=np.int64(2), alpha=np.float64(0.01), progress=False)
    assert [type(v) for v in (spec.masks, spec.sparsity, spec.num_samples, spec.top_k,
                              spec.alpha)] == [int, float, int, int, float]
    by_numpy = locate(tmp_path / "a", spec)
    plain = locate(tmp_path / "b", spec.replace(masks=4, sparsity=0.25, num_samples=4,
                                                top_k=2, alpha=0.01))
    assert by_numpy["tiny_copy"].order == plain["tiny_copy"].order
    assert strict_json(tmp_path / "a" / "config.json")["spec"]["masks"] == 4
    result = sweep(tmp_path / "s", masks=np.arange(3, 5), sparsity=np.float64(0.25),
                   spec=spec.replace(confirm=0, prior="none"))
    assert [(c["masks"], c["sparsity"]) for c in result["cells"]] == [(3, 0.25), (4, 0.25)]
    assert strict_json(tmp_path / "s" / "config.json")["identity"]["masks"] == [3, 4]
    from lm_eval_headloc import write_mib

    graph = strict_json(write_mib(tmp_path / "a", tmp_path / "mib" / "importances.json",
                                  d_model=np.int64(HIDDEN)))
    assert graph["cfg"]["d_model"] == HIDDEN


def test_the_python_api_refuses_bad_arguments_in_its_own_words(tmp_path):
    """RunSpec.validate() accepted tasks=[None], [5], bytes and masks="4" (then an
    AttributeError in set-up); locate(None) was pathlib's TypeError; a MemoryStore of
    records without keys a KeyError later; design_matrix of 10^6 x 10^6 numpy's
    MemoryError (931 GiB) instead of a size check."""
    from lm_eval_headloc.common.errors import UserError
    from lm_eval_headloc.measurement.store import MemoryStore
    from lm_eval_headloc.method.designs import design_matrix
    from lm_eval_headloc.runs.spec import RunSpec

    cases = [
        (lambda: RunSpec(tasks=[None]).validate(), "tasks="),
        (lambda: RunSpec(tasks=[5]).validate(), "tasks="),
        (lambda: RunSpec(tasks=b"gsm8k").validate(), "tasks="),
        (lambda: RunSpec(masks="4").validate(), "masks='4'"),
        (lambda: locate(None), "not None"),
        (lambda: MemoryStore([{"key": "baseline"}]), "records[0]"),
        (lambda: MemoryStore([{"key": "baseline", "mask": "", "scores": {"t": None}}]),
         "records[0] (baseline)"),
        (lambda: design_matrix("bernoulli", 10**6, 10**6, 0.1, 0), "931.3 GiB"),
        # A bare ValueError beside the same function's UsageErrors.
        (lambda: design_matrix("foo", 4, 8, 0.1, 0), "'foo'"),
        (lambda: design_matrix("stratified", 4, 8, 0.1, 0, [12]), "index 12"),
        (lambda: design_matrix("stratified", 4, 8, 0.1, 0, range(8)), "all 8 heads"),
    ]
    for call, said in cases:
        with pytest.raises(UserError) as info:
            call()
        assert said in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert RunSpec(masks="auto").validate().masks == "auto"


# --- what the package's top promises -------------------------------------------------------

#: The public API, written out here (not read from the package): a name added to or dropped
#: from ``__all__`` is a change of promise, made in this test too.
PUBLIC = {
    "locate", "refit", "greedy", "verify", "universal", "overlap", "cross", "types", "sweep",
    "write_mib",                                              # the commands
    "RunSpec", "load_run", "read_rankings", "Ranking",        # a run's options and results
    "read_types", "read_mib",                                 # its head types, its export
    "HeadLasso", "design_matrix",                             # the estimator
    "HFHeadAblateLM", "Head", "parse_heads", "HeadlocError",  # model, notation, errors
}

#: Internals that were once at the top: importable from their modules, not from the top.
INTERNALS = {
    "locate_loop": "method.locate_loop", "LocateState": "method.locate_loop",
    "locate_components": "method.locate_loop", "MemoryStore": "measurement.store",
    "Columns": "method.columns", "RunFolder": "runs.folder", "fit_rankings": "method.rank",
    "HarnessMeasurement": "measurement.measure", "UserError": "common.errors",
}


def test_the_package_top_promises_the_public_api_and_no_more():
    """Each name at the top is a promise: a short list of what users call, the rest
    reached through its module so that it can change."""
    import importlib

    import lm_eval_headloc

    public = lm_eval_headloc.__all__
    assert len(public) == len(set(public)) <= 24
    assert set(public) == PUBLIC
    for name in public:
        assert getattr(lm_eval_headloc, name) is not None, name
    for name, module in INTERNALS.items():
        assert hasattr(importlib.import_module(f"lm_eval_headloc.{module}"), name), name
        with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
            getattr(lm_eval_headloc, name)


def test_the_python_api_page_lists_exactly_the_public_names():
    from pathlib import Path

    import lm_eval_headloc

    page = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"
    listed = re.findall(r"^- `(\w+)`", page.read_text(encoding="utf-8"), re.M)
    assert len(listed) == len(set(listed))
    assert set(listed) == set(lm_eval_headloc.__all__) == PUBLIC


def test_importing_the_package_stays_light():
    """The public names load their modules on first use: ``import lm_eval_headloc`` (which
    the model's registration makes every lm-eval user pay) imports no heavy library."""
    import subprocess
    import sys

    code = ("import sys, lm_eval_headloc\n"
            "print(sorted(m for m in ('torch', 'sklearn', 'numpy', 'lm_eval', 'transformers')"
            " if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[0] == "[]"
