"""The ``logprob`` signal: the mean log-likelihood of each document's gold answer.

A task's metric (accuracy, exact match) moves in steps of 1/documents and sits at its
floor once enough heads are knocked out; the gold answer's log-likelihood moves with
every head that matters and saturates much later, so a Lasso sees more in each
measurement. Per document:

- ``loglikelihood`` tasks: the log-likelihood of the target (the request lm-eval makes);
- ``multiple_choice``: the gold choice's log-softmax over the choices,
  ``ll(gold) - logsumexp(ll(choices))`` (several golds: their summed probability);
- ``generate_until``: the teacher-forced log-likelihood of the document's reference
  answer (``doc_to_target``) after the prompt lm-eval would generate from, so a
  generation task is measured with loglikelihood requests (and K masks per pass).

A task's signal is the mean over its documents (over every leaf of a group).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SIGNALS", "SIGNAL_OUTPUT_TYPES", "GoldAnswer", "gold_answers", "gold_logprob",
           "signal_weights"]

#: What a measurement scores: the harness metric, or the gold answer's log-likelihood.
SIGNALS: tuple[str, ...] = ("metric", "logprob")
#: lm-eval output types the logprob signal is defined for.
SIGNAL_OUTPUT_TYPES: tuple[str, ...] = ("loglikelihood", "multiple_choice", "generate_until")

Request = tuple[str, str]


@dataclass(frozen=True)
class GoldAnswer:
    """One document's loglikelihood requests and which of them are gold."""

    task: str  # the leaf task
    doc_id: int
    requests: tuple[Request, ...]  # (context, continuation); choices in order for MC
    gold: tuple[int, ...]  # indices into ``requests``
    normalize: bool  # MC: log-softmax over ``requests``; otherwise the gold ll itself

    def logprob(self, answers: Mapping[Request, tuple[float, bool]]) -> float:
        lls = [float(answers[r][0]) for r in self.requests]
        gold = _logsumexp([lls[i] for i in self.gold])
        return gold - _logsumexp(lls) if self.normalize else gold

    def gradient(self, answers: Mapping[Request, tuple[float, bool]]) -> list[float]:
        """d logprob / d ll(request) for each of ``requests``: the gold's share of the
        gold set minus, when normalized, each choice's share of all choices."""
        lls = [float(answers[r][0]) for r in self.requests]
        gold_total = _logsumexp([lls[i] for i in self.gold])
        grad = [math.exp(lls[i] - gold_total) if i in self.gold else 0.0
                for i in range(len(lls))]
        if self.normalize:
            total = _logsumexp(lls)
            grad = [g - math.exp(ll - total) for g, ll in zip(grad, lls, strict=True)]
        return grad


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if math.isinf(top):
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


def _reference_answer(task: Any, doc: Mapping[str, Any]) -> str:
    """A generation task's reference answer as text (the first when there are several)."""
    target = task.doc_to_target(doc)
    if isinstance(target, list):
        if not target:
            raise ValueError(f"task {task.config.task!r}: a document has no reference answer")
        target = target[0]
    if isinstance(target, int) and task.config.doc_to_choice is not None:
        target = task.doc_to_choice(doc)[target]
    return str(target)


def gold_answers(instances: Iterable[Any], tasks: Mapping[str, Any],
                 chat_template: Mapping[str, bool] | None = None) -> list[GoldAnswer]:
    """The gold answers of lm-eval ``Instance`` objects recorded during one ``evaluate``.

    ``tasks`` maps leaf task names to lm-eval task objects; ``chat_template`` says which
    leaves were asked through the chat template (their generation prompts end where the
    assistant's answer starts, so no target delimiter is put in front of the answer).
    """
    by_doc: dict[tuple[str, int], list[Any]] = {}
    for instance in instances:
        by_doc.setdefault((instance.task_name, instance.doc_id), []).append(instance)
    answers = []
    for (leaf, doc_id), group in by_doc.items():
        task = tasks[leaf]
        kind = task.get_config("output_type")
        group.sort(key=lambda i: i.idx)
        if kind == "loglikelihood":
            answers.append(GoldAnswer(leaf, doc_id, (tuple(group[0].args),), (0,), False))
        elif kind == "multiple_choice":
            doc = group[0].doc
            choices = task.doc_to_choice(doc)
            # acc_mutual_info appends unconditional requests after the choices.
            requests = tuple(tuple(i.args) for i in group[:len(choices)])
            gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
            golds = gold if isinstance(gold, list) else [gold]
            indices = tuple(sorted({choices.index(g) if isinstance(g, str) else int(g)
                                    for g in golds if not isinstance(g, str) or g in choices}))
            if not indices or max(indices) >= len(requests):
                raise ValueError(f"task {leaf!r}, document {doc_id}: gold answer {gold!r} is "
                                 f"not one of its {len(choices)} choices")
            answers.append(GoldAnswer(leaf, doc_id, requests, indices, True))
        elif kind == "generate_until":
            context = group[0].args[0]
            delimiter = "" if (chat_template or {}).get(leaf) else task.config.target_delimiter
            reference = delimiter + _reference_answer(task, group[0].doc)
            answers.append(GoldAnswer(leaf, doc_id, ((context, reference),), (0,), False))
        else:
            raise ValueError(f"task {leaf!r} ({kind}): the logprob signal needs one of "
                             f"{', '.join(SIGNAL_OUTPUT_TYPES)}")
    return answers


def signal_weights(golds: Sequence[GoldAnswer], answers: Mapping[Request, tuple[float, bool]],
                   leaves: Iterable[str]) -> dict[Request, float]:
    """d gold_logprob / d ll(request) for every request of ``leaves``' documents: the
    weights that make a weighted sum of request log-likelihoods have the signal's
    gradient (``prior`` back-propagates that sum)."""
    wanted = set(leaves)
    chosen = [g for g in golds if g.task in wanted]
    weights: dict[Request, float] = {}
    for gold in chosen:
        for request, grad in zip(gold.requests, gold.gradient(answers), strict=True):
            weights[request] = weights.get(request, 0.0) + grad / len(chosen)
    return weights


def gold_logprob(golds: Sequence[GoldAnswer], answers: Mapping[Request, tuple[float, bool]],
                 leaves: Iterable[str]) -> float:
    """Mean gold log-likelihood over the documents of ``leaves`` (a task's leaf tasks)."""
    wanted = set(leaves)
    values = [g.logprob(answers) for g in golds if g.task in wanted]
    if not values:
        raise ValueError(f"no documents recorded for {', '.join(sorted(wanted))}")
    return float(sum(values) / len(values))
