"""The prompts' common start, computed once per ``generate`` call.

The rows of a generation batch often begin with the same tokens: a chat template's system
prompt, a task's fixed instruction or few-shot examples. For a short answer the prompts'
forward pass is most of a generating measurement's cost on a CPU (``rhyme`` on the embedded
SmolLM2 with its chat template: 36 of the prompts' 45 tokens are common to every row), and
it is the same computation in every row. Here it is done once per mask: its key/value cache
is computed for the common start and copied to every row (``prefill``), and each row is laid
out as [common start][its padding][the rest of its prompt] (``laid_out``), so ``generate``
computes only the rest.

The answers are those of the left-padded batch: ``generate`` takes position ids from the
attention mask (its cumulative sum), so every token keeps the position it has with left
padding, and the padding in the middle is masked as it is at the left. That holds for
models whose key/value cache is a plain list of full-attention layers (``plain_cache``);
sliding-window layers (where the window would count the padding) and recurrent states are
left to the ordinary call.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["beams", "cache_argument", "laid_out", "plain_cache", "shared_start"]


def shared_start(context: torch.Tensor, attention_mask: torch.Tensor | None) -> int:
    """How many leading tokens every row's prompt has in common. ``context``: the rows,
    left-padded as lm-eval pads them for ``generate``; ``attention_mask``: 1 on a prompt's
    tokens (None: no padding). At most the shortest prompt less one token (``generate``
    computes at least one); 0 for a single row or padding that is not on the left."""
    rows, width = context.shape
    mask = (torch.ones_like(context) if attention_mask is None
            else attention_mask.to(context.device)).bool()
    lengths = mask.sum(dim=1)
    left_padded = torch.arange(width, device=context.device) >= (width - lengths)[:, None]
    longest = int(lengths.min()) - 1
    if rows < 2 or longest < 1 or not torch.equal(mask, left_padded):
        return 0
    columns = (width - lengths)[:, None] + torch.arange(longest, device=context.device)
    tokens = context.gather(1, columns)
    same = (tokens == tokens[:1]).all(dim=0)
    return int(same.long().cumprod(dim=0).sum())


def laid_out(context: torch.Tensor, attention_mask: torch.Tensor | None, start: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``context`` and its attention mask with each row as [its first ``start`` tokens]
    [its padding][its other tokens]: as wide as before, so the generated tokens fall in
    the same columns. ``start``: at most ``shared_start``."""
    width = context.shape[1]
    mask = (torch.ones_like(context) if attention_mask is None
            else attention_mask.to(context.device))
    padding = (width - mask.sum(dim=1))[:, None]
    column = torch.arange(width, device=context.device)[None, :]
    source = torch.where(column < start, padding + column,
                         torch.where(column < start + padding, column - start, column))
    return context.gather(1, source), mask.gather(1, source)


def plain_cache(cache: Any) -> bool:
    """Whether ``cache`` (a forward pass's key/value cache) is a ``DynamicCache`` of
    full-attention layers only, whose rows ``batch_select_indices`` can copy."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    layers = getattr(cache, "layers", None)
    return (isinstance(cache, DynamicCache) and bool(layers)
            and all(type(layer) is DynamicLayer for layer in layers))


def cache_argument(model: Any) -> str | None:
    """The name under which ``model``'s forward takes a key/value cache (``cache`` in
    recent transformers, ``past_key_values`` before); None where its forward takes no
    ``position_ids`` (its positions would not follow the attention mask) or no cache."""
    parameters = inspect.signature(model.forward).parameters
    if "position_ids" not in parameters or getattr(model.config, "is_encoder_decoder", False):
        return None
    return next((name for name in ("cache", "past_key_values") if name in parameters), None)


def beams(model: Any, generation_kwargs: dict[str, Any]) -> int:
    """The beams of a ``generate`` call of ``model`` with ``generation_kwargs`` (where they
    give none, or None, the model's generation config's): ``generate`` runs that many rows
    per prompt, each row repeated in place, so a key/value cache or a per-row value made
    for the prompts' rows must be repeated alike."""
    given = generation_kwargs.get("num_beams")
    if given is None:
        given = getattr(getattr(model, "generation_config", None), "num_beams", None)
    return int(given or 1)
