"""One measurement: the task scores of the live model with some heads knocked out.

Tasks are built once; every measurement knocks its heads out of the loaded
``hf-headablate`` model for that measurement only (``knocking_out``) and runs lm-eval's
own ``evaluate`` on the same fixed example subset, so the harness does the scoring (its
filters, metrics and aggregation). Each score carries the per-example values it is the
mean of, where there are such (``TaskScore.examples``): lm-eval's logged samples with the
metric signal, each document's gold log-likelihood with the logprob signal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from lm_eval_headloc.common.checks import check_number
from lm_eval_headloc.common.options import SIGNALS
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.measurement.harness import (
    FEWSHOT_SEED,
    at_scale,
    batching,
    choose_subset,
    configure_tasks,
    quiet_harness,
    seed_as_lm_eval,
    templates_compiled_once,
)
from lm_eval_headloc.measurement.metrics import TaskScore, checked_examples, task_score
from lm_eval_headloc.measurement.signals import (
    gold_answers,
    gold_logprob,
    gold_logprobs,
    no_logprob_reason,
)

__all__ = ["HarnessMeasurement", "Measurement", "measurement_fingerprint"]

_UNSETTLED = object()
log = logging.getLogger(__name__)


@dataclass
class _TaskGroup:
    """Tasks evaluated in one ``evaluate`` call (same chat-template setting)."""

    loaded: dict[str, Any]
    apply_chat_template: bool


Scores = dict[str, TaskScore]


class Measurement(Protocol):
    """What the commands (``runs.plan.run_plan``, the prior, the report) may ask of a
    measurement: ``HarnessMeasurement`` here, and ``distributed.workers``'
    ``DistributedMeasurement``, which measures the masks on Ray workers."""

    lm: Any
    signal: str
    tasks: list[tuple[str, str | None]]
    leaves_of: dict[str, list[str]]  # task -> its leaf tasks (a group's members)
    subset: dict[str, list[int]] | None  # leaf -> the documents measured (None: --limit)
    limit: float | None
    chat_template: dict[str, bool]  # task -> asked through the chat template

    @property
    def examples_used(self) -> dict[str, int]: ...

    def recorded_instances(self) -> list[Any]:
        """lm-eval's requests for the subset, the same for every mask."""
        ...

    def __call__(self, heads: Iterable[Head | str]) -> Scores: ...

    def measure_chunks(self, chunks: Sequence[Sequence[Sequence[Head]]],
                       masks_per_pass: int | None = None, scale: float | None = None
                       ) -> Iterator[tuple[int, list[Scores], float]]:
        """``(index, scores of each mask, seconds per mask)`` of each chunk of masks as it
        is measured (in any order); ``masks_per_pass`` None: the measurement's choice;
        ``scale`` None: the model's own (``at_scale``)."""
        ...

    def auto_masks_per_pass(self) -> int: ...

    @property
    def attributable(self) -> bool: ...

    def no_prior_reason(self) -> str | None: ...

    def attribution(self, points: Sequence[float | Sequence[float]] = (0.0,),
                    kind: str = "heads") -> dict[str, np.ndarray]: ...

    def workers_config(self) -> list[dict[str, Any]] | None:
        """Where the masks were measured (None: here)."""
        ...

    def generation_batch(self) -> contextlib.AbstractContextManager[None]:
        """Inside, ``lm`` generates in the measurement's batches (``--output-path``)."""
        ...


class HarnessMeasurement:
    """Callable ``heads -> {task: TaskScore}`` over a fixed example subset.

    ``tasks`` are ``(name, metric or None)`` pairs; ``loaded_tasks`` maps each name to
    what lm-eval's ``TaskManager.load([name])`` built; ``lm`` is an ``HFHeadAblateLM``.
    Generation tasks get the chat template when the model has one, unless
    ``apply_chat_template`` says otherwise. ``signal``: ``"metric"`` scores each task by
    the harness (the task's metric); ``"logprob"`` by the mean log-likelihood of the gold
    answers (``signals``), reported as metric ``logprob``, higher is better.
    ``num_fewshot`` and ``gen_kwargs``: lm-eval's overrides of the same names
    (``configure_tasks``); ``system_instruction``: lm-eval's, before every prompt.
    ``generation_batch``: rows per mask of a generation task's ``generate`` calls — None:
    the model's batch size; ``"auto"``: every example in one batch where memory allows
    (as the model's ``batch_size=auto``; ``generation_rows``).
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
        gen_kwargs: Mapping[str, Any] | None = None,
        system_instruction: str | None = None,
        limit: int | None = None,
        verbose: bool = False,
        signal: str = "metric",
        examples_part: tuple[int, int] | None = None,
        generation_batch: str | None = None,
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
        self.system_instruction = system_instruction
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
            configure_tasks(loaded["tasks"], num_fewshot, gen_kwargs)
            for leaf, task in loaded["tasks"].items():
                self.doc_counts[leaf] = len(task.eval_docs)
        self._groups = [_TaskGroup(loaded, chat) for chat, loaded in groups.items()]
        # lm-eval's Group objects: how a group's own row weights its tasks (task_score).
        self.lm_eval_groups = {name: g for group in self._groups
                               for name, g in group.loaded["groups"].items()}
        self.chat_template = {name: chat for chat, g in groups.items() for name in g["tasks"]}
        self.subset = None if limit is not None else choose_subset(
            self.doc_counts, num_samples, seed, examples_part)
        self._requests: Any = None  # multimask.LoglikelihoodRequests, made on first use
        self._golds: Any = _UNSETTLED  # what _answer_golds settles on
        self.logprob_missing: str | None = None  # why answers carry no gold logprob
        self._instances: list[Any] | None = None  # lm-eval's requests, recorded once
        self._all_golds: list[Any] | None = None  # every document's gold, made once
        self._batch_size: int | None = None  # rows per pass, resolved on first use
        self._generation_rows: int | None = None  # batch_size=auto: rows per generate call
        if generation_batch not in (None, "auto"):
            raise ValueError(f"generation_batch {generation_batch!r}: None or 'auto'")
        self.generation_batch_size = generation_batch
        self._generates_together: bool | None = None  # settled on first use
        # The automatic masks per pass last chosen (``auto_masks_per_pass``); None: none yet.
        self.chosen_masks_per_pass: int | None = None
        # Masks per pass since one more ran out of GPU memory (measure_many); None: no cap.
        self.most_masks_per_pass: int | None = None

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

    def evaluate(self, heads: Iterable[Head | str], model: Any = None,
                 log_samples: bool = False) -> dict[str, Any]:
        """lm-eval's results dicts merged over the task groups, for this mask.

        ``model`` stands in for the live model (``multimask.ReplayLM``) when answers were
        computed beforehand. ``log_samples``: lm-eval's, so the results hold each leaf
        task's ``samples`` (each document's metric values: the scores' ``examples``).
        """
        from lm_eval.evaluator import evaluate

        merged: dict[str, Any] = {}
        batch = self.generation_batch() if model is None else contextlib.nullcontext()
        with quiet_harness(self.verbose), templates_compiled_once(), \
                self.lm.knocking_out(list(heads)), batch:
            for group in self._groups:
                for task in group.loaded["tasks"].values():
                    # Same few-shot examples in every measurement.
                    task.set_fewshot_seed(seed=FEWSHOT_SEED)
                seed_as_lm_eval()
                results = evaluate(
                    lm=model if model is not None else self.lm, task_dict=group.loaded,
                    samples=self.subset, limit=self.limit, bootstrap_iters=0,
                    log_samples=log_samples, system_instruction=self.system_instruction,
                    apply_chat_template=group.apply_chat_template,
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
        """Each task's score: from lm-eval's ``results`` (metric signal; its per-example
        values from the results' ``samples``, where logged) or from the gold answers'
        loglikelihoods in ``answers`` (logprob signal: each document's, one stratum; with
        the metric signal the logprob is added when the answers hold it)."""
        scores = {}
        for name, metric in self.tasks:
            golds = self._answer_golds() if answers is not None else None
            if self.signal == "logprob":
                values = gold_logprobs(golds, answers, self.leaves_of[name])
                logprob = float(sum(values) / len(values))  # gold_logprob, computed once
                examples = checked_examples((tuple(values),), logprob)
                scores[name] = TaskScore(name, "logprob", logprob, True, examples=examples)
                continue
            logprob = None
            if golds is not None:
                logprob = gold_logprob(golds, answers, self.leaves_of[name])
            scores[name] = dataclasses.replace(
                task_score(results, name, metric, self.leaves_of[name],
                           groups=self.lm_eval_groups), logprob=logprob)
        return scores

    def __call__(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        return self.measure_many([list(heads)])[0]

    def measure_with_model(self, heads: Iterable[Head | str]) -> dict[str, TaskScore]:
        """Scores with the live model answering lm-eval's requests itself (HFLM's own
        loglikelihood and generation code), whatever the task type."""
        heads = list(heads)
        if self.signal == "metric":
            return self._scores(self.evaluate(heads, log_samples=True))
        from lm_eval.api.instance import Instance

        keys = self.requests().keys
        with quiet_harness(self.verbose), self.lm.knocking_out(heads):
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
        from lm_eval_headloc.intervention.multimask import scored_positions_apply

        return ((self.signal == "logprob" or self.loglikelihood_only)
                and scored_positions_apply(self.lm))

    def generation_rows(self) -> int | None:
        """Rows per ``generate`` call (per mask) when the model's batch size is ``auto`` or
        ``generation_batch`` is: every example where memory allows (resolved once, from the
        subset's own requests: ``sizing.generation_batch_size``); None otherwise (HFLM
        batches by the model's batch size)."""
        if self.lm.batch_size != "auto" and self.generation_batch_size != "auto":
            return None
        if self._generation_rows is None:
            from lm_eval_headloc.measurement.sizing import generation_batch_size

            self._generation_rows = generation_batch_size(self.lm,
                                                          self.recorded_instances()) or 0
        return self._generation_rows or None

    def generation_batch(self) -> contextlib.AbstractContextManager[None]:
        """Inside, the live model's ``generate_until`` batches by ``generation_rows()``
        (lm-eval evaluating on this model: the measurement, ``--output-path``)."""
        return batching(self.lm, self.generation_rows())

    def recorded_instances(self) -> list[Any]:
        """lm-eval's requests (``Instance`` objects) for the subset, recorded once by
        running ``evaluate`` against a recorder: they are the same for every mask."""
        from lm_eval_headloc.intervention.multimask import RecordingLM

        if self._instances is None:
            recorder = RecordingLM(self.lm)
            self.evaluate([], model=recorder)
            self._instances = recorder.instances
        return self._instances

    def gold_answers(self) -> list[Any]:
        """Every document's gold answer (``signals.gold_answers``), made once; raises
        ``ValueError`` naming the task where a document has none."""
        if self._all_golds is None:
            leaves = {leaf: task for group in self._groups
                      for leaf, task in group.loaded["tasks"].items()}
            with templates_compiled_once():
                self._all_golds = gold_answers(self.recorded_instances(), leaves,
                                               self.chat_template)
        return self._all_golds

    def _answer_golds(self) -> list[Any] | None:
        """The gold answers whose log-likelihood a mask's answers carry, settled once and
        whatever was called first: with the logprob signal every document's; with the
        metric, the golds when the tasks' own loglikelihood requests include all of
        theirs, else None (``logprob_missing`` says why)."""
        if self._golds is _UNSETTLED:
            if self.signal == "logprob":
                self._golds = self.gold_answers()
            else:
                try:
                    golds = self.gold_answers()
                except ValueError as err:  # a document lm-eval scores but has no gold
                    golds, self.logprob_missing = None, str(err)
                if golds is not None:
                    # Each task's own requests: another task's answers to the same text
                    # (two tasks on one data file) do not make a generation task's free.
                    wanted = {(i.task_name, tuple(i.args)) for i in self.recorded_instances()
                              if i.request_type == "loglikelihood"}
                    if not all((gold.task, key) in wanted
                               for gold in golds for key in gold.requests):
                        golds = None
                        self.logprob_missing = ("the tasks' own requests do not include "
                                                "every gold answer's")
                self._golds = golds
                if golds is None:
                    log.info("no gold log-likelihood alongside the metric: %s",
                             self.logprob_missing)
        return self._golds

    def requests(self) -> Any:
        """The loglikelihood requests a mask is measured by (``multimask.
        LoglikelihoodRequests``), made once. With the logprob signal: the gold answers'
        requests (generation tasks' references included); with the metric: the tasks'
        own requests."""
        from lm_eval_headloc.intervention.multimask import LoglikelihoodRequests

        if self._requests is None:
            if self.signal == "logprob":
                keys = [key for gold in self.gold_answers() for key in gold.requests]
            else:
                keys = [tuple(i.args) for i in self.recorded_instances()
                        if i.request_type == "loglikelihood"]
            self._requests = LoglikelihoodRequests(self.lm, keys)
        return self._requests

    @property
    def attributable(self) -> bool:
        """True when ``attribution`` can run (``no_prior_reason`` is None): ``--prior
        auto`` uses the prior exactly then."""
        return self.no_prior_reason() is None

    def no_prior_reason(self) -> str | None:
        """Why ``attribution`` cannot run, in words, or None: a task without gold answers
        (``signals.no_logprob_reason``: an output type without one, or documents without
        one), or a model that is not decoder-only or has a prompt-learning adapter."""
        from lm_eval_headloc.intervention.multimask import scored_positions_apply

        if not scored_positions_apply(self.lm):
            return "the model is not decoder-only, or has a prompt-learning adapter"
        return no_logprob_reason({leaf: task for group in self._groups
                                  for leaf, task in group.loaded["tasks"].items()})

    def attribution(self, points: Sequence[float | Sequence[float]] = (0.0,),
                    kind: str = "heads") -> dict[str, np.ndarray]:
        """Each task's attribution-patching estimate of its logprob signal's change from
        knocking out each head (``kind="heads"``) or MLP neuron (``"neurons"``), per path
        point or averaged path (``prior.measured_attribution``)."""
        from lm_eval_headloc.measurement.attribution import measured_attribution

        return measured_attribution(self, points, kind)

    def resolved_batch_size(self) -> int:
        """Rows per forward pass (per mask) of the scored-positions path, resolved once
        (``sizing.batch_size``)."""
        if self._batch_size is None:
            from lm_eval_headloc.measurement.sizing import batch_size

            self._batch_size = batch_size(self.lm, self.requests)
        return self._batch_size

    @property
    def generates_together(self) -> bool:
        """True when ``measure_many`` answers generation requests K masks per ``generate``
        call (``multigen``): tasks scored by their metric that generate, greedily, on a
        decoder-only model (``multigen.shares_generate``); their loglikelihood requests, if
        any, go through ``multimask``."""
        from lm_eval_headloc.intervention.multigen import shares_generate

        if self.signal != "metric" or self.loglikelihood_only:
            return False
        if self._generates_together is None:  # the requests and the model stay as they are
            self._generates_together = shares_generate(self.lm, self.recorded_instances())
        return self._generates_together

    def generating_instances(self) -> list[Any]:
        """The subset's generation requests, in the order lm-eval asks for them."""
        return [i for i in self.recorded_instances() if i.request_type == "generate_until"]

    def auto_masks_per_pass(self) -> int:
        """Masks per forward pass (per ``generate`` call for generation tasks) when none is
        asked for (``sizing.masks_per_pass``, ``sizing.generation_masks_per_pass``), chosen
        for each batch of measurements; the last is kept in ``chosen_masks_per_pass``,
        which config.json records."""
        from lm_eval_headloc.measurement.sizing import generation_masks_per_pass, masks_per_pass

        if self.generates_together:
            chosen = generation_masks_per_pass(self.lm, self.generating_instances(),
                                               self.rows_per_generate())
        else:
            chosen = masks_per_pass(self.lm, self.requests, self.resolved_batch_size,
                                    self.scored_positions)
        self.chosen_masks_per_pass = chosen
        return chosen

    def rows_per_generate(self) -> int:
        """Rows per mask of each ``generate`` call (``generation_rows``, else the model's
        batch size)."""
        return self.generation_rows() or int(self.lm.batch_size)

    def measure_chunks(self, chunks: Sequence[Sequence[Sequence[Head]]],
                       masks_per_pass: int | None = None, scale: float | None = None
                       ) -> Iterator[tuple[int, list[Scores], float]]:
        """``Measurement.measure_chunks`` here, in order: a chunk of several masks shares
        forward passes (``measure_many``) ``masks_per_pass`` at a time (None: the chunk's
        size), its heads knocked out at ``scale`` (None: the model's own)."""
        for index, chunk in enumerate(chunks):
            start = time.perf_counter()
            with at_scale(self.lm, scale):  # not held across the yield
                if len(chunk) > 1:
                    scores = self.measure_many(chunk,
                                               masks_per_pass=masks_per_pass or len(chunk))
                else:
                    scores = [self(heads) for heads in chunk]
            yield index, scores, (time.perf_counter() - start) / max(1, len(chunk))

    def workers_config(self) -> None:
        """Measured here, not on workers."""
        return None

    def measure_many(self, masks: Sequence[Sequence[Head]],
                     masks_per_pass: int = 1) -> list[dict[str, TaskScore]]:
        """Scores of several masks.

        The subset's requests are recorded once and each mask's answers computed K =
        ``masks_per_pass`` masks at a time: loglikelihood requests by ``multimask`` (K
        masks share each forward pass of K x ``resolved_batch_size()`` rows, logits only at
        the continuation tokens), generation requests by ``multigen`` (K masks share each
        ``generate`` call of K x ``rows_per_generate()`` rows; ``generates_together``).
        K is halved for good when a pass runs out of GPU memory (``most_masks_per_pass``).
        lm-eval's ``evaluate`` then scores each mask from its answers. Otherwise (a seq2seq
        model, a prompt-learning adapter, sampled generation): ``measure_with_model``, one
        mask at a time (``masks_per_pass`` is then unused).
        """
        per_pass = check_number(masks_per_pass, "masks_per_pass", whole=True, min_val=1)
        if self.scored_positions:
            answer = self._loglikelihood_answers
        elif self.generates_together:
            answer = self._generated_answers
        else:
            return [self.measure_with_model(heads) for heads in masks]
        import torch

        from lm_eval_headloc.intervention.multimask import ReplayLM
        from lm_eval_headloc.measurement.sizing import is_out_of_memory

        scores: list[dict[str, TaskScore]] = []
        start = 0
        while start < len(masks):
            per_pass = min(per_pass, self.most_masks_per_pass or per_pass)
            group = [list(heads) for heads in masks[start:start + per_pass]]
            try:
                answered = answer(group)
            except RuntimeError as error:
                # The automatic K is an estimate (sizing): a pass that does not fit is
                # retried at half the masks, and stays halved for the rest.
                if len(group) == 1 or not is_out_of_memory(error):
                    raise
                self.most_masks_per_pass = len(group) // 2
                log.warning("%d masks per pass ran out of GPU memory; measuring %d per pass "
                            "from now on", len(group), self.most_masks_per_pass)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start += len(group)
            for heads, (answers, generations) in zip(group, answered, strict=True):
                results = None if self.signal == "logprob" else self.evaluate(
                    heads, ReplayLM(self.lm, answers, generations), log_samples=True)
                scores.append(self._scores(results, answers))
        return scores

    def _loglikelihood_answers(self, group: list[list[Head]]
                               ) -> list[tuple[dict[tuple[str, str], Any], None]]:
        """Each mask's loglikelihood answers (``multimask``), the group in each pass."""
        from lm_eval_headloc.intervention.multimask import loglikelihoods_for_masks

        return [(answers, None) for answers in loglikelihoods_for_masks(
            self.lm, self.requests(), group, self.resolved_batch_size() * len(group))]

    def _generated_answers(self, group: list[list[Head]]
                           ) -> list[tuple[dict[tuple[str, str], Any], list[tuple[Any, str]]]]:
        """Each mask's loglikelihood answers (if the tasks ask for any) and its answers to
        the generation requests (``multigen``), the group in each ``generate`` call."""
        from lm_eval_headloc.intervention.multigen import generations_for_masks

        lls: list[dict[tuple[str, str], Any]] = [{} for _ in group]
        if self.requests().keys:
            lls = [answers for answers, _ in self._loglikelihood_answers(group)]
        generating = self.generating_instances()
        texts = generations_for_masks(self.lm, generating, group, self.rows_per_generate())
        return [(answers, list(zip(generating, mask_texts, strict=True)))
                for answers, mask_texts in zip(lls, texts, strict=True)]


def measurement_fingerprint(measure: Measurement) -> str:
    """A digest of what a measurement asks the model: the example subset and every
    request lm-eval built for it (documents, prompts, few-shot contexts, chat templates
    and all). Workers compare theirs with the driver's; a resumed run with the one it
    recorded (``runs.record``), so that no run mixes measurements of other requests.
    Computed once per measurement (its requests are fixed when it is made): a sweep's
    cells and the workers' check ask again."""
    known = getattr(measure, "_requests_fingerprint", None)
    if known is not None:
        return known
    digest = hashlib.sha256(json.dumps(
        {"subset": measure.subset, "limit": measure.limit, "signal": measure.signal},
        sort_keys=True, default=str).encode())
    # One request at a time: a whole benchmark's requests (MMLU's 56,000) as one string
    # would hold them all in memory twice over.
    for i in measure.recorded_instances():
        digest.update(json.dumps([i.request_type, i.task_name, i.doc_id, i.idx,
                                  list(map(str, i.args))], default=str).encode())
    measure._requests_fingerprint = digest.hexdigest()
    return measure._requests_fingerprint
