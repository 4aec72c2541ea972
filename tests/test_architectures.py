"""Architectures whose layers are not all alike: each head is what the model computes as
one (checked against weights zeroed by hand), and a model whose layers are not one grid of
heads, or whose MLP is not one projection, is refused from its config, in one line."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from lm_eval_headloc.geometry import Geometry, UnsupportedGeometry
from lm_eval_headloc.hooks import AttentionOutputNotFound, HeadKnockout, MLPOutputNotFound

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 7, 123, 64, 8]])
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2)


def _model(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _zeroed(model, path: str, start: int, stop: int) -> torch.Tensor:
    """Logits of a copy with input features [start, stop) of module ``path`` zeroed."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.get_submodule(path).weight[:, start:stop] = 0
        return reference(INPUT_IDS).logits


def _knocked(model, heads: str, **kwargs) -> torch.Tensor:
    knockout = HeadKnockout(model, **kwargs)
    with torch.no_grad(), knockout.knocking_out(heads):
        return model(INPUT_IDS).logits


def test_gemma4_heads_are_as_wide_as_their_layers_heads():
    """Gemma 4's full-attention layers have wider heads than its sliding ones (reading one
    head_dim from its config raised transformers' per-layer error in every entry point)."""
    config = transformers.Gemma4TextConfig(**SMALL, num_hidden_layers=4, head_dim=8,
                                           global_head_dim=24)
    widths = [config.per_layer_config[i].head_dim for i in range(4)]
    assert widths == [8, 8, 8, 24]  # the last layer is full attention
    geometry = Geometry.from_config(config)
    assert (geometry.num_layers, geometry.heads_per_layer) == (4, 4)
    assert [geometry.head_dim_of(i) for i in range(4)] == widths
    model = _model(config)
    for layer, head in [(0, 2), (3, 1), (3, 3)]:
        width = widths[layer]
        expected = _zeroed(model, f"model.layers.{layer}.self_attn.o_proj", head * width,
                           (head + 1) * width)
        assert torch.allclose(_knocked(model, f"L{layer}H{head}"), expected, atol=1e-5)
    # Mean ablation's per-layer means have each layer's width.
    knockout = HeadKnockout(model)
    means = [torch.zeros(4, w) for w in widths]
    assert len(knockout.check_replacement(means)) == 4
    with pytest.raises(ValueError, match="shapes"):
        knockout.check_replacement([torch.zeros(4, 8)] * 4)


def test_a_differential_head_is_one_unit():
    """DiffLlama's o_proj takes H/2 differential heads, each two head widths wide and
    normed as one: the units are those, not halves of them."""
    config = transformers.DiffLlamaConfig(**SMALL, num_hidden_layers=2)
    model = _model(config)
    width = 2 * model.model.layers[0].self_attn.head_dim
    geometry = Geometry.from_config(config)
    assert (geometry.heads_per_layer, geometry.head_dim) == (2, width)
    expected = _zeroed(model, "model.layers.1.self_attn.o_proj", width, 2 * width)
    assert torch.allclose(_knocked(model, "L1H1"), expected, atol=1e-5)


def test_a_causal_lm_made_of_a_seq2seq_decoder_has_the_decoders_heads():
    """BartForCausalLM is BART's decoder: its layers and heads, not the encoder's the
    config's num_hidden_layers/num_attention_heads name, and its self-attention, not the
    attention to an encoder it does not have."""
    # (Equal layer counts: transformers' own cache for BartForCausalLM is sized by the
    # encoder's.)
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=2,
                                     decoder_attention_heads=4, encoder_ffn_dim=32,
                                     decoder_ffn_dim=48, max_position_embeddings=32)
    geometry = Geometry.from_config(config)
    assert (geometry.num_layers, geometry.heads_per_layer, geometry.head_dim,
            geometry.neurons_per_layer) == (2, 4, 16, 48)
    model = _model(config)
    expected = _zeroed(model, "model.decoder.layers.1.self_attn.out_proj", 16, 32)
    assert torch.allclose(_knocked(model, "L1H1"), expected, atol=1e-5)


@pytest.mark.parametrize("config, message", [
    # Qwen3.5: three Gated DeltaNet layers in four, whose 8 x 12 output fits 4 heads x 24
    # by chance: its L0H0 was two linear-attention heads.
    (lambda: transformers.Qwen3_5TextConfig(
        **SMALL, num_hidden_layers=4, head_dim=24, linear_num_value_heads=8,
        linear_value_head_dim=12, linear_num_key_heads=4, linear_key_head_dim=12,
        layer_types=["linear_attention"] * 3 + ["full_attention"]),
     "Qwen3_5TextConfig: layers 0, 1, 2 are linear_attention layers, not attention"),
    (lambda: transformers.Dots3NoteTextConfig(),
     "Dots3NoteTextConfig: the number of attention heads varies across layers (128, 128, 64"),
])
def test_layers_that_are_not_one_grid_of_heads_are_refused_from_the_config(config, message):
    with pytest.raises(UnsupportedGeometry) as refused:
        Geometry.from_config(config())
    assert str(refused.value).startswith(message)
    assert "\n" not in str(refused.value)


def test_a_hybrid_model_is_refused_before_its_weights_load(tmp_path, capsys):
    from lm_eval_headloc.commands.cli import main

    config = transformers.Qwen3_5TextConfig(
        **SMALL, num_hidden_layers=4, head_dim=24, linear_num_value_heads=8,
        linear_value_head_dim=12, linear_num_key_heads=4, linear_key_head_dim=12,
        layer_types=["linear_attention"] * 3 + ["full_attention"])
    config.save_pretrained(tmp_path)  # a config and no weights: nothing may load them
    try:
        code = main(["locate", "--model-args", f"pretrained={tmp_path}", "--tasks",
                     "tiny_copy", "--out", str(tmp_path / "run")])
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.endswith(f"pretrained={str(tmp_path)!r}: Qwen3_5TextConfig: layers 0, 1, 2 "
                          "are linear_attention layers, not attention; heads are named on "
                          "one grid of layers x heads (L3H5), and knocking out a slice of "
                          "those layers' output would not be an attention head")
    model = _model(config)
    with pytest.raises(AttentionOutputNotFound, match="linear_attention"):
        HeadKnockout(model)


def test_a_shared_expert_is_not_taken_for_the_layers_mlp():
    """Qwen1.5-MoE's shared expert is as wide as the config's intermediate_size: it was
    taken for the MLP, so knocking out "every neuron" left the routed experts on."""
    config = transformers.Qwen2MoeConfig(**{**SMALL, "intermediate_size": 48},
                                         num_hidden_layers=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2)
    model = _model(config)
    with pytest.raises(MLPOutputNotFound, match="a mixture of experts has no single one"):
        HeadKnockout(model, neurons=True)
    # Its heads are still there; and a dense model's refusal does not blame experts.
    assert _knocked(model, "L0H1").shape == (1, 8, 128)
    dense = _model(transformers.LlamaConfig(**SMALL, num_hidden_layers=2))
    with pytest.raises(MLPOutputNotFound) as refused:
        HeadKnockout(dense, mlp_out="model.layers.*.mlp.up_proj")
    assert "expert" not in str(refused.value)


def test_a_vision_tower_as_deep_as_the_text_decoder_is_not_taken_for_it():
    """GIT: the vision encoder's layer list (as long, more parameters) was taken, so every
    knockout was a no-op on text; the text decoder's layers are looked at (and, BERT-style,
    refused in one line)."""
    config = transformers.GitConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, vision_config=dict(hidden_size=64, num_hidden_layers=2,
                                                  num_attention_heads=4,
                                                  intermediate_size=256, image_size=32,
                                                  patch_size=8))
    with pytest.raises(AttentionOutputNotFound, match="decoder layer 0 \\(GitLayer\\)"):
        HeadKnockout(_model(config))
