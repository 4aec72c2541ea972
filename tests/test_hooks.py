"""Knockout through hf-headablate equals zeroing the output projection, per architecture."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, GQA_FAMILIES, HEADS, LAYERS
from transformers import AutoModelForCausalLM

from lm_eval_headloc.heads import HeadSpecError
from lm_eval_headloc.hooks import AttentionOutputNotFound, HeadKnockout
from lm_eval_headloc.model import HFHeadAblateLM

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
    with torch.no_grad():
        return model(INPUT_IDS).logits


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_knockout_equals_zeroed_output_projection(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder, ablate="L1H2")
    expected = logits(zeroed_reference(folder, family, [(1, 2)]))
    assert torch.allclose(logits(lm.model), expected, atol=1e-5)
    # Two heads in different layers, switched in place on the same object.
    lm.set_heads("L0H0+L1H3")
    expected = logits(zeroed_reference(folder, family, [(0, 0), (1, 3)]))
    assert torch.allclose(logits(lm.model), expected, atol=1e-5)
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
    assert torch.equal(logits(lm.model), logits(plain.model))
    lm.set_heads("L0H1")
    lm.set_heads([])
    assert torch.equal(logits(lm.model), logits(plain.model))


def _projection_inputs(model, family: str, layer: int) -> list[torch.Tensor]:
    """What the output projection of `layer` receives, after the knockout hook."""
    seen: list[torch.Tensor] = []
    proj = model.get_submodule(ARCHITECTURES[family][2].format(l=layer))
    handle = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    try:
        logits(model)
    finally:
        handle.remove()
    return seen


@pytest.mark.parametrize("family", GQA_FAMILIES)
def test_gqa_knockout_leaves_the_rest_of_the_kv_group(tiny_model_dir, family):
    # Query heads 0 and 1 share key/value head 0 (4 query heads, 2 KV heads).
    lm = load_ablate(tiny_model_dir(family))
    (before,) = _projection_inputs(lm.model, family, layer=0)
    lm.set_heads("L0H0")
    (after,) = _projection_inputs(lm.model, family, layer=0)
    per_head_before = before.unflatten(-1, (HEADS, -1))
    per_head_after = after.unflatten(-1, (HEADS, -1))
    assert torch.count_nonzero(per_head_after[..., 0, :]) == 0
    assert torch.count_nonzero(per_head_before[..., 1, :]) > 0
    assert torch.equal(per_head_after[..., 1:, :], per_head_before[..., 1:, :])


def test_switching_in_place_matches_a_fresh_model(tiny_model_dir):
    folder = tiny_model_dir("qwen2")
    live = load_ablate(folder)
    hooks_before = [len(m._forward_pre_hooks) for m in live.knockout.modules]
    for spec in ["L0H1", "L1H*", "L0H0+L0H3+L1H1", "L1H2"]:
        live.set_heads(spec)
        fresh = load_ablate(folder, ablate=spec)
        assert live.knocked_out == fresh.knocked_out
        assert torch.equal(logits(live.model), logits(fresh.model))
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
        logits(lm.model)
        assert received["after"] is received["before"]  # no multiply, no copy
        lm.set_heads("L1H0")  # another layer: layer 0 still untouched
        logits(lm.model)
        assert received["after"] is received["before"]
        lm.set_heads("L0H0")
        logits(lm.model)
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
    assert torch.allclose(logits(lm.model), logits(merged), atol=1e-5)


def test_bad_heads_and_files_are_one_line_errors(tiny_model_dir, tmp_path):
    lm = load_ablate(tiny_model_dir("llama"))
    assert (lm.num_layers, lm.num_heads) == (LAYERS, HEADS)
    for spec, message in [
        ("L99H0", r"L99H0 is outside the model: layer 99 not in 0\.\.1"),
        ("L0H9", r"L0H9 is outside the model: head 9 not in 0\.\.3"),
        ("X1", "bad head name 'X1'"),
        ("L-1H0", "bad head name 'L-1H0'"),
        ("L0H1++L0H2", "empty head name"),
    ]:
        with pytest.raises(HeadSpecError, match=message) as info:
            lm.set_heads(spec)
        assert "\n" not in str(info.value)
    assert lm.knocked_out == ()  # a refused mask leaves the model as it was
    with pytest.raises(HeadSpecError, match="head file not found: .*nope.json"):
        load_ablate(tiny_model_dir("llama"), ablate_file=str(tmp_path / "nope.json"))
    with pytest.raises(HeadSpecError, match="ablate= is empty"):
        load_ablate(tiny_model_dir("llama"), ablate="")
    with pytest.raises(HeadSpecError, match="ablate_top=2 needs ablate_file"):
        load_ablate(tiny_model_dir("llama"), ablate_top=2)


def test_ablate_file_with_top_k_and_union_with_ablate(tiny_model_dir, tmp_path):
    ranked = tmp_path / "heads.json"
    ranked.write_text('{"heads": [{"head": "L1H3"}, {"head": "L0H2"}, {"head": "L0H0"}]}')
    lm = load_ablate(tiny_model_dir("llama"), ablate_file=str(ranked), ablate_top=2,
                     ablate="L1H0")
    assert [str(h) for h in lm.knocked_out] == ["L0H2", "L1H0", "L1H3"]
    assert lm.get_model_info()["ablate"] == "L0H2+L1H0+L1H3"


def test_unreadable_architecture_says_how_to_name_the_module(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    for layer in model.model.layers:  # hide the projection under an unknown name
        layer.self_attn.mixer_out = layer.self_attn.o_proj
        del layer.self_attn.o_proj
    with pytest.raises(AttentionOutputNotFound, match="attn_out=") as info:
        HeadKnockout(model)
    assert "\n" not in str(info.value)
    knockout = HeadKnockout(model, attn_out="model.layers.*.self_attn.mixer_out")
    assert len(knockout.modules) == LAYERS
    with pytest.raises(AttentionOutputNotFound, match="matches 0 module"):
        HeadKnockout(model, attn_out="*.nothing")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_per_row_masks_equal_one_mask_at_a_time(tiny_model_dir, family):
    lm = load_ablate(tiny_model_dir(family), ablate="L0H3")  # replaced while rows are set
    masks = ["L1H2", "", "L0H0+L1H3", "L0H*"]
    expected = []
    for spec in masks:
        lm.set_heads(spec)
        expected.append(logits(lm.model)[0])
    lm.set_heads("L0H3")
    rows = torch.zeros(len(masks), LAYERS * HEADS, dtype=torch.bool)
    for r, spec in enumerate(masks):
        for head in (lm.knockout.set_heads(spec) if spec else []):
            rows[r, head.index(HEADS)] = True
    lm.knockout.set_heads("L0H3")
    lm.knockout.set_row_masks(rows)
    with torch.no_grad():
        together = lm.model(INPUT_IDS.repeat(len(masks), 1)).logits
    for r in range(len(masks)):
        assert torch.allclose(together[r], expected[r], atol=1e-5), masks[r]
    lm.knockout.set_row_masks(None)  # back to the set_heads mask
    lm2 = load_ablate(tiny_model_dir(family), ablate="L0H3")
    assert torch.equal(logits(lm.model), logits(lm2.model))
    with pytest.raises(ValueError, match="per-row masks must have shape"):
        lm.knockout.set_row_masks(torch.zeros(2, 3, dtype=torch.bool))
