"""Knockout hooks: ablate chosen attention heads and MLP neurons in any HF causal LM.

A head's output reaches the residual stream only through the attention output
projection (``o_proj``, ``out_proj``, ``c_proj``, ``dense`` …), whose input is the
concatenation of the heads' outputs. Zeroing the input slice
``[h*d_head:(h+1)*d_head]`` of that projection knocks out head ``h`` exactly: it is
what zeroing that head's columns of the projection's weight does. A neuron is the same
thing one feature wide on the MLP's output projection (``down_proj``, ``fc2`` …): input
feature ``n`` is neuron ``n``'s activation, and zeroing it is zeroing column ``n``.

The hooks are installed once and act only inside ``HeadKnockout.applied``, on the
``Intervention`` (a value) given there; outside it the model is as loaded.

No lm-eval import here: this module works on a bare ``transformers``/PEFT model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lm_eval_headloc.intervention.ablation import check_scale
from lm_eval_headloc.intervention.components import (
    Component,
    HeadSpecError,
    Neuron,
    describe_layers,
    names_neurons,
    parse_components,
)
from lm_eval_headloc.intervention.geometry import Geometry, UnsupportedGeometry, text_config

__all__ = ["KINDS", "ActivePass", "AttentionOutputNotFound", "HeadKnockout", "Intervention",
           "MLPOutputNotFound", "attention_geometry", "find_attention_outputs",
           "find_mlp_outputs", "kind_of"]

# Names the output projection has in the attention blocks of the families we know of
# (Llama/Mistral/Qwen/Gemma/Phi-3: o_proj; OPT/BART: out_proj; GPT-2: c_proj;
# GPT-NeoX/Falcon/Phi-1: dense; T5-style: o; MPT: out_proj; BLOOM: dense).
_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "out")
_ATTENTION_HINTS = ("attn", "attention")
# Attention blocks that are not the layer's own self-attention over the text: a
# seq2seq decoder's attention to the encoder (BART's encoder_attn), which a causal LM made
# of that decoder skips, and linear attention (not heads of softmax attention).
_NOT_SELF_ATTENTION = ("encoder_attn", "linear")


class AttentionOutputNotFound(HeadSpecError):
    """The attention output projection of this architecture could not be discovered."""


class MLPOutputNotFound(HeadSpecError):
    """The MLP output projection (the neurons' site) could not be discovered."""


def _geometry(model: nn.Module) -> Geometry:
    if not hasattr(model, "config"):
        raise AttentionOutputNotFound(f"{type(model).__name__} has no .config: give a Hugging "
                                      "Face model (AutoModelForCausalLM.from_pretrained(...))")
    try:
        return Geometry.from_config(model.config)
    except (AttributeError, UnsupportedGeometry) as err:
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


_VISION = ("vision", "visual", "image")


def _decoder_layers(model: nn.Module, num_layers: int) -> list[nn.Module]:
    # The decoder stack is the ModuleList with one entry per layer; with several, not a
    # vision tower's (GIT's may be as deep and larger), then the one holding the most
    # parameters.
    named = [(name, m) for name, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == num_layers]
    text = [m for name, m in named if not any(word in name.lower() for word in _VISION)]
    lists = text or [m for _, m in named]
    if not lists:
        raise AttentionOutputNotFound(
            f"no list of {num_layers} decoder layers found in {type(model).__name__}; "
            "name the attention output projections with attn_out=<module-name pattern>, "
            "e.g. attn_out=model.layers.*.self_attn.o_proj"
        )
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


def _is_attention(name: str, module: nn.Module, by_class: bool) -> bool:
    """Whether block ``name`` (its last part) is self-attention by its name, or with
    ``by_class`` by its class's (Nemotron-H's ``mixer``, RecurrentGemma's
    ``temporal_block``: ``…Attention``)."""
    words = [name.split(".")[-1].lower()] + ([type(module).__name__.lower()] if by_class else [])
    return any(any(hint in word for hint in _ATTENTION_HINTS) for word in words) and not any(
        bad in word for word in words for bad in _NOT_SELF_ATTENTION)


def _output_projection(layer: nn.Module, index: int, heads_per_layer: int,
                       head_dim: int | None) -> nn.Module:
    blocks = dict(layer.named_modules())
    # Blocks named as attention first; blocks of an attention class where none is.
    for by_class in (False, True):
        candidates = []
        for name, module in layer.named_modules():
            parts = name.split(".")
            if len(parts) < 2 or parts[-1] not in _OUTPUT_NAMES:
                continue
            block = ".".join(parts[:-1])
            if not _is_attention(block, blocks[block], by_class):
                continue
            if _fits(_input_features(module), heads_per_layer, head_dim):
                candidates.append((name, module))
        if candidates:
            break
    if len(candidates) == 1:
        return candidates[0][1]
    seen = [n for n, m in layer.named_modules() if n and _is_attention(n, m, True)]
    found = ", ".join(n for n, _ in candidates) if candidates else "none"
    raise AttentionOutputNotFound(
        f"cannot tell which module of decoder layer {index} ({type(layer).__name__}) is the "
        f"attention output projection (candidates: {found}; attention modules: "
        f"{', '.join(seen[:8]) or 'none'}); name it with attn_out=<module-name pattern>, "
        "e.g. attn_out=model.layers.*.self_attn.o_proj"
    )


def find_attention_outputs(model: nn.Module, attn_out: str | None = None) -> list[nn.Module]:
    """The attention output projection of every decoder layer with heads, in layer order
    (every layer, but in a hybrid model only its attention layers: ``Geometry.head_layers``).

    Discovered from the config's layer count, the decoder layer list and the module
    names and shapes; ``attn_out`` (an fnmatch pattern over ``model.named_modules()``
    names, e.g. ``model.layers.*.self_attn.o_proj``) names them explicitly instead, and
    a probe forward pass checks that each match is what its attention block returns.
    """
    geometry = _geometry(model)
    num_layers, heads_per_layer = geometry.num_layers, geometry.heads_per_layer
    with_heads = geometry.layers_with_heads
    if attn_out:
        named = [(name, m) for name, m in model.named_modules()
                 if fnmatch.fnmatchcase(name, attn_out)]
        if len(named) != len(with_heads):
            which = (f"decoder layer ({num_layers})" if geometry.head_layers is None else
                     f"attention layer (layers {describe_layers(with_heads)})")
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {len(named)} module(s); it must match "
                f"exactly one per {which}"
            )
    else:
        layers = _decoder_layers(model, num_layers)
        named = [(f"decoder layer {i}", _output_projection(layers[i], i, heads_per_layer,
                                                           geometry.head_dim_of(i)))
                 for i in with_heads]
    for index, (name, module) in zip(with_heads, named, strict=True):
        features = _input_features(module)
        head_dim = geometry.head_dim_of(index)
        if not _fits(features, heads_per_layer, head_dim):
            expected = (f"{heads_per_layer} heads x {head_dim} = {heads_per_layer * head_dim}"
                        if head_dim else f"a multiple of {heads_per_layer} heads")
            raise AttentionOutputNotFound(
                f"attention output of layer {index} ({name}, {type(module).__name__}) takes "
                f"{features} input features, not {expected}"
            )
    shared = _shared([module for _, module in named])
    if shared is not None:
        first, second = (with_heads[i] for i in shared)
        raise AttentionOutputNotFound(
            f"decoder layers {first} and {second} share one attention block ({named[shared[0]][0]}"
            "); its heads are not one layer's, so they cannot be named L{layer}H{head}")
    if attn_out:
        if geometry.head_layers is not None:
            _check_in_layers(_decoder_layers(model, num_layers), named, with_heads, attn_out)
        _check_feeds_attention_output(model, named, attn_out)
    return [module for _, module in named]


def _check_in_layers(layers: list[nn.Module], named: list[tuple[str, nn.Module]],
                     with_heads: Sequence[int], attn_out: str) -> None:
    """In a hybrid model, ``attn_out``'s matches must sit in the attention layers, one
    each: as many linear-attention output projections would pass every other check."""
    for (name, module), expected in zip(named, with_heads, strict=True):
        found = next((index for index, layer in enumerate(layers)
                      if any(m is module for m in layer.modules())), None)
        if found != expected:
            where = "no decoder layer" if found is None else f"decoder layer {found}"
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {name}, in {where}; the layers with heads "
                f"are {describe_layers(with_heads)}, and each must have one match")


def _shared(modules: list[nn.Module]) -> tuple[int, int] | None:
    """The first two positions holding one module (Zamba's shared transformer block)."""
    seen: dict[int, int] = {}
    for position, module in enumerate(modules):
        if id(module) in seen:
            return seen[id(module)], position
        seen[id(module)] = position
    return None


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


# Names the MLP's output projection has (Llama/Qwen/Mistral/Gemma/Phi-3: down_proj;
# OPT/Phi-1/2: fc2; GPT-2: c_proj; GPT-NeoX/Falcon: dense_4h_to_h; Mixtral-style/InternLM:
# w2; GPT-J: fc_out; T5: wo). Its input is the MLP's neurons, one feature each.
_MLP_OUTPUT_NAMES = ("down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2", "fc_out", "wo")


def _output_features(module: nn.Module) -> int | None:
    if isinstance(getattr(module, "out_features", None), int):
        return module.out_features
    weight = getattr(module, "weight", None)
    if type(module).__name__ == "Conv1D" and weight is not None:
        return int(weight.shape[1])
    return None


def _hidden_size(model: nn.Module) -> int | None:
    text = text_config(model.config)
    for name in ("hidden_size", "n_embd", "d_model"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _mlp_fits(module: nn.Module, width: int | None, hidden: int | None) -> bool:
    # Neurons in, hidden state out: the up/gate projections are the other way round.
    features, out = _input_features(module), _output_features(module)
    if features is None:
        return False
    if width is not None and features != width:
        return False
    return hidden is None or out is None or out == hidden


def find_mlp_outputs(model: nn.Module, mlp_out: str | None = None) -> list[nn.Module]:
    """The MLP output projection of every decoder layer, in layer order: the module whose
    input is the MLP's neurons (``intermediate_size`` wide where the config says).

    Discovered from the decoder layer list and the module names and shapes, as
    ``find_attention_outputs`` finds the attention's; ``mlp_out`` (an fnmatch pattern over
    ``model.named_modules()`` names, e.g. ``model.layers.*.mlp.down_proj``) names them
    instead, and a probe forward pass checks that each match runs.
    """
    geometry = _geometry(model)
    width, hidden = geometry.neurons_per_layer, _hidden_size(model)
    advice = ("name them with mlp_out=<module-name pattern>, e.g. "
              "mlp_out=model.layers.*.mlp.down_proj")
    if mlp_out:
        named = [(name, m) for name, m in model.named_modules()
                 if fnmatch.fnmatchcase(name, mlp_out)]
        if len(named) != geometry.num_layers:
            raise MLPOutputNotFound(
                f"mlp_out={mlp_out!r} matches {len(named)} module(s); it must match exactly "
                f"one per decoder layer ({geometry.num_layers})")
    else:
        named = []
        for index, layer in enumerate(_decoder_layers(model, geometry.num_layers)):
            # An expert's projection (a shared expert's too, whose width may equal the
            # config's intermediate_size) is not the layer's MLP: the routed experts
            # beside it would stay on.
            candidates = [
                (name, module) for name, module in layer.named_modules()
                if name.split(".")[-1] in _MLP_OUTPUT_NAMES
                and not any(word in part.lower() for part in name.split(".")[:-1]
                            for word in (*_ATTENTION_HINTS, "expert"))
                and _mlp_fits(module, width, hidden)]
            if len(candidates) != 1:
                found = ", ".join(n for n, _ in candidates) or "none"
                experts = any("expert" in name.lower() for name, _ in layer.named_modules())
                why = ("; a mixture of experts has no single one" if experts else "")
                raise MLPOutputNotFound(
                    f"cannot tell which module of decoder layer {index} "
                    f"({type(layer).__name__}) is the MLP output projection (candidates: "
                    f"{found}{why}); {advice}")
            named.append((f"decoder layer {index}", candidates[0][1]))
    widths = {_input_features(module) for _, module in named}
    for index, (name, module) in enumerate(named):
        if not _mlp_fits(module, width, hidden) or len(widths) != 1:
            raise MLPOutputNotFound(
                f"MLP output of layer {index} ({name}, {type(module).__name__}) takes "
                f"{_input_features(module)} input features and gives "
                f"{_output_features(module)}, not the MLP's {width or 'neurons'} in and the "
                f"hidden size {hidden} out; {advice}")
    if mlp_out:
        _check_runs(model, named, f"mlp_out={mlp_out!r}")
    return [module for _, module in named]


def _check_runs(model: nn.Module, named: list[tuple[str, nn.Module]], option: str) -> None:
    """Refuse matches that a forward pass never calls (their knockout would do nothing)."""
    called: set[int] = set()
    handles = [module.register_forward_pre_hook(
        lambda _m, _a, index=index: called.add(index)) for index, (_, module) in
        enumerate(named)]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            model(**_probe_inputs(model))
    except Exception as err:  # whatever broke, say so in one line
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise MLPOutputNotFound(f"{option}: the probe forward pass that checks the matched "
                                f"modules failed ({type(err).__name__}: {message})") from None
    finally:
        for handle in handles:
            handle.remove()
        for module, training in modes:
            module.training = training
    for index, (name, _) in enumerate(named):
        if index not in called:
            raise MLPOutputNotFound(f"{option} matches {name}, which did not run in a "
                                    "forward pass")


#: The kinds of component, in flat-index order (a design's columns: heads, then neurons).
KINDS: tuple[str, ...] = ("heads", "neurons")


def kind_of(component: Component) -> str:
    return "neurons" if isinstance(component, Neuron) else "heads"


@dataclass(frozen=True, eq=False)
class Intervention:
    """What one forward pass does to the model's components: a value, applied only inside
    ``HeadKnockout.applied`` (nothing stays switched on after it).

    ``components`` (heads and MLP neurons) are knocked out in every batch row;
    ``row_masks`` ((rows, columns) booleans over the flat component index: head
    ``layer * H + head``, then, when wider than the heads, neuron
    ``L * H + layer * M + neuron``) knock out a different set in each row instead (several
    masks in one batch). A knocked-out slice becomes ``replacement + scale · (slice −
    replacement)``: the replacement is zero unless ``replacement`` gives, per kind
    (``"heads"``, ``"neurons"``), per-layer ``(units, width)`` means (``ablation.py``), or
    the pass is given resample donors; ``scale`` 0 is the replacement itself, 1 the
    component as it is (both exact), 2 amplification.
    """

    components: tuple[Component, ...] = ()
    row_masks: torch.Tensor | None = None
    scale: float = 0.0
    replacement: Mapping[str, tuple[torch.Tensor, ...]] | None = None

    def __post_init__(self) -> None:
        # A NaN scale would make every knocked-out slice NaN, silently.
        object.__setattr__(self, "scale", check_scale(self.scale))

    @property
    def any_knocked_out(self) -> bool:
        """Whether a pass under it changes anything (scale 1 changes nothing)."""
        if self.scale == 1.0:
            return False
        if self.row_masks is not None:
            return bool(self.row_masks.any())
        return bool(self.components)

    @property
    def kinds(self) -> set[str]:
        """The kinds of component it knocks out."""
        if self.row_masks is not None:
            return set(KINDS)  # the width says; the knockout checks it
        return {kind_of(c) for c in self.components}

    def replace(self, **changes: Any) -> Intervention:
        return dataclasses.replace(self, **changes)


@dataclass
class ActivePass:
    """The intervention of the forward pass(es) running now, placed per kind and layer."""

    masks: dict[str, list[torch.Tensor | None]]  # per layer: None or broadcastable bools
    rows: int | None  # per-row masks: the batch rows they are for
    scale: float
    replacement: dict[str, list[torch.Tensor | None]]
    # Resample: per kind and layer (donors, width, units, d) donor outputs, and per row
    # which donor position (donor × width + position) stands in for each column.
    donors: dict[str, list[torch.Tensor]] | None = None
    donor_index: torch.Tensor | None = None
    first_column: int = 0  # the columns a forward sees start here (generation's cache)


@dataclass
class _Site:
    """Where one kind of component is knocked out: a projection per layer whose input is
    ``units`` slices, each layer's ``widths[layer]`` wide (heads x head_dim, or neurons x
    1; Gemma 4's head width differs between its sliding and full attention layers). The
    lists have an entry per decoder layer, None in a layer without the kind (a hybrid
    model's layers without attention heads)."""

    modules: list[nn.Module | None]
    units: int
    widths: list[int | None]
    devices: list[torch.device | None]
    handles: list = dataclasses.field(default_factory=list)

    @property
    def layers(self) -> list[int]:
        """The layers that have the kind (every layer but a hybrid's others)."""
        return [layer for layer, module in enumerate(self.modules) if module is not None]

    def per_layer(self, present: Sequence[Any]) -> list[Any]:
        """``present`` (one entry per layer that has the kind, in order) spread over every
        layer, None in the others."""
        spread: list[Any] = [None] * len(self.modules)
        for layer, value in zip(self.layers, present, strict=True):
            spread[layer] = value
        return spread


class HeadKnockout:
    """Ablation of attention heads, and MLP neurons, through forward pre-hooks on the
    attention (and MLP) output projections.

    >>> knockout = HeadKnockout(model)                 # hooks installed once
    >>> with knockout.knocking_out("L0H3+L1N12"):      # for the passes inside only
    ...     model(input_ids)
    >>> model(input_ids)                               # the model as loaded

    The hooks are installed once and do nothing outside ``applied`` (or its shorthand
    ``knocking_out``), which scopes an ``Intervention`` to the passes run inside it, as
    TransformerLens's ``run_with_hooks`` scopes hooks to one call: switching costs a few
    small tensor writes, no re-registration. A layer with nothing knocked out returns at
    once. The MLP side is found the first time a neuron is asked for (or with
    ``neurons=True``/``mlp_out``), so a model whose MLP is not one projection per layer
    (a mixture of experts) still has its heads. ``hf-headablate`` (``model.py``) applies
    its components around each forward pass.
    """

    def __init__(self, model: nn.Module, attn_out: str | None = None,
                 mlp_out: str | None = None, neurons: bool = False) -> None:
        self.model = model
        self.geometry = _geometry(model)
        self.num_layers = self.geometry.num_layers
        self.heads_per_layer = self.geometry.heads_per_layer
        #: The layers with heads (every layer but a hybrid model's others).
        self.layers_with_heads = self.geometry.layers_with_heads
        modules = find_attention_outputs(model, attn_out)
        #: The first layer's head width (``geometry.head_dim_of`` gives each layer's).
        self.head_dim = _input_features(modules[0]) // self.heads_per_layer
        self.mlp_out = mlp_out
        self._sites: dict[str, _Site] = {}
        self._active: ActivePass | None = None
        self._placed: tuple[Intervention, ActivePass] | None = None  # the last one placed
        self._removed = False
        self._add_site("heads", dict(zip(self.layers_with_heads, modules, strict=True)),
                       self.heads_per_layer)
        if neurons or mlp_out:
            self.enable_neurons()

    def _add_site(self, kind: str, modules: Mapping[int, nn.Module], units: int) -> None:
        every = [modules.get(layer) for layer in range(self.num_layers)]
        site = _Site(every, units,
                     [None if m is None else _input_features(m) // units for m in every],
                     [None if m is None else _device_of(m) for m in every])
        site.handles = [module.register_forward_pre_hook(self._make_hook(kind, layer))
                        for layer, module in modules.items()]
        self._sites[kind] = site

    def enable_neurons(self) -> None:
        """Find the MLP output projections and hook them (once; raises
        ``MLPOutputNotFound`` naming ``mlp_out=`` when they cannot be told)."""
        if "neurons" in self._sites:
            return
        modules = find_mlp_outputs(self.model, self.mlp_out)
        self._add_site("neurons", dict(enumerate(modules)), _input_features(modules[0]))
        self._placed = None

    @property
    def modules(self) -> list[nn.Module]:
        """The attention output projections, one per layer with heads."""
        return self.site_modules(["heads"])

    @property
    def has_neurons(self) -> bool:
        return "neurons" in self._sites

    @property
    def mlp_modules(self) -> list[nn.Module]:
        """The MLP output projections, one per layer (found on first use)."""
        return self.site_modules(["neurons"])

    @property
    def neurons_per_layer(self) -> int:
        self.enable_neurons()
        return self._sites["neurons"].units

    def site_modules(self, kinds: Iterable[str]) -> list[nn.Module]:
        """The hooked modules of ``kinds`` (in ``KINDS`` order, each kind's layers in
        order; only the layers that have the kind): what mean and resample ablation
        record."""
        return [m for kind in KINDS if kind in set(kinds) for m in self._site(kind).modules
                if m is not None]

    def site_layers(self, kind: str) -> list[int]:
        """The layer of each of ``site_modules([kind])``."""
        return self._site(kind).layers

    def _site(self, kind: str) -> _Site:
        if kind == "neurons":
            self.enable_neurons()
        return self._sites[kind]

    def _make_hook(self, kind: str, layer: int):
        def knock_out(module: nn.Module, args: tuple):
            active = self._active
            masks = None if active is None else active.masks.get(kind)
            mask = None if masks is None else masks[layer]
            if mask is None:
                return None
            hidden, *rest = args
            if active.rows is not None and active.rows != hidden.shape[0]:
                raise RuntimeError(f"per-row masks for {active.rows} rows, batch has "
                                   f"{hidden.shape[0]}")
            if mask.device != hidden.device:  # a model split across devices
                mask = masks[layer] = mask.to(hidden.device)
            # (..., units*width) -> (..., units, width)
            units = self._sites[kind].units
            per_unit = self._ablated(kind, layer, hidden.unflatten(-1, (units, -1)), mask)
            return (per_unit.flatten(-2), *rest)

        return knock_out

    def _ablated(self, kind: str, layer: int, per_unit: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
        """``per_unit`` (..., units, width) with the units in ``mask`` (broadcastable,
        True = out) replaced: the one place the ablation kind and the scale act."""
        scale = self._active.scale
        if scale == 1.0:
            return per_unit  # the component as it is, exactly
        replacement = self.replacement(layer, per_unit, kind)
        if replacement is None:
            if scale == 0.0:
                return per_unit.masked_fill(mask, 0)  # exact zeros whatever the dtype
            return torch.where(mask, per_unit * scale, per_unit)
        if scale == 0.0:
            return torch.where(mask, replacement, per_unit)
        return torch.where(mask, replacement + scale * (per_unit - replacement), per_unit)

    @property
    def active(self) -> ActivePass | None:
        """The intervention of the passes running now (None outside ``applied``, or inside
        ``applied(None)``: the model as loaded)."""
        return self._active

    def replacement(self, layer: int, per_unit: torch.Tensor, kind: str = "heads"
                    ) -> torch.Tensor | None:
        """What layer ``layer``'s knocked-out components of ``kind`` become where their
        projection sees ``per_unit`` (..., units, width) in the active pass: None for
        zeros, else a tensor broadcastable to it (the mean's (units, width), or the donors'
        (rows, columns, units, width) under resample)."""
        active = self._active
        if active is None:
            return None
        if active.donors is not None:
            donors, index = active.donors[kind][layer], active.donor_index
            if per_unit.dim() != 4 or per_unit.shape[0] != index.shape[0]:
                raise RuntimeError(f"resample ablation: layer {layer} sees "
                                   f"{tuple(per_unit.shape[:-2])} positions, donors were set "
                                   f"for {index.shape[0]} rows")
            columns = per_unit.shape[1]
            picked = index[:, active.first_column:active.first_column + columns]
            if picked.shape[1] != columns:
                raise RuntimeError(f"resample ablation: columns {active.first_column}.."
                                   f"{active.first_column + columns} past the "
                                   f"{index.shape[1]} donors were aligned to")
            # (donors × width, units, d) indexed by (rows, columns): each row's donor.
            return donors.flatten(0, 1)[picked.to(donors.device)].to(per_unit)
        replacements = active.replacement.get(kind)
        replacement = None if replacements is None else replacements[layer]
        if replacement is None:
            return None
        if replacement.device != per_unit.device or replacement.dtype != per_unit.dtype:
            replacement = replacements[layer] = replacement.to(per_unit)
        return replacement

    def check_replacement(self, per_layer: Sequence[torch.Tensor | None], kind: str = "heads"
                          ) -> tuple[torch.Tensor | None, ...]:
        """Per-layer ``(units, width)`` means of ``kind`` (one per layer that has the kind,
        as ``site_modules`` lists them, or one per layer with None where it has none),
        checked and placed on each layer's device, for ``Intervention.replacement``;
        returned one per layer."""
        site = self._site(kind)
        layers = site.layers
        if len(per_layer) == len(layers) and len(layers) != self.num_layers:
            per_layer = site.per_layer(per_layer)
        shapes = [(site.units, site.widths[layer]) for layer in layers]
        if len(per_layer) != self.num_layers or any(
                per_layer[layer] is None or tuple(per_layer[layer].shape) != shape
                for layer, shape in zip(layers, shapes, strict=True)):
            described = (f"shape {shapes[0]}" if len(set(shapes)) == 1
                         else f"shapes {shapes}")
            raise ValueError(f"{kind} replacements must be {len(layers)} tensors of "
                             f"{described}")
        return tuple(None if device is None else t.to(device)
                     for t, device in zip(per_layer, site.devices, strict=True))

    def flat_width(self, kinds: Iterable[str]) -> int:
        """Columns of a row mask over ``kinds``: all heads, then (with neurons) all
        neurons (a hybrid model's layers without heads keep their columns, which must
        stay False)."""
        return sum(self.num_layers * self._site(kind).units for kind in KINDS
                   if kind in set(kinds))

    def row_masks(self, masks: Sequence[Iterable[Component]]) -> torch.Tensor:
        """(len(masks), columns) booleans knocking out each mask's components in its row,
        for ``Intervention.row_masks``: as wide as the heads, or, when a mask has a
        neuron, as the heads and every neuron."""
        masks = [list(mask) for mask in masks]
        kinds = {kind_of(c) for mask in masks for c in mask} | {"heads"}
        rows = torch.zeros(len(masks), self.flat_width(kinds), dtype=torch.bool)
        heads = self.flat_width(["heads"])
        for row, mask in enumerate(masks):
            for component in mask:
                if isinstance(component, Neuron):
                    rows[row, heads + component.layer * self.neurons_per_layer
                         + component.neuron] = True
                else:
                    rows[row, component.layer * self.heads_per_layer + component[1]] = True
        return rows

    def kinds_of(self, intervention: Intervention) -> list[str]:
        """The kinds ``intervention`` knocks out (heads when none): what its resample
        donors must be recorded for (``applied``'s ``donors``), in ``KINDS`` order."""
        # What _place would key its masks by, without placing anything (this runs before
        # every measurement and, under resample, every forward pass).
        if intervention.row_masks is not None:
            width = int(intervention.row_masks.shape[-1])
            kinds = ["heads"] if width == self.flat_width(["heads"]) else list(KINDS)
        else:
            kinds = [kind for kind in KINDS if kind in intervention.kinds]
        return kinds or ["heads"]

    def _place(self, intervention: Intervention) -> ActivePass:
        """Per-kind, per-layer device masks for ``intervention`` (the last one is kept: a
        model answering many requests under one intervention places it once)."""
        if self._placed is not None and self._placed[0] is intervention:
            placed = self._placed[1]
            return dataclasses.replace(
                placed, masks={k: list(v) for k, v in placed.masks.items()},
                replacement={k: list(v) for k, v in placed.replacement.items()})
        layers = self.num_layers
        masks: dict[str, list[torch.Tensor | None]] = {}
        rows = None
        if intervention.row_masks is not None:
            knocked = torch.as_tensor(intervention.row_masks, dtype=torch.bool)
            heads_only = self.flat_width(["heads"])
            if knocked.ndim == 2 and knocked.shape[1] > heads_only:
                self.enable_neurons()
            kinds = ["heads"] if knocked.ndim == 2 and knocked.shape[1] == heads_only \
                else list(KINDS)
            width = self.flat_width(kinds)
            if knocked.ndim != 2 or knocked.shape[1] != width:
                raise ValueError(f"per-row masks must have shape (rows, {heads_only}) for "
                                 f"heads or (rows, {self.flat_width(KINDS)}) for heads and "
                                 f"neurons, got {tuple(knocked.shape)}")
            rows, start = knocked.shape[0], 0
            on_device: dict[Any, torch.Tensor] = {}  # the whole mask, once per device
            for kind in kinds:
                site = self._sites[kind]
                span = slice(start, start + layers * site.units)
                by_layer = knocked[:, span].view(-1, layers, site.units)
                start += layers * site.units
                stray = [layer for layer, module in enumerate(site.modules)
                         if module is None and by_layer[:, layer].any()]
                if stray:
                    raise ValueError(f"per-row masks knock out {kind} in layer {stray[0]}, "
                                     f"which has none (the layers with {kind}: "
                                     f"{describe_layers(site.layers)})")
                touched = by_layer.any(dim=(0, 2)).tolist()
                masks[kind] = []
                for layer in range(layers):
                    device = site.devices[layer]
                    if not touched[layer]:
                        masks[kind].append(None)
                        continue
                    if device not in on_device:
                        on_device[device] = _to_device_without_waiting(knocked, device)
                    masks[kind].append(on_device[device][:, span].view(
                        -1, layers, site.units)[:, layer][:, None, :, None])
        else:
            by_layer: dict[tuple[str, int], list[int]] = {}
            kinds = intervention.kinds
            if "neurons" in kinds:
                self.enable_neurons()
            checked = parse_components(
                intervention.components, layers, self.heads_per_layer,
                self._sites["neurons"].units if "neurons" in kinds else None,
                head_layers=self.geometry.head_layers)
            for component in checked:
                by_layer.setdefault((kind_of(component), component.layer),
                                    []).append(component[1])
            for (kind, layer), indices in by_layer.items():
                site = self._sites[kind]
                mask = torch.zeros(site.units, 1, dtype=torch.bool)
                mask[indices] = True
                masks.setdefault(kind, [None] * layers)[layer] = mask.to(site.devices[layer])
            masks = {kind: masks[kind] for kind in KINDS if kind in masks}
        # Every kind given, knocked out or not: attribution (prior.py) reads the
        # replacement of a pass that knocks out nothing.
        replacement = {kind: list(self.check_replacement(per_layer, kind))
                       for kind, per_layer in (intervention.replacement or {}).items()}
        placed = ActivePass(masks, rows, float(intervention.scale), replacement)
        self._placed = (intervention, placed)
        return dataclasses.replace(placed, masks={k: list(v) for k, v in masks.items()},
                                   replacement={k: list(v) for k, v in replacement.items()})

    @contextlib.contextmanager
    def applied(self, intervention: Intervention | None,
                donors: tuple[list[torch.Tensor], torch.Tensor] | None = None
                ) -> Iterator[ActivePass | None]:
        """Inside, every forward pass of the model runs under ``intervention`` (None: the
        model as loaded, e.g. resample's own clean pass for its donors); the previous
        state (usually none) is back on exit, whatever happens inside. ``donors``:
        resample ablation's ``(per_module, index)``: ``per_module`` holds, for the modules
        of ``site_modules(kinds)`` in that order (the kinds the intervention knocks out),
        the donors' inputs (donors, width, features); ``index`` (rows, columns) which
        donor position replaces each column of that row, as donor × width + position
        (``ablation.Resampler.donors``: rows that share a donor share its outputs). Yields
        the ``ActivePass``."""
        if self._removed:  # its hooks are off the model: a knockout would change nothing
            raise RuntimeError("this HeadKnockout's hooks were taken off the model (remove()); "
                               "make a new HeadKnockout(model)")
        active = None if intervention is None else self._place(intervention)
        if active is not None and donors is not None:
            per_module, index = donors
            kinds = list(active.masks) or ["heads"]
            counts = [len(self._sites[kind].layers) for kind in kinds]
            if len(per_module) != sum(counts) or index is None or index.dim() != 2:
                wanted = ", ".join(f"{n} of {k}" for k, n in zip(kinds, counts, strict=True))
                raise ValueError(f"donors must be a tensor per hooked module ({wanted}) and "
                                 "a (rows, columns) index")
            active.donors = {}
            start = 0
            for kind, count in zip(kinds, counts, strict=True):
                site = self._sites[kind]
                chunk = site.per_layer(per_module[start:start + count])
                start += count
                active.donors[kind] = [None if t is None else
                                       t.unflatten(-1, (site.units, -1)).to(device)
                                       for t, device in zip(chunk, site.devices, strict=True)]
            # On the donors' device once, not in every layer of every pass.
            first = next((t.device for ts in active.donors.values() for t in ts
                          if t is not None), None)
            active.donor_index = index if first is None else index.to(first)
        saved, self._active = self._active, active
        try:
            yield active
        finally:
            self._active = saved

    def knocking_out(self, components: str | Iterable[str | Component | tuple[int, int]], *,
                     scale: float = 0.0) -> contextlib.AbstractContextManager:
        """``applied`` for ``components`` (a ``L0H1+L2N3`` string or a list) zeroed, or
        scaled by ``scale``: the shorthand for a bare model."""
        if isinstance(components, str) and not components.strip():
            parsed: tuple[Component, ...] = ()
        else:  # checked against the model, which also expands L0H* and L0N*
            neurons = (self.neurons_per_layer if self.has_neurons
                       or names_neurons(components) else None)
            parsed = tuple(parse_components(components, self.num_layers,
                                            self.heads_per_layer, neurons,
                                            head_layers=self.geometry.head_layers))
        return self.applied(Intervention(components=parsed, scale=scale))

    def remove(self) -> None:
        """Take the hooks off the model (the model is then as loaded)."""
        for site in self._sites.values():
            for handle in site.handles:
                handle.remove()
            site.handles = []
        self._removed = True

    def __repr__(self) -> str:
        neurons = (f", {self._sites['neurons'].units} MLP neurons"
                   if "neurons" in self._sites else "")
        some = ("" if self.geometry.head_layers is None else
                f", heads in layers {describe_layers(self.layers_with_heads)}")
        return (f"HeadKnockout({self.num_layers} layers x {self.heads_per_layer} heads"
                f"{some}{neurons})")


def _to_device_without_waiting(tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """``tensor.to(device)`` that does not make the host wait for the GPU's queued work.

    Per-row masks are placed for every forward pass: a plain copy from pageable host
    memory waits for the previous pass to finish before the host may queue the next one
    (the GPU idle in between). From pinned memory the copy is queued like a kernel, and
    PyTorch keeps the pinned source alive until it is done."""
    device = torch.device(device)
    if tensor.device.type == "cpu" and device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        if tensor.device.type != "meta":
            return tensor.device
    return torch.device("cpu")
