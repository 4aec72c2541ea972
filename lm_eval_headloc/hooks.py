"""Knockout hooks: ablate the output of chosen attention heads in any HF causal LM.

A head's output reaches the residual stream only through the attention output
projection (``o_proj``, ``out_proj``, ``c_proj``, ``dense`` …), whose input is the
concatenation of the heads' outputs. Zeroing the input slice
``[h*d_head:(h+1)*d_head]`` of that projection knocks out head ``h`` exactly: it is
what zeroing that head's columns of the projection's weight does.

The hooks are installed once and act only inside ``HeadKnockout.applied``, on the
``Intervention`` (a value) given there; outside it the model is as loaded.

No lm-eval import here: this module works on a bare ``transformers``/PEFT model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .geometry import Geometry
from .heads import Head, HeadSpecError, parse_heads

__all__ = ["ActivePass", "AttentionOutputNotFound", "HeadKnockout", "Intervention",
           "attention_geometry", "find_attention_outputs"]

# Names the output projection has in the attention blocks of the families we know of
# (Llama/Mistral/Qwen/Gemma/Phi-3: o_proj; OPT/BART: out_proj; GPT-2: c_proj;
# GPT-NeoX/Falcon/Phi-1: dense; T5-style: o; MPT: out_proj; BLOOM: dense).
_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "out")
_ATTENTION_HINTS = ("attn", "attention")


class AttentionOutputNotFound(HeadSpecError):
    """The attention output projection of this architecture could not be discovered."""


def _geometry(model: nn.Module) -> Geometry:
    try:
        return Geometry.from_config(model.config)
    except AttributeError as err:
        raise AttentionOutputNotFound(str(err)) from None


def attention_geometry(model: nn.Module) -> tuple[int, int]:
    """(layers, query heads per layer) from the model's (text) config."""
    geometry = _geometry(model)
    return geometry.num_layers, geometry.heads_per_layer


def _input_features(module: nn.Module) -> int | None:
    if isinstance(getattr(module, "in_features", None), int):  # nn.Linear, PEFT layers
        return module.in_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None:  # GPT-2: weight (in, out)
        return int(weight.shape[0])
    return None


def _fits(features: int | None, heads_per_layer: int, head_dim: int | None) -> bool:
    # The input must be the concatenation of the heads' outputs: heads x head_dim wide.
    if features is None:
        return False
    if head_dim is None:
        return features % heads_per_layer == 0
    return features == heads_per_layer * head_dim


def _decoder_layers(model: nn.Module, num_layers: int) -> list[nn.Module]:
    # The decoder stack is the ModuleList with one entry per layer; with several
    # (e.g. a vision tower), take the one holding the most parameters.
    lists = [
        m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == num_layers
    ]
    if not lists:
        raise AttentionOutputNotFound(
            f"no list of {num_layers} decoder layers found in {type(model).__name__}; "
            "name the attention output projections with attn_out=<module-name pattern>, "
            "e.g. attn_out=model.layers.*.self_attn.o_proj"
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _output_projection(layer: nn.Module, index: int, heads_per_layer: int,
                       head_dim: int | None) -> nn.Module:
    candidates = []
    for name, module in layer.named_modules():
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] not in _OUTPUT_NAMES:
            continue
        if not any(hint in parts[-2].lower() for hint in _ATTENTION_HINTS):
            continue
        if _fits(_input_features(module), heads_per_layer, head_dim):
            candidates.append((name, module))
    if len(candidates) == 1:
        return candidates[0][1]
    seen = [n for n, _ in layer.named_modules() if any(h in n.lower() for h in _ATTENTION_HINTS)]
    found = ", ".join(n for n, _ in candidates) if candidates else "none"
    raise AttentionOutputNotFound(
        f"cannot tell which module of decoder layer {index} ({type(layer).__name__}) is the "
        f"attention output projection (candidates: {found}; attention modules: "
        f"{', '.join(seen[:8]) or 'none'}); name it with attn_out=<module-name pattern>, "
        "e.g. attn_out=model.layers.*.self_attn.o_proj"
    )


def find_attention_outputs(model: nn.Module, attn_out: str | None = None) -> list[nn.Module]:
    """The attention output projection of every decoder layer, in layer order.

    Discovered from the config's layer count, the decoder layer list and the module
    names and shapes; ``attn_out`` (an fnmatch pattern over ``model.named_modules()``
    names, e.g. ``model.layers.*.self_attn.o_proj``) names them explicitly instead, and
    a probe forward pass checks that each match is what its attention block returns.
    """
    geometry = _geometry(model)
    num_layers, heads_per_layer, head_dim = (geometry.num_layers, geometry.heads_per_layer,
                                             geometry.head_dim)
    if attn_out:
        named = [(name, m) for name, m in model.named_modules()
                 if fnmatch.fnmatchcase(name, attn_out)]
        if len(named) != num_layers:
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {len(named)} module(s); it must match "
                f"exactly one per decoder layer ({num_layers})"
            )
    else:
        layers = _decoder_layers(model, num_layers)
        named = [(f"decoder layer {i}", _output_projection(layer, i, heads_per_layer, head_dim))
                 for i, layer in enumerate(layers)]
    for index, (name, module) in enumerate(named):
        features = _input_features(module)
        if not _fits(features, heads_per_layer, head_dim):
            expected = (f"{heads_per_layer} heads x {head_dim} = {heads_per_layer * head_dim}"
                        if head_dim else f"a multiple of {heads_per_layer} heads")
            raise AttentionOutputNotFound(
                f"attention output of layer {index} ({name}, {type(module).__name__}) takes "
                f"{features} input features, not {expected}"
            )
    if attn_out:
        _check_feeds_attention_output(model, named, attn_out)
    return [module for _, module in named]


def _first_tensor(value: object) -> torch.Tensor | None:
    # Attention blocks return (output, weights, ...) or just the output.
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def _close(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    if actual.shape != expected.shape:
        return False
    # A few rounding steps of the coarser of the two dtypes (bf16/fp16 models).
    eps = max(torch.finfo(t.dtype).eps if t.is_floating_point() else 0.0
              for t in (actual, expected))
    actual, expected = actual.detach().float(), expected.detach().float()
    scale = max(expected.abs().max().item(), 1e-30)
    return (actual - expected).abs().max().item() <= 4 * eps * scale


def _probe_inputs(model: nn.Module) -> dict:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    vocab = getattr(embeddings, "num_embeddings", None) or 32
    weight = getattr(embeddings, "weight", None)
    device = weight.device if weight is not None and weight.device.type != "meta" else "cpu"
    # A few distinct ordinary tokens (not 0-2, often pad/bos/eos with special embeddings).
    ids = ((torch.arange(4) * 7 + 3) % vocab)[None].to(device)
    inputs = {"input_ids": ids, "use_cache": False}
    if getattr(model.config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids
    return inputs


def _check_feeds_attention_output(model: nn.Module, named: list[tuple[str, nn.Module]],
                                  attn_out: str) -> None:
    """Refuse ``attn_out`` matches that are not their attention block's output projection.

    The width check alone lets a query/key/value projection through whenever hidden =
    heads x head_dim (Llama's q_proj). What tells them apart: the output projection's
    output is what the block returns to the residual stream, unchanged (or, in BLOOM,
    with the block's residual input added). One probe forward pass on 4 tokens checks it.
    """
    records: list[dict] = [{} for _ in named]
    handles = []

    def keep(record: dict, key: str):
        return lambda module, args, output: record.__setitem__(key, _first_tensor(output))

    def keep_inputs(record: dict):
        def hook(module, args, kwargs):
            record["inputs"] = [t for t in (*args, *kwargs.values())
                                if isinstance(t, torch.Tensor)]
        return hook

    for (name, module), record in zip(named, records, strict=True):
        block_name = name.rpartition(".")[0]
        block = model.get_submodule(block_name) if block_name else model
        record["block_name"] = block_name or "the model"
        handles += [module.register_forward_hook(keep(record, "output")),
                    block.register_forward_pre_hook(keep_inputs(record), with_kwargs=True),
                    block.register_forward_hook(keep(record, "block_output"))]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout between the projection and the block's output would blur it
    try:
        with torch.no_grad():
            model(**_probe_inputs(model))
    except Exception as err:  # whatever broke, say so in one line
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise AttentionOutputNotFound(
            f"attn_out={attn_out!r}: the probe forward pass that checks the matched modules "
            f"failed ({type(err).__name__}: {message})"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    for (name, _), record in zip(named, records, strict=True):
        output, block_output = record.get("output"), record.get("block_output")
        if output is None or block_output is None:
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {name}, which (or whose block "
                f"{record['block_name']}) did not run in a forward pass"
            )
        if not (_close(block_output, output) or any(
                _close(block_output, output + residual)
                for residual in record.get("inputs", []) if residual.shape == output.shape)):
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {name}, whose output is not what its block "
                f"{record['block_name']} returns, so it is not the attention output "
                "projection (a query/key/value projection?); name the projection whose input "
                "is the heads' outputs, e.g. attn_out=model.layers.*.self_attn.o_proj"
            )


@dataclass(frozen=True, eq=False)
class Intervention:
    """What one forward pass does to the heads: a value, applied only inside
    ``HeadKnockout.applied`` (nothing stays switched on after it).

    ``heads`` are knocked out in every batch row; ``row_masks`` ((rows, layers x heads)
    booleans, flat head index ``layer * H + head``) knock out a different set in each row
    instead (several masks in one batch). A knocked-out slice becomes
    ``replacement + scale · (slice − replacement)``: the replacement is zero unless
    ``replacement`` gives per-layer ``(heads, head_dim)`` means (``ablation.py``), or the
    pass is given resample donors; ``scale`` 0 is the replacement itself, 1 the head as it
    is (both exact), 2 amplification.
    """

    heads: tuple[Head, ...] = ()
    row_masks: torch.Tensor | None = None
    scale: float = 0.0
    replacement: tuple[torch.Tensor, ...] | None = None

    @property
    def any_knocked_out(self) -> bool:
        """Whether a pass under it changes any head (scale 1 changes none)."""
        if self.scale == 1.0:
            return False
        if self.row_masks is not None:
            return bool(self.row_masks.any())
        return bool(self.heads)

    def replace(self, **changes: Any) -> Intervention:
        return dataclasses.replace(self, **changes)


@dataclass
class ActivePass:
    """The intervention of the forward pass(es) running now, placed per layer."""

    masks: list[torch.Tensor | None]  # per layer: None (untouched) or broadcastable bools
    rows: int | None  # per-row masks: the batch rows they are for
    scale: float
    replacement: list[torch.Tensor | None]
    # Resample: per layer (rows, width, H, d) donor outputs, and per row which donor
    # position stands in for each column (rows, columns).
    donors: list[torch.Tensor] | None = None
    donor_index: torch.Tensor | None = None
    first_column: int = 0  # the columns a forward sees start here (generation's cache)


class HeadKnockout:
    """Ablation of attention heads through forward pre-hooks on the output projections.

    >>> knockout = HeadKnockout(model)                 # hooks installed once
    >>> with knockout.knocking_out("L0H3+L1H0"):       # for the passes inside only
    ...     model(input_ids)
    >>> model(input_ids)                               # the model as loaded

    The hooks are installed once and do nothing outside ``applied`` (or its shorthand
    ``knocking_out``), which scopes an ``Intervention`` to the passes run inside it, as
    TransformerLens's ``run_with_hooks`` scopes hooks to one call: switching costs a few
    small tensor writes, no re-registration. A layer with nothing knocked out returns at
    once. ``hf-headablate`` (``model.py``) applies its heads around each forward pass.
    """

    def __init__(self, model: nn.Module, attn_out: str | None = None) -> None:
        self.geometry = _geometry(model)
        self.num_layers = self.geometry.num_layers
        self.heads_per_layer = self.geometry.heads_per_layer
        self.modules = find_attention_outputs(model, attn_out)
        self.head_dim = _input_features(self.modules[0]) // self.heads_per_layer
        self._devices = [_device_of(m) for m in self.modules]
        self._active: ActivePass | None = None
        self._placed: tuple[Intervention, ActivePass] | None = None  # the last one placed
        self._handles = [
            module.register_forward_pre_hook(self._make_hook(layer))
            for layer, module in enumerate(self.modules)
        ]

    def _make_hook(self, layer: int):
        def knock_out_heads(module: nn.Module, args: tuple):
            active = self._active
            mask = None if active is None else active.masks[layer]
            if mask is None:
                return None
            hidden, *rest = args
            if active.rows is not None and active.rows != hidden.shape[0]:
                raise RuntimeError(f"per-row head masks for {active.rows} rows, batch has "
                                   f"{hidden.shape[0]}")
            if mask.device != hidden.device:  # a model split across devices
                mask = active.masks[layer] = mask.to(hidden.device)
            # (..., H*d) -> (..., H, d)
            per_head = self._ablated(layer, hidden.unflatten(-1, (self.heads_per_layer, -1)),
                                     mask)
            return (per_head.flatten(-2), *rest)

        return knock_out_heads

    def _ablated(self, layer: int, per_head: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_head`` (..., H, d) with the heads in ``mask`` (broadcastable, True = out)
        replaced: the one place the ablation kind and the scale act."""
        scale = self._active.scale
        if scale == 1.0:
            return per_head  # the head as it is, exactly
        replacement = self.replacement(layer, per_head)
        if replacement is None:
            if scale == 0.0:
                return per_head.masked_fill(mask, 0)  # exact zeros whatever the dtype
            return torch.where(mask, per_head * scale, per_head)
        if scale == 0.0:
            return torch.where(mask, replacement, per_head)
        return torch.where(mask, replacement + scale * (per_head - replacement), per_head)

    @property
    def active(self) -> ActivePass | None:
        """The intervention of the passes running now (None outside ``applied``, or inside
        ``applied(None)``: the model as loaded)."""
        return self._active

    def replacement(self, layer: int, per_head: torch.Tensor) -> torch.Tensor | None:
        """What layer ``layer``'s knocked-out heads become where its output projection sees
        ``per_head`` (..., H, d) in the active pass: None for zeros, else a tensor
        broadcastable to it (the mean's (H, d), or the donors' (rows, columns, H, d) under
        resample)."""
        active = self._active
        if active is None:
            return None
        if active.donors is not None:
            donors, index = active.donors[layer], active.donor_index
            if per_head.dim() != 4 or per_head.shape[0] != donors.shape[0]:
                raise RuntimeError(f"resample ablation: layer {layer} sees "
                                   f"{tuple(per_head.shape[:-2])} positions, donors were set "
                                   f"for {donors.shape[0]} rows")
            columns = per_head.shape[1]
            picked = index[:, active.first_column:active.first_column + columns]
            if picked.shape[1] != columns:
                raise RuntimeError(f"resample ablation: columns {active.first_column}.."
                                   f"{active.first_column + columns} past the "
                                   f"{index.shape[1]} donors were aligned to")
            rows = torch.arange(donors.shape[0], device=donors.device)[:, None]
            return donors[rows, picked.to(donors.device)].to(per_head)
        replacement = active.replacement[layer]
        if replacement is None:
            return None
        if replacement.device != per_head.device or replacement.dtype != per_head.dtype:
            replacement = active.replacement[layer] = replacement.to(per_head)
        return replacement

    def check_replacement(self, per_layer: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Per-layer ``(heads, head_dim)`` means, checked and placed on each layer's
        device, for ``Intervention.replacement``."""
        shape = (self.heads_per_layer, self.head_dim)
        if len(per_layer) != self.num_layers or any(tuple(t.shape) != shape
                                                    for t in per_layer):
            raise ValueError(f"replacements must be {self.num_layers} tensors of shape "
                             f"{shape}")
        return tuple(t.to(device) for t, device in zip(per_layer, self._devices, strict=True))

    def _place(self, intervention: Intervention) -> ActivePass:
        """Per-layer device masks for ``intervention`` (the last one is kept: a model
        answering many requests under one intervention places it once)."""
        if self._placed is not None and self._placed[0] is intervention:
            placed = self._placed[1]
            return dataclasses.replace(placed, masks=list(placed.masks),
                                       replacement=list(placed.replacement))
        per_layer, layers = self.heads_per_layer, self.num_layers
        masks: list[torch.Tensor | None] = [None] * layers
        rows = None
        if intervention.row_masks is not None:
            knocked = torch.as_tensor(intervention.row_masks, dtype=torch.bool)
            if knocked.ndim != 2 or knocked.shape[1] != layers * per_layer:
                raise ValueError(f"per-row masks must have shape (rows, {layers * per_layer}), "
                                 f"got {tuple(knocked.shape)}")
            rows = knocked.shape[0]
            by_layer = knocked.view(-1, layers, per_layer)
            for layer in range(layers):
                if by_layer[:, layer].any():
                    masks[layer] = by_layer[:, layer][:, None, :, None].to(self._devices[layer])
        else:
            by_layer: dict[int, list[int]] = {}
            for head in parse_heads(intervention.heads, layers, per_layer):
                by_layer.setdefault(head.layer, []).append(head.head)
            for layer, indices in by_layer.items():
                mask = torch.zeros(per_layer, 1, dtype=torch.bool)
                mask[indices] = True
                masks[layer] = mask.to(self._devices[layer])
        replacement: list[torch.Tensor | None] = (
            list(self.check_replacement(intervention.replacement))
            if intervention.replacement is not None else [None] * layers)
        placed = ActivePass(masks, rows, float(intervention.scale), replacement)
        self._placed = (intervention, placed)
        return dataclasses.replace(placed, masks=list(masks), replacement=list(replacement))

    @contextlib.contextmanager
    def applied(self, intervention: Intervention | None,
                donors: tuple[list[torch.Tensor], torch.Tensor] | None = None
                ) -> Iterator[ActivePass | None]:
        """Inside, every forward pass of the model runs under ``intervention`` (None: the
        model as loaded, e.g. resample's own clean pass for its donors); the previous
        state (usually none) is back on exit, whatever happens inside. ``donors``:
        resample ablation's ``(per_layer, index)``: ``per_layer[l]`` (rows, width, H·d)
        holds each row's donor outputs at layer ``l``, ``index`` (rows, columns) which
        donor position replaces each column of that row. Yields the ``ActivePass``."""
        active = None if intervention is None else self._place(intervention)
        if active is not None and donors is not None:
            per_layer, index = donors
            if len(per_layer) != self.num_layers or index is None or index.dim() != 2:
                raise ValueError(f"donors must be {self.num_layers} tensors and a (rows, "
                                 "columns) index")
            active.donors = [t.unflatten(-1, (self.heads_per_layer, -1)).to(device)
                             for t, device in zip(per_layer, self._devices, strict=True)]
            active.donor_index = index
        saved, self._active = self._active, active
        try:
            yield active
        finally:
            self._active = saved

    def knocking_out(self, heads: str | Iterable[str | Head | tuple[int, int]], *,
                     scale: float = 0.0) -> contextlib.AbstractContextManager:
        """``applied`` for ``heads`` (a ``L0H1+L2H3`` string or a list) zeroed, or scaled
        by ``scale``: the shorthand for a bare model."""
        if isinstance(heads, str) and not heads.strip():
            parsed: tuple[Head, ...] = ()
        else:
            parsed = tuple(parse_heads(heads, self.num_layers, self.heads_per_layer))
        return self.applied(Intervention(heads=parsed, scale=scale))

    def remove(self) -> None:
        """Take the hooks off the model (the model is then as loaded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        return f"HeadKnockout({self.num_layers} layers x {self.heads_per_layer} heads)"


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
