"""Which known kind of attention head each head is, read off its attention pattern.

Four scores name most of the heads interpretability work talks about, each the mean
attention weight a head puts on one target key per query, as TransformerLens's head
detector computes them (``transformer_lens.head_detector``):

- ``previous_token``: from each query position ``i >= 1`` to ``i - 1``;
- ``duplicate_token``: from each position whose token appeared earlier to the most recent
  earlier position ``j`` holding the same token;
- ``induction``: from the same positions to ``j + 1``, the token that followed the earlier
  copy (Olsson et al. 2022, "In-context learning and induction heads"), counted only where
  ``j + 1 < i`` (with ``j + 1 == i`` the target is the query itself);
- ``attention_sink``: from each query position ``i >= 1`` to the sequence's first position,
  where many heads park attention they do not need (Xiao et al. 2023, "Efficient streaming
  language models with attention sinks").

The usual probe (``repeated_probe``) is ``L`` distinct random tokens repeated twice,
optionally after one first token (a BOS): there the duplicate target of position ``i`` of
the second copy is ``i - L`` and its induction target ``i - L + 1``. Any other batch is
scored the same way from its own repeated tokens, so the run's own examples can be scored
too. Positions an ``attention_mask`` marks as padding are dropped before anything is
counted (position 0 means the first real token, with left padding too), and the means pool
every counted (sequence, query) pair of the batch. A batch with no repeated token has no
duplicate or induction measurement: those scores are NaN, never 0.

``dominant_type`` turns the scores into a label per head, or None where no kind stands out
from the model's typical head. Attention to the first position is what the typical head of
most language models does (Xiao et al.; the embedded SmolLM2's median head gives it 0.44 of
its attention), so no head stands out from the rest by it: the rule's threshold for it lay
above 1 (1.07 there), which no share of attention reaches. It is scored, for reading, and
labels no head (``LABELLED_TYPES``).

A probe's score is a mean over its rows, each drawn at random, so it carries a sampling
error: ``probe_type_scores`` gives each score's standard error over the rows, and a head is
labelled only where its score clears the threshold by ``LABEL_MARGIN`` standard errors
(``dominant_type(errors=…)``). One within that of the threshold is ``borderline``: another
probe seed may put it on either side, so it is said as such, never labelled; a labelled head
is then one that no probe of that size would call clearly not of its type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from lm_eval_headloc.common.options import PROBE_ROWS
from lm_eval_headloc.intervention.components import (
    Component,
    ComponentSpecError,
    Head,
    parse_components,
    validate_heads,
)

__all__ = ["DOMINANT_FLOOR", "DOMINANT_MADS", "DOMINANT_MIN_MARGIN", "EXAMPLES", "HEAD_TYPES",
           "LABELLED_TYPES", "LABEL_MARGIN", "MAD_TO_SD", "PER_PASS", "PROBE", "PROBE_FIRST_ID",
           "HeadTypes", "attention_patterns", "borderline", "dominant_type", "encode_texts",
           "head_type_scores", "head_types_of", "probe_type_scores", "repeated_probe",
           "type_scores_from_patterns", "type_thresholds"]

if TYPE_CHECKING:
    from lm_eval_headloc.measurement.measure import Measurement


#: The scores, in the order every result lists them.
HEAD_TYPES: tuple[str, ...] = ("previous_token", "duplicate_token", "induction",
                               "attention_sink")
#: The scores a head can be labelled by: not ``attention_sink``, which the typical head
#: shares (see the module docstring).
LABELLED_TYPES: tuple[str, ...] = ("previous_token", "duplicate_token", "induction")
#: Standard errors of the probe's score by which a head must clear a type's threshold to be
#: labelled with it (and within which of it the head is ``borderline``): as the threshold
#: asks three robust standard deviations of the heads, this asks three of the probe.
LABEL_MARGIN = 3.0

#: ``repeated_probe`` draws ids from ``PROBE_FIRST_ID`` up to the vocabulary's last id,
#: excluded: most tokenizers put their special tokens at the lowest ids (SmolLM2's are
#: 0-16) or at the very end (GPT-2's ``<|endoftext|>``).
PROBE_FIRST_ID = 20

#: ``dominant_type``'s rule: a head is of a type when its score exceeds
#: ``max(median + max(DOMINANT_MADS * MAD_TO_SD * MAD, DOMINANT_MIN_MARGIN), DOMINANT_FLOOR)``
#: over all of the model's heads (see ``type_thresholds``).
DOMINANT_MADS = 3.0
#: Scales a median absolute deviation to a standard deviation for normal data.
MAD_TO_SD = 1.4826
#: The least a score must exceed the median by, so that a MAD of ~0 (most heads alike)
#: does not make a hair above the median count.
DOMINANT_MIN_MARGIN = 0.1
#: The least score that can name a head, so that nothing is labelled on a model whose
#: heads are all near 0 for a type.
DOMINANT_FLOOR = 0.3


def repeated_probe(vocab_size: int, length: int = 32, batch: int = PROBE_ROWS, seed: int = 0,
                   first_token: int | None = None) -> torch.Tensor:
    """``batch`` rows of ``length`` distinct random token ids repeated twice, shape
    ``(batch, 2 * length)``, or ``(batch, 2 * length + 1)`` with ``first_token``
    (e.g. the tokenizer's BOS) in front.

    Ids come from ``[PROBE_FIRST_ID, vocab_size - 1)`` minus ``first_token``, drawn
    without replacement within a row: with no repeat inside a copy, every position of the
    second copy has exactly one earlier duplicate, ``length`` positions back (TransformerLens
    draws with replacement, which lets a chance repeat move the duplicate target). The same
    ``seed`` gives the same probe.
    """
    ids = np.arange(PROBE_FIRST_ID, vocab_size - 1)
    if first_token is not None:
        ids = ids[ids != first_token]
    if length < 1 or batch < 1:
        raise ValueError(f"length and batch must be positive, got {length} and {batch}")
    if length > ids.size:
        raise ValueError(f"a probe of {length} distinct tokens needs a vocabulary of at least "
                         f"{length + PROBE_FIRST_ID + 2} ids, got {vocab_size}")
    rng = np.random.default_rng(seed)
    half = np.stack([rng.choice(ids, size=length, replace=False) for _ in range(batch)])
    rows = np.concatenate([half, half], axis=1)
    if first_token is not None:
        rows = np.concatenate([np.full((batch, 1), first_token), rows], axis=1)
    return torch.as_tensor(rows, dtype=torch.long)


def encode_texts(tokenizer: Any, texts: Sequence[str],
                 encode: Callable[[str], Sequence[int]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``texts`` tokenized and right-padded into ``(input_ids, attention_mask)``: by
    ``encode`` (an ``HFLM``'s ``tok_encode``, which adds no second BOS to a chat-templated
    text that begins with one) or else with the tokenizer's own special tokens. Right
    padding keeps each text's positions what they are unpadded; the pad id is the
    tokenizer's (its EOS, or 0, where it has none), and the mask, not the id, is what marks
    padding."""
    rows = [list(encode(text) if encode is not None else tokenizer(text)["input_ids"])
            for text in texts]
    pad = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None),
               0)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = torch.as_tensor(row, dtype=torch.long)
        mask[b, :len(row)] = 1
    return ids, mask


def _as_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(device="cpu", dtype=torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def _targets(input_ids: Any, attention_mask: Any | None
             ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """For each type, the (sequence, query, key) positions whose attention it averages,
    as three index arrays into the padded batch."""
    ids = np.asarray(input_ids.cpu() if isinstance(input_ids, torch.Tensor) else input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, positions), got shape {ids.shape}")
    mask = (np.ones(ids.shape, dtype=bool) if attention_mask is None else
            np.asarray(attention_mask.cpu() if isinstance(attention_mask, torch.Tensor)
                       else attention_mask).astype(bool))
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask's shape {mask.shape} is not input_ids' {ids.shape}")
    found: dict[str, list[tuple[int, int, int]]] = {name: [] for name in HEAD_TYPES}
    for b in range(ids.shape[0]):
        real = np.flatnonzero(mask[b])  # padding dropped: real[0] is the first token
        last_seen: dict[int, int] = {}
        for r, i in enumerate(real):
            i = int(i)
            if r >= 1:
                found["previous_token"].append((b, i, int(real[r - 1])))
                found["attention_sink"].append((b, i, int(real[0])))
            token = int(ids[b, i])
            if token in last_seen:
                j = last_seen[token]  # position index into real
                found["duplicate_token"].append((b, i, int(real[j])))
                if j + 1 < r:
                    found["induction"].append((b, i, int(real[j + 1])))
            last_seen[token] = r
    columns = {name: np.asarray(triples, dtype=np.int64).reshape(-1, 3)
               for name, triples in found.items()}
    return {name: (c[:, 0], c[:, 1], c[:, 2]) for name, c in columns.items()}


def _sums(patterns: Sequence[Any], input_ids: Any, attention_mask: Any | None
          ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Each type's attention summed over each row's targets, ``(rows, layers, heads)``, and
    how many targets each row had, ``(rows,)``: what pools across rows and batches."""
    targets = _targets(input_ids, attention_mask)
    rows = len(input_ids)
    sums: dict[str, list[np.ndarray]] = {name: [] for name in HEAD_TYPES}
    for layer in patterns:
        # A tensor stays where it is (a GPU): only the picked weights are copied, not the
        # (batch, heads, T, T) pattern, gigabytes at a few thousand tokens.
        weights = layer.detach() if isinstance(layer, torch.Tensor) else _as_numpy(layer)
        if weights.ndim != 4 or weights.shape[0] != len(input_ids) or \
                tuple(weights.shape[2:]) != (np.shape(input_ids)[1],) * 2:
            raise ValueError(f"a layer's pattern must be (batch, heads, query, key) = "
                             f"({len(input_ids)}, H, {np.shape(input_ids)[1]}, "
                             f"{np.shape(input_ids)[1]}), got {tuple(weights.shape)}")
        for name, (b, q, k) in targets.items():
            # Advanced indices around a slice: the picked weights come out (targets, heads).
            picked = _as_numpy(weights[b, :, q, k])
            per_row = np.zeros((rows, picked.shape[1]))
            np.add.at(per_row, b, picked)
            sums[name].append(per_row)
    return ({name: np.stack(layers, axis=1) for name, layers in sums.items()},
            {name: np.bincount(targets[name][0], minlength=rows) for name in HEAD_TYPES})


def _means(sums: Mapping[str, np.ndarray], counts: Mapping[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    # Pooled over the rows. No target at all (no repeats; one-token sequences) is no
    # measurement: NaN, not 0.
    total = {name: int(np.sum(counts[name])) for name in HEAD_TYPES}
    return {name: (sums[name].sum(axis=0) / total[name] if total[name] else
                   np.full(sums[name].shape[1:], np.nan)) for name in HEAD_TYPES}


def type_scores_from_patterns(patterns: Sequence[Any], input_ids: Any,
                              attention_mask: Any | None = None) -> dict[str, np.ndarray]:
    """Every head's four scores from its attention weights.

    ``patterns`` holds one ``(batch, heads, query, key)`` tensor or array per layer, over
    the whole of ``input_ids`` (``(batch, positions)``); ``attention_mask`` (1 for real
    tokens) drops padding wherever it is. Returns ``HEAD_TYPES`` -> ``(layers, heads)``
    float array: the mean weight on each type's target over every counted (sequence,
    query) pair of the batch, NaN for a type with none (see the module docstring).
    """
    return _means(*_sums(patterns, input_ids, attention_mask))


def _pretrained(model: torch.nn.Module) -> torch.nn.Module | None:
    """The outermost Hugging Face model inside ``model`` (``model`` itself unless it is a
    wrapper such as a PEFT model), which owns the attention implementation setting."""
    from transformers import PreTrainedModel

    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _set_attention(inner: torch.nn.Module, implementation: str) -> None:
    if hasattr(inner, "set_attn_implementation"):  # transformers >= 4.48 or so
        inner.set_attn_implementation(implementation)
    else:
        inner.config._attn_implementation = implementation


def attention_patterns(model: torch.nn.Module, input_ids: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Every layer's attention weights, ``(batch, heads, query, key)``, from one forward
    pass with ``output_attentions=True``, in eval mode (attention dropout would blur them)
    and without gradients.

    sdpa and flash attention never materialise the weights (transformers 5 then returns no
    attentions at all, with only a logged warning), so the pass runs on eager attention and
    the model's own implementation is put back afterwards. ``model`` may wrap a Hugging Face
    model (a PEFT model, say); any module whose forward takes ``input_ids``,
    ``attention_mask`` and ``output_attentions`` and returns ``.attentions`` will do.
    Raises RuntimeError, naming the model, when the weights still do not come back.
    """
    inner = _pretrained(model)
    before = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    device = next(model.parameters(), input_ids).device
    training = model.training
    try:
        if inner is not None and before != "eager":
            _set_attention(inner, "eager")
        model.eval()
        with torch.no_grad():
            out = model(input_ids=input_ids.to(device),
                        attention_mask=None if attention_mask is None else
                        attention_mask.to(device),
                        output_attentions=True)
    finally:
        model.train(training)
        if inner is not None and before is not None and before != "eager":
            _set_attention(inner, before)
    attentions = getattr(out, "attentions", None)
    if not attentions or any(a is None for a in attentions):
        config = getattr(inner or model, "config", None)
        name = getattr(config, "name_or_path", None) or type(inner or model).__name__
        raise RuntimeError(f"{name} returned no attention weights with output_attentions=True "
                           f"(attention implementation {before!r}, eager tried): its "
                           f"heads' types cannot be read")
    return [a.detach() for a in attentions]


def _row_sums(model: torch.nn.Module, input_ids: torch.Tensor,
              attention_mask: torch.Tensor | None, batch_size: int | None
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``_sums`` of ``model``'s own patterns for every row of ``input_ids``, in forward
    passes of ``batch_size`` rows (all at once by default); a hybrid's layers without heads
    NaN."""
    step = batch_size or len(input_ids)
    parts: list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = []
    head_layers = _head_layers(model)
    for start in range(0, len(input_ids), step):
        ids = input_ids[start:start + step]
        mask = None if attention_mask is None else attention_mask[start:start + step]
        sums, counts = _sums(attention_patterns(model, ids, mask), ids, mask)
        if head_layers is not None:
            sums = {name: _spread(rows, *head_layers) for name, rows in sums.items()}
        parts.append((sums, counts))
    return ({name: np.concatenate([p[0][name] for p in parts]) for name in HEAD_TYPES},
            {name: np.concatenate([p[1][name] for p in parts]) for name in HEAD_TYPES})


def head_type_scores(model: torch.nn.Module, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None,
                     batch_size: int | None = None) -> dict[str, np.ndarray]:
    """``type_scores_from_patterns`` on ``model``'s own patterns for ``input_ids``, in
    forward passes of ``batch_size`` rows (all at once by default); the means pool every
    counted query of every row, as one pass would."""
    return _means(*_row_sums(model, input_ids, attention_mask, batch_size))


def probe_type_scores(model: torch.nn.Module, probe: torch.Tensor,
                      batch_size: int | None = None
                      ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``head_type_scores`` on a probe (``repeated_probe``: its rows drawn independently,
    each with the same targets), and each score's standard error over the rows: the
    standard deviation of the rows' own scores over the square root of their number (NaN
    with fewer than two rows)."""
    sums, counts = _row_sums(model, probe, None, batch_size)
    scores = _means(sums, counts)
    errors = {}
    for name in HEAD_TYPES:
        counted = counts[name] > 0
        rows = sums[name][counted] / counts[name][counted][:, None, None]
        errors[name] = (np.std(rows, axis=0, ddof=1) / np.sqrt(len(rows)) if len(rows) > 1
                        else np.full(scores[name].shape, np.nan))
    return scores, errors


def _head_layers(model: torch.nn.Module) -> tuple[int, tuple[int, ...]] | None:
    """A hybrid model's (layers, layers with heads), whose attention weights come back for
    the attention layers only; None for a model with heads in every layer."""
    from lm_eval_headloc.intervention.geometry import Geometry

    config = getattr(_pretrained(model) or model, "config", None)
    try:
        geometry = Geometry.from_config(config)
    except Exception:  # noqa: BLE001 — no readable geometry: the patterns are taken as they come
        return None
    return None if geometry.head_layers is None else (geometry.num_layers,
                                                      geometry.head_layers)


def _spread(rows: np.ndarray, layers: int, head_layers: tuple[int, ...]) -> np.ndarray:
    """A hybrid's per-attention-layer values, ``(..., attention layers, heads)``, as
    ``(..., layers, heads)``, NaN where a layer has no heads (a NaN score is never a
    type)."""
    if rows.shape[-2] != len(head_layers):
        raise ValueError(f"the model returned attention weights for {rows.shape[-2]} layers; "
                         f"it has heads in {len(head_layers)}")
    spread = np.full((*rows.shape[:-2], layers, rows.shape[-1]), np.nan, dtype=np.float64)
    spread[..., list(head_layers), :] = rows
    return spread


def type_thresholds(scores: Mapping[str, np.ndarray], mads: float = DOMINANT_MADS,
                    min_margin: float = DOMINANT_MIN_MARGIN,
                    floor: float = DOMINANT_FLOOR) -> dict[str, float]:
    """Each labelling type's threshold over all of the model's heads (``LABELLED_TYPES``;
    other scores are left out): ``max(median + max(mads * MAD_TO_SD * MAD, min_margin),
    floor)``, with the median and the median absolute deviation (MAD) taken over the heads'
    finite scores; NaN for a type with none."""
    thresholds = {}
    for name, values in scores.items():
        if name not in LABELLED_TYPES:
            continue
        finite = np.asarray(values, dtype=np.float64)
        finite = finite[np.isfinite(finite)]
        if not finite.size:
            thresholds[name] = float("nan")
            continue
        median = float(np.median(finite))
        mad = float(np.median(np.abs(finite - median)))
        thresholds[name] = max(median + max(mads * MAD_TO_SD * mad, min_margin), floor)
    return thresholds


def _clearances(scores: Mapping[str, np.ndarray], errors: Mapping[str, np.ndarray] | None,
                margin: float, thresholds: Mapping[str, float]
                ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per labelling type, ``(score, allowance)``: the allowance is ``margin`` standard
    errors of the score (0 without ``errors``, or where its error is unknown)."""
    out = {}
    for name in thresholds:
        grid = np.asarray(scores[name], dtype=np.float64)
        error = (np.zeros_like(grid) if errors is None or name not in errors else
                 np.nan_to_num(np.asarray(errors[name], dtype=np.float64), nan=0.0))
        out[name] = (grid, margin * error)
    return out


def dominant_type(scores: Mapping[str, np.ndarray], mads: float = DOMINANT_MADS,
                  min_margin: float = DOMINANT_MIN_MARGIN,
                  floor: float = DOMINANT_FLOOR, *,
                  errors: Mapping[str, np.ndarray] | None = None,
                  margin: float = LABEL_MARGIN) -> list[list[str | None]]:
    """Each head's type, ``[layer][head]``: the type whose score is clearly above the
    model's typical head, or None.

    A head qualifies for a type (one of ``LABELLED_TYPES``) when its score is strictly above
    the type's threshold, ``max(median + max(mads * 1.4826 * MAD, min_margin), floor)`` over
    all heads (``type_thresholds``) — a robust number of standard deviations above the
    typical head, at least ``min_margin`` above it, and never below ``floor`` — by more
    than ``margin`` of its standard errors where ``errors`` gives them
    (``probe_type_scores``). A head that qualifies for several types takes the one with the
    largest ``score / threshold``; an exact tie (to 1e-9) between the best two is None, as
    is a head that qualifies for none. NaN scores never qualify.
    """
    thresholds = type_thresholds(scores, mads, min_margin, floor)
    clear = _clearances(scores, errors, margin, thresholds)
    shape = next(iter(np.shape(v) for v in scores.values()))
    labels: list[list[str | None]] = []
    for layer in range(shape[0]):
        row: list[str | None] = []
        for head in range(shape[1]):
            ratios = sorted(((grid[layer, head] / thresholds[name], name)
                             for name, (grid, allow) in clear.items()
                             if grid[layer, head] - allow[layer, head] > thresholds[name]),
                            reverse=True)  # NaN: never above
            if not ratios or (len(ratios) > 1 and np.isclose(ratios[0][0], ratios[1][0],
                                                             rtol=1e-9, atol=0.0)):
                row.append(None)
            else:
                row.append(ratios[0][1])
        labels.append(row)
    return labels


def borderline(scores: Mapping[str, np.ndarray], errors: Mapping[str, np.ndarray],
               mads: float = DOMINANT_MADS, min_margin: float = DOMINANT_MIN_MARGIN,
               floor: float = DOMINANT_FLOOR, margin: float = LABEL_MARGIN
               ) -> list[list[list[str]]]:
    """Each head's types, ``[layer][head]``, whose threshold its score is within ``margin``
    standard errors of (either side): a probe of another seed may put it above or below,
    so ``dominant_type`` does not label it with them, nor can it be said not to be one."""
    thresholds = type_thresholds(scores, mads, min_margin, floor)
    clear = _clearances(scores, errors, margin, thresholds)
    shape = next(iter(np.shape(v) for v in scores.values()))
    return [[[name for name, (grid, allow) in clear.items()
              if abs(grid[layer, head] - thresholds[name]) <= allow[layer, head]]
             for head in range(shape[1])] for layer in range(shape[0])]


#: The probe: ``length`` random tokens repeated twice, drawn with ``seed`` (its rows:
#: ``--probe-rows``).
PROBE = {"length": 32, "seed": 0}


#: The run's examples scored (its first distinct contexts), and how many per pass (the
#: probe's rows too).
EXAMPLES, PER_PASS = 64, 8


class HeadTypes:
    """A model's head types as ``types.json`` holds them: ``scores`` on the probe and
    ``on_examples`` (None without examples), each type -> (layers, heads); ``labels``: each
    head's dominant type or None."""

    def __init__(self, data: Mapping[str, Any]) -> None:
        self.data = dict(data)
        self.scores = {t: np.asarray(v, dtype=np.float64) for t, v in data["scores"].items()}
        self.labels: list[list[str | None]] = [list(row) for row in data["dominant"]]
        #: Head name -> the types it is too near the threshold of to be labelled or not
        #: (none in a file from before the probe's error was taken into account).
        self.near: dict[str, list[str]] = dict(data.get("borderline") or {})
        #: The layers with heads (a hybrid model's attention layers; else every layer).
        self.head_layers: tuple[int, ...] = tuple(data.get("head_layers")
                                                  or range(len(self.labels)))

    def of(self, layer: int | str | Component, head: int | None = None) -> dict[str, float]:
        """One head's four probe scores: ``of(head)`` (a ``Head`` or its name, ``"L3H1"``)
        or ``of(layer, head)``."""
        layer, head = self._check(layer, head)
        return {t: float(self.scores[t][layer, head]) for t in HEAD_TYPES}

    def label(self, layer: int | str | Component, head: int | None = None) -> str | None:
        """One head's dominant type, or None (arguments as ``of``'s)."""
        layer, head = self._check(layer, head)
        return self.labels[layer][head]

    def borderline(self, layer: int | str | Component, head: int | None = None) -> list[str]:
        """The types one head's probe score is within ``LABEL_MARGIN`` standard errors of
        the threshold of: another probe seed may put it either side (arguments as
        ``of``'s)."""
        layer, head = self._check(layer, head)
        return list(self.near.get(str(Head(layer, head)), []))

    def _check(self, layer: int | str | Component, head: int | None) -> tuple[int, int]:
        if head is None:  # one component: a neuron has no attention pattern to type
            parsed = parse_components([layer])
            if len(parsed) != 1:
                raise ComponentSpecError(f"{layer}: one head, e.g. 'L3H1' (or layer, head)")
            component = parsed[0]
            if not isinstance(component, Head):
                raise ComponentSpecError(f"{component} is an MLP neuron: head types are "
                                         "read off attention patterns, of heads only")
            layer, head = component
        # numpy would wrap a negative index round to another head, or raise IndexError.
        validate_heads([Head(int(layer), int(head))], len(self.labels),
                       len(self.labels[0]) if self.labels else 0,
                       head_layers=self.head_layers)
        return int(layer), int(head)


def run_texts(measure: Measurement) -> list[str]:
    """The run's own examples as the model reads them: each request's context (with its
    continuation for a log-likelihood request), distinct, the first ``EXAMPLES``."""
    seen: dict[str, None] = {}
    for instance in measure.recorded_instances():
        context, rest = instance.args[0], instance.args[1] if len(instance.args) > 1 else ""
        text = context + rest if instance.request_type == "loglikelihood" and \
            isinstance(rest, str) else context
        if isinstance(text, str) and text.strip():
            seen.setdefault(text, None)
        if len(seen) >= EXAMPLES:
            break
    return list(seen)


def head_types_of(lm: Any, texts: Sequence[str] = (), probe_rows: int = PROBE_ROWS
                  ) -> dict[str, Any]:
    """``types.json``'s content for the model of ``lm`` (an ``HFHeadAblateLM``): the
    probe's scores (``probe_rows`` rows) and their standard errors, the scores on
    ``texts``, the thresholds, each head's dominant type and the heads borderline to one."""
    model, tokenizer = lm.model, lm.tokenizer
    vocab = int(model.get_input_embeddings().num_embeddings)  # ids the model can embed
    first = tokenizer.bos_token_id
    probe = repeated_probe(vocab, batch=probe_rows, first_token=first, **PROBE).to(lm.device)
    scores, errors = probe_type_scores(model, probe, batch_size=PER_PASS)
    on_examples = None
    if texts:
        # As the model reads them in a measurement: lm-eval's encoding, its window.
        ids, mask = encode_texts(tokenizer, list(texts),
                                 lambda text: lm.tok_encode(text)[-lm.max_length:])
        on_examples = head_type_scores(model, ids.to(lm.device), mask.to(lm.device),
                                       batch_size=PER_PASS)

    def listed(values: Mapping[str, np.ndarray]) -> dict[str, list[list[float | None]]]:
        return {t: [[None if not np.isfinite(x) else round(float(x), 6) for x in row]
                    for row in values[t]] for t in HEAD_TYPES}

    head_layers = lm.knockout.geometry.head_layers
    near = {f"L{layer}H{head}": types_near
            for layer, row in enumerate(borderline(scores, errors))
            for head, types_near in enumerate(row) if types_near}
    return {"made_by": "lm-eval-headloc types",
            **({} if head_layers is None else {"head_layers": list(head_layers)}),
            "probe": {**PROBE, "batch": probe_rows, "first_token": first,
                      "what": "random tokens repeated twice after the first token"},
            "examples": len(texts),
            "scores": listed(scores),
            "errors": listed(errors),
            "on_examples": None if on_examples is None else listed(on_examples),
            "thresholds": {t: round(float(v), 6)
                           for t, v in type_thresholds(scores).items()},
            "label_margin": LABEL_MARGIN,
            "dominant": dominant_type(scores, errors=errors),
            "borderline": near}
