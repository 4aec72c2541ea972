"""Knockout hooks: zero the output of chosen attention heads in any HF causal LM.

A head's output reaches the residual stream only through the attention output
projection (``o_proj``, ``out_proj``, ``c_proj``, ``dense`` …), whose input is the
concatenation of the heads' outputs. Zeroing the input slice
``[h*d_head:(h+1)*d_head]`` of that projection knocks out head ``h`` exactly (SPEC §2).

The hooks are installed once. They read per-layer boolean masks that ``set_heads``
refills in place, so switching masks costs a few tensor writes: no re-registration,
no reload, no recompilation. A layer with nothing knocked out returns at once.

No lm-eval import here: this module works on a bare ``transformers``/PEFT model.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable

import torch
from torch import nn

from .heads import Head, HeadSpecError, format_heads, parse_heads

__all__ = ["AttentionOutputNotFound", "HeadKnockout", "attention_geometry",
           "find_attention_outputs"]

# Names the output projection has in the attention blocks of the families we know of
# (Llama/Mistral/Qwen/Gemma/Phi-3: o_proj; OPT/BART: out_proj; GPT-2: c_proj;
# GPT-NeoX/Falcon/Phi-1: dense; T5-style: o; MPT: out_proj; BLOOM: dense).
_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "out")
_ATTENTION_HINTS = ("attn", "attention")


class AttentionOutputNotFound(HeadSpecError):
    """The attention output projection of this architecture could not be discovered."""


def attention_geometry(model: nn.Module) -> tuple[int, int]:
    """(layers, query heads per layer) from the model's (text) config."""
    config = model.config
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    try:
        return int(config.num_hidden_layers), int(config.num_attention_heads)
    except AttributeError as err:
        raise AttentionOutputNotFound(
            f"cannot read the layer/head counts from {type(config).__name__}: {err}"
        ) from None


def _input_features(module: nn.Module) -> int | None:
    if isinstance(getattr(module, "in_features", None), int):  # nn.Linear, PEFT layers
        return module.in_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None:  # GPT-2: weight (in, out)
        return int(weight.shape[0])
    return None


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


def _output_projection(layer: nn.Module, index: int, num_heads: int) -> nn.Module:
    candidates = []
    for name, module in layer.named_modules():
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] not in _OUTPUT_NAMES:
            continue
        if not any(hint in parts[-2].lower() for hint in _ATTENTION_HINTS):
            continue
        features = _input_features(module)
        if features is not None and features % num_heads == 0:
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
    names, e.g. ``model.layers.*.self_attn.o_proj``) names them explicitly instead.
    """
    num_layers, num_heads = attention_geometry(model)
    if attn_out:
        matches = [m for name, m in model.named_modules() if fnmatch.fnmatchcase(name, attn_out)]
        if len(matches) != num_layers:
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {len(matches)} module(s); it must match "
                f"exactly one per decoder layer ({num_layers})"
            )
    else:
        layers = _decoder_layers(model, num_layers)
        matches = [_output_projection(layer, i, num_heads) for i, layer in enumerate(layers)]
    for index, module in enumerate(matches):
        features = _input_features(module)
        if features is None or features % num_heads:
            raise AttentionOutputNotFound(
                f"attention output of layer {index} ({type(module).__name__}) takes "
                f"{features} input features, not a multiple of {num_heads} heads"
            )
    return matches


class HeadKnockout:
    """Zero-ablation of attention heads through forward pre-hooks on the output projections.

    >>> knockout = HeadKnockout(model)          # hooks installed once
    >>> knockout.set_heads("L0H3+L1H0")          # switch in place, any number of times
    >>> knockout.set_heads([])                   # nothing knocked out: no extra cost
    """

    def __init__(self, model: nn.Module, attn_out: str | None = None) -> None:
        self.num_layers, self.num_heads = attention_geometry(model)
        self.modules = find_attention_outputs(model, attn_out)
        self.head_dim = _input_features(self.modules[0]) // self.num_heads
        # One boolean row per layer, on that layer's device (models may be split
        # across devices); True = knocked out.
        self._knocked = [
            torch.zeros(self.num_heads, 1, dtype=torch.bool, device=_device_of(m))
            for m in self.modules
        ]
        self._active = [False] * self.num_layers
        # Per-row masks (several masks in one batch): per layer None (not in row mode),
        # False (row mode, nothing knocked out in this layer) or a (rows, 1, H, 1) tensor.
        self._row_knocked: list[torch.Tensor | bool | None] = [None] * self.num_layers
        self._heads: tuple[Head, ...] = ()
        self._handles = [
            module.register_forward_pre_hook(self._make_hook(layer))
            for layer, module in enumerate(self.modules)
        ]

    def _make_hook(self, layer: int):
        active, knocked, num_heads = self._active, self._knocked, self.num_heads
        row_knocked = self._row_knocked

        def knock_out_heads(module: nn.Module, args: tuple):
            rows = row_knocked[layer]
            if rows is False:
                return None
            if rows is not None:  # one mask per batch row
                hidden, *rest = args
                if rows.shape[0] != hidden.shape[0]:
                    raise RuntimeError(f"per-row head masks for {rows.shape[0]} rows, batch "
                                       f"has {hidden.shape[0]}")
                per_head = hidden.unflatten(-1, (num_heads, -1)).masked_fill(
                    rows.to(hidden.device), 0)
                return (per_head.flatten(-2), *rest)
            if not active[layer]:
                return None
            hidden, *rest = args
            mask = knocked[layer]
            if mask.device != hidden.device:
                mask = knocked[layer] = mask.to(hidden.device)
            # (..., H*d) -> (..., H, d); masked_fill gives exact zeros whatever the dtype.
            per_head = hidden.unflatten(-1, (num_heads, -1)).masked_fill(mask, 0)
            return (per_head.flatten(-2), *rest)

        return knock_out_heads

    @property
    def heads(self) -> tuple[Head, ...]:
        """The heads knocked out now, sorted."""
        return self._heads

    def set_heads(self, heads: str | Iterable[str | Head | tuple[int, int]]) -> tuple[Head, ...]:
        """Knock out exactly ``heads`` (a ``L0H1+L2H3`` string or a list); [] restores all."""
        if isinstance(heads, str) and not heads.strip():
            parsed: list[Head] = []
        else:
            parsed = parse_heads(heads, self.num_layers, self.num_heads)
        for layer in {h.layer for h in self._heads}:  # clear only the layers in use
            self._knocked[layer].fill_(False)
            self._active[layer] = False
        by_layer: dict[int, list[int]] = {}
        for head in parsed:
            by_layer.setdefault(head.layer, []).append(head.head)
        for layer, indices in by_layer.items():
            self._knocked[layer][indices] = True
            self._active[layer] = True
        self._heads = tuple(parsed)
        return self._heads

    def set_row_masks(self, knocked_out: torch.Tensor | None) -> None:
        """One mask per batch row: ``knocked_out[r, j]`` True knocks out flat head ``j``
        (``layer * H + head``) in row ``r`` of the next forward passes; ``None`` ends it.

        Replaces the ``set_heads`` mask while set. Layers where no row knocks anything
        out keep the no-cost path.
        """
        if knocked_out is None:
            self._row_knocked[:] = [None] * self.num_layers
            return
        knocked_out = torch.as_tensor(knocked_out, dtype=torch.bool)
        expected = self.num_layers * self.num_heads
        if knocked_out.ndim != 2 or knocked_out.shape[1] != expected:
            raise ValueError(f"per-row masks must have shape (rows, {expected}), "
                             f"got {tuple(knocked_out.shape)}")
        per_layer = knocked_out.view(-1, self.num_layers, self.num_heads)
        for layer in range(self.num_layers):
            rows = per_layer[:, layer]
            self._row_knocked[layer] = (rows[:, None, :, None].to(self._knocked[layer].device)
                                        if rows.any() else False)

    def remove(self) -> None:
        """Take the hooks off the model (the model is then as loaded)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __repr__(self) -> str:
        return (f"HeadKnockout({self.num_layers} layers x {self.num_heads} heads, "
                f"knocked out: {format_heads(self._heads) or 'none'})")


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
