"""Where a component's output is: each layer's attention output projection and MLP output
projection, found in any HF causal LM (by name, then by shape, then checked by a run).

A head's output reaches the residual stream only through the attention output
projection (``o_proj``, ``out_proj``, ``c_proj``, ``dense`` …), whose input is the
concatenation of the heads' outputs; a neuron's through the MLP's output projection
(``down_proj``, ``fc2`` …), input feature ``n`` being neuron ``n``'s activation. ``hooks``
knocks components out at these modules' inputs.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

import torch
from torch import nn

from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    describe_layers,
)
from lm_eval_headloc.intervention.geometry import Geometry, UnsupportedGeometry, text_config

__all__ = ["AttentionOutputNotFound", "MLPOutputNotFound", "attention_geometry",
           "find_attention_outputs", "find_mlp_outputs", "input_features", "model_geometry"]


# Names the output projection has in the attention blocks of the families we know of
# (Llama/Mistral/Qwen/Gemma/Phi-3: o_proj; OPT/BART: out_proj; GPT-2: c_proj;
# GPT-NeoX/Falcon/Phi-1: dense; T5-style: o; MPT: out_proj; BLOOM: dense).
_OUTPUT_NAMES = ("o_proj", "out_proj", "c_proj", "dense", "o", "wo", "out")


_ATTENTION_HINTS = ("attn", "attention")


# Attention blocks that are not the layer's own self-attention over the text: a
# seq2seq decoder's attention to the encoder (BART's encoder_attn, T5's EncDecAttention),
# which a causal LM made of that decoder skips, and linear attention (not heads of softmax
# attention).
_NOT_SELF_ATTENTION = ("encoder_attn", "encdec", "linear")


class AttentionOutputNotFound(ComponentSpecError):
    """The attention output projection of this architecture could not be discovered."""


class MLPOutputNotFound(ComponentSpecError):
    """The MLP output projection (the neurons' site) could not be discovered."""


def model_geometry(model: nn.Module) -> Geometry:
    if not hasattr(model, "config"):
        raise AttentionOutputNotFound(f"{type(model).__name__} has no .config: give a Hugging "
                                      "Face model (AutoModelForCausalLM.from_pretrained(...))")
    try:
        return Geometry.from_config(model.config)
    except (AttributeError, UnsupportedGeometry) as err:
        raise AttentionOutputNotFound(str(err)) from None


def attention_geometry(model: nn.Module) -> tuple[int, int]:
    """(layers, query heads per layer) from the model's (text) config."""
    geometry = model_geometry(model)
    return geometry.num_layers, geometry.heads_per_layer


def input_features(module: nn.Module) -> int | None:
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
            if _fits(input_features(module), heads_per_layer, head_dim):
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
    geometry = model_geometry(model)
    num_layers, heads_per_layer = geometry.num_layers, geometry.heads_per_layer
    with_heads = geometry.layers_with_heads
    if attn_out:
        named = [(name, m) for name, m in model.named_modules()
                 if fnmatch.fnmatchcase(name, attn_out)]
        if len(named) != len(with_heads):
            which = (f"decoder layer ({num_layers})" if geometry.head_layers is None else
                     f"attention layer (layers {describe_layers(with_heads)})")
            raise AttentionOutputNotFound(
                f"attn_out={attn_out!r} matches {counted(len(named), 'module')}; it must match "
                f"exactly one per {which}"
            )
    else:
        layers = _decoder_layers(model, num_layers)
        named = [(f"decoder layer {i}", _output_projection(layers[i], i, heads_per_layer,
                                                           geometry.head_dim_of(i)))
                 for i in with_heads]
    for index, (name, module) in zip(with_heads, named, strict=True):
        features = input_features(module)
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
    features, out = input_features(module), _output_features(module)
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
    geometry = model_geometry(model)
    width, hidden = geometry.neurons_per_layer, _hidden_size(model)
    advice = ("name them with mlp_out=<module-name pattern>, e.g. "
              "mlp_out=model.layers.*.mlp.down_proj")
    if mlp_out:
        named = [(name, m) for name, m in model.named_modules()
                 if fnmatch.fnmatchcase(name, mlp_out)]
        if len(named) != geometry.num_layers:
            raise MLPOutputNotFound(
                f"mlp_out={mlp_out!r} matches {counted(len(named), 'module')}; it must match "
                f"exactly one per decoder layer ({geometry.num_layers})")
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
    widths = {input_features(module) for _, module in named}
    for index, (name, module) in enumerate(named):
        if not _mlp_fits(module, width, hidden) or len(widths) != 1:
            raise MLPOutputNotFound(
                f"MLP output of layer {index} ({name}, {type(module).__name__}) takes "
                f"{input_features(module)} input features and gives "
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
