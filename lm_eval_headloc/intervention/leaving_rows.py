"""Finished rows leave a greedy ``generate`` batch: its call made in segments.

A batch of greedy rows that stop on their own (``multigen.RowStops``) runs until its last
row ends, and every step computes every row, the finished ones too: on ``rhyme`` (the
embedded SmolLM2, 100 documents) half of the row-steps were of rows already finished, on
``rhyme_heldout`` 59 %. On a CPU a decoding step costs in proportion to its rows, so the
call is made in segments (``generate_leaving_rows``): ``generate`` pauses once a share of
its rows (``LEAVE_SHARE``) has finished, those rows leave (their rows of the key/value
cache dropped, their per-row masks with them), and the others go on from the cache where
they stopped. Each row gets the tokens of the one call: the same forward passes over its
own tokens, at the same positions (``generate`` reads them off the attention mask), and
the pad token after it finished, as ``generate`` writes it. On a GPU a step costs about as
much for 100 rows as for 32, and the model stays with the one call.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

__all__ = ["LEAVE_SHARE", "generate_leaving_rows"]

#: The share of a segment's rows that finish before it pauses and they leave.
LEAVE_SHARE = 0.25


class _Rows(StoppingCriteria):
    """The batch's ``RowStops`` (made for every row of the call) asked about the rows still
    in it (``rows``: their places in the call), through ``tokens``, the call's (rows, width)
    tokens so far; and a pause, once ``pause_after`` of them have finished."""

    def __init__(self, stops: Any, rows: torch.Tensor, tokens: torch.Tensor,
                 pause_after: int) -> None:
        self.stops, self.rows, self.tokens = stops, rows, tokens
        self.pause_after = pause_after
        self.paused = False

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any
                 ) -> torch.BoolTensor:
        width = int(input_ids.shape[1])
        self.tokens[self.rows, width - 1] = input_ids[:, -1].to(self.tokens.device)
        done = self.stops(self.tokens[:, :width], scores)[self.rows.to(input_ids.device)]
        if int(done.sum()) >= self.pause_after and not bool(done.all()):
            self.paused = True
            return torch.ones_like(done)
        return done


def generate_leaving_rows(generate: Callable[..., torch.Tensor], ids: torch.Tensor,
                          attention_mask: torch.Tensor, cache: Any, stops: Any,
                          pad_token_id: int, max_length: int,
                          rows_of: Callable[[torch.Tensor], contextlib.AbstractContextManager],
                          share: float | None = None) -> torch.Tensor:
    """What ``generate(input_ids=ids, attention_mask=..., stopping_criteria=[stops], ...)``
    returns for greedy rows, made in segments that finished rows leave.

    ``generate(input_ids, attention_mask, stopping_criteria)``: the model's ``generate``
    with the call's other arguments (the key/value cache ``cache``, which it extends in
    place, ``max_length``, the pad token). ``stops``: a ``multigen.RowStops`` for all of
    ``ids``' rows, which records where each finished. ``rows_of(rows)``: a context in which
    the model's forward passes apply to the batch of ``rows`` (their places in ``ids``)
    what they apply to those rows of the whole (their per-row masks). Returns the tokens,
    as wide as the last row's end, each row pad after its end. ``share``: the share of a
    segment's rows whose end pauses it (``LEAVE_SHARE``)."""
    share = LEAVE_SHARE if share is None else share
    total = len(ids)
    tokens = torch.full((total, max(int(max_length), ids.shape[1])), int(pad_token_id),
                        dtype=ids.dtype, device=ids.device)
    tokens[:, :ids.shape[1]] = ids
    rows = torch.arange(total, device=ids.device)
    inputs, mask = ids, attention_mask
    while True:
        criterion = _Rows(stops, rows, tokens, max(1, math.ceil(share * len(rows))))
        with rows_of(rows):
            inputs = generate(inputs, mask, StoppingCriteriaList([criterion]))
        width = int(inputs.shape[1])
        tokens[rows, :width] = inputs
        going = torch.tensor([stops.finished_at[int(row)] is None for row in rows],
                             dtype=torch.bool)
        if not criterion.paused or width >= max_length or not bool(going.any()):
            return tokens[:, :width]
        # The finished rows leave: the others go on from their cache, which holds every
        # column but the token the pause came after (generate computes it next).
        keep = going.nonzero().flatten()
        cache.batch_select_indices(keep.to(ids.device))
        rows, inputs = rows[keep.to(rows.device)], inputs[keep.to(inputs.device)]
        mask = torch.cat([mask[keep.to(mask.device)],
                          mask.new_ones((len(keep), width - mask.shape[1]))], dim=1)
