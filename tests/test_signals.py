"""The logprob signal against sums done by hand over HFLM's own loglikelihoods."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from helpers import TASKS, Request, load_lm, tiny_task_docs

from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.measurement.measure import HarnessMeasurement


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_lm(tiny_model_dir("llama"))


def measurement(task_manager, lm, tasks, signal):
    return HarnessMeasurement(lm, [(t, None) for t in tasks],
                              {t: task_manager.load([t]) for t in tasks}, num_samples=None,
                              seed=0, signal=signal)


def hflm_loglikelihoods(lm, heads, pairs):
    """HFLM's own answers (its full-logits code path, not ours) with ``heads`` out."""
    lm.set_heads(heads)
    try:
        return [ll for ll, _ in lm.loglikelihood([Request(p) for p in pairs],
                                                 disable_tqdm=True)]
    finally:
        lm.set_heads([])


MASKS = [[], parse_heads("L0H1", 2, 4), parse_heads("L0H0+L1H2+L1H3", 2, 4)]


def by_hand(lm, task, heads):
    """The task's logprob signal, written out from its YAML and documents."""
    docs = tiny_task_docs(task)
    if task == "tiny_choice":  # target_delimiter " " before each choice; gold = answer
        values = []
        for doc in docs:
            lls = hflm_loglikelihoods(lm, heads, [(doc["question"], " " + c)
                                                  for c in doc["choices"]])
            gold = lls[doc["answer"]]
            values.append(gold - math.log(sum(math.exp(v) for v in lls)))
        return float(np.mean(values))
    # tiny_copy: the target's loglikelihood; tiny_generate: its reference answer, the
    # same target, teacher-forced after the generation prompt (no delimiter).
    return float(np.mean(hflm_loglikelihoods(lm, heads, [(d["context"], d["target"])
                                                          for d in docs])))


@pytest.mark.parametrize("task", ["tiny_copy", "tiny_choice", "tiny_generate"])
def test_logprob_signal_equals_the_gold_answers_loglikelihood_by_hand(task_manager, lm, task):
    measure = measurement(task_manager, lm, [task], "logprob")
    assert measure.scored_positions  # generation too: its reference answer is a request
    several = measure.measure_many(MASKS, masks_per_pass=2)
    for heads, scores in zip(MASKS, several, strict=True):
        score = scores[task]
        assert (score.metric, score.higher_is_better) == ("logprob", True)
        assert score.value == pytest.approx(by_hand(lm, task, heads), abs=1e-4)
    # The masks are not all alike, so the comparison above could have failed.
    assert len({round(s[task].value, 6) for s in several}) == len(MASKS)
    # HFLM answering the same requests itself gives the same signal.
    with_model = measure.measure_with_model(MASKS[2])[task].value
    assert with_model == pytest.approx(several[2][task].value, abs=1e-4)


def test_metric_signal_carries_the_logprob_of_the_same_answers(task_manager, lm):
    tasks = ["tiny_copy", "tiny_choice"]
    metric = measurement(task_manager, lm, tasks, "metric").measure_many(MASKS)
    logprob = measurement(task_manager, lm, tasks, "logprob").measure_many(MASKS)
    for with_metric, alone in zip(metric, logprob, strict=True):
        for task in tasks:
            assert with_metric[task].metric == "acc,none"
            assert with_metric[task].logprob == pytest.approx(alone[task].value, abs=1e-9)


def test_a_generation_task_measured_by_its_metric_has_no_free_logprob(task_manager, lm):
    measure = measurement(task_manager, lm, ["tiny_copy", "tiny_generate"], "metric")
    assert not measure.scored_positions
    scores = measure(MASKS[1])
    assert scores["tiny_generate"].metric == "exact_match,none"
    assert all(s.logprob is None for s in scores.values())


def test_signal_weights_are_the_signals_derivative():
    from lm_eval_headloc.measurement.signals import GoldAnswer, gold_logprob, signal_weights

    golds = [GoldAnswer("a", 0, (("c", " x"), ("c", " y"), ("c", " z")), (1,), True),
             GoldAnswer("a", 1, (("d", " x"), ("d", " y")), (0, 1), True),
             GoldAnswer("a", 2, (("e", " w"),), (0,), False),
             GoldAnswer("b", 0, (("f", " v"),), (0,), False)]
    answers = {("c", " x"): (-1.0, False), ("c", " y"): (-2.5, False),
               ("c", " z"): (-0.3, True), ("d", " x"): (-4.0, False),
               ("d", " y"): (-1.5, True), ("e", " w"): (-7.0, True), ("f", " v"): (-2.0, True)}
    weights = signal_weights(golds, answers, ["a"])
    assert ("f", " v") not in weights
    eps = 1e-6
    for key in answers:
        if key == ("f", " v"):
            continue
        up = {**answers, key: (answers[key][0] + eps, False)}
        down = {**answers, key: (answers[key][0] - eps, False)}
        numeric = (gold_logprob(golds, up, ["a"]) - gold_logprob(golds, down, ["a"])) / (2 * eps)
        assert weights[key] == pytest.approx(numeric, abs=1e-8)


def test_gold_logprobs_are_each_documents_and_gold_logprob_their_mean():
    from lm_eval_headloc.measurement.signals import GoldAnswer, gold_logprob, gold_logprobs

    golds = [GoldAnswer("b", 0, (("f", " v"),), (0,), False),
             GoldAnswer("a", 0, (("c", " x"), ("c", " y")), (1,), True),
             GoldAnswer("a", 1, (("e", " w"),), (0,), False)]
    answers = {("c", " x"): (-1.0, False), ("c", " y"): (-2.0, False),
               ("e", " w"): (-7.0, True), ("f", " v"): (-2.0, True)}
    # In golds' order, each its own: a choice's log-softmax, a target's log-likelihood.
    expected = [-2.0 - math.log(math.exp(-1.0) + math.exp(-2.0)), -7.0]
    assert gold_logprobs(golds, answers, ["a"]) == pytest.approx(expected, abs=1e-12)
    assert gold_logprobs(golds, answers, ["a", "b"])[0] == -2.0
    assert gold_logprob(golds, answers, ["a"]) == pytest.approx(np.mean(expected), abs=1e-12)
    with pytest.raises(ValueError, match="no documents recorded for c"):
        gold_logprobs(golds, answers, ["c"])


@pytest.mark.parametrize("prefix, delimited", [("Answer:", True), ("Answer: ", False),
                                               (None, False)])
def test_a_chat_prompts_gold_answer_is_delimited_as_lm_evals_own_answers(
        tiny_model_dir, tmp_path, prefix, delimited):
    """Under the chat template lm-eval puts the target delimiter before an answer only
    after a gen_prefix that does not end in whitespace ("Answer: 4"): its multiple-choice
    requests, built from the same YAML lines, are the reference for the generation task's
    teacher-forced gold answer."""
    from helpers import with_chat_template

    from lm_eval_headloc.tasks import make_task_manager

    model = with_chat_template(tiny_model_dir("llama"), tmp_path / "chat")
    folder = tmp_path / "tasks"
    folder.mkdir()
    lines = ['target_delimiter: " "'] + ([f'gen_prefix: "{prefix}"'] if prefix else [])
    # Answers without their own leading space, so the delimiter is all that may add one.
    for name, base, answers in (
            ("prefixed_generate", "tiny_generate", 'doc_to_target: "{{target | trim}}"'),
            ("prefixed_choice", "tiny_choice",
             "doc_to_choice: \"{{choices | map('trim') | list}}\"")):
        (folder / f"{name}.yaml").write_text("\n".join(
            [f"include: {Path(TASKS) / base / (base + '.yaml')}", f"task: {name}", answers,
             *lines]) + "\n")
    manager = make_task_manager([TASKS, str(folder)])
    lm = load_lm(model)
    requests = {}
    for name in ("prefixed_generate", "prefixed_choice"):
        measure = HarnessMeasurement(lm, [(name, None)], {name: manager.load([name])},
                                     num_samples=2, apply_chat_template=True,
                                     signal="logprob")
        requests[name] = [r for gold in measure.gold_answers() for r in gold.requests]
    # lm-eval's own choices, then our gold answers: delimited alike.
    assert {cont.startswith(" ") for _, cont in requests["prefixed_choice"]} == {delimited}
    assert {cont.startswith(" ") for _, cont in requests["prefixed_generate"]} == {delimited}
    assert all(not cont.startswith("  ") for _, cont in requests["prefixed_generate"])
    if prefix:
        assert all(context.endswith(prefix) for context, _ in requests["prefixed_generate"])
