"""Several head masks per forward pass, for loglikelihood tasks.

The requests of a fixed example subset do not depend on the mask. So they are collected
once (lm-eval's ``evaluate`` run against a recorder), their loglikelihoods are computed
for K masks at a time (the batch is replicated K times and each row gets its own head
mask through ``HeadKnockout.set_row_masks``), and each mask's answers are then handed to
lm-eval's ``evaluate`` in turn through a replaying model, so the harness still applies
its filters, metrics and aggregation.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from .heads import Head

__all__ = ["RecordingLM", "ReplayLM", "loglikelihoods_for_masks"]

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


@torch.no_grad()
def loglikelihoods_for_masks(lm: Any, requests: Sequence[tuple[str, str]],
                             masks: Sequence[Sequence[Head]], batch_size: int = 32
                             ) -> list[dict[tuple[str, str], Answer]]:
    """(logprob, is_greedy) of every request under every mask, K masks per forward pass.

    Inputs are built as HFLM's ``_loglikelihood_tokens`` builds them (context +
    continuation minus the last token, truncated on the left to ``max_length``, right
    padding, causal attention), so the answers equal one-mask-at-a-time evaluation up to
    float rounding.
    """
    knockout = lm.knockout
    unique = list(dict.fromkeys(tuple(r) for r in requests))
    encoded = [_encode(lm, c, x) for c, x in unique]
    order = sorted(range(len(unique)), key=lambda i: -len(encoded[i][0] + encoded[i][1]))
    row_masks = torch.zeros(len(masks), knockout.num_layers * knockout.num_heads,
                            dtype=torch.bool)
    for k, heads in enumerate(masks):
        for head in heads:
            row_masks[k, Head(*head).index(knockout.num_heads)] = True
    answers: list[dict[tuple[str, str], Answer]] = [{} for _ in masks]
    per_pass = max(1, batch_size // max(1, len(masks)))  # rows per pass ~ batch_size
    try:
        for start in range(0, len(order), per_pass):
            chunk = order[start:start + per_pass]
            tokens = [(encoded[i][0] + encoded[i][1])[-(lm.max_length + 1):][:-1]
                      for i in chunk]
            width = max(len(t) for t in tokens)
            batch = torch.zeros(len(chunk), width, dtype=torch.long)
            for row, t in enumerate(tokens):
                batch[row, :len(t)] = torch.tensor(t)
            knockout.set_row_masks(row_masks.repeat_interleave(len(chunk), dim=0))
            logits = lm._model_call(batch.repeat(len(masks), 1).to(lm.device))
            for k in range(len(masks)):
                for row, i in enumerate(chunk):
                    continuation = encoded[i][1]
                    n = len(continuation)
                    end = len(tokens[row])
                    scored = F.log_softmax(
                        logits[k * len(chunk) + row, end - n:end].float(), dim=-1)
                    target = torch.tensor(continuation, device=scored.device)
                    greedy = bool((scored.argmax(dim=-1) == target).all())
                    logprob = float(scored.gather(1, target[:, None]).sum())
                    answers[k][unique[i]] = (logprob, greedy)
    finally:
        knockout.set_row_masks(None)
    return answers
