"""The attribution prior over MLP neurons against finite differences of the logprob signal.

A neuron is input feature ``n`` of a layer's MLP output projection (``down_proj`` here,
written out, not discovered). Each expected derivative moves that feature with a hook of
the test's own and measures the signal through the harness (``measure_with_model``); mean
ablation's means are recorded independently over the reference texts.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from helpers import load_lm, raises_naming

from lm_eval_headloc.intervention.components import Neuron
from lm_eval_headloc.intervention.multimask import loglikelihoods_for_masks
from lm_eval_headloc.measurement.attribution import (
    IG_STEPS,
    PRIOR_POINTS,
    _answers_at,
    attribution_effects,
    ig_points,
    measured_attribution,
    path_point,
)
from lm_eval_headloc.measurement.harness import at_scale
from lm_eval_headloc.measurement.measure import HarnessMeasurement

TASK = "tiny_choice"
TEXTS = ["the cat sat on the mat when the dog sat", "Mary and John went to the store"]
EPS = 1e-2  # float64 forwards still differ by ~1e-9: a smaller step is noise

Rewrite = Callable[[torch.Tensor], torch.Tensor]


@pytest.fixture(autouse=True)
def _grad_back_on():
    """lm-eval's evaluation switches autograd off globally; later tests need it on."""
    yield
    torch.set_grad_enabled(True)


def _setup(tiny_model_dir, task_manager, tmp_path=None, family="llama", **model_args):
    """hf-headablate on the tiny llama in float64 (reference texts for mean and resample
    ablation under ``tmp_path``), and the logprob measurement of ``TASK`` on it."""
    if tmp_path is not None:
        reference = tmp_path / "reference.txt"
        reference.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
        model_args["ablation_data"] = str(reference)
        if model_args.get("ablation") == "mean":
            model_args["ablation_cache"] = str(tmp_path / "cache")
    lm = load_lm(tiny_model_dir(family), dtype="float64", softmax_dtype="float64",
                 **model_args)
    measure = HarnessMeasurement(lm, [(TASK, None)], {TASK: task_manager.load([TASK])},
                                 num_samples=None, signal="logprob")
    return lm, measure


def _down_proj(lm, layer: int) -> torch.nn.Module:
    return lm.model.model.layers[layer].mlp.down_proj


def _signal(measure, rewrites: dict[int, Rewrite]) -> float:
    """The logprob signal with layer ``l``'s MLP neurons rewritten by ``rewrites[l]``."""
    handles = [_down_proj(measure.lm, layer).register_forward_pre_hook(
        lambda _m, args, rewrite=rewrite: (rewrite(args[0].clone()), *args[1:]))
        for layer, rewrite in rewrites.items()]
    try:
        return measure.measure_with_model([])[TASK].value
    finally:
        for handle in handles:
            handle.remove()


def _derivative(measure, layer: int, along: Callable[[float], Rewrite]) -> float:
    """d signal / d step at 0, where ``along(step)`` rewrites layer ``layer``'s neurons."""
    up, down = (_signal(measure, {layer: along(step)}) for step in (EPS, -EPS))
    return (up - down) / (2 * EPS)


def _recorded_means(lm) -> list[torch.Tensor]:
    """Per layer, each neuron's mean over every position of the reference texts: the
    unhooked model's forward passes, recorded by hooks of the test's own."""
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    handles = [_down_proj(lm, layer).register_forward_pre_hook(
        lambda _m, args, layer=layer: seen[layer].append(args[0][0].detach()))
        for layer in seen]
    try:
        with torch.no_grad():
            for text in TEXTS:
                lm.model(torch.tensor([lm.tok_encode(text)]))
    finally:
        for handle in handles:
            handle.remove()
    return [torch.cat(seen[layer]).mean(dim=0) for layer in sorted(seen)]


def _picked(effects: np.ndarray, width: int) -> list[Neuron]:
    """Per layer the neuron with the largest estimate and two fixed ones."""
    picked = []
    for layer in range(effects.size // width):
        row = effects[layer * width:(layer + 1) * width]
        picked += [Neuron(layer, n) for n in dict.fromkeys((int(np.abs(row).argmax()), 3, 40))]
    return picked


@pytest.mark.parametrize("ablation, scale", [("zero", 0.0), ("mean", 0.5)])
def test_neuron_attribution_is_the_signals_derivative_along_its_ablation(
        tiny_model_dir, task_manager, tmp_path, ablation, scale):
    """At the clean run a neuron's estimate is (1 - s)·dS/dstep, its feature z moved
    to z + step·(t - z): t = 0 for zero ablation, its mean for mean ablation."""
    lm, measure = _setup(tiny_model_dir, task_manager, tmp_path if ablation == "mean"
                         else None, ablation=ablation, scale=scale)
    effects = measure.attribution((0.0,), kind="neurons")[TASK][0]
    width = lm.knockout.neurons_per_layer
    assert effects.shape == (lm.knockout.num_layers * width,) == (2 * 64,)
    means = _recorded_means(lm) if ablation == "mean" else None

    for neuron in _picked(effects, width):
        def along(step, n=neuron.neuron, layer=neuron.layer):
            def rewrite(z):
                target = 0.0 if means is None else means[layer][n]
                z[..., n] += step * (target - z[..., n])
                return z
            return rewrite
        derivative = _derivative(measure, neuron.layer, along)
        assert effects[neuron.layer * width + neuron.neuron] == pytest.approx(
            (1 - scale) * derivative, rel=1e-3, abs=1e-6), neuron
    assert np.abs(effects).max() > 1e-3  # neurons matter, so the comparison could fail


def test_a_layers_neurons_sum_to_the_derivative_along_the_whole_mlp(tiny_model_dir,
                                                                    task_manager):
    """The first-order estimate is linear: a layer's neurons' estimates add up to the
    signal's derivative as that whole MLP output moves towards zero."""
    lm, measure = _setup(tiny_model_dir, task_manager)
    effects = measure.attribution((0.0,), kind="neurons")[TASK][0]
    width = lm.knockout.neurons_per_layer
    for layer in (0, 1):
        derivative = _derivative(measure, layer, lambda step: lambda z: z * (1 - step))
        assert abs(derivative) > 1e-3  # so the comparison could fail
        assert effects[layer * width:(layer + 1) * width].sum() == pytest.approx(
            derivative, rel=1e-3, abs=1e-6)


def test_neuron_attribution_at_a_path_point_is_the_derivative_there(tiny_model_dir,
                                                                   task_manager):
    """At 0.5 every neuron is 0.5·z (zero ablation); neuron j's estimate is the signal's
    derivative as j alone moves on towards 0 there, j's factor 0.5 ∓ eps."""
    lm, measure = _setup(tiny_model_dir, task_manager)
    at, width = 0.5, lm.knockout.neurons_per_layer
    clean, effects = measure.attribution((0.0, at), kind="neurons")[TASK]

    def signal(neuron: Neuron, factor: float) -> float:
        def rewrite_for(layer):
            def rewrite(z):
                moved = z * (1 - at)
                if layer == neuron.layer:
                    moved[..., neuron.neuron] = z[..., neuron.neuron] * factor
                return moved
            return rewrite
        return _signal(measure, {layer: rewrite_for(layer) for layer in (0, 1)})

    for neuron in _picked(effects, width):
        derivative = (signal(neuron, 1 - at - EPS) - signal(neuron, 1 - at + EPS)) / (2 * EPS)
        assert effects[neuron.layer * width + neuron.neuron] == pytest.approx(
            derivative, rel=1e-3, abs=1e-6), neuron
    # The point matters: the estimates differ from the clean run's, so the test could fail.
    assert np.abs(effects - clean).max() > 1e-3


@pytest.mark.parametrize("ablation, family", [
    ("zero", "llama"), ("mean", "llama"), ("resample", "llama"),
    ("resample", "opt")])  # OPT's MLP sees its batch flattened
def test_estimate_is_the_knockouts_derivative_in_its_scale(tiny_model_dir, task_manager,
                                                           tmp_path, ablation, family):
    """A neuron knocked out at scale 1 - d moves by d·(t - z): its estimate is the
    measured knockout's derivative in d at 0, whatever t is (resample's donors too)."""
    lm, measure = _setup(tiny_model_dir, task_manager,
                         None if ablation == "zero" else tmp_path, family, ablation=ablation)
    effects = measure.attribution((0.0,), kind="neurons")[TASK][0]
    width = lm.knockout.neurons_per_layer
    for neuron in _picked(effects, width)[:3]:
        values = []
        for scale in (1 - EPS, 1 + EPS):
            with at_scale(lm, scale):
                values.append(measure.measure_with_model([neuron])[TASK].value)
        derivative = (values[0] - values[1]) / (2 * EPS)
        assert effects[neuron.layer * width + neuron.neuron] == pytest.approx(
            derivative, rel=1e-3, abs=1e-6), neuron
    assert np.abs(effects).max() > 1e-3


@pytest.mark.parametrize("ablation, kind, units", [
    ("mean", "neurons", "L0N*+L1N*"), ("resample", "neurons", "L0N*+L1N*"),
    ("resample", "heads", "L0H*+L1H*")])
def test_answers_at_a_path_point_are_every_unit_knocked_out_part_way(
        tiny_model_dir, task_manager, tmp_path, ablation, kind, units):
    """Every unit ``at`` of the way to its ablated value is every unit knocked out at
    scale 1 - at: the weights at a path point come from those answers (the donors and
    the neurons' means included)."""
    lm, measure = _setup(tiny_model_dir, task_manager, tmp_path, ablation=ablation)
    requests = measure.requests()
    with lm.knocking_out([]):
        at_point = _answers_at(lm, requests, 0.5, kind, 3)
    with at_scale(lm, 0.5):
        knocked = loglikelihoods_for_masks(lm, requests, [units], 4)[0]
    clean = loglikelihoods_for_masks(lm, requests, [[]], 4)[0]
    assert at_point.keys() == knocked.keys()
    for key, (value, _) in at_point.items():
        assert value == pytest.approx(knocked[key][0], abs=1e-9), key
    assert max(abs(value - clean[key][0]) for key, (value, _) in at_point.items()) > 1e-3


@pytest.mark.parametrize("ablation, scale", [("zero", 0.0), ("mean", 0.5)])
def test_integrated_gradients_sum_to_every_neurons_knockout(tiny_model_dir, task_manager,
                                                            tmp_path, ablation, scale):
    """``ig``'s estimates, the integrand averaged over the path's midpoints, add up over
    every neuron to the signal's change when every neuron is knocked out (up to the
    midpoint rule's error), which neither path point alone does."""
    assert PRIOR_POINTS["ig"] == (ig_points(IG_STEPS),) and len(ig_points()) == IG_STEPS
    lm, measure = _setup(tiny_model_dir, task_manager, tmp_path if ablation == "mean"
                         else None, ablation=ablation, scale=scale)
    means = _recorded_means(lm) if ablation == "mean" else None

    def knocked_out(layer):
        def rewrite(z):
            target = 0.0 if means is None else means[layer]
            return target + scale * (z - target)
        return rewrite

    change = _signal(measure, {layer: knocked_out(layer) for layer in (0, 1)}) \
        - _signal(measure, {})
    assert abs(change) > 1e-2
    integrated = measure.attribution(PRIOR_POINTS["ig"], kind="neurons")[TASK]
    assert integrated.shape == (1, 2 * 64)
    assert integrated.sum() == pytest.approx(change, rel=1e-3)
    clean = measure.attribution((0.0,), kind="neurons")[TASK]
    # The clean run's first-order sum is off by a few % (so the test could fail).
    assert abs(clean.sum() - change) > 1e-2 * abs(change)
    # One row, the mean of the points' own rows.
    points = ig_points(2)
    np.testing.assert_allclose(measure.attribution((points,), kind="neurons")[TASK][0],
                               measure.attribution(points, kind="neurons")[TASK].mean(0),
                               rtol=1e-12, atol=1e-15)


def test_heads_are_the_default_kind_and_a_bad_kind_is_refused(tiny_model_dir, task_manager):
    lm, measure = _setup(tiny_model_dir, task_manager)
    default = measure.attribution((0.0, 0.5))[TASK]
    heads = measure.attribution((0.0, 0.5), kind="heads")[TASK]
    assert default.shape == (2, 8)
    assert np.array_equal(default, heads)
    neurons = measure.attribution((0.0,), kind="neurons")[TASK]
    assert neurons.shape == (1, 2 * 64)
    with raises_naming(ValueError, "kind='mlp'", "heads, neurons"):
        measured_attribution(measure, kind="mlp")
    requests = measure.requests()
    with pytest.raises(ValueError, match=r"kind='mlp'"):
        attribution_effects(lm, requests, {}, kind="mlp")
    with pytest.raises(ValueError, match=r"kind='neuron'"):
        with path_point(lm, 0.5, kind="neuron"):
            pass


def test_ig_allowance_follows_its_steps():
    from lm_eval_headloc.measurement.attribution import IG_STEPS, PRIOR_POINTS
    from lm_eval_headloc.method.budget import PRIOR_ALLOWANCE

    assert PRIOR_ALLOWANCE["ig"] == PRIOR_ALLOWANCE["atp"] * IG_STEPS
    assert len(PRIOR_POINTS["ig"][0]) == IG_STEPS
