"""Several masks per forward pass give the same answers and scores as one at a time."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ARCHITECTURES

from lm_eval_headloc import driver
from lm_eval_headloc.heads import parse_heads
from lm_eval_headloc.multimask import RecordingLM, logits_only_at, loglikelihoods_for_masks

TASKS = str(Path(__file__).parent / "tasks")
MASKS = ["L0H1", "", "L0H0+L1H3", "L1H*", "L0H2+L1H1", "L0H3"]


@pytest.fixture(scope="module")
def measurement(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    setup = driver.prepare(f"pretrained={folder},dtype=float32,device=cpu",
                           ["tiny_copy_ppl", "tiny_choice"], [TASKS])
    lm = driver.load_model(setup, batch_size=4)
    return driver.open_measurement(setup, lm, num_samples=10, seed=0,
                                   apply_chat_template=None, confirm_run_unsafe_code=False)


def test_answers_equal_hflm_one_mask_at_a_time(measurement):
    lm = measurement.lm
    recorder = RecordingLM(lm)
    measurement.evaluate([], model=recorder)
    requests = recorder.requests
    assert len(requests) == 4 * 2 + 10  # tiny_choice: 4 docs x 2 choices; tiny_copy: 10
    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    together = loglikelihoods_for_masks(lm, requests, masks, batch_size=8)

    class Request:
        def __init__(self, args):
            self.args = args

    for heads, answers in zip(masks, together, strict=True):
        lm.set_heads(heads)
        alone = lm.loglikelihood([Request(r) for r in requests], disable_tqdm=True)
        for request, (logprob, greedy) in zip(requests, alone, strict=True):
            assert answers[request][0] == pytest.approx(logprob, abs=1e-4)
            assert answers[request][1] == greedy


@pytest.mark.parametrize("per_pass", [1, 2, 4, 6])
def test_scores_equal_the_model_answering_lm_eval_itself(measurement, per_pass):
    masks = [parse_heads(m, 2, 4) if m else [] for m in MASKS]
    one_by_one = [measurement.measure_with_model(heads) for heads in masks]
    batched = measurement.measure_many(masks, masks_per_pass=per_pass)
    for alone, together in zip(one_by_one, batched, strict=True):
        for task in alone:
            assert together[task].value == pytest.approx(alone[task].value, rel=1e-5)
    # The masks matter (the comparison could fail): some score moves off the baseline.
    values = [tuple(s[t].value for t in sorted(s)) for s in one_by_one]
    assert any(v != values[1] for v in values)  # MASKS[1] knocks out nothing


def test_locate_with_masks_per_pass_equals_one_at_a_time(tiny_model_dir, tmp_path):
    import json

    from lm_eval_headloc.cli import main

    args = ["locate", "--model-args", f"pretrained={tiny_model_dir('llama')},dtype=float32",
            "--include-path", TASKS, "--tasks", "tiny_copy_ppl", "--masks", "9",
            "--sparsity", "0.25", "--num-samples", "6", "--batch-size", "4"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--masks-per-pass", "4", "--out", str(tmp_path / "four")]) == 0
    one, four = ([json.loads(x) for x in (tmp_path / d / "measurements.jsonl").read_text()
                  .splitlines()] for d in ("one", "four"))
    assert [r["mask"] for r in one] == [r["mask"] for r in four]
    for a, b in zip(one, four, strict=True):
        assert b["scores"]["tiny_copy_ppl"] == pytest.approx(a["scores"]["tiny_copy_ppl"],
                                                             rel=1e-5)


def test_greedy_with_masks_per_pass_equals_one_at_a_time(tiny_model_dir, tmp_path):
    import json

    from lm_eval_headloc.cli import main

    args = ["greedy", "--model-args", f"pretrained={tiny_model_dir('gpt2')},dtype=float32",
            "--include-path", TASKS, "--tasks", "tiny_copy", "--num-samples", "6",
            "--batch-size", "4", "--top-k", "2"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    assert main([*args, "--masks-per-pass", "3", "--out", str(tmp_path / "three")]) == 0
    one, three = ([json.loads(x) for x in (tmp_path / d / "measurements.jsonl").read_text()
                   .splitlines()] for d in ("one", "three"))
    assert len(one) == len(three) == 1 + 8
    for a, b in zip(one, three, strict=True):
        assert b["mask"] == a["mask"]
        assert b["scores"]["tiny_copy"] == pytest.approx(a["scores"]["tiny_copy"], rel=1e-5)


def test_each_task_subset_ignores_the_other_tasks():
    from lm_eval_headloc.measure import choose_subset

    alone = choose_subset({"b": 50}, 10, 0)["b"]
    assert choose_subset({"a": 50, "b": 50}, 10, 0)["b"] == alone
    assert choose_subset({"b": 50}, 10, 1)["b"] != alone


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_logits_only_at_scored_positions_equal_full_logits(tiny_model_dir, family):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(family), dtype=torch.float32)
    model.eval()
    batch = torch.randint(3, 300, (3, 7))
    rows = torch.tensor([0, 0, 1, 2, 2, 2])
    positions = torch.tensor([5, 6, 0, 2, 3, 6])
    with torch.no_grad():
        full = model(batch).logits
        with logits_only_at(model, rows, positions):
            narrow = model(batch).logits
    assert narrow.shape == (1, len(rows), full.shape[-1])  # only the scored positions
    torch.testing.assert_close(narrow[0], full[rows, positions], rtol=1e-5, atol=1e-5)


def test_masks_per_pass_grow_with_free_memory_and_shrink_with_the_model():
    from transformers import LlamaConfig

    from lm_eval_headloc.driver import masks_per_pass_for_memory

    small = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152)
    large = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    gib = 2**30
    assert masks_per_pass_for_memory(0, 32, small) == 1  # never zero
    assert masks_per_pass_for_memory(1000 * gib, 32, small) == 64  # capped
    few, many = (masks_per_pass_for_memory(m * gib, 32, small) for m in (8, 64))
    assert 1 <= few < many <= 64
    assert masks_per_pass_for_memory(64 * gib, 32, large) < many
    assert masks_per_pass_for_memory(64 * gib, 8, small) > many or many == 64


def test_seq2seq_models_answer_through_hflm(measurement, monkeypatch):
    import lm_eval_headloc.multimask as multimask

    def refuse(*args, **kwargs):
        raise AssertionError("multimask builds decoder-only inputs")

    monkeypatch.setattr(multimask, "loglikelihoods_for_masks", refuse)
    monkeypatch.setattr(measurement, "measure_with_model", lambda heads: {"hflm": heads})
    monkeypatch.setattr(measurement.lm, "backend", "seq2seq")
    masks = [parse_heads("L0H1", 2, 4), []]
    assert measurement.measure_many(masks, masks_per_pass=2) == [{"hflm": m} for m in masks]
    monkeypatch.setattr(measurement.lm, "backend", "causal")
    with pytest.raises(AssertionError, match="decoder-only"):
        measurement.measure_many(masks, masks_per_pass=2)


def test_requests_are_tokenized_once_per_measurement_run(measurement, monkeypatch):
    masks = [parse_heads("L0H1", 2, 4), []]
    first = measurement.measure_many(masks)  # records and tokenizes on first use
    calls = []
    encode = measurement.lm._encode_pair
    monkeypatch.setattr(measurement.lm, "_encode_pair",
                        lambda *args: calls.append(args) or encode(*args))
    again = measurement.measure_many(masks, masks_per_pass=2)
    assert calls == []
    assert [s["tiny_choice"].value for s in again] == [s["tiny_choice"].value for s in first]
