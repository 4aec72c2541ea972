"""One measurement: the task scores of the live model with some heads knocked out.

Tasks are built once; every measurement switches the heads in place on the loaded
``hf-headablate`` model and runs lm-eval's own ``evaluate`` on the same fixed example
subset, so the harness does the scoring (its filters, metrics and aggregation).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .checks import check_number
from .heads import Head
from .metrics import TaskScore, task_score
from .signals import SIGNAL_OUTPUT_TYPES, SIGNALS, gold_answers, gold_logprob, signal_weights

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
    ``apply_chat_template`` says otherwise. ``signal``: ``"metric"`` scores each task by
    the harness (the task's metric); ``"logprob"`` by the mean log-likelihood of the gold
    answers (``signals``), reported as metric ``logprob``, higher is better.
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
        signal: str = "metric",
    ) -> None:
        if signal not in SIGNALS:
            raise ValueError(f"signal {signal!r}: must be one of {', '.join(SIGNALS)}")
        self.signal = signal
        self.lm = lm
        self.tasks = list(tasks)
        self.leaves_of = {name: list(loaded_tasks[name]["tasks"]) for name, _ in self.tasks}
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
        self._golds: list[Any] | None = None  # signals.GoldAnswer per document, ditto
        self._instances: list[Any] | None = None  # lm-eval's requests, recorded once
        self._all_golds: list[Any] | None = None  # every document's gold, made once
        self._batch_size: int | None = None  # rows per pass, resolved on first use

    @property
    def leaf_tasks(self) -> list[str]:
        return sorted(self.doc_counts)

    @property
    def examples_used(self) -> dict[str, int]:
        """Documents each leaf task is measured on. ``num_samples`` (or ``limit``) larger
        than a task's documents uses all of them, so this can be less than asked for."""
        if self.subset is not None:
            return {leaf: len(indices) for leaf, indices in self.subset.items()}
        if self.limit is None:
            return dict(self.doc_counts)
        # lm-eval's evaluator_utils.get_sample_size: a limit below 1 is a fraction.
        return {leaf: min(count, math.ceil(count * self.limit) if self.limit < 1.0
                          else int(self.limit)) for leaf, count in self.doc_counts.items()}

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

    def _scores(self, results: dict[str, Any] | None,
                answers: Mapping[tuple[str, str], tuple[float, bool]] | None = None
                ) -> dict[str, TaskScore]:
        """Each task's score: from lm-eval's ``results`` (metric signal) or from the gold
        answers' loglikelihoods in ``answers`` (logprob signal; with the metric signal the
        logprob is added when the answers hold it)."""
        scores = {}
        for name, metric in self.tasks:
            logprob = None
            if answers is not None and self._golds is not None:
                logprob = gold_logprob(self._golds, answers, self.leaves_of[name])
            if self.signal == "logprob":
                scores[name] = TaskScore(name, "logprob", logprob, True)
            else:
                scores[name] = dataclasses.replace(task_score(results, name, metric),
                                                   logprob=logprob)
        return scores

    def __call__(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        return self.measure_many([list(heads)])[0]

    def measure_with_model(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        """Scores with the live model answering lm-eval's requests itself (HFLM's own
        loglikelihood and generation code), whatever the task type."""
        heads = list(heads)
        if self.signal == "metric":
            return self._scores(self.evaluate(heads))
        from lm_eval.api.instance import Instance

        keys = self._recorded().keys
        self.lm.set_heads(heads)
        with quiet_harness(self.verbose):
            answered = self.lm.loglikelihood(
                [Instance("loglikelihood", doc={}, arguments=key, idx=0) for key in keys],
                disable_tqdm=True)
        return self._scores(None, dict(zip(keys, answered, strict=True)))

    @property
    def scored_positions(self) -> bool:
        """True when ``measure_many`` answers through ``multimask`` (loglikelihood requests
        — every task with the logprob signal, loglikelihood tasks with the metric — on a
        decoder-only model that sees the request's tokens as they are); otherwise every
        mask is measured by ``measure_with_model``."""
        from .multimask import scored_positions_apply

        return ((self.signal == "logprob" or self.loglikelihood_only)
                and scored_positions_apply(self.lm))

    def _recorded_instances(self) -> list[Any]:
        """lm-eval's requests (``Instance`` objects) for the subset, recorded once by
        running ``evaluate`` against a recorder: they are the same for every mask."""
        from .multimask import RecordingLM

        if self._instances is None:
            recorder = RecordingLM(self.lm)
            self.evaluate([], model=recorder)
            self._instances = recorder.instances
        return self._instances

    def _gold_answers(self) -> list[Any]:
        """Every document's gold answer (``signals.gold_answers``), made once."""
        if self._all_golds is None:
            leaves = {leaf: task for group in self._groups
                      for leaf, task in group.loaded["tasks"].items()}
            self._all_golds = gold_answers(self._recorded_instances(), leaves,
                                           self.chat_template)
        return self._all_golds

    def _recorded(self) -> Any:
        """The loglikelihood requests a mask is measured by (``multimask.
        LoglikelihoodRequests``), made on first use. With the logprob signal: the gold
        answers' requests (generation tasks' references included); with the metric: the
        tasks' own requests."""
        from .multimask import LoglikelihoodRequests

        if self._requests is None:
            if self.signal == "logprob":
                self._golds = self._gold_answers()
                keys = [key for gold in self._golds for key in gold.requests]
            else:
                keys = [tuple(i.args) for i in self._recorded_instances()
                        if i.request_type == "loglikelihood"]
                try:  # the logprob comes with the answers when every request is there
                    wanted = set(keys)
                    golds = self._gold_answers()
                    if all(key in wanted for gold in golds for key in gold.requests):
                        self._golds = golds
                except ValueError:  # a document lm-eval scores but has no usable gold
                    self._golds = None
            self._requests = LoglikelihoodRequests(self.lm, keys)
        return self._requests

    @property
    def attributable(self) -> bool:
        """True when ``attribution`` can run: every task has gold answers (its output type
        is one of ``SIGNAL_OUTPUT_TYPES``) and the model is decoder-only without a
        prompt-learning adapter (``--prior auto`` uses the prior exactly then)."""
        from .multimask import scored_positions_apply

        return scored_positions_apply(self.lm) and all(
            task.get_config("output_type") in SIGNAL_OUTPUT_TYPES
            for group in self._groups for task in group.loaded["tasks"].values())

    def attribution(self, points: Sequence[float] = (0.0,)) -> dict[str, np.ndarray]:
        """Attribution patching (``prior``): each task's estimated change of its logprob
        signal from knocking out each head, a ``(len(points), heads)`` array: per path
        point (``prior.attribution_effects``' ``at``) a forward pass for the answers there
        and a forward and backward pass over the gold answers' requests (whatever signal
        the run measures). Decoder-only models (``scored_positions_apply``) only."""
        from .multimask import (
            LoglikelihoodRequests,
            loglikelihoods_for_masks,
            scored_positions_apply,
        )
        from .prior import attribution_effects, path_point

        if not scored_positions_apply(self.lm):
            raise ValueError("the attribution prior needs a decoder-only model without a "
                             "prompt-learning adapter")
        # The prior is of the unablated model, whatever mask was measured last (a pilot's
        # floor mask left in place made a resumed run's prior differ from a fresh one's).
        self.lm.set_heads([])
        golds = self._gold_answers()
        requests = self._recorded() if self.signal == "logprob" else LoglikelihoodRequests(
            self.lm, [key for gold in golds for key in gold.requests])
        batch_size = self.resolved_batch_size()
        effects: dict[str, list[np.ndarray]] = {name: [] for name, _ in self.tasks}
        for at in points:
            # The signal's weights are its derivatives at this point's own answers.
            with path_point(self.lm, at):
                answers = loglikelihoods_for_masks(self.lm, requests, [[]], batch_size)[0]
            for name, _ in self.tasks:
                weights = signal_weights(golds, answers, self.leaves_of[name])
                effects[name].append(attribution_effects(self.lm, requests, weights,
                                                         batch_size, at=at))
        return {name: np.stack(rows) for name, rows in effects.items()}

    def resolved_batch_size(self) -> int:
        """Rows per forward pass (per mask) of the scored-positions path: the model's
        ``batch_size``, or for ``auto``/``auto:N`` what lm-eval's own detection finds for
        the widest recorded request (``multimask.auto_batch_size``), resolved once."""
        if self._batch_size is None:
            size = self.lm.batch_size
            if isinstance(size, int):
                self._batch_size = size
            else:  # HFLM keeps "auto" for both auto and auto:N
                from .multimask import auto_batch_size

                self._batch_size = auto_batch_size(self.lm, self._recorded())
        return self._batch_size

    def auto_masks_per_pass(self) -> int:
        """Masks per forward pass when none is asked for. 1 on a CPU, where the forward
        is compute-bound and batching masks gains little (BENCH.md), and whenever masks
        are measured one at a time anyway (generation tasks, ``scored_positions`` False).
        On a GPU: as many as half of the free memory holds for the widest batch actually
        sent (``multimask.masks_per_pass_for_memory``)."""
        import torch

        device = torch.device(self.lm.device)
        if device.type != "cuda" or not self.scored_positions:
            return 1
        from .multimask import masks_per_pass_for_memory

        # The batch size first: its auto detection uses memory, then frees it.
        shapes = self._recorded().shapes(self.resolved_batch_size())
        free, _ = torch.cuda.mem_get_info(device)
        model = self.lm.model
        return masks_per_pass_for_memory(free, shapes, model.config,
                                         torch.finfo(model.dtype).bits // 8)

    def measure_many(self, masks: Sequence[Sequence[Head]],
                     masks_per_pass: int = 1) -> list[dict[str, TaskScore]]:
        """Scores of several masks.

        Loglikelihood tasks: the subset's requests are recorded once and their answers
        computed by ``multimask`` (K = ``masks_per_pass`` masks share each forward pass of
        K x ``resolved_batch_size()`` rows, logits only at the continuation tokens), then
        lm-eval's ``evaluate`` scores each mask from those answers. Other tasks, a seq2seq
        model or a prompt-learning adapter (``scored_positions`` False):
        ``measure_with_model``, one mask at a time (``masks_per_pass`` is then unused).
        """
        per_pass = check_number(masks_per_pass, "masks_per_pass", whole=True, min_val=1)
        if not self.scored_positions:
            return [self.measure_with_model(heads) for heads in masks]
        from .multimask import ReplayLM, loglikelihoods_for_masks

        requests = self._recorded()
        batch_size = self.resolved_batch_size()
        scores = []
        for start in range(0, len(masks), per_pass):
            group = [list(heads) for heads in masks[start:start + per_pass]]
            answers = loglikelihoods_for_masks(self.lm, requests, group,
                                               batch_size * len(group))
            for heads, answered in zip(group, answers, strict=True):
                results = None if self.signal == "logprob" else self.evaluate(
                    heads, ReplayLM(self.lm, answered))
                scores.append(self._scores(results, answered))
        return scores
