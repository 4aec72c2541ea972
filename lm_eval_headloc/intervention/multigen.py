"""Several head masks per ``generate`` call, and rows that stop on their own.

A generation measurement's requests do not depend on the mask, so, as for loglikelihood
(``multimask``), they are recorded once. Each batch HFLM's ``generate_until`` would send is
then replicated K times, every copy with its own head mask (per-row masks: a row keeps its
row of the mask through every key/value-cache step, whatever the sequence length), and each
mask's rows go through lm-eval's own ``generate_until`` post-processing (decode, cut at
``until``), so its answers are those of a measurement of it alone.

lm-eval's stopping criteria end a batch only when one ``until`` string is in *every* row
(or at ``max_gen_toks``): a row that stopped on another string, or early, generates on and
its text is cut after the fact. ``RowStops`` ends each row as soon as one of its stop
strings is in its generated text (or it generated an end-of-sequence token). lm-eval keeps
the text before the first stop string only, which is the same either way; a batch then ends
as soon as all its rows have. This is for greedy decoding without thinking tokens and
with a pad token that decodes to nothing (``stops_per_row``): with sampling a shorter batch
leaves the random generator elsewhere for the next batch, with ``think_end_token`` a stop
string before it does not end the answer, and a pad token that is a word stays in a row's
text as often as its batch ran on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from transformers import StoppingCriteria

from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.intervention.prompt_start import beams

__all__ = ["RowStops", "could_end", "generations_for_masks", "row_stops_for",
           "rows_stop_on_their_own", "shares_generate", "stopping_per_row", "stops_per_row"]


class RowStops(StoppingCriteria):
    """Ends each row of a ``generate`` batch on its own: once one of ``stops`` is in the
    text it generated, or its last token is one of ``eos_ids``.

    A row's text is looked at as lm-eval's ``MultiTokenEOSCriteria`` looks at it: the last
    tokens generated (as many as the longest stop string's tokens, plus two), decoded; and
    only on a step whose new token could end a stop string (``could_end``): decoding every
    row at every step would cost a large batch milliseconds a step. ``finished_at[row]``:
    the sequence width at which the row finished (None: still going), which is where a
    batch of that row's mask alone would have ended.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_width: int, rows: int,
                 eos_ids: Iterable[int] = (), vocab_size: int = 0) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: its ids past the tokenizer's are looked up
        self.stops = tuple(stop for stop in stops if stop)
        self.lookback = max((len(tokenizer.encode(stop, add_special_tokens=False)) + 2
                             for stop in self.stops), default=1)
        self.prompt_width = prompt_width
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.finished_at: list[int | None] = [None] * rows
        self._open: torch.Tensor | None = None  # rows still going, on the batch's device
        self._could_end: torch.Tensor | None = None

    def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any
                 ) -> torch.BoolTensor:
        width = int(input_ids.shape[1])
        if self._open is None:
            self._open = torch.ones(len(self.finished_at), dtype=torch.bool,
                                    device=input_ids.device)
            self._could_end = could_end(self.tokenizer, self.stops, self.eos_ids,
                                        self.vocab_size).to(input_ids.device)
        table = self._could_end
        last = input_ids[:, -1]
        # Ids past the table (past the tokenizer's and the model's vocabulary) are looked at.
        could = torch.where(last < len(table), table[last.clamp(max=len(table) - 1)], True)
        # One copy to the host per step: the rows to look at (few), then their tails.
        candidates = (self._open & could).nonzero().flatten().tolist()
        if candidates:
            start = max(self.prompt_width, width - self.lookback)
            tails = input_ids[candidates, start:].tolist()
            texts = self.tokenizer.batch_decode(tails)
            ended = [row for row, tail, text in zip(candidates, tails, texts, strict=True)
                     if tail[-1] in self.eos_ids or any(s in text for s in self.stops)]
            for row in ended:
                self.finished_at[row] = width
            if ended:
                self._open[ended] = False
        return ~self._open

    def width_of(self, rows: range, full: int) -> int:
        """Where a batch of only ``rows`` would have ended: when its last row finished
        (``full``, the batch's own width, if one never did)."""
        ends = [self.finished_at[row] for row in rows]
        return full if any(end is None for end in ends) else max(ends, default=full)


@functools.lru_cache(maxsize=8)
def could_end(tokenizer: Any, stops: tuple[str, ...], eos_ids: frozenset[int],
              vocab_size: int = 0) -> torch.Tensor:
    """Per token id, whether a step that generates it may complete one of ``stops`` (or
    end the row: ``eos_ids``). A stop string newly in the decoded tail must end in the new
    token's text, so its last character is there — where that character stands alone in a
    token's own decoding (ASCII, not a space, which SentencePiece drops at a token's
    start); for other stop strings every token may. The ids are the tokenizer's and, up to
    ``vocab_size``, a model's past them (a vocabulary padded past the tokenizer's, which
    an untrained model generates from as readily as any), which a fast tokenizer decodes to
    nothing: looking at every row that generated one cost a 1,500-row batch milliseconds a
    step. Where the tokenizer cannot decode them one by one, they are looked at."""
    decoded = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    try:
        decoded += tokenizer.batch_decode([[i] for i in range(len(decoded), vocab_size)])
    except Exception:  # noqa: BLE001 - a tokenizer's own error: those ids stay looked at
        pass
    table = torch.zeros(len(decoded), dtype=torch.bool)
    for stop in stops:
        last = stop[-1]
        if last == " " or not last.isascii():
            return torch.ones(len(decoded), dtype=torch.bool)
        table |= torch.tensor([last in text for text in decoded])
    for eos in eos_ids:
        if 0 <= eos < len(table):
            table[eos] = True
    return table


def _eos_ids(lm: Any) -> list[int]:
    """The tokens ``generate`` ends a row on (the generation config's, as transformers
    reads it), besides the ``until`` strings lm-eval passes."""
    eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = lm.tokenizer.eos_token_id
    return [] if eos is None else [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _vocab_size(model: Any) -> int:
    """The ids ``model`` can generate: its output embedding's rows (0 if not told)."""
    output = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(output, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 \
        else 0


def stops_per_row(lm: Any, generation_kwargs: dict[str, Any]) -> bool:
    """Whether rows may stop on their own for a ``_model_generate`` call with these
    ``generation_kwargs`` (before HFLM reads them): greedy search, as HFLM resolves it
    (temperature 0 and no ``do_sample``: greedy; ``do_sample`` unset with a temperature:
    the model's generation config decides), one beam, no thinking tokens, and a pad token
    that decodes to nothing."""
    config = getattr(lm.model, "generation_config", None)
    do_sample = generation_kwargs.get("do_sample")
    if do_sample is None:
        do_sample = (generation_kwargs.get("temperature", 0.0) != 0.0
                     and bool(getattr(config, "do_sample", False)))
    # A seq2seq model's generated sequence is the decoder's, without the prompt's columns
    # that RowStops passes over.
    return (getattr(lm, "backend", "causal") == "causal" and not do_sample
            and beams(lm.model, generation_kwargs) == 1
            and getattr(lm, "think_end_token", None) is None
            and _padding_is_silent(lm.tokenizer))


def _padding_is_silent(tokenizer: Any) -> bool:
    """Whether the pad token decodes to nothing (a special token, as lm-eval's own
    ``configure_pad_token`` makes it). A pad token that is a word stays in the text of a
    row that ended on an end-of-sequence token, as many times as the batch ran on after
    it: ending rows sooner would change those answers."""
    pad = tokenizer.pad_token_id
    # As lm-eval decodes an answer (``tok_decode``): what its tokenizer skips, not what the
    # tokenizer lists as special (a pad token set by hand is listed, and decoded).
    return pad is None or tokenizer.decode([pad], skip_special_tokens=True) == ""


def stopping_per_row(lm: Any) -> bool:
    """Whether ``lm``'s ``generate`` calls stop each row on its own now (inside
    ``rows_stop_on_their_own``)."""
    return getattr(lm, "row_stops", None) is not None


@contextlib.contextmanager
def rows_stop_on_their_own(lm: Any) -> Iterator[list[RowStops]]:
    """Inside, ``lm``'s ``_model_generate`` (``HFHeadAblateLM``) stops each row on its own:
    ``RowStops`` (``row_stops_for``) in place of the criteria lm-eval's own
    ``_model_generate`` makes; yields the list of the criteria made, one per call. Nested,
    the outer list gets them."""
    made = getattr(lm, "row_stops", None)
    if made is not None:  # already inside: the outer one collects
        yield made
        return
    made = []
    lm.row_stops = made
    try:
        yield made
    finally:
        lm.row_stops = None


def row_stops_for(lm: Any, stops: Sequence[str], prompt_width: int, rows: int) -> RowStops:
    """The ``RowStops`` of one ``generate`` call of ``lm`` inside ``rows_stop_on_their_own``
    (``rows`` rows, prompts ``prompt_width`` wide), kept in its list."""
    criteria = RowStops(lm.tokenizer, stops, prompt_width, rows, _eos_ids(lm),
                        _vocab_size(lm.model))
    lm.row_stops.append(criteria)
    return criteria


def shares_generate(lm: Any, instances: Sequence[Any]) -> bool:
    """Whether several masks may share ``generate`` calls for these generation requests:
    a decoder-only model that sees the prompt's tokens as they are (``multimask.
    scored_positions_apply``), requests that are generations or plain loglikelihoods
    (``multimask`` answers those; rolling ones are not) with at least one generation, and
    greedy generations whose rows stop on their own (``stops_per_row``). Sampled ones draw
    otherwise in a bigger batch."""
    from lm_eval.models.utils import normalize_gen_kwargs

    from lm_eval_headloc.intervention.multimask import scored_positions_apply

    kinds = {instance.request_type for instance in instances}
    if "generate_until" not in kinds or not kinds <= {"generate_until", "loglikelihood"}:
        return False
    if not scored_positions_apply(lm):
        return False
    for instance in instances:
        if instance.request_type != "generate_until":
            continue
        kwargs = dict(instance.args[1]) if len(instance.args) > 1 else {}
        kwargs = normalize_gen_kwargs(kwargs, int(getattr(lm, "max_gen_toks", 256)))
        # HFLM leaves temperature out of greedy calls; do_sample as normalized.
        if not stops_per_row(lm, {"do_sample": kwargs.get("do_sample"),
                                  "temperature": kwargs.get("temperature", 0.0),
                                  "num_beams": kwargs.get("num_beams")}):
            return False
    return True


@torch.no_grad()
def generations_for_masks(lm: Any, instances: Sequence[Any],
                          masks: Sequence[Sequence[Head | str]], rows: int) -> list[list[str]]:
    """Each mask's answers to lm-eval's ``generate_until`` ``instances`` (in their order),
    the masks sharing every ``generate`` call.

    HFLM's own ``generate_until`` batches the requests (``rows`` per batch, sorted and
    grouped as it does) and post-processes the tokens; each batch it sends to the model is
    generated once for all K masks (K x ``rows`` rows, mask k in the k-th copy) and each
    copy cut where a batch of its mask alone would have ended (``RowStops.width_of``).
    ``shares_generate`` must hold (greedy requests).
    """
    from lm_eval.api.model import CacheHook

    from lm_eval_headloc.intervention.multimask import LMProxy, hflm_class

    k_masks = len(masks)
    row_masks = lm.knockout.row_masks([lm._parsed(heads) if heads else () for heads in masks])
    # Per mask, the tokens of each batch, in the order HFLM sends the batches.
    outputs: list[list[torch.Tensor]] = [[] for _ in masks]

    def generate_together(context: torch.Tensor, max_length: int, stop: list[str],
                          **kwargs: Any) -> torch.Tensor:
        size = len(context)
        attention = kwargs.pop("attention_mask", None)
        if attention is not None:
            kwargs["attention_mask"] = attention.repeat(k_masks, 1)
        with lm.knocking_out(row_masks=row_masks.repeat_interleave(size, dim=0)), \
                rows_stop_on_their_own(lm) as made:
            generated = lm._model_generate(context.repeat(k_masks, 1), max_length, stop,
                                           **kwargs)
        stops = made[-1]
        width = int(generated.shape[1])
        for k in range(k_masks):
            mask_rows = range(k * size, (k + 1) * size)
            outputs[k].append(generated[k * size:(k + 1) * size,
                                        :stops.width_of(mask_rows, width)])
        return outputs[0][-1]

    hflm = hflm_class(lm)
    answers = [hflm.generate_until(
        LMProxy(lm, _model_generate=generate_together, batch_size=rows,
                cache_hook=CacheHook(None)), list(instances), disable_tqdm=True)]
    for k in range(1, k_masks):
        made = iter(outputs[k])
        answers.append(hflm.generate_until(
            LMProxy(lm, _model_generate=lambda *_, made=made, **__: next(made),
                    batch_size=rows, cache_hook=CacheHook(None)),
            list(instances), disable_tqdm=True))
    return answers
