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

__all__ = ["Geometry", "text_config"]


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

    @property
    def total_heads(self) -> int:
        return self.num_layers * self.heads_per_layer

    @property
    def total_neurons(self) -> int | None:
        if self.neurons_per_layer is None:
            return None
        return self.num_layers * self.neurons_per_layer

    @classmethod
    def from_config(cls, config: Any) -> Geometry:
        """Read from a transformers config (or its text config). ``v_head_dim`` comes
        before ``head_dim``: in multi-head latent attention (DeepSeek-V2/V3) the output
        projection takes the value heads, while ``head_dim`` is the rotary query/key
        width. Raises ``AttributeError`` naming the config when it has no layer/head
        counts."""
        text = text_config(config)
        try:
            layers, heads = int(text.num_hidden_layers), int(text.num_attention_heads)
        except AttributeError as err:
            raise AttributeError(f"cannot read the layer/head counts from "
                                 f"{type(text).__name__}: {err}") from None
        head_dim = None
        for name in ("v_head_dim", "head_dim"):
            value = getattr(text, name, None)
            if isinstance(value, int) and value > 0:
                head_dim = value
                break
        hidden = getattr(text, "hidden_size", None)
        if head_dim is None:
            if isinstance(hidden, int) and heads and hidden % heads == 0:
                head_dim = hidden // heads
        return cls(layers, heads, head_dim, _mlp_width(text, hidden))


# Where configs keep the MLP width: Llama/Qwen/Mistral/Gemma/Phi/GPT-NeoX, OPT, Falcon,
# T5, GPT-2/GPT-J. Mixture-of-experts configs give one expert's width; their MLPs are not
# one projection per layer, which the hooks refuse.
_MLP_WIDTH_NAMES = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "d_ff", "n_inner")


def _mlp_width(text: Any, hidden: Any) -> int | None:
    for name in _MLP_WIDTH_NAMES:
        if not hasattr(text, name):
            continue
        value = getattr(text, name)
        if isinstance(value, int) and value > 0:
            return value
        if value is None and isinstance(hidden, int):
            return 4 * hidden  # GPT-2/GPT-J/Falcon: None means the customary 4 x hidden
    return None
