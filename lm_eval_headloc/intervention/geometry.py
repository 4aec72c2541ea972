"""A model's component geometry (attention heads, MLP neurons), read from its config in
one place.

Used before the weights load (``runs.setup``, ``hf-headablate``: component names are
checked against the config), by the knockout hooks (``hooks``: which projection input is
heads x head_dim wide, which is the MLP's width) and by memory sizing (``multimask``). No
torch import: reading a config is cheap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lm_eval_headloc.common.errors import UserError

__all__ = ["Geometry", "UnsupportedGeometry", "text_config"]


class UnsupportedGeometry(UserError):
    """The config describes a model whose attention layers are not one grid of heads (a
    head count that varies across layers), or that has no attention layer at all."""


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal config nests it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@dataclass(frozen=True)
class Geometry:
    """Decoder layers, query heads per layer, the width of one head's slice of the
    attention output projection's input, and the MLP's width (its neurons: the input of
    its output projection) — the last two None when the config does not tell.

    A hybrid model (Qwen3.5, Qwen3-Next, Jamba, OLMo-Hybrid, LFM2, Nemotron-H …) has
    attention heads only in some layers, the rest being linear attention, convolution or
    state-space blocks: ``head_layers`` lists the layers with heads (None: every layer).
    Heads keep the model's own layer numbers (Qwen3.5's first heads are L3H0..), so a
    name means the same here as in any other tool."""

    num_layers: int
    heads_per_layer: int
    head_dim: int | None
    neurons_per_layer: int | None = None
    #: Each layer's head width where it varies across layers (Gemma 4's full-attention
    #: layers have wider heads than its sliding ones); None where ``head_dim`` is every
    #: layer's.
    layer_head_dims: tuple[int, ...] | None = None
    #: The layers that have attention heads, in order, where not every layer has them;
    #: None where every layer does.
    head_layers: tuple[int, ...] | None = None
    #: The residual stream's width (None where the config does not tell), and whether a
    #: layer's attention and MLP both read the stream as it entered the layer (GPT-J,
    #: GPT-NeoX, Phi-1/2, CodeGen, Falcon's parallel attention) rather than in sequence:
    #: what a circuit graph of the model (MIB's) is built from.
    d_model: int | None = None
    parallel_attn_mlp: bool = False

    @property
    def total_heads(self) -> int:
        return len(self.layers_with_heads) * self.heads_per_layer

    @property
    def layers_with_heads(self) -> tuple[int, ...]:
        """The layers that have attention heads (every layer but a hybrid's others)."""
        return tuple(range(self.num_layers)) if self.head_layers is None else self.head_layers

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
            # The decoder's (BART's decoder_layers, T5's num_decoder_layers): the encoder's
            # heads are never knocked out.
            layers = int(_first_of(text, ("decoder_layers", "num_decoder_layers",
                                          "num_hidden_layers")))
            heads_each = _per_layer(text, layers, ("decoder_attention_heads",
                                                   "num_attention_heads"))
        except (AttributeError, TypeError) as err:
            raise AttributeError(f"cannot read the layer/head counts from {name}: "
                                 f"{err}") from None
        head_layers = _attention_layers(text, name, layers)
        sliding = _sliding_layers(text, layers)
        swa_heads, swa_dim = (_global(text, key) for key in ("swa_num_attention_heads",
                                                             "swa_head_dim"))
        if isinstance(swa_heads, int):  # Inkling: sliding layers have heads of their own
            heads_each = [swa_heads if layer in sliding else count
                          for layer, count in enumerate(heads_each)]
        if len({heads_each[layer] for layer in head_layers}) > 1:
            counts = [heads_each[layer] for layer in head_layers]
            raise UnsupportedGeometry(
                f"{name}: the number of attention heads varies across layers "
                f"({_listed(counts)}); heads are named on one grid of layers x heads "
                "(L3H5), which this model does not have")
        heads = int(heads_each[head_layers[0]])
        hidden = _global(text, "hidden_size")
        dims = []
        per_layer_dims = _per_layer(text, layers, ("v_head_dim", "head_dim"), missing=None)
        if isinstance(swa_dim, int):
            per_layer_dims = [swa_dim if layer in sliding else value
                              for layer, value in enumerate(per_layer_dims)]
        for value in per_layer_dims:
            if not (isinstance(value, int) and value > 0):
                value = (hidden // heads if isinstance(hidden, int) and heads
                         and hidden % heads == 0 else None)
            dims.append(value)
        if getattr(text, "model_type", None) == "diffllama":
            # A differential head is a pair of heads subtracted and normed together: its
            # output is two head widths wide, and half as many reach o_proj.
            heads, dims = heads // 2, [None if d is None else 2 * d for d in dims]
        uniform = len({dims[layer] for layer in head_layers}) == 1
        return cls(layers, heads, dims[head_layers[0]] if uniform else None,
                   _mlp_width(text, hidden), None if uniform else tuple(dims),
                   None if len(head_layers) == layers else tuple(head_layers),
                   hidden if isinstance(hidden, int) and hidden > 0 else None,
                   _parallel_blocks(text))


_MISSING = object()


def _parallel_blocks(text: Any) -> bool:
    """Whether attention and MLP read the same residual stream in each layer."""
    return bool(_global(text, "use_parallel_residual", False)
                or _global(text, "parallel_attn", False)
                or getattr(text, "model_type", None) in ("gptj", "phi", "codegen"))


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


# Layer types (a config's ``layer_types``) that are not softmax attention: linear
# attention (Qwen3.5's Gated DeltaNet, whose output projection takes more, narrower heads
# than the attention's, at a width that may fit them by chance), convolution, state-space
# and MLP-only blocks. Their layers have no heads.
_NOT_ATTENTION_WORDS = ("linear", "conv", "mamba", "recurrent", "ssm", "rwkv", "deltanet")
_NOT_ATTENTION_TYPES = ("mlp", "moe")


def _layer_types(text: Any, layers: int) -> list[str] | None:
    """The config's ``layer_types`` of the decoder layers, lower-case (entries past them:
    multi-token-prediction layers), or None where it does not say."""
    types = _global(text, "layer_types")
    if not isinstance(types, (list, tuple)) or len(types) < layers:
        return None
    return [str(kind).lower() for kind in types[:layers]]


def _attention_layers(text: Any, name: str, layers: int) -> list[int]:
    """The layers with self-attention heads: every layer unless the config's
    ``layer_types`` names other blocks (a hybrid model's) or its ``cross_attention_layers``
    are cross-attention layers (Mllama's, which a text-only forward skips whole: their heads
    could change nothing)."""
    cross = _global(text, "cross_attention_layers")
    if isinstance(cross, (list, tuple)) and all(isinstance(i, int) for i in cross):
        attention = [index for index in range(layers) if index not in set(cross)]
        if not attention:
            raise UnsupportedGeometry(f"{name}: every layer is a cross-attention layer, so "
                                      "it has no self-attention heads to knock out")
        return attention
    types = _layer_types(text, layers)
    if types is None:
        return list(range(layers))
    attention = [index for index, kind in enumerate(types)
                 if not (kind in _NOT_ATTENTION_TYPES
                         or any(word in kind for word in _NOT_ATTENTION_WORDS))]
    if not attention:
        raise UnsupportedGeometry(f"{name}: no layer is an attention layer (its layers are "
                                  f"{' / '.join(sorted(set(types)))}), so it has no heads to "
                                  "knock out")
    return attention


def _sliding_layers(text: Any, layers: int) -> set[int]:
    """The layers whose ``layer_types`` entry is a sliding-window one."""
    types = _layer_types(text, layers) or []
    return {index for index, kind in enumerate(types) if "sliding" in kind}


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
            return _adjusted_width(text, value)
        if value is None and isinstance(hidden, int):
            return 4 * hidden  # GPT-2/GPT-J/Falcon: None means the customary 4 x hidden
    return None


def _adjusted_width(text: Any, width: int) -> int:
    """LFM2 builds its MLP narrower than ``intermediate_size`` says (``Lfm2MLP``): two
    thirds of it, times ``block_ffn_dim_multiplier`` rounded up to ``block_multiple_of``."""
    if not _global(text, "block_auto_adjust_ff_dim", False):
        return width
    width = int(2 * width / 3)
    multiplier = _global(text, "block_ffn_dim_multiplier")
    if multiplier is not None:
        step = int(_global(text, "block_multiple_of", 1) or 1)
        width = step * ((int(multiplier * width) + step - 1) // step)
    return width
