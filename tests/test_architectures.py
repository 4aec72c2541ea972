"""Architectures whose layers are not all alike: each head is what the model computes as
one (checked against weights zeroed by hand), and a model whose attention layers are not
one grid of heads, or whose MLP is not one projection, is refused from its config, in one
line. Hybrid models (heads in some layers only): test_hybrid.py."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from helpers import raises_naming
from transformers import AutoModelForCausalLM

from lm_eval_headloc.intervention.discovery import AttentionOutputNotFound, MLPOutputNotFound
from lm_eval_headloc.intervention.geometry import Geometry, UnsupportedGeometry
from lm_eval_headloc.intervention.hooks import ComponentKnockout

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
    knockout = ComponentKnockout(model, **kwargs)
    with torch.no_grad(), knockout.knocking_out(heads):
        return model(INPUT_IDS).logits


def test_gemma4_heads_are_as_wide_as_their_layers_heads():
    """Gemma 4's full-attention layers have wider heads than its sliding ones (reading one
    head_dim from its config raised transformers' per-layer error in every entry point)."""
    # The per-layer input embedding small too: its default vocabulary (262,144 x 1,024) is
    # a quarter of a billion weights.
    config = transformers.Gemma4TextConfig(**SMALL, num_hidden_layers=4, head_dim=8,
                                           global_head_dim=24, vocab_size_per_layer_input=128,
                                           hidden_size_per_layer_input=16)
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
    knockout = ComponentKnockout(model)
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


@pytest.mark.parametrize("config, attention, mlp", [
    (lambda: transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=3, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48,
        decoder_ffn_dim=48, max_position_embeddings=32),
     "model.decoder.layers.{}.self_attn.out_proj", "model.decoder.layers.{}.fc2"),
    (lambda: transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=48, num_heads=4,
                                   num_layers=3, num_decoder_layers=2, decoder_start_token_id=0),
     "decoder.block.{}.layer.0.SelfAttention.o", "decoder.block.{}.layer.2.DenseReluDense.wo"),
])
def test_a_seq2seq_models_heads_are_its_decoders_self_attention_heads(config, attention, mlp):
    """lm-eval runs an encoder-decoder model (backend=seq2seq) whole: its heads are the
    decoder's self-attention heads, as in BartForCausalLM. T5's were counted by its
    encoder's layers (num_layers), so a head past the decoder passed the check before the
    load, and its decoder's attention to the encoder (EncDecAttention) was taken for self-
    attention: refused after the load, or, where the encoder's layers outnumber the
    decoder's, the encoder's heads knocked out instead."""
    from transformers import AutoModelForSeq2SeqLM

    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLM.from_config(config()).eval()
    assert Geometry.from_config(model.config).num_layers == 2
    knockout = ComponentKnockout(model)
    names = {module: name for name, module in model.named_modules()}
    assert [names[m] for m in knockout.modules] == [attention.format(i) for i in (0, 1)]
    assert [names[m] for m in knockout.mlp_modules] == [mlp.format(i) for i in (0, 1)]

    def logits(of) -> torch.Tensor:
        return of(input_ids=INPUT_IDS, decoder_input_ids=INPUT_IDS[:, :5]).logits

    with torch.no_grad():
        with knockout.knocking_out("L1H2+L0N7"):
            knocked = logits(model)
        reference = copy.deepcopy(model)
        reference.get_submodule(attention.format(1)).weight[:, 32:48] = 0
        reference.get_submodule(mlp.format(0)).weight[:, 7] = 0
        assert torch.allclose(knocked, logits(reference), atol=1e-5)
        assert not torch.allclose(knocked, logits(model), atol=1e-3)


@pytest.mark.parametrize("config, values", [  # the config and what is wrong in it
    # No attention layer at all: nothing to name a head in.
    (lambda: transformers.Qwen3_5TextConfig(
        **SMALL, num_hidden_layers=2, head_dim=24, linear_num_value_heads=8,
        linear_value_head_dim=12, linear_num_key_heads=4, linear_key_head_dim=12,
        layer_types=["linear_attention"] * 2),
     ("Qwen3_5TextConfig", "linear_attention")),
    (lambda: transformers.Dots3NoteTextConfig(),
     ("Dots3NoteTextConfig", "(128, 128, 64")),
])
def test_layers_that_are_not_one_grid_of_heads_are_refused_from_the_config(config, values):
    with raises_naming(UnsupportedGeometry, *values) as refused:
        Geometry.from_config(config())
    assert "\n" not in str(refused.value)


def test_a_shared_expert_is_not_taken_for_the_layers_mlp():
    """Qwen1.5-MoE's shared expert is as wide as the config's intermediate_size: it was
    taken for the MLP, so knocking out "every neuron" left the routed experts on."""
    config = transformers.Qwen2MoeConfig(**{**SMALL, "intermediate_size": 48},
                                         num_hidden_layers=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=48, num_experts=4,
                                         num_experts_per_tok=2)
    model = _model(config)
    with raises_naming(MLPOutputNotFound, "decoder layer 0 (Qwen2MoeDecoderLayer)",
                       "mixture of experts"):
        ComponentKnockout(model, neurons=True)
    # Its heads are still there; and a dense model's refusal does not blame experts.
    assert _knocked(model, "L0H1").shape == (1, 8, 128)
    dense = _model(transformers.LlamaConfig(**SMALL, num_hidden_layers=2))
    with pytest.raises(MLPOutputNotFound) as refused:
        ComponentKnockout(dense, mlp_out="model.layers.*.mlp.up_proj")
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
        ComponentKnockout(_model(config))


def test_an_attention_block_shared_by_two_layers_is_refused():
    # Zamba's shared transformer block: one module called from several layers, whose
    # "L1H0" would be every calling layer's head at once.
    model = _model(transformers.LlamaConfig(**SMALL, num_hidden_layers=3))
    model.model.layers[2] = model.model.layers[0]
    with raises_naming(AttentionOutputNotFound, "layers 0 and 2"):
        ComponentKnockout(model)


def _inkling(**sliding):
    return transformers.InklingTextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, swa_num_key_value_heads=2,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], sliding_window_size=4,
        n_routed_experts=2, num_experts_per_tok=1, n_shared_experts=1,
        moe_intermediate_size=32, num_mtp_layers=0, pad_token_id=0, **sliding)


def test_sliding_layers_with_heads_of_their_own_are_sliced_at_their_width():
    # Inkling's sliding-window layers take swa_num_attention_heads x swa_head_dim: here
    # 4 x 8 beside the full layer's 4 x 16; its L0H1 was two of layer 0's real heads.
    config = _inkling(swa_num_attention_heads=4, swa_head_dim=8)
    geometry = Geometry.from_config(config)
    assert (geometry.heads_per_layer, geometry.layer_head_dims) == (4, (8, 16, 8))
    model = _model(config)
    expected = _zeroed(model, "model.layers.0.self_attn.o_proj", 8, 16)
    assert torch.allclose(_knocked(model, "L0H1"), expected, atol=1e-5)
    expected = _zeroed(model, "model.layers.1.self_attn.o_proj", 16, 32)
    assert torch.allclose(_knocked(model, "L1H1"), expected, atol=1e-5)
    with raises_naming(UnsupportedGeometry, "(8, 4, 8)"):
        Geometry.from_config(_inkling(swa_num_attention_heads=8, swa_head_dim=8))
