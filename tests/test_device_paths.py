"""The code paths a GPU takes, on an imitated GPU (``fake_cuda.FakeCuda``): no host tensor
meets a device tensor, every measurement scores what the same model scores on the CPU, and
a loglikelihood measurement's forward passes never make the host wait for the GPU (it
waits once, for the answers, after the last pass)."""

from __future__ import annotations

import pytest
import torch
from fake_cuda import DEVICE, FakeCuda, on_device, on_fake_cuda, pinned
from helpers import load_lm

from lm_eval_headloc.intervention.multimask import LoglikelihoodRequests, loglikelihoods_for_masks
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS

REFERENCE = ["the cat sat on the mat", "Mary and John went to the store",
             "one two three four five"]
MASKS = [[], ["L0H1"], ["L1H0", "L0H2"], ["L1H*"]]
REQUESTS = [("The cat sat on", " the mat"), ("The cat sat on", " a hat"),
            ("one two three", " four"), ("Mary and John went to the store. John gave a",
                                         " drink to Mary"), ("x", " y z")]


@pytest.fixture(autouse=True)
def pinning_on_the_cpu(monkeypatch):
    """A CPU-only torch refuses to pin memory; ``fake_cuda.pinned`` stands in for it."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", pinned)


def measurement(manager, lm, task, **kwargs):
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    return HarnessMeasurement(lm, [(task, None)], {task: manager.load([task])},
                              num_samples=None, **kwargs)


def test_the_imitation_catches_what_cuda_would():
    """The checks below can fail: a host tensor meeting a device tensor raises, a read to
    the host or a blocking copy is a wait, a non-blocking copy from pinned memory is not."""
    with FakeCuda() as gpu:
        on = torch.ones(3, device="cuda")
        assert on_device(on) and on.device == DEVICE and on.is_cuda
        with pytest.raises(RuntimeError, match="same device"):
            on + torch.ones(3)
        assert on_device(on + torch.tensor(1.0))  # a 0-dim host tensor may meet it
        on.sum().item()
        on.cpu()
        torch.ones(3).to("cuda")
        torch.tensor([1, 2], device="cuda")
        torch.ones(3).pin_memory().to("cuda", non_blocking=True)  # no wait
        torch.tensor([], device="cuda")  # nothing copied: no wait
    assert [what for what, _ in gpu.waits] == [
        "to the host: item", "to the host: cpu", "to the device: a blocking copy",
        "to the device: torch.tensor from host data"]


@pytest.mark.parametrize("masks", [MASKS[1:2], MASKS], ids=["one mask", "four masks"])
def test_loglikelihood_passes_make_the_host_wait_only_for_the_answers(tiny_model_dir, masks):
    folder = tiny_model_dir("llama")
    on_cpu = loglikelihoods_for_masks(load_lm(folder), REQUESTS, masks, batch_size=4)
    lm = on_fake_cuda(load_lm(folder))
    rows = 2 * len(masks)  # two requests' rows per pass: three passes
    with FakeCuda() as gpu:
        requests = LoglikelihoodRequests(lm, REQUESTS)
        assert len(requests.batches(2)) == 3
        assert all(on_device(batch.input_ids) for batch in requests.batches(2))
        gpu.waits.clear()
        answers = loglikelihoods_for_masks(lm, requests, masks, batch_size=rows)
    # Two copies to the host (sums and greedy misses), after the last pass; none per pass,
    # per layer or per mask.
    assert [what for what, _ in gpu.waits] == ["to the host: cpu"] * 2, gpu.waits
    assert all(where.startswith("lm_eval_headloc/intervention/multimask.py")
               for _, where in gpu.waits)
    for got, want in zip(answers, on_cpu, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert got[key][0] == pytest.approx(want[key][0], abs=1e-5)
            assert got[key][1] == want[key][1]


def test_a_measurement_waits_as_often_with_one_row_per_pass_as_with_all(tiny_model_dir,
                                                                        task_manager):
    """A whole measurement (lm-eval scoring the answers too): the host's waits do not grow
    with the forward passes."""
    waits = {}
    for batch_size in (1, 16):
        lm = on_fake_cuda(load_lm(tiny_model_dir("llama"), batch_size=batch_size))
        with FakeCuda() as gpu:
            measure = measurement(task_manager, lm, "tiny_choice")
            measure.measure_many([[]])  # records the requests
            passes = len(measure.requests().batches(measure.resolved_batch_size()))
            gpu.waits.clear()
            measure.measure_many([["L0H1"], ["L1H2"]], masks_per_pass=1)
        waits[batch_size] = (passes, len(gpu.waits))
    assert waits[1][0] > waits[16][0] == 1  # one row per pass: several passes
    assert waits[1][1] == waits[16][1] == 4, waits  # two per mask, whatever the passes


def scores_on(lm, manager, task, masks, ablation="zero", signal="metric"):
    if ablation != "zero":
        lm.set_ablation(ablation, REFERENCE)
    measure = measurement(manager, lm, task, signal=signal)
    return [{name: (s.value, s.logprob) for name, s in scores.items()}
            for scores in measure.measure_many(masks, masks_per_pass=len(masks))]


@pytest.mark.parametrize("task,ablation,signal", [
    ("tiny_choice", "zero", "metric"), ("tiny_generate", "zero", "metric"),
    ("tiny_choice", "mean", "metric"), ("tiny_generate", "mean", "metric"),
    ("tiny_choice", "resample", "metric"), ("tiny_generate", "resample", "metric"),
    ("tiny_copy", "zero", "logprob")])
def test_measurements_on_the_gpu_score_as_on_the_cpu(tiny_model_dir, task_manager, task,
                                                     ablation, signal):
    folder = tiny_model_dir("llama")
    masks = [[], ["L0H1", "L1N3"], ["L1H0", "L0H2"]]
    want = scores_on(load_lm(folder), task_manager, task, masks, ablation, signal)
    lm = on_fake_cuda(load_lm(folder))
    with FakeCuda():
        got = scores_on(lm, task_manager, task, masks, ablation, signal)
    assert got == want  # the same CPU arithmetic: the same numbers


@pytest.mark.parametrize("ablation,kind,points", [
    ("zero", "heads", "atp"), ("mean", "neurons", "atp-path"), ("resample", "heads", "ig")])
def test_the_attribution_prior_on_the_gpu_estimates_as_on_the_cpu(tiny_model_dir,
                                                                  task_manager, ablation,
                                                                  kind, points):
    folder = tiny_model_dir("llama")

    def estimate(lm):
        if ablation != "zero":
            lm.set_ablation(ablation, REFERENCE)
        measure = measurement(task_manager, lm, "tiny_choice", signal="logprob")
        return measure.attribution(PRIOR_POINTS[points], kind=kind)["tiny_choice"]

    want = estimate(load_lm(folder))
    lm = on_fake_cuda(load_lm(folder))
    with FakeCuda():
        got = estimate(lm)
    assert got.shape == want.shape and abs(want).max() > 0
    assert got == pytest.approx(want, rel=1e-4, abs=1e-6)
