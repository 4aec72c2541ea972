"""Several head masks per forward pass, for loglikelihood tasks.

The requests of a fixed example subset do not depend on the mask. So they are collected
once (lm-eval's ``evaluate`` run against a recorder), their loglikelihoods are computed
for K masks at a time (the batch is replicated K times and each row gets its own head
mask: ``HFHeadAblateLM.knocking_out(row_masks=...)``), and each mask's answers are then handed to
lm-eval's ``evaluate`` in turn through a replaying model, so the harness still applies
its filters, metrics and aggregation. Only the logits at the continuation tokens are
computed (``logits_only_at``). Loglikelihood measurements take this path for K = 1 too,
except where the model's inputs are not the request's tokens (``scored_positions_apply``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.intervention.components import Head

__all__ = ["LMProxy", "LoglikelihoodRequests", "RecordingLM", "ReplayLM", "ScoredBatch",
           "generation_key", "hflm_class", "logits_only_at", "loglikelihoods_for_masks",
           "scored_positions_apply"]

Answer = tuple[float, bool]


class RecordingLM:
    """Stands in for the model during one ``evaluate``: remembers the requests.

    ``requests``: the loglikelihood requests' ``(context, continuation)``; ``instances``:
    every lm-eval ``Instance`` asked for (generation ones too, answered with ``""``).
    """

    def __init__(self, lm: Any) -> None:
        self._lm = lm
        self.requests: list[tuple[str, str]] = []
        self.instances: list[Any] = []

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Answer]:
        self.requests.extend(tuple(r.args) for r in requests)
        self.instances.extend(requests)
        return [(0.0, False)] * len(requests)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        self.instances.extend(requests)
        return [""] * len(requests)

    def loglikelihood_rolling(self, requests: list[Any],
                              disable_tqdm: bool = False) -> list[float]:
        # Recorded, not run: a perplexity task's requests are part of what a mask costs.
        self.instances.extend(requests)
        return [0.0] * len(requests)

    def __getattr__(self, name: str) -> Any:  # rank, world_size, tokenizer_name, ...
        return getattr(self._lm, name)


class ReplayLM(RecordingLM):
    """Answers each loglikelihood request from precomputed results, and each generation
    request from ``generations`` (``(instance, text)`` pairs, ``multigen``) where given,
    else (and every rolling loglikelihood request) from the live model."""

    def __init__(self, lm: Any, answers: dict[tuple[str, str], Answer],
                 generations: Sequence[tuple[Any, str]] | None = None) -> None:
        super().__init__(lm)
        self._answers = answers
        self._generations: dict[Any, list[str]] | None = None
        if generations is not None:
            self._generations = {}
            for instance, text in generations:
                self._generations.setdefault(generation_key(instance), []).append(text)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Answer]:
        return [self._answers[tuple(r.args)] for r in requests]

    def loglikelihood_rolling(self, requests: list[Any],
                              disable_tqdm: bool = False) -> list[float]:
        return self._lm.loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if self._generations is None:
            return self._lm.generate_until(requests, disable_tqdm=disable_tqdm)
        # Requests alike are answered alike (greedy); in the order recorded all the same.
        return [self._generations[generation_key(r)].pop(0) for r in requests]


def generation_key(instance: Any) -> tuple[str, str]:
    """A generation request's prompt and settings, as a key (its settings are a dict)."""
    import json

    context, *rest = instance.args
    return context, json.dumps(rest[0] if rest else None, sort_keys=True, default=repr)


#: The lm-eval versions whose HFLM builds a loglikelihood request's model input as
#: ``model_input`` does (checked at run time on the requests themselves: ``check_inputs``).
CHECKED_LM_EVAL = "0.4.13"


def encoded(lm: Any, keys: Sequence[tuple[str, str]]) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) tokens of each request, by lm-eval's own
    ``TemplateLM.loglikelihood`` (its empty-context rule, ``_encode_pair`` and all): its
    hand-over to ``_loglikelihood_tokens`` is caught instead of run."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.model import TemplateLM

    caught: list[tuple[list[int], list[int]]] = []

    def catch(requests: list, disable_tqdm: bool = False, **_: Any) -> list[Answer]:
        caught.extend((list(context), list(continuation)) for _, context, continuation
                      in requests)
        return [(0.0, False)] * len(requests)

    proxy = LMProxy(lm, _loglikelihood_tokens=catch)
    TemplateLM.loglikelihood(proxy, [Instance("loglikelihood", doc={}, arguments=key, idx=0)
                                     for key in keys], disable_tqdm=True)
    return caught


class LMProxy:
    """``lm`` with a few attributes replaced, for calling lm-eval's methods on it."""

    def __init__(self, lm: Any, **replaced: Any) -> None:
        self._lm, self._replaced = lm, replaced

    def __getattr__(self, name: str) -> Any:
        if name in self._replaced:
            return self._replaced[name]
        value = getattr(type(self._lm), name, None)
        if callable(value) and not isinstance(value, (staticmethod, classmethod, property)):
            return value.__get__(self)  # so its own self.<method> calls see the replacements
        return getattr(self._lm, name)


def hflm_class(lm: Any) -> type:
    """lm-eval's ``HFLM`` among ``lm``'s classes: its own methods, run on a proxy."""
    return next(c for c in type(lm).__mro__ if c.__name__ == "HFLM")


def model_input(context: list[int], continuation: list[int], max_length: int) -> list[int]:
    """The tokens HFLM's ``_loglikelihood_tokens`` feeds a decoder-only model for one
    request: context + continuation minus the last token, cut on the left to
    ``max_length``."""
    return (context + continuation)[-(max_length + 1):][:-1]


def check_inputs(lm: Any, pairs: Sequence[tuple[list[int], list[int]]]) -> None:
    """Refuse to measure when HFLM would build these requests' model inputs otherwise
    than ``model_input`` (a newer lm-eval may): HFLM's own ``_loglikelihood_tokens`` runs
    on them with its model call caught (and no response cache), and the rows it would
    send are compared, padding aside."""
    import lm_eval
    from lm_eval.api.model import CacheHook

    # HFLM answers identical requests once (one row): the narrowest and the widest request
    # are one and the same when a subset has a single request, or only identical ones.
    pairs = [(list(c), list(x)) for c, x in dict.fromkeys((tuple(c), tuple(x))
                                                          for c, x in pairs)]
    sent: list[list[int]] = []
    vocab = 1 + max(max(c + x, default=0) for c, x in pairs)

    def catch(inputs: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        sent.extend(inputs.tolist())
        return torch.zeros(*inputs.shape, vocab, device=inputs.device)

    base = hflm_class(lm)
    proxy = LMProxy(lm, _model_call=catch, cache_hook=CacheHook(None))
    problem = None
    try:
        base._loglikelihood_tokens(proxy, [(("", ""), list(c), list(x)) for c, x in pairs],
                                   disable_tqdm=True, override_bs=len(pairs))
    except Exception as err:  # noqa: BLE001 — said below, with the version
        problem = f"{type(err).__name__}: {err}"
    unmatched = [list(row) for row in sent]
    # Requests with one model input are one row (HFLM groups a question's one-token
    # choices by context + continuation[:-1]): one row is expected for them.
    for want in map(list, dict.fromkeys(tuple(model_input(c, x, int(lm.max_length)))
                                        for c, x in pairs)):
        match = next((row for row in unmatched
                      if row[:len(want)] == want and not any(row[len(want):])), None)
        if match is None:
            problem = problem or f"HFLM sends {sent}, expected a row {want}"
            break
        unmatched.remove(match)
    if problem is not None:
        raise RuntimeError(
            f"lm-eval {getattr(lm_eval, '__version__', '?')} builds loglikelihood model "
            f"inputs otherwise than lm-eval {CHECKED_LM_EVAL}, which this package's "
            f"scored-positions path was checked against ({problem}); install "
            f"lm-eval=={CHECKED_LM_EVAL}")


@contextlib.contextmanager
def logits_only_at(model: Any, rows: torch.Tensor, positions: torch.Tensor
                   ) -> Iterator[None]:
    """Inside, the model's output embedding (``lm_head``) sees only the hidden states at
    ``(rows[i], positions[i])``, so the forward returns logits of shape ``(1, S, vocab)``.

    A loglikelihood needs the logits of the continuation tokens only; over the whole
    sequence the vocabulary projection is a large share of a small model's forward and
    of its memory (K masks x every position x the vocabulary). Whatever the model does
    after ``lm_head`` (soft-capping, scaling) is elementwise, so it still applies.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") \
        else None
    if head is None:
        raise AttributeError(f"{type(model).__name__} has no output embedding")

    def pick_scored(_module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        # With parallelize=True lm_head (and so its input) may sit on another GPU than
        # the one the batch was built on; indices must be on the indexed tensor's device.
        return (hidden[rows.to(hidden.device), positions.to(hidden.device)][None],
                *args[1:])

    handle = head.register_forward_pre_hook(pick_scored)
    try:
        yield
    finally:
        handle.remove()


def scored_positions_apply(lm: Any) -> bool:
    """Whether ``loglikelihoods_for_masks`` answers for ``lm``: a decoder-only model that
    sees exactly the request's tokens. A PEFT prompt-learning adapter (prompt, prefix or
    P-tuning) prepends virtual tokens, which moves every scored position; HFLM allows for
    them, so such a model answers through HFLM (``HarnessMeasurement.measure_with_model``).
    """
    if getattr(lm, "backend", "causal") != "causal":
        return False
    # PeftModel.active_peft_config; a plain transformers model has none (AttributeError).
    config = getattr(lm.model, "active_peft_config", None)
    return not getattr(config, "is_prompt_learning", False)


@dataclass
class ScoredBatch:
    """One forward pass's worth of requests, built as HFLM's ``_loglikelihood_tokens``
    builds it (context + continuation minus the last token, truncated on the left to
    ``max_length``, right padding), with where each continuation token is scored.
    Requests with the same model input share its row (an MMLU-style question's one-token
    choices all read the question alone), as HFLM's one-token grouping has them."""

    keys: list[tuple[str, str]]  # the requests of the batch
    input_ids: torch.Tensor  # (rows, width): one row per distinct model input
    rows: torch.Tensor  # per scored token: its batch row ...
    positions: torch.Tensor  # ... the position whose logits predict it ...
    targets: torch.Tensor  # ... the token ...
    owners: torch.Tensor  # ... and the request it belongs to (an index into keys)


class LoglikelihoodRequests:
    """The loglikelihood requests of a fixed example subset, tokenized once and batched
    once per batch size: a measurement loop reuses them for every mask. A batch size
    counts distinct model inputs (``ScoredBatch``)."""

    def __init__(self, lm: Any, requests: Sequence[tuple[str, str]]) -> None:
        self.keys = list(dict.fromkeys(tuple(r) for r in requests))
        self._encoded = encoded(lm, self.keys)
        for key, (_, continuation) in zip(self.keys, self._encoded, strict=True):
            # HFLM asserts both; scored here they would be (0, greedy) or wrapped positions.
            # The task's answers, not the package, are at fault: one line, no traceback.
            if not continuation or len(continuation) > int(lm.max_length):
                raise UserError(
                    f"loglikelihood request {key!r}: its continuation is "
                    f"{len(continuation)} tokens; lm-eval scores 1 to max_length "
                    f"({int(lm.max_length)})")
        if self._encoded:  # the widest and the narrowest, where truncation would show
            by_width = sorted(self._encoded, key=lambda pair: len(pair[0] + pair[1]))
            check_inputs(lm, [by_width[0], by_width[-1]])
        if hasattr(lm, "remember_prompts"):  # resample ablation picks donors by the prompt
            lm.remember_prompts(self._encoded)
        self._max_length = int(lm.max_length)
        self._device = lm.device
        # The requests of each distinct model input, in the order first seen.
        self._sharing: dict[tuple[int, ...], list[int]] = {}
        for index, pair in enumerate(self._encoded):
            self._sharing.setdefault(tuple(model_input(*pair, self._max_length)),
                                     []).append(index)
        self._batches: dict[int, list[ScoredBatch]] = {}
        # Narrow lm_head to the scored positions unless the model has no output embedding.
        get_head = getattr(lm.model, "get_output_embeddings", None)
        self.narrow = get_head is not None and get_head() is not None

    def batches(self, size: int) -> list[ScoredBatch]:
        if size not in self._batches:
            # Widest first (as HFLM orders them), the first-seen order among equals.
            inputs = sorted(self._sharing.items(), key=lambda item: -len(item[0]))
            self._batches[size] = [self._batch(inputs[start:start + size])
                                   for start in range(0, len(inputs), size)]
        return self._batches[size]

    def widest(self) -> tuple[list[int], list[int]]:
        """(context, continuation) tokens of the request with the widest model input."""
        return max(self._encoded, key=lambda pair: len(pair[0] + pair[1]))

    def shapes(self, size: int) -> list[tuple[int, int, int]]:
        """(rows, width, scored tokens) of each forward pass at batch size ``size``."""
        return [(*batch.input_ids.shape, len(batch.targets)) for batch in self.batches(size)]

    def _batch(self, chunk: list[tuple[tuple[int, ...], list[int]]]) -> ScoredBatch:
        input_ids = torch.zeros(len(chunk), max(len(t) for t, _ in chunk), dtype=torch.long)
        keys: list[tuple[str, str]] = []
        rows, positions, targets, owners = [], [], [], []
        for row, (tokens, sharing) in enumerate(chunk):
            input_ids[row, :len(tokens)] = torch.tensor(tokens)
            for i in sharing:
                continuation = self._encoded[i][1]
                positions.extend(range(len(tokens) - len(continuation), len(tokens)))
                rows.extend([row] * len(continuation))
                targets.extend(continuation)
                owners.extend([len(keys)] * len(continuation))
                keys.append(self.keys[i])
        device = self._device
        return ScoredBatch(keys, input_ids.to(device),
                           torch.tensor(rows, device=device),
                           torch.tensor(positions, device=device),
                           torch.tensor(targets, device=device),
                           torch.tensor(owners, device=device))


def _scored_logits(lm: Any, requests: LoglikelihoodRequests, input_ids: torch.Tensor,
                   rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits ``(S, vocab)`` at the scored positions, computing no others when possible."""
    if requests.narrow:
        with logits_only_at(lm.model, rows, positions):
            logits = lm._model_call(input_ids)
        if logits.shape[:2] == (1, len(rows)):
            return logits[0]
        requests.narrow = False  # lm_head is not where this model makes its logits
    logits = lm._model_call(input_ids)
    return logits[rows.to(logits.device), positions.to(logits.device)]


@torch.no_grad()
def loglikelihoods_for_masks(lm: Any, requests: Sequence[tuple[str, str]] | LoglikelihoodRequests,
                             masks: Sequence[Sequence[Head | str]], batch_size: int = 32
                             ) -> list[dict[tuple[str, str], Answer]]:
    """(logprob, is_greedy) of every request under every mask, K masks per forward pass.

    Each ``ScoredBatch`` is replicated once per mask, every copy with its own head mask,
    so the answers equal one-mask-at-a-time evaluation up to float rounding. Logits are
    computed at the continuation positions only. ``batch_size`` counts rows of a pass.
    The log-softmax is taken in HFLM's ``softmax_dtype`` (default: the logits' dtype),
    so the answers are HFLM's.
    """
    if not scored_positions_apply(lm):
        raise ValueError(f"{type(lm.model).__name__}: scored positions need a decoder-only "
                         "model without a prompt-learning adapter; use HFLM's loglikelihood")
    if not isinstance(requests, LoglikelihoodRequests):
        requests = LoglikelihoodRequests(lm, requests)
    knockout = lm.knockout
    k_masks = len(masks)
    row_masks = knockout.row_masks([lm._parsed(heads) if heads else () for heads in masks])
    softmax_dtype = getattr(lm, "softmax_dtype", None)
    keys: list[tuple[str, str]] = []
    summed_parts, misses_parts = [], []
    for batch in requests.batches(max(1, batch_size // max(1, k_masks))):
        size = len(batch.input_ids)
        copies = torch.arange(k_masks, device=batch.rows.device)[:, None] * size
        with lm.knocking_out(row_masks=row_masks.repeat_interleave(size, dim=0)):
            logits = _scored_logits(lm, requests, batch.input_ids.repeat(k_masks, 1),
                                    (copies + batch.rows).flatten(),
                                    batch.positions.repeat(k_masks))
        # As HFLM's _loglikelihood_tokens: log_softmax(logits, dtype=softmax_dtype).
        logprobs = F.log_softmax(logits, dim=-1, dtype=softmax_dtype)
        logprobs = logprobs.view(k_masks, len(batch.rows), -1)
        target = batch.targets.to(logprobs.device)
        token_logprob = logprobs.gather(2, target.expand(k_masks, -1)[..., None])[..., 0]
        token_greedy = (logprobs.argmax(dim=-1) == target).float()
        # Per request: the sum of its tokens' logprobs, and whether all were greedy.
        # HFLM's logprobs.sum() accumulates half precision in float32 and rounds the
        # total to the logprobs' dtype; so does this.
        owner = batch.owners.to(logprobs.device)
        total = torch.promote_types(logprobs.dtype, torch.float32)
        empty = torch.zeros(k_masks, len(batch.keys), dtype=total, device=logprobs.device)
        summed_parts.append(empty.index_add(1, owner, token_logprob.to(total))
                            .to(logprobs.dtype))
        misses_parts.append(empty.index_add(1, owner, 1.0 - token_greedy.to(total)))
        keys += batch.keys
    # To the host once, after every pass: a copy per pass would make the host wait for
    # each pass to finish before it queues the next (on a GPU, idle between passes).
    summed = torch.cat(summed_parts, dim=1).cpu().tolist() if keys else [[]] * k_masks
    misses = torch.cat(misses_parts, dim=1).cpu().tolist() if keys else [[]] * k_masks
    return [{key: (summed[k][index], misses[k][index] == 0) for index, key in enumerate(keys)}
            for k in range(k_masks)]
