"""Options an audit found silently ignored or refused in misleading words: a head given to
--exclude (or --never-ablate) of a run that locates MLP neurons only; a task named twice in
verify's --general, said as if --tasks had named it; a --scale too large for the model's
numbers, refused only after the model loaded, measured and returned NaN, with advice to
load in float32 that a float32 model already followed."""

from __future__ import annotations

import json
import math

import pytest
from helpers import (
    assert_names,
    error_line,
    fake_run,
    finished_run,
    harness,
    last_error,
    raises_naming,
    tiny_args,
)

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    Head,
    Neuron,
    check_component_names,
    parse_components,
)
from lm_eval_headloc.runs.spec import RunSpec


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test where a command loads the model's weights."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(HFHeadAblateLM, "create_from_arg_string", classmethod(refuse))


# --- 1. a head kept out of a run that locates MLP neurons only -----------------------------

def test_heads_are_refused_where_only_neurons_are_taken():
    with raises_naming(ComponentSpecError, "'L1H2'", "MLP neurons"):
        parse_components("L0N3+L1H2", heads=False)
    with raises_naming(ComponentSpecError, "L1H2"):
        parse_components([Neuron(0, 3), Head(1, 2)], heads=False)
    with raises_naming(ComponentSpecError, "'L1H*'"):
        check_component_names("L1H*", heads=False)
    assert parse_components("L1N2+L0N3", heads=False) == [Neuron(0, 3), Neuron(1, 2)]
    # Heads stay accepted by default.
    assert parse_components("L1H2+L0N3") == [Neuron(0, 3), Head(1, 2)]


@pytest.mark.parametrize("name", ["exclude", "never_ablate"])
def test_a_neurons_runs_spec_refuses_a_head_naming_it_and_the_components(name, tmp_path):
    flag = "--" + name.replace("_", "-")
    with raises_naming(UsageError, flag, "L1H2", "--components neurons"):
        RunSpec(components="neurons", **{name: "L0N3+L1H2"}).validate()
    # From Python, as components.
    with raises_naming(UsageError, flag, "L1H2"):
        RunSpec(components="neurons", **{name: [Neuron(0, 3), Head(1, 2)]}).validate()
    # A head file too (one head per line).
    listed = tmp_path / "keep.txt"
    listed.write_text("L0N3\nL1H2\n")
    with raises_naming(UsageError, flag, str(listed), "L1H2"):
        RunSpec(components="neurons", **{name: str(listed)}).validate()
    # What the run's components take passes: neurons alone, or both kinds where it
    # locates both; a heads run's neurons are refused once the config is read (head_list).
    RunSpec(components="neurons", **{name: "L0N3+L1N*"}).validate()
    RunSpec(components="heads+neurons", **{name: "L0N3+L1H2"}).validate()
    RunSpec(components="heads+neurons", **{name: str(listed)}).validate()
    RunSpec(**{name: "L1H2"}).validate()
    # A malformed name or an unreadable file is left to head_list (it says why, with the
    # model's ranges), not refused as a head.
    RunSpec(components="neurons", **{name: str(tmp_path / "missing.txt")}).validate()


def neuron_args(model_dir) -> list[str]:
    return ["locate", *tiny_args(model_dir), "--tasks", "tiny_copy", "--num-samples", "8",
            "--seed", "3", "--sparsity", "0.25", "--masks", "6", "--confirm", "2",
            "--prior", "atp", "--top-k", "2", "--components", "neurons", "--candidates", "8"]


def test_locate_refuses_a_head_to_exclude_from_a_neurons_run_before_loading(
        tiny_model_dir, tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    args = neuron_args(tiny_model_dir("llama"))
    capsys.readouterr()  # the model's making
    assert harness(*args, "--exclude", "L1H2", "--out", str(out)) == 2
    assert_names(error_line(capsys), "--exclude L1H2", "'L1H2'", "--components neurons")
    assert not (out / "measurements.jsonl").exists()


@pytest.fixture(scope="module")
def neuron_run(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("neurons") / "run"
    assert harness(*neuron_args(tiny_model_dir("llama")), "--out", str(out)) == 0
    return out


def test_refit_refuses_a_head_to_exclude_from_a_neurons_run(neuron_run, capsys):
    before = {name: (neuron_run / name).read_bytes()
              for name in ("heads.json", "report.md", "config.json")}
    capsys.readouterr()
    assert harness("refit", str(neuron_run), "--exclude", "L1H2") == 2
    assert_names(error_line(capsys), "--exclude L1H2", "'L1H2'", "--components neurons")
    # Nothing rewritten: no report saying the head was excluded.
    assert {name: (neuron_run / name).read_bytes() for name in before} == before
    # A neuron of the run is still excluded as before.
    first = json.loads(before["heads.json"])["top_k"][0]
    assert harness("refit", str(neuron_run), "--exclude", first) == 0
    assert json.loads((neuron_run / "heads.json").read_text())["excluded"] == [first]
    assert harness("refit", str(neuron_run), "--exclude", "") == 0


# --- 2. verify's --general naming a task twice ----------------------------------------------

def test_a_general_task_named_twice_is_said_of_general(tiny_model_dir, tmp_path, capsys,
                                                       no_model_load):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    capsys.readouterr()  # the model's making
    assert harness("verify", str(run), "--general", "tiny_choice,tiny_choice",
                   "--limit", "4", "--random-draws", "0", "--out", str(tmp_path / "v")) == 2
    message = error_line(capsys)
    assert_names(message, "--general tiny_choice,tiny_choice", "'tiny_choice'", "twice")
    assert "--tasks" not in message  # the user gave none
    # One of the run's own tasks named in --general (with a metric, which verify's own
    # filter of the run's tasks does not catch): said of --general too.
    assert harness("verify", str(run), "--general", "tiny_choice,tiny_copy:acc",
                   "--limit", "4", "--random-draws", "0", "--out", str(tmp_path / "v")) == 2
    assert_names(error_line(capsys), "--general tiny_choice,tiny_copy:acc", "'tiny_copy'",
                 "--tasks tiny_copy")


def test_a_task_named_twice_in_tasks_is_said_of_tasks(tiny_model_dir, tmp_path, capsys,
                                                      no_model_load):
    args = tiny_args(tiny_model_dir("llama"))
    capsys.readouterr()  # the model's making
    assert harness("locate", *args, "--tasks", "tiny_copy,tiny_choice,tiny_copy",
                   "--out", str(tmp_path / "r")) == 2
    assert_names(error_line(capsys), "--tasks tiny_copy,tiny_choice,tiny_copy",
                 "'tiny_copy'", "twice")


# --- 3. a --scale the model's numbers cannot hold -------------------------------------------

#: float32's largest number, from its bits (exponent 254, all 23 fraction bits set), and
#: the least number that rounds to inf as a float32: that plus half its last unit (2^104).
FLOAT32_MAX = (2 - 2 ** -23) * 2.0 ** 127
TOO_LARGE = FLOAT32_MAX + 2.0 ** 103


def test_the_bound_is_where_a_scale_is_inf_as_a_float32():
    import numpy as np
    import torch

    from lm_eval_headloc.intervention.ablation import FLOAT32_OVERFLOW

    assert FLOAT32_OVERFLOW == TOO_LARGE and FLOAT32_MAX == torch.finfo(torch.float32).max
    with np.errstate(over="ignore"):
        assert np.isinf(np.float32(TOO_LARGE))
        assert np.float32(math.nextafter(TOO_LARGE, 0)) == FLOAT32_MAX
    # From the bound on, every nonzero output (the smallest float16) is inf in the three
    # dtypes a knockout's arithmetic may use short of float64.
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        tiny = torch.finfo(dtype).smallest_normal if dtype != torch.float16 else 6e-8
        out = torch.tensor([tiny, -2.0], dtype=dtype) * TOO_LARGE
        assert torch.isinf(out).all(), dtype
    # Just below it, a small output stays finite; float64 holds a larger scale.
    for dtype in (torch.bfloat16, torch.float32):
        below = torch.tensor([1e-3], dtype=dtype) * math.nextafter(TOO_LARGE, 0)
        assert torch.isfinite(below).all(), dtype
    assert torch.isfinite(torch.tensor([1e-3], dtype=torch.float64) * 1e308).all()


@pytest.mark.parametrize("model_args, config_dtype, refused", [
    ("pretrained=m,dtype=float32", None, "float32"),
    ("pretrained=m", None, "float32"),  # no dtype said anywhere: torch's default
    ("pretrained=m,dtype=auto", "bfloat16", "bfloat16"),
    ("pretrained=m,dtype=float16", "float64", "float16"),
    ("pretrained=m,dtype=float64,mixed_precision_dtype=bfloat16", None, "bfloat16"),
    ("pretrained=m,dtype=float64", None, None),
    ("pretrained=m,dtype=double", None, None),
    ("pretrained=m", "float64", None),
])
def test_a_scale_beyond_float32_is_refused_unless_the_model_runs_in_float64(
        model_args, config_dtype, refused):
    import types

    from lm_eval_headloc.runs.setup import check_scale_fits

    config = types.SimpleNamespace(dtype=config_dtype)
    for scale in (TOO_LARGE, -TOO_LARGE, 1e308):
        if refused is None:
            check_scale_fits(scale, model_args, config)
        else:
            with raises_naming(UsageError, f"--scale {scale:g}", refused, "dtype=float64"):
                check_scale_fits(scale, model_args, config)
    below = math.nextafter(TOO_LARGE, 0)
    for scale in (0.0, 1.0, 2.0, -FLOAT32_MAX, FLOAT32_MAX, below, -below, 1e38):
        check_scale_fits(scale, model_args, config)


def test_hf_headablate_refuses_a_scale_beyond_its_mixed_precision_before_loading(
        tiny_model_dir, monkeypatch):
    """dtype=float64 holds the scale, but mixed_precision_dtype=bfloat16 computes in
    bfloat16: every knocked-out output inf, every score NaN."""
    from lm_eval.models.huggingface import HFLM

    from lm_eval_headloc.intervention.ablation import AblationError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the weights were loading")

    monkeypatch.setattr(HFLM, "_create_model", refuse)
    with raises_naming(AblationError, "scale=1e+39", "bfloat16"):
        HFHeadAblateLM(pretrained=str(tiny_model_dir("llama")), device="cpu", ablate="L0H1",
                       scale=1e39, dtype="float64", mixed_precision_dtype="bfloat16")


def test_verify_refuses_a_scale_beyond_float32_before_loading(tiny_model_dir, tmp_path,
                                                              capsys, no_model_load):
    run = fake_run(tmp_path / "run", tiny_model_dir("llama"))
    capsys.readouterr()  # the model's making
    out = tmp_path / "v"
    assert harness("verify", str(run), "--scale", "1e308", "--general", "tiny_choice",
                   "--limit", "4", "--random-draws", "0", "--out", str(out)) == 2
    message = error_line(capsys)
    assert_names(message, "--scale 1e+308", "float32")
    assert "dtype=float32" not in message
    assert not (out / "measurements.jsonl").exists()
    # So does locate, where the scale is its own.
    assert harness("locate", *tiny_args(tiny_model_dir("llama")), "--tasks", "tiny_copy",
                   "--scale=-1e39", "--out", str(tmp_path / "r")) == 2
    assert_names(error_line(capsys), "--scale -1e+39")


class _NaNMeasurement:
    """Returns NaN for every mask, on a model of ``dtype`` knocking out at ``scale``."""

    def __init__(self, scale, dtype):
        import types

        self.lm = types.SimpleNamespace(scale=scale, model=types.SimpleNamespace(dtype=dtype),
                                        mixed_precision_dtype=None)

    def measure_chunks(self, chunks, masks_per_pass=None, scale=None):
        from lm_eval_headloc.measurement.metrics import TaskScore

        for index, chunk in enumerate(chunks):
            yield index, [{"t": TaskScore("t", "acc,none", math.nan, True)}
                          for _ in chunk], 0.0


@pytest.mark.parametrize("own_scale, entry_scale, dtype, names_scale, says_float32", [
    (1e308, None, "float32", "1e+308", False),    # verify's own scale, in float32
    (1e308, None, "float64", "1e+308", False),    # float64 lets it load; NaN all the same
    (2.0, None, "float16", "2", True),            # a scale and a float16 model: both said
    (0.0, 3.0, "float32", "3", False),            # a plan entry's own scale (cross's)
    (0.0, None, "float32", None, False),          # a plain knockout: no scale to blame
    (0.0, None, "bfloat16", None, True),
    (1e308, 0.0, "float32", None, False),         # verify's erase beside it: scale 0
])
def test_a_nan_measurement_names_the_scale_and_the_dtype(own_scale, entry_scale, dtype,
                                                         names_scale, says_float32):
    import torch

    from lm_eval_headloc.measurement.metrics import MetricError
    from lm_eval_headloc.measurement.store import MemoryStore, run_plan

    measure = _NaNMeasurement(own_scale, getattr(torch, dtype))
    entry = ("set", [Head(1, 2)]) if entry_scale is None else ("set", [Head(1, 2)],
                                                                entry_scale)
    with pytest.raises(MetricError) as refused:
        run_plan(MemoryStore(), measure, [entry], "t", progress=False)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and "'set'" in message and "L1H2" in message
    if names_scale is None:
        assert "--scale" not in message
    else:
        assert f"--scale {names_scale}" in message
    assert ("dtype=float32" in message) == says_float32, message
    if says_float32:
        assert dtype in message


def test_a_nan_baseline_blames_no_scale():
    import torch

    from lm_eval_headloc.measurement.metrics import MetricError
    from lm_eval_headloc.measurement.store import MemoryStore, run_plan

    with pytest.raises(MetricError) as refused:
        run_plan(MemoryStore(), _NaNMeasurement(1e308, torch.float32), [("baseline", [])],
                 "t", progress=False)
    assert "--scale" not in str(refused.value) and "knocked out nothing" in str(refused.value)


def test_a_float64_model_at_a_huge_scale_says_the_scale(tiny_model_dir, tmp_path, capsys):
    """End to end: float64 holds 1e308, so the run loads; the knockouts overflow, and the
    refusal names the scale, not float32 (already more than float32)."""
    model = tiny_model_dir("llama")
    run = finished_run(tmp_path / "run", model, "tiny_copy", ("L1H2", "L0H0"),
                       model_args=f"pretrained={model},dtype=float64,device=cpu")
    capsys.readouterr()  # the model's making
    assert harness("verify", str(run), "--scale", "1e308", "--general", "tiny_choice",
                   "--limit", "4", "--random-draws", "0", "--top-k", "2",
                   "--out", str(tmp_path / "v")) == 2
    message = last_error(capsys)  # after the model's and the measurement's bars
    assert_names(message, "--scale 1e+308", "not a finite number", "L1H2")
    assert "dtype=float32" not in message


def test_hf_headablate_refuses_a_scale_past_float32_before_the_load(tiny_model_dir,
                                                                    monkeypatch):
    """lm_eval --model hf-headablate with scale=1e308 scored the NaN logits as answers
    (acc 0.75 against 0.25): the model's own path had no bound."""
    from transformers import AutoModelForCausalLM

    from lm_eval_headloc.intervention.ablation import AblationError
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("weights are loading")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    folder = str(tiny_model_dir("llama"))
    for scale, dtype in ((1e308, "float32"), (-1e39, "bfloat16")):
        with pytest.raises(AblationError) as err:
            HFHeadAblateLM(pretrained=folder, device="cpu", dtype=dtype, ablate="L0H1",
                           scale=scale)
        said = str(err.value)
        assert f"scale={scale:g}" in said and dtype in said and "\n" not in said
    # float64 arithmetic holds it; a scale below the bound is not refused: the load follows.
    for scale, dtype in ((1e308, "float64"), (1e30, "float32")):
        with pytest.raises(AssertionError, match="weights are loading"):
            HFHeadAblateLM(pretrained=folder, device="cpu", dtype=dtype, ablate="L0H1",
                           scale=scale)
