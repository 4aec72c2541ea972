"""Picking the one number a task is measured by from lm-eval's results."""

from pathlib import Path

import pytest
from helpers import raises_naming

from lm_eval_headloc.measurement.metrics import (
    TASK_METRICS,
    MetricError,
    metrics_of_task,
    parse_task_metric,
    task_score,
)

# Shaped like simple_evaluate's return value (only the keys we read).
RESULTS = {
    "results": {
        "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.30,
                  "exact_match_stderr,strict-match": 0.01,
                  "exact_match,flexible-extract": 0.42,
                  "exact_match_stderr,flexible-extract": 0.01},
        "arithmetic_1dc": {"alias": "arithmetic_1dc", "acc,none": 0.2},
        "arithmetic_2da": {"alias": "arithmetic_2da", "acc,none": 0.6},
        "mmlu": {"alias": "mmlu", "acc,none": 0.55, "acc_stderr,none": 0.01},
        "mmlu_a": {"alias": " - a", "acc,none": 0.9},
        "mmlu_b": {"alias": " - b", "acc,none": 0.1},
        "mygroup": {"alias": "mygroup"},
        "sub1": {"alias": " - sub1", "f1,none": 0.5, "perplexity,none": 12.0},
        "sub2": {"alias": " - sub2", "f1,none": 0.7, "perplexity,none": 8.0},
        "custom": {"alias": "custom", "brier_score,none": 0.3, "acc,none": 0.6},
    },
    "group_subtasks": {"mmlu": ["mmlu_a", "mmlu_b"], "mygroup": ["sub1", "sub2"]},
    "configs": {"arithmetic_1dc": {"tag": ["arithmetic"]},
                "arithmetic_2da": {"tag": "arithmetic"}, "gsm8k": {}},
    "higher_is_better": {"custom": {"brier_score": False, "acc": True},
                         "sub1": {"f1": True, "perplexity": False},
                         "sub2": {"f1": True, "perplexity": False}},
}


def test_table_choices_for_builtins():
    score = task_score(RESULTS, "gsm8k")
    assert (score.metric, score.value, score.higher_is_better) == (
        "exact_match,flexible-extract", 0.42, True)
    assert TASK_METRICS["hellaswag"][0] == "acc_norm,none"
    assert TASK_METRICS["mbpp"][0] == "pass_at_1,none"


def test_tag_is_the_mean_over_its_tasks():
    score = task_score(RESULTS, "arithmetic")
    assert score.value == pytest.approx(0.4)
    assert score.subtasks == ("arithmetic_1dc", "arithmetic_2da")


def test_group_uses_the_harness_aggregate_when_reported_else_the_mean():
    assert task_score(RESULTS, "mmlu").value == 0.55  # the harness's own group number
    mean = task_score(RESULTS, "mygroup")
    assert (mean.metric, mean.value, mean.subtasks) == ("f1,none", pytest.approx(0.6),
                                                        ("sub1", "sub2"))
    perplexity = task_score(RESULTS, "mygroup", "perplexity,none")
    assert perplexity.value == 10.0 and perplexity.higher_is_better is False


def test_a_metric_whose_direction_lm_eval_does_not_know_is_refused():
    """A YAML metric without higher_is_better (lm-eval records None) was taken as higher is
    better: a loss or an error rate ranked the heads whose knockout helps as the task's."""
    results = {"results": {"mine": {"alias": "mine", "err,none": 13.8}},
               "higher_is_better": {"mine": {"err": None}}}
    with raises_naming(MetricError, "'mine'", "'err'", "higher_is_better"):
        task_score(results, "mine")
    # Results that say nothing of the task (older or hand-made ones): higher, as before.
    assert task_score({"results": results["results"]}, "mine").higher_is_better is True


def test_unknown_task_falls_back_to_first_metric_and_harness_flag():
    score = task_score(RESULTS, "custom")
    assert (score.metric, score.higher_is_better) == ("brier_score,none", False)
    assert task_score(RESULTS, "custom", "acc,none").value == 0.6


def test_override_and_errors():
    assert parse_task_metric("gsm8k:exact_match,strict-match") == (
        "gsm8k", "exact_match,strict-match")
    assert parse_task_metric("boolq:acc") == ("boolq", "acc,none")
    assert parse_task_metric("boolq") == ("boolq", None)
    task, metric = parse_task_metric("gsm8k:exact_match,strict-match")
    assert task_score(RESULTS, task, metric).value == 0.30
    with raises_naming(MetricError, "gsm8k", "'acc,none'",
                       "exact_match,strict-match, exact_match,flexible-extract"):  # it has
        task_score(RESULTS, "gsm8k", "acc,none")
    with raises_naming(MetricError, "'nope'"):
        task_score(RESULTS, "nope")
    with raises_naming(MetricError, "'gsm8k:'", "TASK:METRIC"):
        parse_task_metric("gsm8k:")


@pytest.fixture(scope="module")
def manager():
    """lm-eval's task index with the test tasks and ours (building it takes seconds)."""
    from lm_eval_headloc.tasks import make_task_manager

    return make_task_manager([str(Path(__file__).parent / "tasks")])


def test_metrics_of_a_built_task(manager):
    from lm_eval.tasks import get_task_dict

    task = get_task_dict(["tiny_choice"], manager)["tiny_choice"]
    assert metrics_of_task(task) == ["acc,none"]


def test_table_metrics_of_our_tasks_are_what_their_yamls_report(manager):
    # Two sources: the table in metrics.py and the metric_list lm-eval reads from each
    # YAML in task_configs/ (a typo in either would measure nothing).
    from lm_eval.tasks import get_task_dict

    ours = [t for t in TASK_METRICS if t in ("swear", "rhyme", "rhyme_heldout")
            or t.startswith("headloc_")]
    assert len(ours) == 6
    tasks = get_task_dict(ours, manager)
    for name in ours:
        metric, higher_is_better = TASK_METRICS[name]
        assert metric in metrics_of_task(tasks[name]), name
        assert tasks[name].higher_is_better()[metric.split(",")[0]] is higher_is_better, name


def test_an_unknown_task_is_scored_by_its_yamls_first_metric_not_the_results_first():
    """lm-eval reports a loglikelihood task's perplexity before the acc its YAML lists
    first; the run names and scores acc (``default_metric``'s choice) either way."""
    results = {"results": {"kv": {"alias": "kv", "perplexity,none": 3.2,
                                  "perplexity_stderr,none": "N/A", "acc,none": 0.67,
                                  "acc_stderr,none": 0.05}},
               "higher_is_better": {"kv": {"perplexity": False, "acc": True}},
               "configs": {"kv": {"metric_list": [
                   {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                   {"metric": "perplexity", "aggregation": "perplexity"}]}}}
    score = task_score(results, "kv")
    assert (score.metric, score.value, score.higher_is_better) == ("acc,none", 0.67, True)
    del results["configs"]  # results that do not say: the first they report, as before
    assert task_score(results, "kv").metric == "perplexity,none"


# --- the per-example values a score is the mean of (TaskScore.examples) ------------------

def _sample(doc_id, flt="none", **metrics):
    return {"doc_id": doc_id, "filter": flt, "doc": {}, "target": "", **metrics}


def _with_samples():
    """RESULTS as ``evaluate(log_samples=True)`` gives them: each document's values."""
    import numpy as np

    samples = {
        # Out of document order, as lm-eval's ranks may gather them; numpy and bool values.
        "gsm8k": [_sample(2, "flexible-extract", exact_match=np.float64(0.1)),
                  _sample(0, "flexible-extract", exact_match=1.0),
                  _sample(1, "flexible-extract", exact_match=np.bool_(False)),
                  _sample(3, "flexible-extract", exact_match=True),
                  _sample(4, "flexible-extract", exact_match=0),
                  *(_sample(i, "strict-match", exact_match=float(i < 1)) for i in range(4)),
                  _sample(4, "strict-match", exact_match=0.5)],
        "arithmetic_1dc": [_sample(i, acc=float(i == 0)) for i in range(5)],
        "arithmetic_2da": [_sample(i, acc=float(i < 3)) for i in range(5)],
        "mmlu_a": [_sample(i, acc=float(i < 9)) for i in range(10)],
        "mmlu_b": [_sample(i, acc=float(i < 2)) for i in range(20)],
        # f1's and perplexity's per-document values: pairs and loglikelihoods.
        "sub1": [_sample(i, f1=("a", "b"), perplexity=-2.0) for i in range(2)],
        "sub2": [_sample(i, f1=("a", "a"), perplexity=-2.1) for i in range(2)],
        # brier_score: per-document values whose mean is not the reported 0.3.
        "custom": [_sample(i, brier_score=0.5, acc=float(i < 3)) for i in range(5)],
    }
    return {**RESULTS, "samples": samples}


def test_examples_are_each_documents_value_in_document_order():
    results = _with_samples()
    # flexible-extract's values, ordered by doc_id; numpy's and Python's bools are numbers.
    assert task_score(results, "gsm8k").examples == ((1.0, 0.0, 0.1, 1.0, 0.0),)  # 0.42
    # strict-match: 1, 0, 0, 0, 0.5 (mean 0.3) -- the other filter's samples are not mixed in.
    assert task_score(results, "gsm8k", "exact_match,strict-match").examples == (
        (1.0, 0.0, 0.0, 0.0, 0.5),)
    assert task_score(results, "custom", "acc,none").examples == ((1.0,) * 3 + (0.0,) * 2,)
    # A tag (the mean of its tasks' scores): one stratum per task, in its subtasks' order.
    tag = task_score(results, "arithmetic")
    assert tag.subtasks == ("arithmetic_1dc", "arithmetic_2da")
    assert tag.examples == ((1.0, 0.0, 0.0, 0.0, 0.0), (1.0, 1.0, 1.0, 0.0, 0.0))
    # Results without samples (log_samples=False) carry none, as before.
    assert task_score(RESULTS, "gsm8k").examples is None


def test_a_score_no_per_example_values_reproduce_has_none():
    results = _with_samples()
    # f1 (pairs per document) and perplexity (exp of minus the mean) are not such means.
    assert task_score(results, "mygroup").examples is None
    assert task_score(results, "mygroup", "perplexity,none").examples is None
    assert task_score(results, "sub1", "perplexity,none").examples is None
    # Numbers per document whose mean is not the reported score: none, never a guess.
    assert task_score(results, "custom").examples is None
    off = _with_samples()
    off["samples"]["gsm8k"][1]["exact_match"] = 1.0 + 1e-6  # the mean moves by 2e-7
    assert task_score(off, "gsm8k").examples is None
    off["samples"]["gsm8k"][1]["exact_match"] = 1.0 + 1e-9  # by 2e-10: the same number
    assert task_score(off, "gsm8k").examples is not None
    # A tag of a task that has none has none.
    off["samples"]["arithmetic_2da"][0]["acc"] = ("x", "y")
    assert task_score(off, "arithmetic").examples is None


def test_a_group_rows_examples_follow_its_weighting():
    from types import SimpleNamespace

    from lm_eval.config.group import AggMetricConfig

    results = _with_samples()
    leaves = [SimpleNamespace(task_name=name) for name in ("mmlu_a", "mmlu_b")]

    def group(**aggregate):
        return {"mmlu": SimpleNamespace(aggregate_metric_list=[AggMetricConfig(**aggregate)],
                                        get_all_tasks=lambda: leaves)}

    a, b = (results["samples"][leaf] for leaf in ("mmlu_a", "mmlu_b"))
    pooled = tuple(float(s["acc"]) for s in a + b)  # 11 of 30
    per_task = (tuple(float(s["acc"]) for s in a), tuple(float(s["acc"]) for s in b))
    results["results"]["mmlu"]["acc,none"] = 11 / 30  # as lm-eval weights by size
    assert task_score(results, "mmlu", groups=group(metric="acc")).examples == (pooled,)
    results["results"]["mmlu"]["acc,none"] = (0.9 + 0.1) / 2  # weight_by_size: false
    assert task_score(results, "mmlu", groups=group(
        metric="acc", weight_by_size=False)).examples == per_task
    # The weighting said does not give the row's number; no weighting said; another
    # metric's or filter's entry; a custom aggregation: none.
    for groups in (group(metric="acc"), None, {}, group(metric="acc_norm"),
                   group(metric="acc", filter_list=["strict"]),
                   group(metric="acc", weight_by_size=False, aggregation=lambda v, s: 0.5)):
        assert task_score(results, "mmlu", groups=groups).examples is None
