"""Attribution patching against a finite difference of the measured logprob signal."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import load_lm

from lm_eval_headloc.heads import Head
from lm_eval_headloc.measure import HarnessMeasurement
from lm_eval_headloc.multimask import loglikelihoods_for_masks
from lm_eval_headloc.prior import attribution_effects
from lm_eval_headloc.signals import signal_weights


def scaled_head(lm, head: Head, factor: float):
    """A hook, independent of ours, that multiplies one head's slice by ``factor``."""
    module = lm.knockout.modules[head.layer]
    d = lm.knockout.head_dim

    def scale(_module, args):
        z = args[0].clone()
        z[..., head.head * d:(head.head + 1) * d] *= factor
        return (z, *args[1:])

    return module.register_forward_pre_hook(scale)


@pytest.mark.parametrize("family, task", [("llama", "tiny_copy"), ("llama", "tiny_choice"),
                                          ("gpt2", "tiny_choice")])
def test_attribution_is_the_signals_derivative_along_each_head(tiny_model_dir, task_manager,
                                                               family, task):
    lm = load_lm(tiny_model_dir(family), dtype="float64", softmax_dtype="float64")
    measure = HarnessMeasurement(lm, [(task, None)], {task: task_manager.load([task])},
                                 num_samples=None, signal="logprob")
    requests = measure._recorded()
    answers = loglikelihoods_for_masks(lm, requests, [[]])[0]
    weights = signal_weights(measure._golds, answers, measure.leaves_of[task])
    effects = attribution_effects(lm, requests, weights, batch_size=3)
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


def test_the_prior_is_of_the_unablated_model_whatever_was_measured_last(tiny_model_dir,
                                                                       task_manager):
    """A run computes its prior after the pilot's half-heads floor mask: that mask must
    not stay in place (a resumed run, which skipped it, got another prior)."""
    lm = load_lm(tiny_model_dir("llama"), dtype="float64", softmax_dtype="float64")
    measure = HarnessMeasurement(lm, [("tiny_choice", None)],
                                 {"tiny_choice": task_manager.load(["tiny_choice"])},
                                 num_samples=None, signal="metric")
    fresh = measure.attribution()["tiny_choice"]
    half = [Head(0, 0), Head(0, 3), Head(1, 1), Head(1, 2)]
    measure.measure_with_model(half)  # the metric path leaves the mask set on the model
    assert lm.knockout.heads  # so the check below could fail
    after = measure.attribution()["tiny_choice"]
    np.testing.assert_allclose(after, fresh, rtol=1e-9, atol=1e-12)
    torch.set_grad_enabled(True)
