"""Attribution patching against a finite difference of the measured logprob signal; and
locate --prior on a tiny model (prior.json, the eased penalty, a prior that found no
effect, --prior auto)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers import assert_names, harness, last_error, load_lm, read_run, strict_json, tiny_args

from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.intervention.multimask import loglikelihoods_for_masks
from lm_eval_headloc.measurement.attribution import attribution_effects, path_point
from lm_eval_headloc.measurement.measure import HarnessMeasurement
from lm_eval_headloc.measurement.signals import signal_weights


def scaled_head(lm, head: Head, factor: float):
    """A hook, independent of ours, that multiplies one head's slice by ``factor``."""
    module = lm.knockout.modules[head.layer]
    d = lm.knockout.head_dim

    def scale(_module, args):
        z = args[0].clone()
        z[..., head.head * d:(head.head + 1) * d] *= factor
        return (z, *args[1:])

    return module.register_forward_pre_hook(scale)


def _measure_and_attribute(lm, task_manager, task: str):
    """The logprob measurement of ``task`` on ``lm`` and the prior's estimates on it."""
    measure = HarnessMeasurement(lm, [(task, None)], {task: task_manager.load([task])},
                                 num_samples=None, signal="logprob")
    requests = measure.requests()
    answers = loglikelihoods_for_masks(lm, requests, [[]])[0]
    weights = signal_weights(measure.gold_answers(), answers, measure.leaves_of[task])
    return measure, attribution_effects(lm, requests, weights, batch_size=3)


@pytest.mark.parametrize("family, task", [("llama", "tiny_copy"), ("llama", "tiny_choice"),
                                          ("gpt2", "tiny_choice")])
def test_attribution_is_the_signals_derivative_along_each_head(tiny_model_dir, task_manager,
                                                               family, task):
    lm = load_lm(tiny_model_dir(family), dtype="float64", softmax_dtype="float64")
    measure, effects = _measure_and_attribute(lm, task_manager, task)
    layers, per_layer = lm.knockout.num_layers, lm.knockout.heads_per_layer
    assert effects.shape == (layers * per_layer,)
    eps = 1e-2  # float64 forwards still differ by ~1e-9: a smaller step is noise
    for flat in range(layers * per_layer):
        head = Head.from_flat_index(flat, per_layer)
        values = []
        for factor in (1 + eps, 1 - eps):
            handle = scaled_head(lm, head, factor)
            try:
                values.append(measure.measure_with_model([])[task].value)
            finally:
                handle.remove()
        # Zeroing z is the step -z; to first order the signal moves by -dS/d(scale).
        derivative = (values[0] - values[1]) / (2 * eps)
        assert effects[flat] == pytest.approx(-derivative, rel=1e-3, abs=1e-6)
    assert np.abs(effects).max() > 1e-3  # heads matter, so the comparison could fail
    torch.set_grad_enabled(True)


@pytest.mark.parametrize("at", [0.5, 0.25])
def test_attribution_at_a_path_point_is_the_derivative_there(tiny_model_dir, task_manager,
                                                             at):
    """At ``at`` every head's slice is (1 - at)·z (zero ablation); the estimate for head j
    is the signal's derivative as j alone moves on towards 0, taken there: j's factor
    1 - at - eps against 1 - at + eps, every other head at 1 - at (hooks of our own)."""
    lm = load_lm(tiny_model_dir("llama"), dtype="float64", softmax_dtype="float64")
    task = "tiny_choice"
    measure = HarnessMeasurement(lm, [(task, None)], {task: task_manager.load([task])},
                                 num_samples=None, signal="logprob")
    requests = measure.requests()
    clean = attribution_effects(lm, requests, signal_weights(
        measure.gold_answers(), loglikelihoods_for_masks(lm, requests, [[]])[0],
        measure.leaves_of[task]), batch_size=3)
    with path_point(lm, at):
        answers = loglikelihoods_for_masks(lm, requests, [[]])[0]
    weights = signal_weights(measure.gold_answers(), answers, measure.leaves_of[task])
    effects = attribution_effects(lm, requests, weights, batch_size=3, at=at)
    knockout, eps = lm.knockout, 1e-2
    d = knockout.head_dim

    def all_scaled(head: Head | None, factor: float):
        def scale(module, args):
            z = args[0] * (1 - at)
            if head is not None and module is knockout.modules[head.layer]:
                part = slice(head.head * d, (head.head + 1) * d)
                z[..., part] = args[0][..., part] * factor
            return (z, *args[1:])
        return [m.register_forward_pre_hook(scale) for m in knockout.modules]

    for flat in range(knockout.num_layers * knockout.heads_per_layer):
        head = Head.from_flat_index(flat, knockout.heads_per_layer)
        values = []
        for factor in (1 - at - eps, 1 - at + eps):
            handles = all_scaled(head, factor)
            try:
                values.append(measure.measure_with_model([])[task].value)
            finally:
                for handle in handles:
                    handle.remove()
        assert effects[flat] == pytest.approx((values[0] - values[1]) / (2 * eps),
                                              rel=1e-3, abs=1e-6)
    # The point matters: the estimates differ from the clean run's, so the test could fail.
    assert np.abs(effects - clean).max() > 1e-3
    torch.set_grad_enabled(True)


def test_the_prior_is_of_the_unablated_model_whatever_was_measured_last(tiny_model_dir,
                                                                       task_manager):
    """A run computes its prior after the pilot's half-heads floor mask: that mask must
    not stay in place (a resumed run, which skipped it, got another prior)."""
    lm = load_lm(tiny_model_dir("llama"), dtype="float64", softmax_dtype="float64")
    measure = HarnessMeasurement(lm, [("tiny_choice", None)],
                                 {"tiny_choice": task_manager.load(["tiny_choice"])},
                                 num_samples=None, signal="metric")
    fresh = measure.attribution((0.0, 0.5))["tiny_choice"]
    assert fresh.shape == (2, 8)
    half = [Head(0, 0), Head(0, 3), Head(1, 1), Head(1, 2)]
    measure.measure_with_model(half)
    assert lm.knocked_out == ()  # a measurement leaves nothing knocked out
    lm.set_heads(half)  # even a model set to knock heads out gets the clean run's prior
    assert lm.knocked_out  # so the check below could fail
    after = measure.attribution((0.0, 0.5))["tiny_choice"]
    assert lm.knocked_out == tuple(half)  # and keeps its own heads
    np.testing.assert_allclose(after, fresh, rtol=1e-9, atol=1e-12)
    torch.set_grad_enabled(True)


def test_attribution_follows_the_ablation_kind_and_scale(tiny_model_dir, task_manager,
                                                         tmp_path):
    """Under mean ablation at scale s a head's slice moves by (1 - s)(mean - z): the
    estimate must be the signal's derivative along that direction, scaled."""
    reference = tmp_path / "reference.txt"
    reference.write_text("the cat sat on the mat\nMary and John went to the store\n",
                         encoding="utf-8")
    lm = load_lm(tiny_model_dir("llama"), dtype="float64", softmax_dtype="float64",
                 ablation="mean", scale=0.5, ablation_data=str(reference),
                 ablation_cache=str(tmp_path))
    task = "tiny_choice"
    measure, effects = _measure_and_attribute(lm, task_manager, task)
    d, eps = lm.knockout.head_dim, 1e-2
    for flat in (0, 5):
        head = Head.from_flat_index(flat, lm.knockout.heads_per_layer)
        mean = lm.intervention.replacement["heads"][head.layer][head.head]
        part = slice(head.head * d, (head.head + 1) * d)
        values = []
        for step in (eps, -eps):
            def toward_mean(_module, args, step=step, part=part, mean=mean):
                z = args[0].clone()
                z[..., part] += step * (mean - z[..., part])
                return (z, *args[1:])
            handle = lm.knockout.modules[head.layer].register_forward_pre_hook(toward_mean)
            try:
                values.append(measure.measure_with_model([])[task].value)
            finally:
                handle.remove()
        derivative = (values[0] - values[1]) / (2 * eps)
        assert abs(derivative) > 1e-4  # the direction matters, so the test could fail
        assert effects[flat] == pytest.approx(0.5 * derivative, rel=1e-3, abs=1e-6)
    torch.set_grad_enabled(True)


def test_the_prior_halves_its_backward_batch_on_running_out_of_gpu_memory(
        tiny_model_dir, task_manager, monkeypatch, caplog):
    """A backward pass keeps every layer's activations: at 8B the measurements' batch can
    exceed the GPU's memory. The prior retries at half the rows (kept for later passes)
    and gives the estimates it would have given at any batch size."""
    from lm_eval_headloc.measurement import attribution as prior

    lm = load_lm(tiny_model_dir("llama"), dtype="float64", softmax_dtype="float64",
                 batch_size=8)
    task = "tiny_choice"
    measure = HarnessMeasurement(lm, [(task, None)], {task: task_manager.load([task])},
                                 num_samples=None, signal="logprob")
    expected = prior.measured_attribution(measure, points=(0.0, 0.5))[task]
    real = prior._scored_logprobs
    tried: list[int] = []

    def short_of_memory(lm_, requests, batch, *args, **kwargs):
        if torch.is_grad_enabled():
            tried.append(len(batch.input_ids))
            if len(batch.input_ids) > 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 9 GiB")
        return real(lm_, requests, batch, *args, **kwargs)

    monkeypatch.setattr(prior, "_scored_logprobs", short_of_memory)
    with caplog.at_level("WARNING", logger="lm_eval_headloc.measurement.attribution"):
        got = prior.measured_attribution(measure, points=(0.0, 0.5))[task]
    assert max(tried) == 8 and sorted(set(tried))[-2] <= 4  # 8 failed, then fewer rows
    assert tried.count(8) == 1  # halved once, kept for the second point
    assert "retrying with 4 rows per backward pass" in caplog.text
    np.testing.assert_allclose(got, expected, rtol=1e-9, atol=1e-12)
    # Out of memory at one row is not hidden.
    monkeypatch.setattr(prior, "_scored_logprobs", lambda *a, **k: (_ for _ in ()).throw(
        torch.OutOfMemoryError("CUDA out of memory")) if torch.is_grad_enabled()
        else real(*a, **k))
    with pytest.raises(torch.OutOfMemoryError):
        prior.measured_attribution(measure)
    torch.set_grad_enabled(True)


# --- locate --prior on a tiny model -------------------------------------------------------

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
    from lm_eval_headloc.method.confirm import prior_found_nothing

    assert prior_found_nothing(np.zeros((2, 4)))
    assert prior_found_nothing(np.array([[-0.3] * 4, [0.1 + 0.2, 0.3, 0.3, 0.3]]))  # round-off
    assert not prior_found_nothing(np.array([[0.0, 0.0, 0.0, -1e-6]]))
    assert not prior_found_nothing(np.array([[0.0] * 4, [0.0, -0.2, 0.0, 0.0]]))
    assert not prior_found_nothing(None)
    # Neuron groups have no estimate (+inf): a prior that told the neurons apart found
    # something (--neuron-groups read as 'the same change for every neuron').
    assert not prior_found_nothing(np.array([[-0.2, 0.1, np.inf, np.inf]] * 2))
    assert prior_found_nothing(np.array([[0.0, 0.0, np.inf, np.inf]]))


def test_prior_atp_is_saved_ranked_and_eases_the_penalty(tiny_model_dir, tmp_path):
    from lm_eval_headloc.method.confirm import prior_penalty_weights
    from lm_eval_headloc.method.lasso import HeadLasso
    from lm_eval_headloc.method.rank import fit_rankings

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
    assert_names(last_error(capsys), "--prior atp", "'tiny_rolling'", "loglikelihood_rolling")
    assert not (tmp_path / "x").exists()
