"""Hybrid models: attention heads in some layers only (Qwen3.5's Gated DeltaNet layers
between its attention layers; Jamba's, LFM2's, Nemotron-H's …).

Heads keep the model's layer numbers; the layers without heads have none to name, knock
out, rank, draw or picture. Every expected value is computed by hand on the plain
``transformers`` model: weights zeroed, projection inputs recorded and substituted by
hooks written here.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import transformers
from helpers import (
    HEADS,
    HYBRID_HEAD_LAYERS,
    TASKS,
    assert_names,
    harness,
    hybrid_config,
    load_lm,
    raises_naming,
)
from transformers import AutoModelForCausalLM

from lm_eval_headloc.intervention.components import ComponentSpecError
from lm_eval_headloc.intervention.discovery import AttentionOutputNotFound
from lm_eval_headloc.intervention.geometry import Geometry
from lm_eval_headloc.intervention.hooks import ComponentKnockout

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 7, 123, 64, 8]])
HEAD_DIM = 8  # hybrid_config's head_dim
O_PROJ = "model.layers.{}.self_attn.o_proj"
#: Every head of the tiny hybrid, by name: layers 1 and 3 only.
HYBRID_HEADS = {f"L{layer}H{head}" for layer in HYBRID_HEAD_LAYERS for head in range(HEADS)}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(hybrid_config()).eval()


def _zeroed(model, heads: list[tuple[int, int]]) -> torch.Tensor:
    """Logits of a copy with each head's columns of its layer's o_proj weight zeroed."""
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for layer, head in heads:
            weight = reference.get_submodule(O_PROJ.format(layer)).weight
            weight[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0
        return reference(INPUT_IDS).logits


# --- which layers have heads, from the config --------------------------------------------

def _jamba():
    # Jamba's rule: layer i is attention where i % attn_layer_period == attn_layer_offset.
    return transformers.JambaConfig(num_hidden_layers=8, attn_layer_period=4,
                                    attn_layer_offset=2, num_attention_heads=4,
                                    num_key_value_heads=2)


def _mllama():
    return transformers.MllamaTextConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, cross_attention_layers=[1, 3],
        pad_token_id=0, eos_token_id=2, bos_token_id=1)


@pytest.mark.parametrize("config, layers, heads", [
    (hybrid_config, 4, (1, 3)),
    (_jamba, 8, (2, 6)),
    (lambda: transformers.Lfm2Config(num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2,
                                     layer_types=["conv", "full_attention", "conv", "conv"]),
     4, (1,)),
    # Nemotron-H's pattern: * attention, M mamba, - MLP, E mixture of experts.
    (lambda: transformers.NemotronHConfig(hybrid_override_pattern="M*-E*",
                                          num_attention_heads=4, num_key_value_heads=2),
     5, (1, 4)),
    # Mllama's cross-attention layers: skipped whole on text, so no heads.
    (lambda: _mllama(), 4, (0, 2)),
    # Gemma 3's sliding and full attention layers both have heads.
    (lambda: transformers.Gemma3TextConfig(num_hidden_layers=6, num_attention_heads=4,
                                           num_key_value_heads=2),
     6, None),
])
def test_the_layers_with_heads_come_from_the_config(config, layers, heads):
    geometry = Geometry.from_config(config())
    assert geometry.num_layers == layers
    assert geometry.head_layers == heads
    assert geometry.layers_with_heads == (heads or tuple(range(layers)))
    assert geometry.total_heads == len(heads or range(layers)) * geometry.heads_per_layer


# --- knocking out --------------------------------------------------------------------------

@pytest.mark.parametrize("heads", [[(1, 2)], [(3, 0), (3, 3)], [(1, 0), (3, 1)]])
def test_a_hybrids_head_is_its_attention_layers_o_proj_slice(model, heads):
    knockout = ComponentKnockout(model)
    try:
        with torch.no_grad(), knockout.knocking_out([f"L{layer}H{head}" for layer, head in heads]):
            got = model(INPUT_IDS).logits
    finally:
        knockout.remove()
    expected = _zeroed(model, heads)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (expected - model(INPUT_IDS).logits).abs().max() > 1e-4  # it changed something


def test_mllamas_heads_are_its_self_attention_layers_and_cross_attention_is_refused():
    """On text, Mllama skips its cross-attention layers whole: their heads (hooked before)
    could change nothing. Its heads are those of the self-attention layers, o_proj slices."""
    torch.manual_seed(0)
    mllama = transformers.MllamaForCausalLM(_mllama()).eval()
    knockout = ComponentKnockout(mllama)
    try:
        assert knockout.layers_with_heads == (0, 2)
        with torch.no_grad(), knockout.knocking_out(["L2H1", "L0H3"]):
            got = mllama(INPUT_IDS).logits
        with raises_naming(ComponentSpecError, "L1H0", "0, 2"):  # the layers with heads
            with knockout.knocking_out(["L1H0"]):
                pass
    finally:
        knockout.remove()
    reference = copy.deepcopy(mllama)
    with torch.no_grad():
        for layer, head in [(2, 1), (0, 3)]:
            weight = reference.get_submodule(O_PROJ.format(layer)).weight
            weight[:, head * HEAD_DIM:(head + 1) * HEAD_DIM] = 0
        expected = reference(INPUT_IDS).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert (expected - mllama(INPUT_IDS).logits).abs().max() > 1e-4


def test_one_mask_per_row_knocks_out_each_rows_heads(model):
    knockout = ComponentKnockout(model)
    masks = [["L1H1"], ["L3H2", "L1H3"]]
    try:
        rows = knockout.row_masks([knockout_components(knockout, m) for m in masks])
        assert rows.shape == (2, 4 * HEADS)  # every layer's place, the linear ones' unused
        with torch.no_grad(), knockout.applied(_intervention(rows)):
            got = model(INPUT_IDS.repeat(2, 1)).logits
    finally:
        knockout.remove()
    torch.testing.assert_close(got[0:1], _zeroed(model, [(1, 1)]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:2], _zeroed(model, [(3, 2), (1, 3)]), rtol=1e-5,
                               atol=1e-5)


def knockout_components(knockout, names):
    from lm_eval_headloc.intervention.components import parse_components

    return parse_components(names, knockout.num_layers, knockout.heads_per_layer,
                            head_layers=knockout.geometry.head_layers)


def _intervention(rows):
    from lm_eval_headloc.intervention.hooks import Intervention

    return Intervention(row_masks=rows)


def test_a_row_mask_over_a_layer_without_heads_is_refused(model):
    knockout = ComponentKnockout(model)
    rows = torch.zeros(1, 4 * HEADS, dtype=torch.bool)
    rows[0, 0 * HEADS + 1] = True  # L0H1: layer 0 is linear attention
    try:
        with raises_naming(ValueError, "layer 0"):
            with knockout.applied(_intervention(rows)):
                model(INPUT_IDS)
    finally:
        knockout.remove()


@pytest.mark.parametrize("names, values", [  # the head and the layers it may be in
    ("L0H1", ("L0H1", "1, 3")),
    ("L2H*", ("L2H*", "1, 3")),
    ("L4H0", ("L4H0", "0..3")),
])
def test_a_head_in_a_layer_without_heads_is_named_in_the_refusal(model, names, values):
    knockout = ComponentKnockout(model)
    try:
        with raises_naming(ComponentSpecError, *values):
            knockout.knocking_out(names)
    finally:
        knockout.remove()


def test_a_whole_attention_layer_and_a_linear_layers_neurons(model):
    knockout = ComponentKnockout(model)
    try:
        with torch.no_grad(), knockout.knocking_out("L3H*"):
            whole = model(INPUT_IDS).logits
        with torch.no_grad(), knockout.knocking_out("L0N5"):  # its MLP is a plain MLP
            neuron = model(INPUT_IDS).logits
    finally:
        knockout.remove()
    torch.testing.assert_close(whole, _zeroed(model, [(3, h) for h in range(HEADS)]),
                               rtol=1e-5, atol=1e-5)
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.get_submodule("model.layers.0.mlp.down_proj").weight[:, 5] = 0
        torch.testing.assert_close(neuron, reference(INPUT_IDS).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pattern, values", [  # what it matched; the layers with heads
    # As many linear-attention projections as attention layers: in the wrong layers.
    ("model.layers.*.linear_attn.out_proj", ("model.layers.0.linear_attn.out_proj", "1, 3")),
    ("model.layers.*.mlp.down_proj", ("4 module", "1, 3")),
])
def test_attn_out_must_name_the_attention_layers_projections(model, pattern, values):
    with raises_naming(AttentionOutputNotFound, f"attn_out={pattern!r}", *values):
        ComponentKnockout(model, attn_out=pattern)
    knockout = ComponentKnockout(model, attn_out="model.layers.*.self_attn.o_proj")
    knockout.remove()
    assert knockout.modules == [model.get_submodule(O_PROJ.format(layer))
                                for layer in HYBRID_HEAD_LAYERS]


# --- mean ablation's means, recorded by hand -------------------------------------------------

TEXTS = ["the cat sat on the mat", "Mary and John went to the store",
         "one plus two equals three"]
PROBE = "John gave the dog a drink and the cat sat"


def test_mean_ablation_of_a_hybrids_heads_equals_means_recorded_by_hand(tiny_hybrid_dir,
                                                                          tmp_path):
    from transformers import AutoTokenizer

    plain = AutoModelForCausalLM.from_pretrained(tiny_hybrid_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid_dir)
    seen: dict[int, list[torch.Tensor]] = {layer: [] for layer in HYBRID_HEAD_LAYERS}
    handles = [plain.get_submodule(O_PROJ.format(layer)).register_forward_pre_hook(
        lambda module, args, layer=layer: seen[layer].append(args[0][0].detach().clone()))
        for layer in HYBRID_HEAD_LAYERS]
    with torch.no_grad():
        for text in TEXTS:
            plain(tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids)
    for handle in handles:
        handle.remove()
    means = {layer: torch.cat(rows).double().mean(0).float() for layer, rows in seen.items()}
    out = [(1, 2), (3, 0)]

    def to_mean(module, args, layer):
        hidden = args[0].clone()
        for at, head in out:
            if at == layer:
                part = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                hidden[..., part] = means[layer][part]
        return (hidden,)

    handles = [plain.get_submodule(O_PROJ.format(layer)).register_forward_pre_hook(
        lambda module, args, layer=layer: to_mean(module, args, layer))
        for layer in HYBRID_HEAD_LAYERS]
    probe = tokenizer(PROBE, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = plain(probe).logits
    for handle in handles:
        handle.remove()
    reference = tmp_path / "reference.txt"
    reference.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
    lm = load_lm(tiny_hybrid_dir, ablate="L1H2+L3H0", ablation="mean",
                 ablation_data=str(reference), ablation_cache=str(tmp_path / "cache"))
    with torch.no_grad():
        got = lm._model_call(torch.tensor([lm.tok_encode(PROBE)]))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert (plain(probe).logits - expected).abs().max() > 1e-4


# --- the commands --------------------------------------------------------------------------

def _args(folder) -> list[str]:
    return ["--model-args", f"pretrained={folder},dtype=float32", "--include-path", TASKS,
            "--tasks", "tiny_copy", "--num-samples", "8"]


@pytest.fixture(scope="module")
def hybrid_run(tiny_hybrid_dir, tmp_path_factory):
    """A finished locate run (prior, confirmation, bootstrap: the defaults) on the hybrid."""
    out = tmp_path_factory.mktemp("hybrid") / "locate"
    assert harness("locate", *_args(tiny_hybrid_dir), "--signal", "logprob", "--masks", "16",
                   "--out", str(out)) == 0
    return out


def test_locate_ranks_the_heads_of_the_attention_layers_only(hybrid_run):
    config = json.loads((hybrid_run / "config.json").read_text())
    assert (config["layers"], config["heads_per_layer"], config["head_layers"]) == \
        (4, HEADS, list(HYBRID_HEAD_LAYERS))
    ranking = json.loads((hybrid_run / "heads-tiny_copy.json").read_text())
    assert {entry["head"] for entry in ranking["heads"]} == HYBRID_HEADS
    assert len(ranking["heads"]) == len(HYBRID_HEADS)
    prior = json.loads((hybrid_run / "prior.json").read_text())
    assert set(prior["tasks"]["tiny_copy"]["points"][0]["ranking"]) == HYBRID_HEADS
    assert np.load(hybrid_run / "design_matrix.npy").shape[1] == len(HYBRID_HEADS)
    assert (hybrid_run / "heatmap.png").stat().st_size > 0
    # Head types: the linear-attention layers have no scores and no heads in the table.
    from lm_eval_headloc.method.head_types import HeadTypes
    from lm_eval_headloc.report.type_pages import types_table

    data = json.loads((hybrid_run / "types.json").read_text())
    assert data["head_layers"] == list(HYBRID_HEAD_LAYERS)
    for layer in (0, 2):
        assert data["dominant"][layer] == [None] * HEADS
        assert all(data["scores"][kind][layer] == [None] * HEADS for kind in data["scores"])
    assert all(v is not None for kind in data["scores"] for layer in HYBRID_HEAD_LAYERS
               for v in data["scores"][kind][layer])
    rows = types_table(HeadTypes(data)).splitlines()[1:]
    assert sorted(row.split(",")[0] for row in rows) == sorted(HYBRID_HEADS)


def test_refit_reads_the_hybrids_columns_back(hybrid_run, tmp_path):
    import shutil

    copy_ = tmp_path / "run"
    shutil.copytree(hybrid_run, copy_)
    before = json.loads((copy_ / "heads-tiny_copy.json").read_text())
    assert harness("refit", str(copy_), "--top-k", "3") == 0
    after = json.loads((copy_ / "heads-tiny_copy.json").read_text())
    assert after["top_k"] == before["top_k"][:3]
    assert {entry["head"] for entry in after["heads"]} == HYBRID_HEADS


def test_greedy_measures_each_head_of_the_attention_layers(tiny_hybrid_dir, tmp_path):
    out = tmp_path / "greedy"
    assert harness("greedy", *_args(tiny_hybrid_dir), "--signal", "logprob",
                   "--out", str(out)) == 0
    keys = [json.loads(line)["key"] for line in
            (out / "measurements.jsonl").read_text().splitlines()]
    assert sorted(keys) == sorted(["baseline", *(f"round1-{h}" for h in HYBRID_HEADS)])


def test_verifys_random_heads_are_drawn_from_the_attention_layers(hybrid_run, tmp_path):
    out = tmp_path / "verify"
    assert harness("verify", str(hybrid_run), "--top-k", "2", "--random-draws", "12",
                   "--general", "tiny_choice",
                   "--out", str(out)) == 0
    drawn = json.loads((out / "verify.json").read_text())["random"]["tiny_copy"]["sets"]
    assert len(drawn) == 12
    assert all(len(heads) == 2 and set(heads) <= HYBRID_HEADS for heads in drawn)
    masks = {name for line in (out / "measurements.jsonl").read_text().splitlines()
             for name in json.loads(line)["mask"].split("+") if name}
    assert masks <= HYBRID_HEADS and len(masks) > 2


def test_export_to_mib_refuses_a_hybrid_run(hybrid_run, tmp_path, capsys):
    assert harness("export", str(hybrid_run), "--out", str(tmp_path / "g.json")) == 2
    assert_names(capsys.readouterr().err, str(hybrid_run), "1, 3 (2 layers)")
    assert not (tmp_path / "g.json").exists()


@pytest.mark.parametrize("flag, value", [("--exclude", "L0H1"), ("--never-ablate", "L2H*")])
def test_a_head_in_a_linear_layer_is_refused_before_the_weights_load(
        tiny_hybrid_dir, tmp_path, capsys, no_model_loading, flag, value):
    assert harness("locate", *_args(tiny_hybrid_dir), flag, value,
                   "--out", str(tmp_path / "run")) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    # The option, the heads it was given (in a layer without heads), the layers with heads.
    assert_names(error, f"{flag}: ", value, "1, 3 (2 layers)")
    assert not (tmp_path / "run").exists()


def test_the_attribution_prior_of_a_hybrid_is_each_heads_derivative_in_its_layer(
        tiny_hybrid_dir, task_manager):
    from lm_eval_headloc.intervention.multimask import loglikelihoods_for_masks
    from lm_eval_headloc.measurement.attribution import attribution_effects
    from lm_eval_headloc.measurement.measure import HarnessMeasurement
    from lm_eval_headloc.measurement.signals import signal_weights

    lm = load_lm(tiny_hybrid_dir, dtype="float64", softmax_dtype="float64")
    task = "tiny_copy"
    measure = HarnessMeasurement(lm, [(task, None)], {task: task_manager.load([task])},
                                 num_samples=None, signal="logprob")
    requests = measure.requests()
    answers = loglikelihoods_for_masks(lm, requests, [[]])[0]
    weights = signal_weights(measure.gold_answers(), answers, measure.leaves_of[task])
    effects = attribution_effects(lm, requests, weights, batch_size=3).reshape(4, HEADS)
    assert not effects[[0, 2]].any()  # the linear-attention layers have no heads
    eps = 1e-2
    for layer in HYBRID_HEAD_LAYERS:
        for head in range(HEADS):
            values = []
            for factor in (1 + eps, 1 - eps):
                def scale(_module, args, head=head, factor=factor):
                    z = args[0].clone()
                    z[..., head * HEAD_DIM:(head + 1) * HEAD_DIM] *= factor
                    return (z, *args[1:])
                handle = lm.model.get_submodule(O_PROJ.format(layer)) \
                    .register_forward_pre_hook(scale)
                try:
                    values.append(measure.measure_with_model([])[task].value)
                finally:
                    handle.remove()
            derivative = (values[0] - values[1]) / (2 * eps)
            # The Gated DeltaNet layers compute in float32 whatever the dtype: the finite
            # difference carries ~1e-5 of rounding (a mislaid layer is off by far more).
            assert effects[layer, head] == pytest.approx(-derivative, rel=2e-2, abs=2e-5)
    # Further apart than the tolerance: a head's estimate in another's place could not pass.
    assert np.diff(np.sort(effects[list(HYBRID_HEAD_LAYERS)].ravel())).min() > 5e-3
    torch.set_grad_enabled(True)


@pytest.mark.parametrize("model_type, options, path", [
    # Blocks not named as attention, of an attention class: Nemotron-H's mixer (mamba,
    # attention or MLP by layer), RecurrentGemma's temporal_block (recurrent or attention).
    ("nemotron_h", dict(hybrid_override_pattern="M*-*", mamba_num_heads=4, mamba_head_dim=8,
                        ssm_state_size=4, n_groups=1, head_dim=8, num_hidden_layers=4),
     "model.layers.{}.mixer.o_proj"),
    ("recurrent_gemma", dict(num_hidden_layers=3, lru_width=32, attention_window_size=8,
                             block_types=["recurrent", "recurrent", "attention"], head_dim=8),
     "model.layers.{}.temporal_block.o_proj"),
])
def test_an_attention_block_is_found_by_its_class_where_its_name_does_not_say(
        model_type, options, path):
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=32, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        pad_token_id=0, **options)
    torch.manual_seed(0)
    hybrid = AutoModelForCausalLM.from_config(config).eval()
    knockout = ComponentKnockout(hybrid)
    layers = knockout.layers_with_heads
    assert knockout.modules == [hybrid.get_submodule(path.format(layer)) for layer in layers]
    ids = torch.tensor([[5, 17, 42, 99, 7, 100, 64, 8]])
    with torch.no_grad(), knockout.knocking_out(f"L{layers[-1]}H1"):
        got = hybrid(ids).logits
    knockout.remove()
    reference = copy.deepcopy(hybrid)
    with torch.no_grad():
        weight = reference.get_submodule(path.format(layers[-1])).weight
        width = weight.shape[1] // 4
        weight[:, width:2 * width] = 0
        expected = reference(ids).logits
        assert (expected - hybrid(ids).logits).abs().max() > 1e-3
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [
    dict(block_auto_adjust_ff_dim=True, block_multiple_of=16, block_ffn_dim_multiplier=1.0),
    dict(block_auto_adjust_ff_dim=True, block_multiple_of=40, block_ffn_dim_multiplier=1.5),
    dict(block_auto_adjust_ff_dim=False),
])
def test_lfm2s_neurons_are_as_wide_as_the_mlp_it_builds(options):
    # LFM2's MLP is two thirds of intermediate_size (rounded up to block_multiple_of): the
    # config's 96 was refused against a 64-wide w2, even when named with mlp_out=.
    config = transformers.Lfm2Config(
        vocab_size=128, hidden_size=32, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
        layer_types=["conv", "full_attention", "conv"], **options)
    torch.manual_seed(0)
    lfm = AutoModelForCausalLM.from_config(config).eval()
    w2 = lfm.model.layers[2].feed_forward.w2
    assert Geometry.from_config(config).neurons_per_layer == w2.in_features
    knockout = ComponentKnockout(lfm, neurons=True)
    last = w2.in_features - 1
    with torch.no_grad(), knockout.knocking_out(f"L2N{last}+L1H2"):
        got = lfm(INPUT_IDS).logits
    knockout.remove()
    reference = copy.deepcopy(lfm)
    with torch.no_grad():
        reference.model.layers[2].feed_forward.w2.weight[:, last] = 0
        reference.model.layers[1].self_attn.out_proj.weight[:, 2 * 8:3 * 8] = 0
        torch.testing.assert_close(got, reference(INPUT_IDS).logits, rtol=1e-5, atol=1e-5)


def test_a_hybrid_runs_rankings_read_back_to_the_files_they_were_written_as(hybrid_run):
    from lm_eval_headloc.method.ranking import ranked_heads_json
    from lm_eval_headloc.runs.record import read_rankings

    ranking = read_rankings(hybrid_run)["tiny_copy"]
    written = json.loads((hybrid_run / "heads-tiny_copy.json").read_text())
    assert json.loads(json.dumps(ranked_heads_json(ranking, 5))) == written
    assert {str(c) for c in ranking.columns} == HYBRID_HEADS
    assert ranking.stability is not None and ranking.head_types is not None
