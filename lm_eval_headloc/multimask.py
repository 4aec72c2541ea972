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
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .heads import Head, parse_heads

__all__ = ["RecordingLM", "ReplayLM", "logits_only_at", "loglikelihoods_for_masks"]

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


def _scored_logits(lm: Any, batch: torch.Tensor, rows: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """Logits ``(S, vocab)`` at the scored positions, computing no others when possible."""
    try:
        with logits_only_at(lm.model, rows, positions):
            logits = lm._model_call(batch)
        if logits.shape[:2] == (1, len(rows)):
            return logits[0]
    except AttributeError:
        pass
    # An architecture whose output embedding we cannot narrow: all logits, then pick.
    return lm._model_call(batch)[rows, positions]


@torch.no_grad()
def loglikelihoods_for_masks(lm: Any, requests: Sequence[tuple[str, str]],
                             masks: Sequence[Sequence[Head | str]], batch_size: int = 32
                             ) -> list[dict[tuple[str, str], Answer]]:
    """(logprob, is_greedy) of every request under every mask, K masks per forward pass.

    Inputs are built as HFLM's ``_loglikelihood_tokens`` builds them (context +
    continuation minus the last token, truncated on the left to ``max_length``, right
    padding, causal attention), so the answers equal one-mask-at-a-time evaluation up to
    float rounding. Logits are computed at the continuation positions only.
    """
    knockout = lm.knockout
    unique = list(dict.fromkeys(tuple(r) for r in requests))
    encoded = [_encode(lm, c, x) for c, x in unique]
    order = sorted(range(len(unique)), key=lambda i: -len(encoded[i][0] + encoded[i][1]))
    row_masks = torch.zeros(len(masks), knockout.num_layers * knockout.num_heads,
                            dtype=torch.bool)
    for k, heads in enumerate(masks):
        for head in parse_heads(heads, knockout.num_layers, knockout.num_heads) if heads else []:
            row_masks[k, head.index(knockout.num_heads)] = True
    answers: list[dict[tuple[str, str], Answer]] = [{} for _ in masks]
    per_pass = max(1, batch_size // max(1, len(masks)))  # rows per pass ~ batch_size
    try:
        for start in range(0, len(order), per_pass):
            chunk = order[start:start + per_pass]
            tokens = [(encoded[i][0] + encoded[i][1])[-(lm.max_length + 1):][:-1]
                      for i in chunk]
            width = max(len(t) for t in tokens)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            # The scored positions of every row of every mask copy, and their targets.
            rows, positions, targets = [], [], []
            for row, (t, i) in enumerate(zip(tokens, chunk, strict=True)):
                batch[row, :len(t)] = torch.tensor(t)
                continuation = encoded[i][1]
                end = len(t)
                positions.extend(range(end - len(continuation), end))
                rows.extend([row] * len(continuation))
                targets.extend(continuation)
            copies = torch.arange(len(masks))[:, None] * len(chunk)
            all_rows = (copies + torch.tensor(rows)[None]).flatten()
            all_positions = torch.tensor(positions).repeat(len(masks))
            knockout.set_row_masks(row_masks.repeat_interleave(len(chunk), dim=0))
            logits = _scored_logits(lm, batch.repeat(len(masks), 1).to(lm.device),
                                    all_rows.to(lm.device), all_positions.to(lm.device))
            logprobs = F.log_softmax(logits.float(), dim=-1).view(len(masks), len(rows), -1)
            target = torch.tensor(targets, device=logprobs.device)
            token_logprob = logprobs.gather(2, target.expand(len(masks), -1)[..., None])[..., 0]
            token_greedy = (logprobs.argmax(dim=-1) == target).float()
            # Per request: the sum of its tokens' logprobs, and whether all were greedy.
            owner = torch.tensor(rows, device=logprobs.device)
            empty = torch.zeros(len(masks), len(chunk), device=logprobs.device)
            summed = empty.index_add(1, owner, token_logprob)
            misses = empty.index_add(1, owner, 1.0 - token_greedy)
            summed, misses = summed.cpu().tolist(), misses.cpu().tolist()
            for k in range(len(masks)):
                for row, i in enumerate(chunk):
                    answers[k][unique[i]] = (summed[k][row], misses[k][row] == 0)
    finally:
        knockout.set_row_masks(None)
    return answers
