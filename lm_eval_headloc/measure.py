"""One measurement: the task scores of the live model with some heads knocked out.

Tasks are built once; every measurement switches the heads in place on the loaded
``hf-headablate`` model and runs lm-eval's own ``evaluate`` on the same fixed example
subset, so the harness does the scoring (its filters, metrics and aggregation).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .heads import Head
from .metrics import TaskScore, task_score

__all__ = ["HarnessMeasurement", "choose_subset"]

FEWSHOT_SEED = 1234  # lm-eval's default fewshot_random_seed


# Modules whose per-call progress bars would print hundreds of times in a run.
_HARNESS_TQDM_MODULES = ("lm_eval.api.task", "lm_eval.api.model", "lm_eval.models.huggingface")


@contextlib.contextmanager
def quiet_harness(verbose: bool = False) -> Iterator[None]:
    """Silence lm-eval's logging and progress bars for one measurement.

    lm-eval gives no switch for the bars of ``build_all_requests`` and the model
    calls made by ``evaluate``, so their module-level ``tqdm`` is swapped for a
    disabled one while the measurement runs, and put back after.
    """
    if verbose:
        yield
        return
    from tqdm import tqdm

    def silent_tqdm(*args, **kwargs):
        kwargs["disable"] = True
        return tqdm(*args, **kwargs)

    logger = logging.getLogger("lm_eval")
    level = logger.level
    modules = [importlib.import_module(name) for name in _HARNESS_TQDM_MODULES]
    originals = [module.tqdm for module in modules]
    logger.setLevel(logging.ERROR)
    for module in modules:
        module.tqdm = silent_tqdm
    try:
        yield
    finally:
        for module, original in zip(modules, originals, strict=True):
            module.tqdm = original
        logger.setLevel(level)


def choose_subset(doc_counts: dict[str, int], num_samples: int | None,
                  seed: int) -> dict[str, list[int]] | None:
    """The same ``num_samples`` document indices per leaf task for every measurement.

    Drawn without replacement with ``seed`` (sorted, for readable run folders); a task
    with fewer documents uses all of them. ``None`` means every document.
    """
    if num_samples is None:
        return None
    subset = {}
    for name in sorted(doc_counts):
        count = doc_counts[name]
        # Seeded per task, so a task's subset does not depend on the other tasks run.
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        picked = rng.choice(count, size=min(num_samples, count), replace=False)
        subset[name] = sorted(int(i) for i in picked)
    return subset


@dataclass
class _TaskGroup:
    """Tasks evaluated in one ``evaluate`` call (same chat-template setting)."""

    loaded: dict[str, Any]
    apply_chat_template: bool


class HarnessMeasurement:
    """Callable ``heads -> {task: TaskScore}`` over a fixed example subset.

    ``tasks`` are ``(name, metric or None)`` pairs; ``loaded_tasks`` maps each name to
    what lm-eval's ``TaskManager.load([name])`` built; ``lm`` is an ``HFHeadAblateLM``.
    Generation tasks get the chat template when the model has one, unless
    ``apply_chat_template`` says otherwise.
    """

    def __init__(
        self,
        lm: Any,
        tasks: Sequence[tuple[str, str | None]],
        loaded_tasks: Mapping[str, Any],
        num_samples: int | None = 100,
        seed: int = 0,
        apply_chat_template: bool | None = None,
        confirm_run_unsafe_code: bool = False,
        num_fewshot: int | None = None,
        limit: int | None = None,
        verbose: bool = False,
    ) -> None:
        self.lm = lm
        self.tasks = list(tasks)
        self.confirm_run_unsafe_code = confirm_run_unsafe_code
        self.verbose = verbose
        self.limit = limit
        has_template = bool(getattr(getattr(lm, "tokenizer", None), "chat_template", None))
        groups: dict[bool, dict[str, Any]] = {}
        self.doc_counts: dict[str, int] = {}
        for name, _ in self.tasks:
            loaded = loaded_tasks[name]
            generative = any(t.get_config("output_type") == "generate_until"
                             for t in loaded["tasks"].values())
            chat = has_template and generative if apply_chat_template is None \
                else apply_chat_template
            group = groups.setdefault(chat, {"tasks": {}, "groups": {}, "group_map": {}})
            for key in group:
                group[key].update(loaded.get(key, {}))
            for leaf, task in loaded["tasks"].items():
                if num_fewshot is not None and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                self.doc_counts[leaf] = len(task.eval_docs)
        self._groups = [_TaskGroup(loaded, chat) for chat, loaded in groups.items()]
        self.chat_template = {name: chat for chat, g in groups.items() for name in g["tasks"]}
        self.subset = None if limit is not None else choose_subset(
            self.doc_counts, num_samples, seed)
        self._requests: Any = None  # multimask.LoglikelihoodRequests, made on first use

    @property
    def leaf_tasks(self) -> list[str]:
        return sorted(self.doc_counts)

    @property
    def loglikelihood_only(self) -> bool:
        """True when every task asks only for loglikelihoods (several masks per pass work)."""
        return all(task.get_config("output_type") in ("loglikelihood", "multiple_choice")
                   for group in self._groups for task in group.loaded["tasks"].values())

    def evaluate(self, heads: Iterable[Head | str], model: Any = None) -> dict[str, Any]:
        """lm-eval's results dicts merged over the task groups, for this mask.

        ``model`` stands in for the live model (``multimask.ReplayLM``) when answers were
        computed beforehand.
        """
        from lm_eval.evaluator import evaluate

        self.lm.set_heads(list(heads))
        merged: dict[str, Any] = {}
        with quiet_harness(self.verbose):
            for group in self._groups:
                for task in group.loaded["tasks"].values():
                    # Same few-shot examples in every measurement.
                    task.set_fewshot_seed(seed=FEWSHOT_SEED)
                results = evaluate(
                    lm=model if model is not None else self.lm, task_dict=group.loaded,
                    samples=self.subset, limit=self.limit, bootstrap_iters=0,
                    log_samples=False, apply_chat_template=group.apply_chat_template,
                    fewshot_as_multiturn=group.apply_chat_template,
                    confirm_run_unsafe_code=self.confirm_run_unsafe_code,
                )
                for key, value in results.items():
                    if isinstance(value, dict):
                        merged.setdefault(key, {}).update(value)
        return merged

    def _scores(self, results: dict[str, Any]) -> dict[str, TaskScore]:
        return {name: task_score(results, name, metric) for name, metric in self.tasks}

    def __call__(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        return self.measure_many([list(heads)])[0]

    def measure_with_model(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        """Scores with the live model answering lm-eval's requests itself (HFLM's own
        loglikelihood and generation code), whatever the task type."""
        return self._scores(self.evaluate(heads))

    def measure_many(self, masks: Sequence[Sequence[Head]],
                     masks_per_pass: int = 1) -> list[dict[str, TaskScore]]:
        """Scores of several masks.

        Loglikelihood tasks: the subset's requests are recorded once and their answers
        computed by ``multimask`` (K = ``masks_per_pass`` masks share each forward pass,
        logits only at the continuation tokens), then lm-eval's ``evaluate`` scores each
        mask from those answers. Other tasks (or a seq2seq model): ``measure_with_model``,
        one mask at a time.
        """
        # multimask builds decoder-only inputs; seq2seq models answer through HFLM.
        if not self.loglikelihood_only or getattr(self.lm, "backend", "causal") != "causal":
            return [self.measure_with_model(heads) for heads in masks]
        from .multimask import (
            LoglikelihoodRequests,
            RecordingLM,
            ReplayLM,
            loglikelihoods_for_masks,
        )

        if self._requests is None:  # the subset's requests, the same for every mask
            recorder = RecordingLM(self.lm)
            self.evaluate([], model=recorder)
            self._requests = LoglikelihoodRequests(self.lm, recorder.requests)
        batch_size = self.lm.batch_size if isinstance(self.lm.batch_size, int) else 32
        per_pass = max(1, masks_per_pass)
        scores = []
        for start in range(0, len(masks), per_pass):
            group = [list(heads) for heads in masks[start:start + per_pass]]
            answers = loglikelihoods_for_masks(self.lm, self._requests, group,
                                               batch_size * len(group))
            for heads, answered in zip(group, answers, strict=True):
                scores.append(self._scores(self.evaluate(heads, ReplayLM(self.lm, answered))))
        return scores
