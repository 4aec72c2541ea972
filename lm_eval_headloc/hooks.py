"""Knockout hooks: ablate the output of chosen attention heads in any HF causal LM.

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

import contextlib
import fnmatch
from collections.abc import Iterable, Iterator

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


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def attention_geometry(model: nn.Module) -> tuple[int, int]:
    """(layers, query heads per layer) from the model's (text) config."""
    config = _text_config(model)
    try:
        return int(config.num_hidden_layers), int(config.num_attention_heads)
    except AttributeError as err:
        raise AttentionOutputNotFound(
            f"cannot read the layer/head counts from {type(config).__name__}: {err}"
        ) from None


def _head_dim(model: nn.Module, heads_per_layer: int) -> int | None:
    """Width of one head's slice of the output projection's input, per the config.

    ``v_head_dim`` first: in multi-head latent attention (DeepSeek-V2/V3) the projection
    takes the value heads while ``head_dim`` is the rotary query/key width. None when
    the config does not tell.
    """
    config = _text_config(model)
    for name in ("v_head_dim", "head_dim"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hidden, int) and hidden % heads_per_layer == 0:
        return hidden // heads_per_layer
    return None


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
    num_layers, heads_per_layer = attention_geometry(model)
    head_dim = _head_dim(model, heads_per_layer)
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


class HeadKnockout:
    """Ablation of attention heads through forward pre-hooks on the output projections.

    >>> knockout = HeadKnockout(model)          # hooks installed once
    >>> knockout.set_heads("L0H3+L1H0")          # switch in place, any number of times
    >>> knockout.set_heads([])                   # nothing knocked out: no extra cost

    A knocked-out head's slice becomes ``replacement + scale · (slice − replacement)``:
    the replacement is zero unless :meth:`set_replacement` gives per-layer means
    (``ablation.py``); ``scale`` 0 (default) is the replacement itself, 1 the head as it
    is (both exact), 2 amplification.
    """

    def __init__(self, model: nn.Module, attn_out: str | None = None, *,
                 scale: float = 0.0) -> None:
        self.num_layers, self.heads_per_layer = attention_geometry(model)
        self.modules = find_attention_outputs(model, attn_out)
        self.head_dim = _input_features(self.modules[0]) // self.heads_per_layer
        self.scale = float(scale)
        # Per layer: None (zeros) or a (heads, head_dim) tensor on that layer's device.
        self._replacement: list[torch.Tensor | None] = [None] * self.num_layers
        # Resample ablation: per layer a (rows, donor width, H, d) tensor of donor outputs,
        # and per row which donor position stands in for each column (rows, columns).
        self._donors: list[torch.Tensor] | None = None
        self._donor_index: torch.Tensor | None = None
        self.first_column = 0  # the columns a forward sees start here (generation's cache)
        self._suspended = [False]  # a list: the hooks hold it (see suspended)
        # One boolean row per layer, on that layer's device (models may be split
        # across devices); True = knocked out.
        self._knocked = [
            torch.zeros(self.heads_per_layer, 1, dtype=torch.bool, device=_device_of(m))
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
        active, knocked, heads_per_layer = self._active, self._knocked, self.heads_per_layer
        row_knocked, ablated, suspended = self._row_knocked, self._ablated, self._suspended

        def knock_out_heads(module: nn.Module, args: tuple):
            rows = row_knocked[layer]
            if rows is False or suspended[0]:
                return None
            if rows is not None:  # one mask per batch row
                hidden, *rest = args
                if rows.shape[0] != hidden.shape[0]:
                    raise RuntimeError(f"per-row head masks for {rows.shape[0]} rows, batch "
                                       f"has {hidden.shape[0]}")
                per_head = ablated(layer, hidden.unflatten(-1, (heads_per_layer, -1)),
                                   rows.to(hidden.device))
                return (per_head.flatten(-2), *rest)
            if not active[layer]:
                return None
            hidden, *rest = args
            mask = knocked[layer]
            if mask.device != hidden.device:
                mask = knocked[layer] = mask.to(hidden.device)
            # (..., H*d) -> (..., H, d)
            per_head = ablated(layer, hidden.unflatten(-1, (heads_per_layer, -1)), mask)
            return (per_head.flatten(-2), *rest)

        return knock_out_heads

    def _ablated(self, layer: int, per_head: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``per_head`` (..., H, d) with the heads in ``mask`` (broadcastable, True = out)
        replaced: the one place the ablation kind and the scale act."""
        scale = self.scale
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

    def replacement(self, layer: int, per_head: torch.Tensor) -> torch.Tensor | None:
        """What layer ``layer``'s knocked-out heads become where its output projection sees
        ``per_head`` (..., H, d): None for zeros, else a tensor broadcastable to it (the
        mean's (H, d), or the donors' (rows, columns, H, d) under resample)."""
        if self._donors is not None:
            donors, index = self._donors[layer], self._donor_index
            if per_head.dim() != 4 or per_head.shape[0] != donors.shape[0]:
                raise RuntimeError(f"resample ablation: layer {layer} sees "
                                   f"{tuple(per_head.shape[:-2])} positions, donors were set "
                                   f"for {donors.shape[0]} rows")
            columns = per_head.shape[1]
            picked = index[:, self.first_column:self.first_column + columns]
            if picked.shape[1] != columns:
                raise RuntimeError(f"resample ablation: columns {self.first_column}.."
                                   f"{self.first_column + columns} past the {index.shape[1]} "
                                   "donors were aligned to")
            rows = torch.arange(donors.shape[0], device=donors.device)[:, None]
            return donors[rows, picked.to(donors.device)].to(per_head)
        replacement = self._replacement[layer]
        if replacement is None:
            return None
        if replacement.device != per_head.device or replacement.dtype != per_head.dtype:
            replacement = self._replacement[layer] = replacement.to(per_head)
        return replacement

    def set_donors(self, per_layer: list[torch.Tensor] | None,
                   index: torch.Tensor | None = None) -> None:
        """Resample ablation for the next forward passes: ``per_layer[l]`` (rows, width,
        H·d) holds each row's donor outputs at layer ``l``, ``index`` (rows, columns) which
        donor position replaces each column of that row; ``None`` ends it."""
        if per_layer is None:
            self._donors, self._donor_index, self.first_column = None, None, 0
            return
        if len(per_layer) != self.num_layers or index is None or index.dim() != 2:
            raise ValueError(f"donors must be {self.num_layers} tensors and a (rows, columns) "
                             "index")
        self._donors = [t.unflatten(-1, (self.heads_per_layer, -1)).to(_device_of(m))
                        for t, m in zip(per_layer, self.modules, strict=True)]
        self._donor_index = index
        self.first_column = 0

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, the hooks leave every head as it is (the donors' own clean pass)."""
        saved, self._suspended[0] = self._suspended[0], True
        try:
            yield
        finally:
            self._suspended[0] = saved

    @property
    def is_suspended(self) -> bool:
        """Whether the hooks leave every head as it is now (inside ``suspended``)."""
        return self._suspended[0]

    @property
    def any_knocked_out(self) -> bool:
        """Whether the next forward pass knocks out any head."""
        rows = self._row_knocked
        if any(r is not None for r in rows):
            return any(r is not None and r is not False for r in rows)
        return any(self._active)

    def set_replacement(self, per_layer: list[torch.Tensor] | None) -> None:
        """What knocked-out heads are replaced by: per layer a ``(heads, head_dim)``
        tensor (mean ablation), or ``None`` for zeros."""
        if per_layer is None:
            self._replacement[:] = [None] * self.num_layers
            return
        shape = (self.heads_per_layer, self.head_dim)
        if len(per_layer) != self.num_layers or any(tuple(t.shape) != shape
                                                    for t in per_layer):
            raise ValueError(f"replacements must be {self.num_layers} tensors of shape "
                             f"{shape}")
        self._replacement[:] = [t.to(_device_of(m)) for t, m in zip(per_layer, self.modules,
                                                                     strict=True)]

    @property
    def heads(self) -> tuple[Head, ...]:
        """The heads knocked out now, sorted."""
        return self._heads

    def set_heads(self, heads: str | Iterable[str | Head | tuple[int, int]]) -> tuple[Head, ...]:
        """Knock out exactly ``heads`` (a ``L0H1+L2H3`` string or a list); [] restores all."""
        if isinstance(heads, str) and not heads.strip():
            parsed: list[Head] = []
        else:
            parsed = parse_heads(heads, self.num_layers, self.heads_per_layer)
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
        expected = self.num_layers * self.heads_per_layer
        if knocked_out.ndim != 2 or knocked_out.shape[1] != expected:
            raise ValueError(f"per-row masks must have shape (rows, {expected}), "
                             f"got {tuple(knocked_out.shape)}")
        per_layer = knocked_out.view(-1, self.num_layers, self.heads_per_layer)
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
        return (f"HeadKnockout({self.num_layers} layers x {self.heads_per_layer} heads, "
                f"knocked out: {format_heads(self._heads) or 'none'})")


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
