"""Several head masks per forward pass, for loglikelihood tasks.

The requests of a fixed example subset do not depend on the mask. So they are collected
once (lm-eval's ``evaluate`` run against a recorder), their loglikelihoods are computed
for K masks at a time (the batch is replicated K times and each row gets its own head
mask through ``HeadKnockout.set_row_masks``), and each mask's answers are then handed to
lm-eval's ``evaluate`` in turn through a replaying model, so the harness still applies
its filters, metrics and aggregation. Only the logits at the continuation tokens are
computed (``logits_only_at``). Loglikelihood measurements take this path for K = 1 too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .heads import Head, parse_heads

__all__ = ["LoglikelihoodRequests", "RecordingLM", "ReplayLM", "ScoredBatch", "logits_only_at",
           "loglikelihoods_for_masks"]

Answer = tuple[float, bool]


class RecordingLM:
    """Stands in for the model during one ``evaluate``: remembers the requests."""

    def __init__(self, lm: Any) -> None:
        self._lm = lm
        self.requests: list[tuple[str, str]] = []

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Answer]:
        self.requests.extend(tuple(r.args) for r in requests)
        return [(0.0, False)] * len(requests)

    def __getattr__(self, name: str) -> Any:  # rank, world_size, tokenizer_name, ...
        return getattr(self._lm, name)


class ReplayLM(RecordingLM):
    """Answers each loglikelihood request from precomputed results."""

    def __init__(self, lm: Any, answers: dict[tuple[str, str], Answer]) -> None:
        super().__init__(lm)
        self._answers = answers

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[Answer]:
        return [self._answers[tuple(r.args)] for r in requests]


def _encode(lm: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    # As lm-eval's TemplateLM.loglikelihood does, including its empty-context rule.
    if context == "":
        continuation_enc = lm.tok_encode(continuation, add_special_tokens=False)
        if lm.prefix_token_id != continuation_enc[0]:
            return [lm.prefix_token_id], continuation_enc
        return continuation_enc[:1], continuation_enc[1:]
    return lm._encode_pair(context, continuation)


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
        return (hidden[rows, positions][None], *args[1:])

    handle = head.register_forward_pre_hook(pick_scored)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class ScoredBatch:
    """One forward pass's worth of requests, built as HFLM's ``_loglikelihood_tokens``
    builds it (context + continuation minus the last token, truncated on the left to
    ``max_length``, right padding), with where each continuation token is scored."""

    keys: list[tuple[str, str]]  # the request of each batch row
    input_ids: torch.Tensor  # (rows, width)
    rows: torch.Tensor  # per scored token: its batch row ...
    positions: torch.Tensor  # ... the position whose logits predict it ...
    targets: torch.Tensor  # ... and the token


class LoglikelihoodRequests:
    """The loglikelihood requests of a fixed example subset, tokenized once and batched
    once per batch size: a measurement loop reuses them for every mask."""

    def __init__(self, lm: Any, requests: Sequence[tuple[str, str]]) -> None:
        self.keys = list(dict.fromkeys(tuple(r) for r in requests))
        self._encoded = [_encode(lm, c, x) for c, x in self.keys]
        self._max_length = int(lm.max_length)
        self._device = lm.device
        self._batches: dict[int, list[ScoredBatch]] = {}
        # Narrow lm_head to the scored positions unless the model has no output embedding.
        get_head = getattr(lm.model, "get_output_embeddings", None)
        self.narrow = get_head is not None and get_head() is not None

    def batches(self, size: int) -> list[ScoredBatch]:
        if size not in self._batches:
            encoded = self._encoded
            order = sorted(range(len(self.keys)), key=lambda i: -len(encoded[i][0] +
                                                                      encoded[i][1]))
            self._batches[size] = [self._batch(order[start:start + size])
                                   for start in range(0, len(order), size)]
        return self._batches[size]

    def _batch(self, chunk: list[int]) -> ScoredBatch:
        tokens = [(self._encoded[i][0] + self._encoded[i][1])[-(self._max_length + 1):][:-1]
                  for i in chunk]
        input_ids = torch.zeros(len(chunk), max(len(t) for t in tokens), dtype=torch.long)
        rows, positions, targets = [], [], []
        for row, (t, i) in enumerate(zip(tokens, chunk, strict=True)):
            input_ids[row, :len(t)] = torch.tensor(t)
            continuation = self._encoded[i][1]
            positions.extend(range(len(t) - len(continuation), len(t)))
            rows.extend([row] * len(continuation))
            targets.extend(continuation)
        device = self._device
        return ScoredBatch([self.keys[i] for i in chunk], input_ids.to(device),
                           torch.tensor(rows, device=device),
                           torch.tensor(positions, device=device),
                           torch.tensor(targets, device=device))


def _scored_logits(lm: Any, requests: LoglikelihoodRequests, input_ids: torch.Tensor,
                   rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Logits ``(S, vocab)`` at the scored positions, computing no others when possible."""
    if requests.narrow:
        with logits_only_at(lm.model, rows, positions):
            logits = lm._model_call(input_ids)
        if logits.shape[:2] == (1, len(rows)):
            return logits[0]
        requests.narrow = False  # lm_head is not where this model makes its logits
    return lm._model_call(input_ids)[rows, positions]


@torch.no_grad()
def loglikelihoods_for_masks(lm: Any, requests: Sequence[tuple[str, str]] | LoglikelihoodRequests,
                             masks: Sequence[Sequence[Head | str]], batch_size: int = 32
                             ) -> list[dict[tuple[str, str], Answer]]:
    """(logprob, is_greedy) of every request under every mask, K masks per forward pass.

    Each ``ScoredBatch`` is replicated once per mask, every copy with its own head mask,
    so the answers equal one-mask-at-a-time evaluation up to float rounding. Logits are
    computed at the continuation positions only. ``batch_size`` counts rows of a pass.
    """
    if not isinstance(requests, LoglikelihoodRequests):
        requests = LoglikelihoodRequests(lm, requests)
    knockout = lm.knockout
    k_masks = len(masks)
    row_masks = torch.zeros(k_masks, knockout.num_layers * knockout.num_heads,
                            dtype=torch.bool)
    for k, heads in enumerate(masks):
        for head in parse_heads(heads, knockout.num_layers, knockout.num_heads) if heads else []:
            row_masks[k, head.index(knockout.num_heads)] = True
    answers: list[dict[tuple[str, str], Answer]] = [{} for _ in masks]
    try:
        for batch in requests.batches(max(1, batch_size // max(1, k_masks))):
            size = len(batch.keys)
            knockout.set_row_masks(row_masks.repeat_interleave(size, dim=0))
            copies = torch.arange(k_masks, device=batch.rows.device)[:, None] * size
            logits = _scored_logits(lm, requests, batch.input_ids.repeat(k_masks, 1),
                                    (copies + batch.rows).flatten(),
                                    batch.positions.repeat(k_masks))
            logprobs = F.log_softmax(logits.float(), dim=-1).view(k_masks, len(batch.rows), -1)
            target = batch.targets.to(logprobs.device)
            token_logprob = logprobs.gather(2, target.expand(k_masks, -1)[..., None])[..., 0]
            token_greedy = (logprobs.argmax(dim=-1) == target).float()
            # Per request: the sum of its tokens' logprobs, and whether all were greedy.
            owner = batch.rows.to(logprobs.device)
            empty = torch.zeros(k_masks, size, device=logprobs.device)
            summed = empty.index_add(1, owner, token_logprob).cpu().tolist()
            misses = empty.index_add(1, owner, 1.0 - token_greedy).cpu().tolist()
            for k in range(k_masks):
                for row, key in enumerate(batch.keys):
                    answers[k][key] = (summed[k][row], misses[k][row] == 0)
    finally:
        knockout.set_row_masks(None)
    return answers
