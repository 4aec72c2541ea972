"""Which single number a task is measured by, and whether higher is better.

The driver needs one scalar per task per measurement. ``TASK_METRICS`` holds the
metric the compressed-sensing paper's released code (Bair, Xu, Sun & Kolter, arXiv
2603.03335) scores lm-eval's built-ins by, and our own tasks' metrics; any other task
falls back to its first metric and the harness's own higher-is-better flag.
``task:metric`` overrides either.

Scores are read from the dict ``lm_eval.simple_evaluate`` returns: the harness does
the scoring (filters, metrics, group aggregation); this module only picks the number.
Where those results log their samples, the score also carries the per-example values it
is the mean of (``TaskScore.examples``), found by rebuilding the number from them: a
measurement is a sample of examples, and the same examples in every measurement, so the
noise of a change between two is read from their paired per-example differences
(``noise``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lm_eval_headloc.common.errors import UserError

__all__ = ["EXAMPLES_TOLERANCE", "TASK_METRICS", "Examples", "MetricError", "TaskScore",
           "checked_examples", "default_metric", "mean_of_strata", "metrics_of_task",
           "parse_task_metric", "reproduces", "tag_advice", "tag_metric", "task_score"]

# task -> (metric key as lm-eval reports it, higher is better).
# Groups and tags not aggregated by the harness are the mean over their subtasks.
TASK_METRICS: dict[str, tuple[str, bool]] = {
    # lm-eval's built-ins: the metrics the paper's released code scores them by
    "gsm8k": ("exact_match,flexible-extract", True),
    "arithmetic": ("acc,none", True),  # a tag: mean over arithmetic_1dc ... _5ds
    "mbpp": ("pass_at_1,none", True),
    "humaneval_instruct": ("pass@1,create_test", True),
    "boolq": ("acc,none", True),
    "mmlu": ("acc,none", True),
    "wmdp_bio": ("acc,none", True),
    "wmdp_chem": ("acc,none", True),
    "wmdp_cyber": ("acc,none", True),
    "arc_challenge": ("acc_norm,none", True),
    "hellaswag": ("acc_norm,none", True),
    # ours (task_configs/)
    "swear": ("swear_words,none", True),
    "rhyme": ("rhyme_acc,none", True),
    "rhyme_heldout": ("rhyme_acc,none", True),
    "headloc_induction": ("acc,none", True),
    "headloc_ioi": ("acc,none", True),
    "headloc_arith": ("acc,none", True),
}

_NOT_METRICS = ("alias", "samples", "name", "sample_len", "sample_count")

#: Per-example values as strata: the score is the mean over strata of each one's mean.
Examples = tuple[tuple[float, ...], ...]

#: How close the per-example values' mean must come to the reported score to stand for it
#: (absolute; relative above 1).
EXAMPLES_TOLERANCE = 1e-9


class MetricError(UserError):
    """A task or metric the results do not have, or a score that is no finite number
    (a user mistake, reported in one line)."""


@dataclass(frozen=True)
class TaskScore:
    task: str
    metric: str
    value: float
    higher_is_better: bool
    subtasks: tuple[str, ...] = ()  # non-empty when the value is a mean over subtasks
    # The gold answer's mean log-likelihood from the same answers, when it came for free
    # (loglikelihood tasks measured by their metric); see ``signals``.
    logprob: float | None = None
    # The per-example values ``value`` is the mean of, as strata (``mean_of_strata``): one
    # for a task (or a group lm-eval weights by size: all its documents), one per subtask
    # where the value is the mean of theirs. None where no such values reproduce it (an
    # aggregation that is not a mean: f1, bleu, perplexity ...; samples not logged).
    examples: Examples | None = None


def parse_task_metric(spec: str) -> tuple[str, str | None]:
    """``"gsm8k:exact_match,strict-match"`` -> ``("gsm8k", "exact_match,strict-match")``;
    ``"gsm8k"`` -> ``("gsm8k", None)``. A metric without a filter means filter ``none``."""
    task, sep, metric = spec.partition(":")
    task, metric = task.strip(), metric.strip()
    if not task or (sep and not metric):
        raise MetricError(f"bad task spec {spec!r}: expected TASK or TASK:METRIC "
                          "(e.g. gsm8k:exact_match,strict-match)")
    if metric and "," not in metric:
        metric = f"{metric},none"
    return task, metric or None


def _metric_keys(row: Mapping[str, Any]) -> list[str]:
    return [k for k in row if "," in k and "_stderr" not in k and k.split(",")[0]
            not in _NOT_METRICS]


def _members(results: Mapping[str, Any], task: str,
             leaves: Sequence[str] | None = None) -> list[str]:
    """Subtasks of a group (from the harness's ``group_subtasks``) or a tag (from the
    ``tag`` entries of the task configs, which lm-eval 0.4.13 no longer dumps there; else
    ``leaves``, the tasks lm-eval's TaskManager loaded for the name)."""
    members = results.get("group_subtasks", {}).get(task)
    if members:
        return list(members)
    tagged = []
    for name, config in results.get("configs", {}).items():
        tags = config.get("tag") or []
        if task in ([tags] if isinstance(tags, str) else tags):
            tagged.append(name)
    if not tagged and leaves and any(leaf != task for leaf in leaves):
        tagged = [leaf for leaf in leaves if leaf in results.get("results", {})]
    return sorted(tagged)


def _config_order(results: Mapping[str, Any], task: str) -> list[str]:
    """The ``metric,filter`` keys in the order the task's config lists them (the results'
    ``configs``: ``metrics_of_task``'s order), or none where the results do not say."""
    config = results.get("configs", {}).get(task) or {}
    names = [m.get("metric") for m in config.get("metric_list") or [] if isinstance(m, dict)]
    filters = [f.get("name") for f in config.get("filter_list") or []
               if isinstance(f, dict)] or ["none"]
    return [f"{name},{flt}" for flt in filters for name in names if isinstance(name, str)]


def _higher_is_better(results: Mapping[str, Any], task: str, metric: str) -> bool | None:
    flags = results.get("higher_is_better", {}).get(task, {})
    flag = flags.get(metric.split(",")[0])
    return None if flag is None else bool(flag)


def task_score(results: Mapping[str, Any], task: str, metric: str | None = None,
               leaves: Sequence[str] | None = None,
               groups: Mapping[str, Any] | None = None) -> TaskScore:
    """The one number ``task`` is measured by in ``simple_evaluate``'s ``results``;
    ``leaves``: the tasks lm-eval loaded for it (a tag's members: the mean over them).

    Where ``results`` hold lm-eval's ``samples`` (``log_samples=True``), the score carries
    the per-example values it is the mean of (``TaskScore.examples``), checked to give it
    back; ``groups``: lm-eval's ``Group`` objects by name (``TaskManager.load``'s
    ``"groups"``), which say how a group's own row weights its tasks."""
    rows = results.get("results", {})
    row = rows.get(task, {})
    members = [] if _metric_keys(row) and (metric is None or metric in row) else _members(
        results, task, leaves)
    if not row and not members:
        raise MetricError(f"task {task!r} is not in the results; they hold: "
                          f"{', '.join(sorted(rows)) or 'nothing'}")
    known_metric, known_flag = TASK_METRICS.get(task, (None, None))
    if metric is None and known_metric is None and members and not _metric_keys(row):
        # A tag or group with no score of its own: each member by its own metric, which
        # must be one metric for the mean to mean anything.
        parts = [task_score(results, m, groups=groups) for m in members]
        metric = tag_metric(task, {p.task: p.metric for p in parts})
        value = sum(p.value for p in parts) / len(parts)
        return TaskScore(task, metric, value, parts[0].higher_is_better, tuple(members),
                         examples=checked_examples(_parts_examples(results, parts), value))
    if metric is None:
        metric = known_metric
    if metric is None:  # fallback: the task's first metric
        keys = _metric_keys(row) or [k for m in members for k in _metric_keys(rows.get(m, {}))]
        if not keys:
            raise MetricError(f"task {task!r} reports no metric")
        # The YAML's first (``default_metric``'s), not the results' first: lm-eval lists a
        # loglikelihood task's perplexity before an acc the YAML names first.
        metric = next((k for k in _config_order(results, task) if k in keys), keys[0])

    if metric in row:
        value = float(row[metric])
        subtasks: tuple[str, ...] = ()
        flag = _higher_is_better(results, task, metric)
        examples = _row_examples(results, task, metric, groups)
    elif members:
        parts = [task_score(results, m, metric, groups=groups) for m in members]
        value = sum(p.value for p in parts) / len(parts)
        subtasks = tuple(members)
        flag = parts[0].higher_is_better
        examples = _parts_examples(results, parts)
    else:
        raise MetricError(f"task {task!r} produces no metric {metric!r}; it produces: "
                          f"{', '.join(_metric_keys(row)) or 'none'}")
    if known_flag is not None and metric == known_metric:
        flag = known_flag
    if flag is None:
        name = metric.split(",")[0]
        if name in results.get("higher_is_better", {}).get(task, {}):
            # lm-eval's "higher_is_better not specified" (None): taken as higher, an error
            # rate or a loss would rank the heads whose knockout helps as the task's heads.
            raise MetricError(f"task {task!r}: lm-eval does not say whether a higher "
                              f"{name!r} is better (the metric's metric_list entry in the "
                              "task's YAML gives no higher_is_better, or a group's tasks "
                              "give different ones); add higher_is_better: true or false "
                              "there")
        flag = True
    return TaskScore(task, metric, value, flag, subtasks,
                     examples=checked_examples(examples, value))


# --- the per-example values a score is the mean of -----------------------------------

def mean_of_strata(examples: Examples) -> float:
    """The score per-example values stand for: the mean over strata of each one's mean."""
    return sum(sum(stratum) / len(stratum) for stratum in examples) / len(examples)


def reproduces(value: float, reported: float) -> bool:
    """Whether ``value`` is the ``reported`` score, to ``EXAMPLES_TOLERANCE`` (absolute,
    or relative where the score is larger than 1); never for a NaN or an infinity."""
    return math.isfinite(value) and math.isfinite(reported) and \
        abs(value - reported) <= EXAMPLES_TOLERANCE * max(1.0, abs(reported))


def checked_examples(examples: Examples | None, value: float) -> Examples | None:
    """``examples`` where they give ``value`` back, else None: a metric whose aggregation
    is not the mean of its per-document values (f1, bleu, perplexity ...) has none."""
    if not examples or not all(examples) or not reproduces(mean_of_strata(examples), value):
        return None
    return examples


def _number(value: Any) -> float | None:
    """A per-document metric value as a float, or None where it is not one number (f1's
    and bleu's (reference, prediction) pairs, a perplexity's (loglikelihood, words))."""
    if isinstance(value, numbers.Real):  # bool and int too
        return float(value)
    if getattr(value, "shape", None) == () and getattr(value, "dtype", None) is not None:
        try:  # a numpy scalar (numpy's bool is not a numbers.Real)
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def _leaf_values(results: Mapping[str, Any], leaf: str, metric: str
                 ) -> tuple[float, ...] | None:
    """A leaf task's per-document values of ``metric`` (``name,filter``) from lm-eval's
    logged samples, ordered by document; None where they are not all numbers."""
    samples = results.get("samples", {}).get(leaf)
    if not samples:
        return None
    name, _, flt = metric.partition(",")
    chosen = sorted((s for s in samples if s.get("filter") == flt), key=lambda s: s["doc_id"])
    values = [_number(s.get(name)) for s in chosen]
    if not values or any(v is None for v in values):
        return None
    return tuple(float(v) for v in values if v is not None)


def _row_examples(results: Mapping[str, Any], task: str, metric: str,
                  groups: Mapping[str, Any] | None) -> Examples | None:
    """The per-example values of lm-eval's own row for ``task``: a leaf's documents (one
    stratum); a group's, as its ``aggregate_metric_list`` averages its leaf tasks: weighted
    by size, the mean over all their documents (one stratum); unweighted, the mean of their
    means (one stratum each). None where the group's weighting is not known."""
    if "samples" not in results:
        return None
    if task in results["samples"]:
        values = _leaf_values(results, task, metric)
        return None if values is None else (values,)
    group = (groups or {}).get(task)
    weighted = None if group is None else _size_weighted(group, metric)
    if weighted is None:
        return None
    rows = results.get("results", {})
    # lm-eval averages the group's leaf tasks that report the metric, in this order.
    leaves = [t.task_name for t in group.get_all_tasks()
              if metric in rows.get(t.task_name, {})]
    found = [_leaf_values(results, leaf, metric) for leaf in leaves]
    strata = tuple(s for s in found if s is not None)
    if not strata or len(strata) != len(found):
        return None
    return (tuple(v for stratum in strata for v in stratum),) if weighted else strata


def _size_weighted(group: Any, metric: str) -> bool | None:
    """Whether lm-eval's ``Group`` weights its tasks by size in its row for ``metric``, or
    None where that row is not a mean of theirs (a custom aggregation, or none)."""
    name, _, flt = metric.partition(",")
    found = None
    for entry in getattr(group, "aggregate_metric_list", None) or []:
        if entry.metric == name and (entry.filter_list is None or flt in entry.filter_list):
            found = entry  # a later entry's row replaces an earlier one's
    if found is None or found.aggregation != "mean":
        return None
    return bool(found.weight_by_size)


def _parts_examples(results: Mapping[str, Any], parts: Sequence[TaskScore]
                    ) -> Examples | None:
    """A mean over ``parts``' scores: one stratum per part, each part's own single stratum
    (None where a part has several: the mean of their means is not one stratum's)."""
    if "samples" not in results or any(p.examples is None or len(p.examples) != 1
                                       for p in parts):
        return None
    return tuple(p.examples[0] for p in parts if p.examples is not None)


def tag_metric(task: str, metrics: Mapping[str, str],
               common: Sequence[str] | None = None) -> str:
    """The one metric a tag's tasks (``metrics``: each one's) are scored by, whose mean is
    the tag's score; a MetricError naming them where they differ (``common``: the metrics
    every one of them produces, where known, the ones to offer)."""
    used = sorted(set(metrics.values()))
    if len(used) > 1:
        raise MetricError(f"task {task!r}: its tasks are scored by different metrics ("
                          + ", ".join(f"{t}: {m}" for t, m in metrics.items())
                          + f"); {tag_advice(task, common, list(metrics))}")
    return used[0]


def tag_advice(task: str, common: Sequence[str] | None,
               tasks: Sequence[str] = ()) -> str:
    """How to measure a tag whose tasks' metrics do not agree: by a metric all of them
    produce (``common``; None: not known), else by naming its tasks."""
    if common is None:
        return f"give one ({task}:METRIC) or name the tasks"
    if common:
        return ("give one they all produce (" + ", ".join(f"{task}:{m}" for m in common)
                + ") or name the tasks")
    named = f" (--tasks {','.join(tasks)})" if tasks else ""
    return f"they produce no metric in common: name the tasks{named}"


def default_metric(name: str, task: Any) -> str:
    """The metric a leaf task is scored by when none is given: ``TASK_METRICS``', else
    its first (``metrics_of_task``)."""
    known = TASK_METRICS.get(name)
    return known[0] if known else (metrics_of_task(task) or [""])[0]


def metrics_of_task(task: Any) -> list[str]:
    """The ``metric,filter`` keys a built lm-eval Task will report (before running it)."""
    config = task.config
    names = [m["metric"] if isinstance(m["metric"], str) else m["metric"].__name__
             for m in (config.metric_list or [])]
    if not names:  # tasks without metric_list use their output type's defaults
        names = list(task.aggregation().keys())
    filters = [f["name"] for f in (config.filter_list or [])] or ["none"]
    return [f"{name},{flt}" for flt in filters for name in names]
