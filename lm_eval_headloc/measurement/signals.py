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

A task's signal is the mean over its documents (over every leaf of a group):
:func:`gold_logprobs` are those documents' values, the per-example values a measurement's
noise is read from (``TaskScore.examples``).

A task whose documents have no gold answer (``doc_to_target: ""``: one scored by a
function of the generated text alone, such as ``swear``) has no such signal: what would be
measured is the log-likelihood of an empty answer (at most a delimiter), which says nothing
about the task, so its changes and their attribution are noise. :func:`no_gold_reason`
tells such a task before any weights load; ``--signal logprob`` and ``--prior atp`` /
``atp-path`` are refused for it (:func:`check_gold_answers`), and ``--prior auto``
resolves to none there.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["GOLD_SAMPLE", "SIGNAL_OUTPUT_TYPES", "GoldAnswer", "check_gold_answers",
           "gold_answers", "gold_logprob", "gold_logprobs", "has_gold_answers",
           "no_gold_reason", "no_logprob_reason", "signal_weights"]

#: lm-eval output types the logprob signal is defined for.
SIGNAL_OUTPUT_TYPES: tuple[str, ...] = ("loglikelihood", "multiple_choice", "generate_until")

#: Documents of a task whose gold answers are looked at to tell whether it has any.
GOLD_SAMPLE = 5

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
    assistant's answer starts, so the target delimiter goes before the answer only after
    a ``gen_prefix`` that does not end in whitespace, as lm-eval delimits its own answers).
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
            delimiter = task.config.target_delimiter
            if (chat_template or {}).get(leaf):
                # lm-eval's rule for a chat prompt's answer (multiple choice's, and its
                # few-shot answers'): the delimiter only after a gen_prefix that does not
                # end in whitespace ("Answer:" -> "Answer: 4"), else none.
                prefix = _gen_prefix(task, group[0].doc)
                delimiter = delimiter if prefix and not prefix[-1].isspace() else ""
            reference = delimiter + _reference_answer(task, group[0].doc)
            answers.append(GoldAnswer(leaf, doc_id, ((context, reference),), (0,), False))
        else:
            raise ValueError(f"task {leaf!r} ({kind}): the logprob signal needs one of "
                             f"{', '.join(SIGNAL_OUTPUT_TYPES)}")
    return answers


def _gen_prefix(task: Any, doc: Any) -> str | None:
    """The text a task's chat prompt starts the assistant's answer with, if any."""
    prefix = task.doc_to_prefix(doc) if hasattr(task, "doc_to_prefix") else \
        task.get_config("gen_prefix")
    return prefix if isinstance(prefix, str) and prefix else None


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


def gold_logprobs(golds: Sequence[GoldAnswer], answers: Mapping[Request, tuple[float, bool]],
                  leaves: Iterable[str]) -> list[float]:
    """Each gold log-likelihood of the documents of ``leaves`` (a task's leaf tasks), in
    ``golds``' order: the values ``gold_logprob`` is the mean of."""
    wanted = set(leaves)
    values = [g.logprob(answers) for g in golds if g.task in wanted]
    if not values:
        raise ValueError(f"no documents recorded for {', '.join(sorted(wanted))}")
    return values


def gold_logprob(golds: Sequence[GoldAnswer], answers: Mapping[Request, tuple[float, bool]],
                 leaves: Iterable[str]) -> float:
    """Mean gold log-likelihood over the documents of ``leaves`` (a task's leaf tasks)."""
    values = gold_logprobs(golds, answers, leaves)
    return float(sum(values) / len(values))


# --- whether a task has gold answers at all ------------------------------------------

def _empty_gold(target: Any) -> bool:
    # An index (multiple choice: 0 is the first choice) is a gold answer; text is one
    # when it has a visible character; a list when one of its entries is.
    if target is None:
        return True
    if isinstance(target, str):
        return not target.strip()
    if isinstance(target, (list, tuple)):
        return all(_empty_gold(t) for t in target)
    return False


def no_gold_reason(task: Any, leaf: str | None = None, sample: int = GOLD_SAMPLE
                   ) -> str | None:
    """Why the lm-eval task ``task`` has no gold-answer log-likelihood to measure, or None
    when it has one: an output type the signal is not defined for, or no gold answer
    (``doc_to_target`` empty) in its first ``sample`` documents. Reads the documents
    the task has already loaded; no model is needed. ``leaf``: the name to say."""
    name = leaf or task.get_config("task")
    kind = task.get_config("output_type")
    if kind not in SIGNAL_OUTPUT_TYPES:
        return (f"task {name!r} is {kind}; the gold answer's log-likelihood is defined for "
                f"{', '.join(SIGNAL_OUTPUT_TYPES)}")
    docs = list(itertools.islice(task.eval_docs, sample))
    if not docs:
        return f"task {name!r} has no documents"
    try:
        targets = [task.doc_to_target(doc) for doc in docs]
    except Exception as err:  # noqa: BLE001 -- a task's own template or function failing
        said = str(err).strip()
        return (f"task {name!r}: its gold answer cannot be read ({type(err).__name__}"
                + (f": {said.splitlines()[0]})" if said else ")"))
    if all(_empty_gold(target) for target in targets):
        return (f"task {name!r} has no gold answer (doc_to_target is empty for its first "
                f"{len(docs)} documents), so it has no log-likelihood signal")
    return None


def has_gold_answers(task: Any) -> bool:
    """Whether the lm-eval task ``task`` has a gold-answer log-likelihood to measure
    (:func:`no_gold_reason` is None)."""
    return no_gold_reason(task) is None


def no_logprob_reason(leaves: Mapping[str, Any]) -> str | None:
    """The first leaf task's reason to have no log-likelihood signal (``leaves``: leaf
    name -> lm-eval task, as ``TaskManager.load(...)["tasks"]`` gives), or None when
    every leaf has one: why ``--prior auto`` computes no attribution prior."""
    for leaf, task in leaves.items():
        reason = no_gold_reason(task, leaf)
        if reason is not None:
            return reason
    return None


def check_gold_answers(leaves: Mapping[str, Any], flag: str) -> None:
    """Refuse ``flag`` (``--signal logprob``, ``--prior atp`` …) in one line naming the
    task when a leaf of ``leaves`` has no gold answer, before any weights load."""
    reason = no_logprob_reason(leaves)
    if reason is not None:
        from lm_eval_headloc.common.checks import UsageError  # sklearn: imported only when refusing

        instead = {"--signal": "--signal metric", "--prior": "--prior auto or none",
                   "--components": "--components heads"}[flag.split()[0]]
        raise UsageError(f"{flag}: {reason} (use {instead})")
