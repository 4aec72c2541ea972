"""Each measurement's per-example values (``TaskScore.examples``, a record's ``examples``):
what its score is the mean of, derived here by hand from the model's own loglikelihoods,
for tasks, groups and tags, both signals and both measuring paths; none for a metric that is
not such a mean; the paired standard error of a change between two records; and records
written by ``run_plan`` and read back from a run folder."""

from __future__ import annotations

import json
import math
import pickle

import numpy as np
import pytest
from helpers import TASKS, Request, load_lm, tiny_task_docs

from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.measurement.measure import HarnessMeasurement
from lm_eval_headloc.measurement.metrics import TaskScore, mean_of_strata
from lm_eval_headloc.measurement.noise import change_se, paired_se
from lm_eval_headloc.measurement.store import MemoryStore, run_plan
from lm_eval_headloc.tasks import make_task_manager

MASKS = [[], parse_heads("L0H1", 2, 4), parse_heads("L0H0+L1H2+L1H3", 2, 4)]


@pytest.fixture(scope="module")
def lm(tiny_model_dir):
    return load_lm(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """Groups of tiny_copy and tiny_choice (6 and 4 documents at num_samples=6): lm-eval's
    own row weighted by size, its row unweighted, and no row of its own (our mean)."""
    folder = tmp_path_factory.mktemp("groups")
    for name, aggregate in (("pair_sized", "weight_by_size: true"),
                            ("pair_even", "weight_by_size: false"), ("pair_plain", None)):
        text = f"group: {name}\ntask: [tiny_copy, tiny_choice]\n"
        if aggregate:
            text += f"aggregate_metric_list:\n  - metric: acc\n    {aggregate}\n"
        (folder / f"{name}.yaml").write_text(text)
    return make_task_manager([TASKS, str(folder)])


def measurement(manager, lm, tasks, signal="metric", num_samples=6):
    return HarnessMeasurement(lm, [(t, None) for t in tasks],
                              {t: manager.load([t]) for t in tasks},
                              num_samples=num_samples, seed=0, signal=signal)


def hflm_answers(lm, heads, pairs):
    """HFLM's own (loglikelihood, is_greedy) answers, ``heads`` knocked out."""
    lm.set_heads(heads)
    try:
        return lm.loglikelihood([Request(p) for p in pairs], disable_tqdm=True)
    finally:
        lm.set_heads([])


def acc_by_hand(lm, task, heads, indices):
    """Each document's acc, in document order, from the YAMLs: tiny_copy's is whether its
    target is the greedy continuation; tiny_choice's whether its answer has the largest
    loglikelihood of the choices (after lm-eval's " " target delimiter)."""
    docs = [tiny_task_docs(task)[i] for i in sorted(indices)]
    if task == "tiny_copy":
        return [float(greedy) for _, greedy in
                hflm_answers(lm, heads, [(d["context"], d["target"]) for d in docs])]
    values = []
    for doc in docs:
        lls = [ll for ll, _ in hflm_answers(lm, heads, [(doc["question"], " " + c)
                                                        for c in doc["choices"]])]
        values.append(float(int(np.argmax(lls)) == doc["answer"]))
    return values


def logprob_by_hand(lm, task, heads):
    """Each document's gold log-likelihood (every document, in order): tiny_choice's gold
    choice's log-softmax over its choices, tiny_copy's target's log-likelihood."""
    docs = tiny_task_docs(task)
    if task == "tiny_copy":
        return [ll for ll, _ in hflm_answers(lm, heads, [(d["context"], d["target"])
                                                          for d in docs])]
    values = []
    for doc in docs:
        lls = [ll for ll, _ in hflm_answers(lm, heads, [(doc["question"], " " + c)
                                                        for c in doc["choices"]])]
        values.append(lls[doc["answer"]] - math.log(sum(math.exp(v) for v in lls)))
    return values


def test_metric_examples_are_each_documents_value_by_hand(task_manager, lm):
    tasks = ["tiny_copy", "tiny_choice", "tiny_copy_ppl"]
    measure = measurement(task_manager, lm, tasks)
    assert measure.scored_positions  # measure_many answers through multimask
    several = measure.measure_many(MASKS, masks_per_pass=2)
    with_model = [measure.measure_with_model(heads) for heads in MASKS]  # HFLM's own path
    seen = set()
    for heads, scores, hflm in zip(MASKS, several, with_model, strict=True):
        for task in ("tiny_copy", "tiny_choice"):
            expected = acc_by_hand(lm, task, heads, measure.subset[task])
            assert len(expected) == measure.examples_used[task]
            for score in (scores[task], hflm[task]):
                assert score.examples == (tuple(expected),)
                assert mean_of_strata(score.examples) == pytest.approx(score.value, abs=1e-12)
            seen.update(expected)
        # Perplexity is exp(-mean loglikelihood), not the mean of anything per document.
        assert scores["tiny_copy_ppl"].examples is None and hflm["tiny_copy_ppl"].examples is None
    assert seen == {0.0, 1.0}  # the by-hand values are not all alike
    # TaskScore travels to and from Ray workers pickled: the examples with it.
    assert pickle.loads(pickle.dumps(several[2])) == several[2]


def test_a_generation_tasks_examples_are_hflms_own_per_document(task_manager, lm):
    measure = measurement(task_manager, lm, ["tiny_generate"], num_samples=8)
    assert measure.generates_together  # measure_many shares generate calls (multigen)
    several = measure.measure_many(MASKS, masks_per_pass=3)
    for heads, scores in zip(MASKS, several, strict=True):
        score = scores["tiny_generate"]
        assert score.metric == "exact_match,none" and len(score.examples[0]) == 8
        assert mean_of_strata(score.examples) == pytest.approx(score.value, abs=1e-12)
        # HFLM generating alone, one mask at a time, gives each document the same value.
        assert measure.measure_with_model(heads)["tiny_generate"].examples == score.examples


@pytest.mark.parametrize("task", ["tiny_choice", "tiny_copy"])
def test_logprob_examples_are_each_documents_gold_loglikelihood(task_manager, lm, task):
    measure = measurement(task_manager, lm, [task], signal="logprob", num_samples=None)
    several = measure.measure_many(MASKS, masks_per_pass=3)
    for heads, scores in zip(MASKS, several, strict=True):
        score = scores[task]
        (values,) = score.examples
        assert values == pytest.approx(logprob_by_hand(lm, task, heads), abs=1e-4)
        assert mean_of_strata(score.examples) == pytest.approx(score.value, abs=1e-12)
    assert measure.measure_with_model(MASKS[2])[task].examples[0] == pytest.approx(
        several[2][task].examples[0], abs=1e-4)


def test_a_groups_examples_follow_how_its_score_averages_its_tasks(groups, lm):
    leaves = ["tiny_copy", "tiny_choice"]
    names = ["pair_sized", "pair_even", "pair_plain"]
    measure = measurement(groups, lm, [*leaves, *names])
    assert measure.examples_used == {"tiny_copy": 6, "tiny_choice": 4}
    for heads in MASKS:
        scores = measure(heads)
        own = [scores[leaf].examples[0] for leaf in leaves]
        # Weighted by size: lm-eval's mean over all 10 documents, one stratum.
        assert scores["pair_sized"].examples == (own[0] + own[1],)
        assert scores["pair_sized"].value == pytest.approx(np.mean(own[0] + own[1]), abs=1e-12)
        # Unweighted, and a group without a row of its own (the mean of its tasks' scores):
        # one stratum per task, the mean of their means.
        for name in ("pair_even", "pair_plain"):
            assert scores[name].examples == tuple(own)
            assert scores[name].value == pytest.approx(
                (np.mean(own[0]) + np.mean(own[1])) / 2, abs=1e-12)
        assert scores["pair_plain"].subtasks == tuple(leaves)
        assert scores["pair_sized"].subtasks == scores["pair_even"].subtasks == ()


def test_a_tags_examples_are_one_stratum_per_task(task_manager, lm):
    # headloc: a tag of the three headloc_* tasks, its score the mean of theirs.
    measure = measurement(task_manager, lm, ["headloc"], num_samples=3)
    alone = measurement(task_manager, lm, list(measure.leaves_of["headloc"]), num_samples=3)
    for heads in MASKS[:2]:
        score, each = measure(heads)["headloc"], alone(heads)
        assert score.subtasks == tuple(sorted(each))
        assert score.examples == tuple(each[t].examples[0] for t in score.subtasks)
        assert [len(s) for s in score.examples] == [3, 3, 3]
        assert mean_of_strata(score.examples) == pytest.approx(score.value, abs=1e-12)


def test_records_carry_examples_last_and_a_folder_keeps_them(task_manager, lm, tmp_path):
    from lm_eval_headloc.runs.folder import RunFolder

    measure = measurement(task_manager, lm, ["tiny_choice", "tiny_copy_ppl"])
    plan = [("baseline", []), ("a", MASKS[2]), ("b", MASKS[1]), ("twin", MASKS[2])]
    (tmp_path / "run").mkdir()
    with RunFolder(tmp_path / "run") as folder:
        written = run_plan(folder, measure, plan, "test", progress=False, masks_per_pass=2)
        on_disk = {r["key"]: r for r in folder.measurements()}
    in_memory = run_plan(MemoryStore(), measure, plan, "test", progress=False)
    lines = [json.loads(x) for x in (tmp_path / "run" / "measurements.jsonl").read_text()
             .splitlines()]
    assert [r["key"] for r in lines] == ["baseline", "a", "b", "twin"]
    for record in lines[:3]:
        assert list(record) == ["key", "mask", "num_knocked_out", "scores", "metrics",
                                "higher_is_better", "seconds", "logprob", "examples"]
        # Only the task with per-example values: tiny_copy_ppl's perplexity has none.
        assert list(record["examples"]) == ["tiny_choice"]
        (stratum,) = record["examples"]["tiny_choice"]
        assert isinstance(stratum, list) and len(stratum) == 4
        assert np.mean(stratum) == pytest.approx(record["scores"]["tiny_choice"], abs=1e-12)
    assert lines[3]["same_as"] == "a" and lines[3]["examples"] == lines[1]["examples"]
    assert {k: r["examples"] for k, r in on_disk.items()} == \
        {k: r["examples"] for k, r in written.items()} == \
        {k: r["examples"] for k, r in in_memory.items()}
    # The change's paired standard error, from two records read back.
    se = change_se(on_disk["a"], on_disk["baseline"], "tiny_choice")
    diffs = np.subtract(on_disk["a"]["examples"]["tiny_choice"][0],
                        on_disk["baseline"]["examples"]["tiny_choice"][0])
    assert se == pytest.approx(np.std(diffs, ddof=1) / math.sqrt(4), abs=1e-12)
    assert change_se(on_disk["a"], on_disk["baseline"], "tiny_copy_ppl") is None


def test_a_logprob_record_holds_each_documents_value(task_manager, lm):
    measure = measurement(task_manager, lm, ["tiny_copy", "tiny_choice"], signal="logprob")
    records = run_plan(MemoryStore(), measure, [("baseline", []), ("a", MASKS[1])], "test",
                       progress=False)
    for record in records.values():
        assert "logprob" not in record  # the score itself is the logprob
        assert list(record)[-1] == "examples"
        for task, (stratum,) in record["examples"].items():
            assert len(stratum) == measure.examples_used[task]
            assert np.mean(stratum) == pytest.approx(record["scores"][task], abs=1e-12)
    assert change_se(records["a"], records["baseline"], "tiny_copy") > 0


def test_no_record_examples_key_where_no_task_has_any(task_manager, lm):
    measure = measurement(task_manager, lm, ["tiny_copy_ppl"])
    (record,) = run_plan(MemoryStore(), measure, [("baseline", [])], "test",
                         progress=False).values()
    assert "examples" not in record


def test_paired_se_by_hand():
    a = [[1.0, 0.0, 1.0], [0.2, 0.4, 0.9, 0.1, 0.5]]
    b = [[0.0, 0.0, 1.0], [0.1, 0.6, 0.3, 0.1, 0.2]]
    d = [np.subtract(x, y) for x, y in zip(a, b, strict=True)]
    expected = math.sqrt(np.var(d[0], ddof=1) / 3 + np.var(d[1], ddof=1) / 5) / 2
    assert paired_se(a, b) == pytest.approx(expected, rel=1e-12)
    # One stratum: the usual standard error of a mean difference.
    assert paired_se(a[1:], b[1:]) == pytest.approx(np.std(d[1], ddof=1) / math.sqrt(5),
                                                    rel=1e-12)
    # A stratum of one example adds nothing, but still counts as a stratum.
    assert paired_se([[3.0], *a[1:]], [[1.0], *b[1:]]) == pytest.approx(
        np.std(d[1], ddof=1) / math.sqrt(5) / 2, rel=1e-12)
    assert paired_se(a, a) == 0.0
    # Not the same examples, or none: no standard error.
    for other in (b[:1], [b[0], b[1][:4]], [b[1], b[0]], None, []):
        assert paired_se(a, other) is None and paired_se(other, a) is None
    assert paired_se([[1.0, None]], [[0.0, 1.0]]) is None  # a value written as null
    assert change_se({"examples": {"t": a}}, {"examples": {"t": b}}, "t") == paired_se(a, b)
    assert change_se({"examples": {"t": a}}, {"scores": {"t": 0.5}}, "t") is None


def test_task_score_examples_field_is_last_and_optional():
    score = TaskScore("t", "acc,none", 0.5, True)
    assert score.examples is None
    assert TaskScore("t", "acc,none", 0.5, True, (), None, ((1.0, 0.0),)).examples == (
        (1.0, 0.0),)
