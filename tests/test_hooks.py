"""Knockout through hf-headablate equals zeroing the output projection, per architecture."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ARCHITECTURES,
    GQA_FAMILIES,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    raises_naming,
)
from torch import nn
from transformers import AutoModelForCausalLM

from lm_eval_headloc.intervention.components import ComponentSpecError
from lm_eval_headloc.intervention.discovery import AttentionOutputNotFound
from lm_eval_headloc.intervention.hooks import ComponentKnockout
from lm_eval_headloc.intervention.model import HFHeadAblateLM

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 7, 123, 64, 8, 250, 31]])


def load_ablate(folder, **kwargs) -> HFHeadAblateLM:
    return HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32", **kwargs)


def zeroed_reference(folder, family: str, heads: list[tuple[int, int]]):
    """An independent copy whose output-projection weights for `heads` are zero."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _, _, path, conv1d = ARCHITECTURES[family]
    with torch.no_grad():
        for layer, head in heads:
            proj = model.get_submodule(path.format(l=layer))
            width = proj.weight.shape[0 if conv1d else 1] // HEADS
            cols = slice(head * width, (head + 1) * width)
            if conv1d:  # GPT-2 Conv1D stores weight as (in, out)
                proj.weight[cols, :] = 0
            else:
                proj.weight[:, cols] = 0
    return model


def logits(model) -> torch.Tensor:
    """Logits of INPUT_IDS: through lm-eval's ``_model_call`` for an lm-eval model (where
    its heads are applied), else from the bare model."""
    with torch.no_grad():
        if hasattr(model, "_model_call"):
            return model._model_call(INPUT_IDS)
        return model(INPUT_IDS).logits


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_knockout_equals_zeroed_output_projection(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder, ablate="L1H2")
    expected = logits(zeroed_reference(folder, family, [(1, 2)]))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    # Two heads in different layers, switched in place on the same object.
    lm.set_heads("L0H0+L1H3")
    expected = logits(zeroed_reference(folder, family, [(0, 0), (1, 3)]))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    # ...and the knockout really changes the output (the test could fail).
    plain = logits(zeroed_reference(folder, family, []))
    assert not torch.allclose(expected, plain, atol=1e-4)


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_no_heads_is_identical_to_plain_hf(tiny_model_dir, family):
    from lm_eval.models.huggingface import HFLM

    folder = tiny_model_dir(family)
    plain = HFLM(pretrained=str(folder), device="cpu", dtype="float32")
    lm = load_ablate(folder)
    assert lm.knocked_out == ()
    assert torch.equal(logits(lm), logits(plain))
    lm.set_heads("L0H1")
    lm.set_heads([])
    assert torch.equal(logits(lm), logits(plain))


def value_head_zeroed(folder, layer: int, kv_head: int):
    """An independent copy whose key/value head `kv_head` has zero values in `layer`.

    Every query head of that KV group then outputs exactly zero, whatever the attention
    weights: the reference for knocking out the whole group, computed without our hook.
    """
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    attn = model.model.layers[layer].self_attn
    d = getattr(model.config, "head_dim", None) or HIDDEN // HEADS
    if hasattr(attn, "v_proj"):
        proj, start = attn.v_proj, 0
    else:  # Phi-3: one fused projection, rows [queries | keys | values]
        proj, start = attn.qkv_proj, (HEADS + KV_HEADS) * d
    rows = slice(start + kv_head * d, start + (kv_head + 1) * d)
    with torch.no_grad():
        proj.weight[rows] = 0
        if proj.bias is not None:  # Qwen2 has value biases
            proj.bias[rows] = 0
    return model


@pytest.mark.parametrize("family", GQA_FAMILIES)
def test_gqa_knockout_removes_one_query_head_not_its_kv_group(tiny_model_dir, family):
    # 4 query heads, 2 KV heads: query heads 0-1 read KV head 0, 2-3 read KV head 1.
    folder = tiny_model_dir(family)
    lm = load_ablate(folder)
    for group in range(KV_HEADS):
        # Knocking out both query heads of a group = silencing its value head.
        lm.set_heads(f"L0H{2 * group}+L0H{2 * group + 1}")
        assert torch.allclose(logits(lm), logits(value_head_zeroed(folder, 0, group)),
                              atol=1e-5), group
    # One query head: its own o_proj columns only, not its whole KV group (a hook that
    # sliced by KV heads, or zeroed the shared value head, would give the group result).
    lm.set_heads("L0H1")
    one = logits(lm)
    assert torch.allclose(one, logits(zeroed_reference(folder, family, [(0, 1)])), atol=1e-5)
    assert not torch.allclose(one, logits(value_head_zeroed(folder, 0, 0)), atol=1e-4)
    assert not torch.allclose(one, logits(zeroed_reference(folder, family, [])), atol=1e-4)


def test_switching_in_place_matches_hand_zeroed_weights(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    live = load_ablate(folder)
    hooks_before = [len(m._forward_pre_hooks) for m in live.knockout.modules]
    # Each mask after another: a head left over from the previous mask would show.
    for spec, heads in [("L0H1", [(0, 1)]), ("L1H*", [(1, 0), (1, 1), (1, 2), (1, 3)]),
                        ("L0H0+L0H3+L1H1", [(0, 0), (0, 3), (1, 1)]), ("L1H2", [(1, 2)]),
                        ("", [])]:
        live.set_heads(spec)
        assert live.knocked_out == tuple(sorted(heads))
        expected = logits(zeroed_reference(folder, "qwen2", heads))
        assert torch.allclose(logits(live), expected, atol=1e-5), spec
    # Switching re-registers nothing.
    assert [len(m._forward_pre_hooks) for m in live.knockout.modules] == hooks_before


def test_layers_without_knockouts_pass_their_input_through(tiny_model_dir):
    lm = load_ablate(tiny_model_dir("llama"))
    proj = lm.knockout.modules[0]
    received: dict[str, torch.Tensor] = {}
    first = proj.register_forward_pre_hook(
        lambda m, a: received.__setitem__("before", a[0]), prepend=True)
    last = proj.register_forward_pre_hook(lambda m, a: received.__setitem__("after", a[0]))
    try:
        logits(lm)
        assert received["after"] is received["before"]  # no multiply, no copy
        lm.set_heads("L1H0")  # another layer: layer 0 still untouched
        logits(lm)
        assert received["after"] is received["before"]
        lm.set_heads("L0H0")
        logits(lm)
        assert received["after"] is not received["before"]
    finally:
        first.remove()
        last.remove()


def test_peft_lora_on_the_output_projection(tiny_model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model

    folder = tiny_model_dir("llama")
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft_model = get_peft_model(base, LoraConfig(r=2, target_modules=["o_proj", "q_proj"],
                                                 init_lora_weights=False))
    peft_model.save_pretrained(tmp_path / "adapter")
    lm = load_ablate(folder, peft=str(tmp_path / "adapter"), ablate="L1H2")
    assert type(lm.knockout.modules[1]).__module__.startswith("peft")

    # Reference: merge the adapter, then zero head 2's columns of o_proj.
    from peft import PeftModel

    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), tmp_path / "adapter"
    ).merge_and_unload()
    with torch.no_grad():
        width = merged.model.layers[1].self_attn.o_proj.weight.shape[1] // HEADS
        merged.model.layers[1].self_attn.o_proj.weight[:, 2 * width:3 * width] = 0
    assert torch.allclose(logits(lm), logits(merged), atol=1e-5)


def test_bad_heads_and_files_are_one_line_errors(tiny_model_dir, tmp_path):
    lm = load_ablate(tiny_model_dir("llama"))
    assert (lm.num_layers, lm.heads_per_layer) == (LAYERS, HEADS)
    for spec, values in [
        ("L99H0", ("L99H0", "0..1")),  # the head and the model's range
        ("L0H9", ("L0H9", "0..3")),
        ("X1", ("'X1'",)),
        ("L-1H0", ("'L-1H0'",)),
        ("L0H1++L0H2", ("empty component name", "'L0H1++L0H2'")),
    ]:
        with raises_naming(ComponentSpecError, *values) as info:
            lm.set_heads(spec)
        assert "\n" not in str(info.value)
    assert lm.knocked_out == ()  # a refused mask leaves the model as it was
    with raises_naming(ComponentSpecError, str(tmp_path / "nope.json")):
        load_ablate(tiny_model_dir("llama"), ablate_file=str(tmp_path / "nope.json"))
    with pytest.raises(ComponentSpecError, match="ablate= is empty"):
        load_ablate(tiny_model_dir("llama"), ablate="")
    with raises_naming(ComponentSpecError, "ablate_top=2", "ablate_file"):
        load_ablate(tiny_model_dir("llama"), ablate_top=2)


def test_ablate_file_with_top_k_and_union_with_ablate(tiny_model_dir, tmp_path):
    ranked = tmp_path / "heads.json"
    ranked.write_text('{"heads": [{"head": "L1H3"}, {"head": "L0H2"}, {"head": "L0H0"}]}')
    lm = load_ablate(tiny_model_dir("llama"), ablate_file=str(ranked), ablate_top=2,
                     ablate="L1H0")
    assert [str(h) for h in lm.knocked_out] == ["L0H2", "L1H0", "L1H3"]
    assert lm.get_model_info()["ablate"] == "L0H2+L1H0+L1H3"


def test_the_log_names_what_ablate_adds_to_the_file(tiny_model_dir, tmp_path, caplog):
    """The log said "knocking out L1H3+L0H2: the top 2 of FILE" while L1H0 of ablate= was
    knocked out too."""
    ranked = tmp_path / "heads.json"
    ranked.write_text('{"heads": [{"head": "L1H3"}, {"head": "L0H2"}, {"head": "L0H0"}]}')
    caplog.set_level("INFO", logger="lm_eval.models.hf_headablate")
    load_ablate(tiny_model_dir("llama"), ablate_file=str(ranked), ablate_top=2,
                ablate="L1H0+L0N3")
    assert (f"knocking out L1H3+L0H2: the top 2 of {ranked}; and L1H0+L0N3, from ablate="
            in caplog.messages)


def test_knocking_out_refuses_names_beside_row_masks(tiny_model_dir):
    """knocking_out("L0H1", row_masks=M) knocked out M's rows only, L0H1 silently dropped."""
    import numpy as np

    lm = load_ablate(tiny_model_dir("llama"))
    masks = np.zeros((2, 8), dtype=bool)
    with raises_naming(ComponentSpecError, "'L0H1'", "row_masks", "not both"):
        with lm.knocking_out("L0H1", row_masks=masks):
            pass
    with lm.knocking_out(row_masks=masks) as intervention:  # either alone is fine
        assert intervention.row_masks is not None
    for bad in (5, None):  # set_heads(5) was "'int' object is not iterable"
        with raises_naming(ComponentSpecError, repr(bad), "L0H29+L1H31"):
            lm.set_heads(bad)


def test_a_runs_ranking_without_ablate_top_knocks_out_its_top_k(tiny_model_dir, tmp_path,
                                                               caplog):
    """A run's heads.json ranks every head; naming it means the heads the run located (its
    top_k), not all of them, and the log says which those are. Files that are no run's
    ranking (a list, universal.json's object) still give every entry."""
    import json

    folder = tiny_model_dir("llama")
    ranked = tmp_path / "heads.json"
    order = ["L1H3", "L0H2", "L0H0", "L1H1", "L0H1", "L0H3", "L1H0", "L1H2"]
    ranked.write_text(json.dumps({"task": "tiny_copy", "top_k": order[:2],
                                  "heads": [{"rank": i + 1, "head": h}
                                            for i, h in enumerate(order)]}))
    caplog.set_level("INFO", logger="lm_eval.models.hf_headablate")
    lm = load_ablate(folder, ablate_file=str(ranked))
    assert [str(h) for h in lm.knocked_out] == ["L0H2", "L1H3"]
    assert (f"knocking out L1H3+L0H2: the run's top-2 (ablate_top=K for another count) of "
            f"{ranked} (ranked for task tiny_copy)") in caplog.messages
    # ablate_top still says how many, more than the run's top-k included.
    lm = load_ablate(folder, ablate_file=str(ranked), ablate_top=3)
    assert [str(h) for h in lm.knocked_out] == ["L0H0", "L0H2", "L1H3"]
    # universal.json: an int top_k (the setting) and the found heads only.
    universal = tmp_path / "universal.json"
    universal.write_text(json.dumps({"top_k": 5, "heads": [{"head": "L0H1"},
                                                           {"head": "L1H0"}]}))
    assert [str(h) for h in load_ablate(folder, ablate_file=str(universal)).knocked_out] \
        == ["L0H1", "L1H0"]
    # A top_k list that is not the start of the ranking: which heads were meant is unclear.
    ranked.write_text(json.dumps({"top_k": ["L0H0"], "heads": [{"head": "L1H3"},
                                                               {"head": "L0H0"}]}))
    with raises_naming(ComponentSpecError, str(ranked), "top_k", "ablate_top=K"):
        load_ablate(folder, ablate_file=str(ranked))
    assert [str(h) for h in load_ablate(folder, ablate_file=str(ranked),
                                        ablate_top=2).knocked_out] == ["L0H0", "L1H3"]


def test_unreadable_architecture_says_how_to_name_the_module(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    for layer in model.model.layers:  # list the projection under an unknown name only
        o_proj = layer.self_attn.o_proj
        del layer.self_attn.o_proj
        layer.self_attn.mixer_out = o_proj
        layer.self_attn.__dict__["o_proj"] = o_proj  # what forward calls; not a submodule
    with pytest.raises(AttentionOutputNotFound, match="attn_out=") as info:
        ComponentKnockout(model)
    assert "\n" not in str(info.value)
    knockout = ComponentKnockout(model, attn_out="model.layers.*.self_attn.mixer_out")
    assert len(knockout.modules) == LAYERS
    with raises_naming(AttentionOutputNotFound, "attn_out='*.nothing'", "0"):
        ComponentKnockout(model, attn_out="*.nothing")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_per_row_masks_equal_one_mask_at_a_time(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder, ablate="L0H3")  # replaced while rows are set
    masks = ["L1H2", "", "L0H0+L1H3", "L0H*"]
    by_hand = [[(1, 2)], [], [(0, 0), (1, 3)], [(0, 0), (0, 1), (0, 2), (0, 3)]]
    expected = [logits(zeroed_reference(folder, family, heads))[0] for heads in by_hand]
    rows = torch.zeros(len(masks), LAYERS * HEADS, dtype=torch.bool)
    for r, heads in enumerate(by_hand):
        for layer, head in heads:
            rows[r, layer * HEADS + head] = True
    with torch.no_grad(), lm.knocking_out(row_masks=rows):
        together = lm._model_call(INPUT_IDS.repeat(len(masks), 1))
    for r in range(len(masks)):
        assert torch.allclose(together[r], expected[r], atol=1e-5), masks[r]
    # Back to the model's own heads after the block.
    assert torch.allclose(logits(lm), logits(zeroed_reference(folder, family, [(0, 3)])),
                          atol=1e-5)
    with raises_naming(ValueError, "(2, 3)", f"(rows, {LAYERS * HEADS})"), \
            lm.knocking_out(row_masks=torch.zeros(2, 3, dtype=torch.bool)):
        lm._model_call(INPUT_IDS.repeat(2, 1))


# Patterns that match one module per layer, but the wrong one: each layer's input width
# is hidden = heads x head_dim in these tiny models, so only the probe can refuse most.
WRONG_ATTN_OUT = {
    "llama": ["model.layers.*.self_attn.q_proj", "model.layers.*.self_attn.k_proj",
              "model.layers.*.self_attn.v_proj", "model.layers.*.mlp.gate_proj"],
    "phi3": ["model.layers.*.self_attn.qkv_proj"],
    "gpt2": ["transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"],
    "gpt_neox": ["gpt_neox.layers.*.attention.query_key_value"],
    "opt": ["model.decoder.layers.*.self_attn.q_proj", "model.decoder.layers.*.fc1"],
}


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_attn_out_accepts_only_the_attention_output_projection(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    pattern = ARCHITECTURES[family][2].replace("{l}", "*")
    lm = load_ablate(folder, attn_out=pattern, ablate="L1H2")
    expected = logits(zeroed_reference(folder, family, [(1, 2)]))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for wrong in WRONG_ATTN_OUT.get(family, []):
        with pytest.raises(AttentionOutputNotFound, match=r"attn_out=|input features") as info:
            ComponentKnockout(model, attn_out=wrong)
        assert "\n" not in str(info.value)
        # The probe's hooks are gone again.
        assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


def test_attn_out_width_must_be_heads_times_head_dim(tiny_model_dir):
    # down_proj takes 64 features: a multiple of 4 heads, but not 4 x 8.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    with raises_naming(AttentionOutputNotFound, "model.layers.0.mlp.down_proj", "64",
                       "4 heads x 8 = 32"):
        ComponentKnockout(model, attn_out="model.layers.*.mlp.down_proj")


def test_discovery_skips_a_look_alike_of_the_wrong_width(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32)
    for layer in model.model.layers:  # named like an output projection, 8 heads x 8 wide
        layer.self_attn.out = nn.Linear(2 * HEADS * 8, 32)
    knockout = ComponentKnockout(model)
    assert knockout.modules == [layer.self_attn.o_proj for layer in model.model.layers]


def test_bloom_adds_the_residual_inside_attention_and_attn_out_still_works():
    from transformers import BloomConfig

    torch.manual_seed(0)
    config = BloomConfig(vocab_size=300, hidden_size=32, n_layer=LAYERS, n_head=HEADS)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
        plain = logits(model)
        dense = model.transformer.h[1].self_attention.dense
        saved = dense.weight[:, 16:24].clone()
        dense.weight[:, 16:24] = 0  # head 2 by hand
        by_hand = logits(model)
        dense.weight[:, 16:24] = saved
    knockout = ComponentKnockout(model, attn_out="transformer.h.*.self_attention.dense")
    with knockout.knocking_out("L1H2"):
        assert torch.allclose(logits(model), by_hand, atol=1e-5)
    assert torch.equal(logits(model), plain)  # scoped: nothing stays applied
    assert not torch.allclose(by_hand, plain, atol=1e-4)
    knockout.remove()
    with raises_naming(AttentionOutputNotFound,
                       "transformer.h.0.self_attention.query_key_value",
                       "transformer.h.0.self_attention"):  # the module and its block
        ComponentKnockout(model, attn_out="transformer.h.*.self_attention.query_key_value")


def test_knocking_out_names_are_checked_against_the_model_and_expanded(tiny_model_dir):
    """The bare-model shorthand took L0H* only with a head count it had but did not pass,
    and a head outside the model was not refused there."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama")).eval()
    knockout = ComponentKnockout(model)
    with torch.no_grad():
        with knockout.knocking_out("L0H*"):
            whole_layer = model(INPUT_IDS).logits
        with knockout.knocking_out("+".join(f"L0H{h}" for h in range(HEADS))):
            assert torch.equal(model(INPUT_IDS).logits, whole_layer)
    with raises_naming(ComponentSpecError, f"L{LAYERS}H0", f"0..{LAYERS - 1}"):
        knockout.knocking_out(f"L{LAYERS}H0")


def test_a_runs_top_k_with_heads_that_do_not_hurt_says_so_when_knocked_out(tiny_model_dir,
                                                                           tmp_path, caplog):
    """ablate_file=heads.json knocked out the top-5 though the report said three of them
    were heads that do not hurt: the log line says which."""
    import json

    ranked = tmp_path / "heads.json"
    effects = {"L1H3": -0.3, "L0H2": 0.0, "L0H0": 0.05, "L1H1": 0.1}  # higher is better
    ranked.write_text(json.dumps({"task": "tiny_copy", "higher_is_better": True,
                                  "top_k": list(effects)[:3],
                                  "heads": [{"rank": i + 1, "head": h, "effect": e}
                                            for i, (h, e) in enumerate(effects.items())]}))
    caplog.set_level("INFO", logger="lm_eval.models.hf_headablate")
    lm = load_ablate(tiny_model_dir("llama"), ablate_file=str(ranked))
    assert [str(h) for h in lm.knocked_out] == ["L0H0", "L0H2", "L1H3"]
    [line] = [m for m in caplog.messages if m.startswith("knocking out")]
    assert line.endswith("; of them L0H2+L0H0 did not hurt the task in the run (its "
                         "ranking records no harm)")
