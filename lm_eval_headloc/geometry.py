"""A model's component geometry (attention heads, MLP neurons), read from its config in
one place.

Used before the weights load (``commands.engine``, ``hf-headablate``: component names are
checked against the config), by the knockout hooks (``hooks``: which projection input is
heads x head_dim wide, which is the MLP's width) and by memory sizing (``multimask``). No
torch import: reading a config is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import UserError

__all__ = ["Geometry", "UnsupportedGeometry", "text_config"]


class UnsupportedGeometry(UserError):
    """The config describes a model whose decoder layers are not one grid of attention
    heads: a head count that varies across layers, or layers of linear attention,
    convolution or state-space blocks among the attention layers."""


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class Geometry:
    """Decoder layers, query heads per layer, the width of one head's slice of the
    attention output projection's input, and the MLP's width (its neurons: the input of
    its output projection) — the last two None when the config does not tell."""

    num_layers: int
    heads_per_layer: int
    head_dim: int | None
    neurons_per_layer: int | None = None
    #: Each layer's head width where it varies across layers (Gemma 4's full-attention
    #: layers have wider heads than its sliding ones); None where ``head_dim`` is every
    #: layer's.
    layer_head_dims: tuple[int, ...] | None = None

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.heads_per_layer

    @property
    def total_neurons(self) -> int | None:
        if self.neurons_per_layer is None:
            return None
        return self.num_layers * self.neurons_per_layer

    def head_dim_of(self, layer: int) -> int | None:
        """The width of one head's slice of layer ``layer``'s attention output projection
        input (None where the config does not tell)."""
        return self.head_dim if self.layer_head_dims is None else self.layer_head_dims[layer]

    @classmethod
    def from_config(cls, config: Any) -> Geometry:
        """Read from a transformers config (or its text config). ``v_head_dim`` comes
        before ``head_dim``: in multi-head latent attention (DeepSeek-V2/V3) the output
        projection takes the value heads, while ``head_dim`` is the rotary query/key
        width. A causal LM made of a seq2seq model's decoder (BART's and Whisper's
        ``ForCausalLM``) has the decoder's layers and heads. Raises ``AttributeError``
        naming the config when it has no layer/head counts, ``UnsupportedGeometry`` when
        its layers are not one grid of heads."""
        text = text_config(config)
        name = type(text).__name__
        try:
            layers = int(_first_of(text, ("decoder_layers", "num_hidden_layers")))
            heads_each = _per_layer(text, layers, ("decoder_attention_heads",
                                                   "num_attention_heads"))
        except (AttributeError, TypeError) as err:
            raise AttributeError(f"cannot read the layer/head counts from {name}: "
                                 f"{err}") from None
        if len(set(heads_each)) > 1:
            raise UnsupportedGeometry(
                f"{name}: the number of attention heads varies across layers "
                f"({_listed(heads_each)}); heads are named on one grid of layers x heads "
                "(L3H5), which this model does not have")
        heads = int(heads_each[0])
        _check_layer_types(text, name)
        hidden = _global(text, "hidden_size")
        dims = []
        for value in _per_layer(text, layers, ("v_head_dim", "head_dim"), missing=None):
            if not (isinstance(value, int) and value > 0):
                value = (hidden // heads if isinstance(hidden, int) and heads
                         and hidden % heads == 0 else None)
            dims.append(value)
        if getattr(text, "model_type", None) == "diffllama":
            # A differential head is a pair of heads subtracted and normed together: its
            # output is two head widths wide, and half as many reach o_proj.
            heads, dims = heads // 2, [None if d is None else 2 * d for d in dims]
        uniform = len(set(dims)) == 1
        return cls(layers, heads, dims[0] if uniform else None, _mlp_width(text, hidden),
                   None if uniform else tuple(dims))


_MISSING = object()


def _global(text: Any, name: str, default: Any = None) -> Any:
    """``text.name``, or ``default`` where it is absent or varies across layers."""
    try:
        return getattr(text, name, default)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return default


def _first_of(text: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = _global(text, name, _MISSING)
        if value is not _MISSING and value is not None:
            return value
    raise AttributeError(f"it has no {names[-1]}")


def _per_layer(text: Any, layers: int, names: tuple[str, ...], missing: Any = _MISSING
               ) -> list[Any]:
    """The first of ``names`` the config has, in every layer: a heterogeneous config
    (transformers' ``per_layer_config``: Gemma 4) keeps some values per layer, and reading
    them from the whole config raises."""
    for name in names:
        try:
            value = getattr(text, name, _MISSING)
        except RuntimeError:
            views = getattr(text, "per_layer_config", None)
            if views is None:
                raise
            return [getattr(views[layer], name, missing) for layer in range(layers)]
        if value is not _MISSING and value is not None:
            return [value] * layers
    if missing is _MISSING:
        raise AttributeError(f"it has no {names[-1]}")
    return [missing] * layers


# Layer types (a config's ``layer_types``) that are not softmax attention: their output
# projection's input is not heads x head_dim of attention (Qwen3.5's Gated DeltaNet layers
# have more, narrower heads behind a shared-width projection that fits by chance).
_NOT_ATTENTION_WORDS = ("linear", "conv", "mamba", "recurrent", "ssm", "rwkv", "deltanet")
_NOT_ATTENTION_TYPES = ("mlp", "moe")


def _check_layer_types(text: Any, name: str) -> None:
    types = _global(text, "layer_types")
    if not isinstance(types, (list, tuple)):
        return
    other = [(index, str(kind)) for index, kind in enumerate(types)
             if str(kind).lower() in _NOT_ATTENTION_TYPES
             or any(word in str(kind).lower() for word in _NOT_ATTENTION_WORDS)]
    if other:
        kinds = sorted({kind for _, kind in other})
        raise UnsupportedGeometry(
            f"{name}: layers {_listed([index for index, _ in other])} are "
            f"{' / '.join(kinds)} layers, not attention; heads are named on one grid of "
            "layers x heads (L3H5), and knocking out a slice of those layers' output "
            "would not be an attention head")


def _listed(values: list[Any], most: int = 8) -> str:
    shown = ", ".join(map(str, values[:most]))
    return shown + (f", ... ({len(values)} in all)" if len(values) > most else "")


# Where configs keep the MLP width: Llama/Qwen/Mistral/Gemma/Phi/GPT-NeoX, OPT, Falcon,
# T5, GPT-2/GPT-J, BART's decoder. Mixture-of-experts configs give one expert's width;
# their MLPs are not one projection per layer, which the hooks refuse.
_MLP_WIDTH_NAMES = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "d_ff", "n_inner",
                    "decoder_ffn_dim")


def _mlp_width(text: Any, hidden: Any) -> int | None:
    for name in _MLP_WIDTH_NAMES:
        value = _global(text, name, _MISSING)
        if value is _MISSING:
            continue
        if isinstance(value, int) and value > 0:
            return value
        if value is None and isinstance(hidden, int):
            return 4 * hidden  # GPT-2/GPT-J/Falcon: None means the customary 4 x hidden
    return None
