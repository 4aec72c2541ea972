"""Interventions are values scoped to a pass: nothing stays switched on after one.

Reference answers come from independent copies of the model whose output-projection
columns were zeroed by hand and that are evaluated by lm-eval's plain ``hf`` model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import load_lm, per_sample_loglikelihoods, simple_evaluate
from transformers import AutoModelForCausalLM

from lm_eval_headloc.intervention.multimask import loglikelihoods_for_masks

HEAD_DIM = 8  # the tiny models: hidden 32, 4 heads


def _hand_zeroed(folder, heads: list[tuple[int, int]]):
    from lm_eval.models.huggingface import HFLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        for layer, head in heads:
            o_proj = model.model.layers[layer].self_attn.o_proj
            o_proj.weight[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0
    return HFLM(pretrained=model, tokenizer=str(folder), device="cpu", batch_size=4)


def _hooks_idle(lm) -> bool:
    return lm.knockout.active is None


def test_passes_with_different_interventions_leave_nothing_behind(tiny_model_dir):
    folder = tiny_model_dir("llama")
    truth = {name: per_sample_loglikelihoods(simple_evaluate(model=_hand_zeroed(folder, h)))
             for name, h in {"": [], "L0H1": [(0, 1)], "L1H2+L0H3": [(1, 2), (0, 3)]}.items()}
    assert truth["L0H1"] != pytest.approx(truth[""], abs=1e-5)  # so the test could fail

    lm = load_lm(folder)
    plain_first = per_sample_loglikelihoods(simple_evaluate(model=lm))
    assert plain_first == pytest.approx(truth[""], abs=1e-6)
    for spec in ["L0H1", "L1H2+L0H3", "L0H1"]:
        with lm.knocking_out(spec):
            ablated = per_sample_loglikelihoods(simple_evaluate(model=lm))
        assert ablated == pytest.approx(truth[spec], abs=1e-6), spec
        assert _hooks_idle(lm) and lm.knocked_out == ()
        # A plain lm-eval call right after: the model as loaded.
        plain = per_sample_loglikelihoods(simple_evaluate(model=lm))
        assert plain == pytest.approx(truth[""], abs=1e-6), spec


def test_several_masks_per_pass_then_plain_and_a_failure_inside(tiny_model_dir):
    folder = tiny_model_dir("llama")
    lm = load_lm(folder)
    requests = [("The cat sat on the", " mat"), ("Mary gave John a", " drink")]

    def one(model, heads):
        ids = torch.tensor([model.tok_encode("".join(requests[0]))])
        with torch.no_grad():
            return model._model_call(ids)

    expected = {spec: one(_hand_zeroed(folder, h), []) for spec, h in
                {"": [], "L1H0": [(1, 0)]}.items()}
    masks = [["L1H0"], [], ["L0H2", "L1H1"]]
    answers = loglikelihoods_for_masks(lm, requests, masks)
    assert answers[0] != answers[1]
    assert _hooks_idle(lm)
    torch.testing.assert_close(one(lm, []), expected[""])
    # A pass that fails half-way leaves the hooks idle too.
    with pytest.raises(RuntimeError, match="per-row masks for 3 rows"), \
            lm.knocking_out(row_masks=torch.ones(3, 8, dtype=torch.bool)):
        one(lm, [])
    assert _hooks_idle(lm)
    torch.testing.assert_close(one(lm, []), expected[""])
    # set_heads is the model's own standing choice, applied at each pass.
    lm.set_heads("L1H0")
    torch.testing.assert_close(one(lm, []), expected["L1H0"])
    assert _hooks_idle(lm)
    with lm.knocking_out([]):
        torch.testing.assert_close(one(lm, []), expected[""])
    torch.testing.assert_close(one(lm, []), expected["L1H0"])
    # The bare model, outside any pass, is as loaded whatever the lm-eval model holds.
    ids = torch.tensor([lm.tok_encode("".join(requests[0]))])
    with torch.no_grad():
        torch.testing.assert_close(lm.model(ids).logits, expected[""])
