"""MLP neurons as components: ``L3N1234`` in hf-headablate equals hand-edited weights.

A neuron is one input feature of the MLP's output projection. Each expected value here is
computed without our hooks: on an independent copy of the model whose projection column
was zeroed (or doubled) by hand, or with a hook of the test's own that writes the feature.
"""

from __future__ import annotations

import pytest
import torch
from helpers import ARCHITECTURES, LAYERS, raises_naming
from transformers import AutoModelForCausalLM

from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    Head,
    Neuron,
    format_heads,
    parse_components,
    parse_heads,
)
from lm_eval_headloc.intervention.discovery import MLPOutputNotFound
from lm_eval_headloc.intervention.hooks import ComponentKnockout
from lm_eval_headloc.intervention.model import HFHeadAblateLM

INPUT_IDS = torch.tensor([[5, 17, 42, 99, 7, 123, 64, 8, 250, 31]])

# family -> path of layer l's MLP output projection (written out here, not discovered).
MLP_OUT = {
    "llama": "model.layers.{l}.mlp.down_proj", "mistral": "model.layers.{l}.mlp.down_proj",
    "qwen2": "model.layers.{l}.mlp.down_proj", "qwen3": "model.layers.{l}.mlp.down_proj",
    "gemma2": "model.layers.{l}.mlp.down_proj", "phi3": "model.layers.{l}.mlp.down_proj",
    "gpt2": "transformer.h.{l}.mlp.c_proj", "gpt_neox": "gpt_neox.layers.{l}.mlp.dense_4h_to_h",
    "opt": "model.decoder.layers.{l}.fc2",
}
MLP_WIDTH = {"gpt2": 128}  # GPT-2's n_inner=None: 4 x 32; the others: 64


def load_ablate(folder, **kwargs) -> HFHeadAblateLM:
    return HFHeadAblateLM(pretrained=str(folder), device="cpu", dtype="float32", **kwargs)


def edited_copy(folder, family: str, neurons=(), heads=(), factor: float = 0.0):
    """An independent copy whose MLP output columns for ``neurons`` (and attention output
    columns for ``heads``) are multiplied by ``factor``."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _, _, attn_path, conv1d = ARCHITECTURES[family]
    heads_per_layer = 4
    with torch.no_grad():
        for layer, neuron in neurons:
            weight = model.get_submodule(MLP_OUT[family].format(l=layer)).weight
            if conv1d:  # GPT-2 Conv1D: weight (in, out)
                weight[neuron, :] *= factor
            else:
                weight[:, neuron] *= factor
        for layer, head in heads:
            weight = model.get_submodule(attn_path.format(l=layer)).weight
            width = weight.shape[0 if conv1d else 1] // heads_per_layer
            cols = slice(head * width, (head + 1) * width)
            if conv1d:
                weight[cols, :] *= factor
            else:
                weight[:, cols] *= factor
    return model


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        if hasattr(model, "_model_call"):
            return model._model_call(INPUT_IDS)
        return model(INPUT_IDS).logits


def test_notation_mixes_heads_and_neurons():
    parsed = parse_components("L1N7+L0H2+L1H0+L0N3")
    assert parsed == [Head(0, 2), Neuron(0, 3), Head(1, 0), Neuron(1, 7)]
    assert format_heads(parsed) == "L0H2+L0N3+L1H0+L1N7"
    # Head(0, 1) and Neuron(0, 1) are equal tuples: both must survive de-duplication.
    assert parse_components("L0N1+L0H1+L0N1") == [Head(0, 1), Neuron(0, 1)]
    assert parse_components("L1N*", 2, 4, 3) == [Neuron(1, 0), Neuron(1, 1), Neuron(1, 2)]
    with raises_naming(ComponentSpecError, "L1N3", "0..2"):
        parse_components("L1N3", 2, 4, 3)
    with raises_naming(ComponentSpecError, "'L0N2'", "L{layer}H{head}"):
        parse_heads("L0H1+L0N2")
    for bad in ("L0N", "L0Nx", "N3", "L0N-1", "L0n3"):
        with raises_naming(ComponentSpecError, repr(bad)):
            parse_components(bad)


@pytest.mark.parametrize("family", list(ARCHITECTURES))
def test_neuron_knockout_equals_zeroed_mlp_column(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder, ablate="L1N5")
    assert lm.neurons_per_layer == MLP_WIDTH.get(family, 64)
    expected = logits(edited_copy(folder, family, neurons=[(1, 5)]))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    # Heads and neurons in one mask, a whole MLP among them, switched in place.
    width = lm.neurons_per_layer
    lm.set_heads("L0H1+L1N3+L0N*")
    expected = logits(edited_copy(folder, family, heads=[(0, 1)],
                                  neurons=[(1, 3)] + [(0, n) for n in range(width)]))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    plain = logits(edited_copy(folder, family))
    assert not torch.allclose(expected, plain, atol=1e-4)  # the test could fail
    lm.set_heads([])
    assert torch.equal(logits(lm), logits(edited_copy(folder, family)))


@pytest.mark.parametrize("family", ["llama", "gpt2", "opt"])
def test_neuron_scale_two_doubles_its_column(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder, ablate="L0N2+L1N9", scale=2)
    expected = logits(edited_copy(folder, family, neurons=[(0, 2), (1, 9)], factor=2.0))
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    assert not torch.allclose(expected, logits(edited_copy(folder, family)), atol=1e-4)


def _logits_with_feature(model, family: str, layer: int, neuron: int, value) -> torch.Tensor:
    """Logits of INPUT_IDS with feature ``neuron`` of layer ``layer``'s MLP output
    projection input written to ``value`` (a number, or a tensor over positions) by a hook
    of the test's own."""
    module = model.get_submodule(MLP_OUT[family].format(l=layer))

    def write(_module, args):
        hidden = args[0].clone()
        hidden[..., neuron] = value
        return (hidden, *args[1:])
    handle = module.register_forward_pre_hook(write)
    try:
        return logits(model)
    finally:
        handle.remove()


def _recorded_inputs(model, family: str, layer: int, ids: list[int]) -> torch.Tensor:
    module = model.get_submodule(MLP_OUT[family].format(l=layer))
    seen = []
    handle = module.register_forward_pre_hook(lambda _m, a: seen.append(a[0].detach()))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen[0].reshape(len(ids), -1)  # (positions, width); OPT's MLP sees them flat


# OPT's neuron 4 of layer 1 never fires (ReLU); its MLP sees the batch flattened.
@pytest.mark.parametrize("family, neuron", [("llama", 4), ("gpt2", 4), ("opt", 6)])
def test_neuron_mean_ablation_writes_its_mean(tiny_model_dir, family, neuron, tmp_path):
    folder = tiny_model_dir(family)
    reference = tmp_path / "reference.txt"
    texts = ["the cat sat on the mat", "Mary and John went to the store"]
    reference.write_text("\n".join(texts) + "\n", encoding="utf-8")
    lm = load_ablate(folder, ablate=f"L1N{neuron}", ablation="mean",
                     ablation_data=str(reference), ablation_cache=str(tmp_path / "cache"))
    plain = edited_copy(folder, family)
    # The mean over every real position of both reference texts, recorded independently.
    positions = torch.cat([_recorded_inputs(plain, family, 1, lm.tok_encode(t))
                           for t in texts])
    mean = positions[:, neuron].double().mean().float()
    expected = _logits_with_feature(plain, family, 1, neuron, mean)
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    assert not torch.allclose(expected, logits(plain), atol=1e-5)
    assert lm.neuron_means_file is not None and lm.means_file is not None
    # The means of heads are kept as they were: the heads' cache file is the same one.
    assert lm.get_model_info()["neuron_means_file"] == lm.neuron_means_file


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_neuron_resample_takes_the_donors_feature(tiny_model_dir, tmp_path, family):
    from lm_eval_headloc.intervention.ablation import pick_donor

    folder = tiny_model_dir(family)
    reference = tmp_path / "reference.txt"
    texts = ["the cat sat on the mat when the dog sat", "Mary and John went to the store"]
    reference.write_text("\n".join(texts) + "\n", encoding="utf-8")
    lm = load_ablate(folder, ablate="L0N7", ablation="resample", ablation_data=str(reference))
    plain = edited_copy(folder, family)
    row = INPUT_IDS[0].tolist()
    references = [lm.tok_encode(t)[-lm.max_length:] for t in texts]
    donor = references[pick_donor(row, references, 0)]
    donor_feature = _recorded_inputs(plain, family, 0, donor)[:, 7]
    # Row position i gets donor position min(i, last).
    aligned = donor_feature[torch.clamp(torch.arange(len(row)), max=len(donor) - 1)]
    expected = _logits_with_feature(plain, family, 0, 7, aligned)
    assert torch.allclose(logits(lm), expected, atol=1e-5)
    assert not torch.allclose(expected, logits(plain), atol=1e-5)


# OPT's MLP sees its batch flattened (rows x positions, features).
@pytest.mark.parametrize("family", ["qwen2", "opt"])
def test_row_masks_over_heads_and_neurons(tiny_model_dir, family):
    folder = tiny_model_dir(family)
    lm = load_ablate(folder)
    heads, width = LAYERS * 4, lm.neurons_per_layer
    masks = torch.zeros(3, heads + LAYERS * width, dtype=torch.bool)
    masks[0, heads + 1 * width + 6] = True  # L1N6
    masks[1, 1 * 4 + 2] = True  # L1H2
    masks[1, heads + 0 * width + 0] = True  # L0N0
    ids = INPUT_IDS.repeat(3, 1)
    with torch.no_grad(), lm.knocking_out(row_masks=masks):
        batched = lm._model_call(ids)
    expected = [logits(edited_copy(folder, family, neurons=[(1, 6)])),
                logits(edited_copy(folder, family, heads=[(1, 2)], neurons=[(0, 0)])),
                logits(edited_copy(folder, family))]
    for row, want in enumerate(expected):
        assert torch.allclose(batched[row], want[0], atol=1e-5), row
    with raises_naming(ValueError, str(tuple(masks[:, :-1].shape)),
                       f"(rows, {heads + LAYERS * width})"):
        with lm.knocking_out(row_masks=masks[:, :-1]):
            lm._model_call(ids)


@pytest.fixture
def no_weights(monkeypatch):
    """The config is read; loading the weights fails the test."""
    from lm_eval.models.huggingface import HFLM

    def refuse(self, *args, **kwargs):
        raise AssertionError("weights are loading")
    monkeypatch.setattr(HFLM, "_create_model", refuse)


@pytest.mark.parametrize("ablate, values", [  # the component and the model's range
    ("L0N64", ("L0N64", "0..63")),
    ("L2N0", ("L2N0", "0..1")),
    ("L0H1+L0H4", ("L0H4", "0..3")),
    ("L0N", ("'L0N'",)),
    ("L0N1+L0Nx", ("'L0Nx'",)),
])
def test_bad_neurons_fail_before_the_weights_load(tiny_model_dir, no_weights, ablate, values):
    with raises_naming(ComponentSpecError, *values) as info:
        load_ablate(tiny_model_dir("llama"), ablate=ablate)
    assert "\n" not in str(info.value)


def test_mlp_out_override_and_refusals(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"))
    knockout = ComponentKnockout(model, mlp_out="model.layers.*.mlp.down_proj")
    assert knockout.mlp_modules == [layer.mlp.down_proj for layer in model.model.layers]
    for wrong, values in [("model.layers.*.mlp.up_proj", ("up_proj", "32")),  # its width
                          ("model.layers.*.mlp.*", ("'model.layers.*.mlp.*'", "8")),  # matches
                          ("*.nothing", ("'*.nothing'", "0"))]:
        with raises_naming(MLPOutputNotFound, *values):
            ComponentKnockout(model, mlp_out=wrong)
    # Discovery is lazy: a model whose MLP cannot be found keeps its heads.
    for layer in model.model.layers:  # a second down_proj in each layer: two candidates
        layer.second_mlp = torch.nn.Module()
        layer.second_mlp.down_proj = torch.nn.Linear(64, 32)
    knockout = ComponentKnockout(model)
    with knockout.knocking_out("L0H1"):
        model(INPUT_IDS)
    with pytest.raises(MLPOutputNotFound, match=r"decoder layer 0 .*mlp_out="):
        with knockout.knocking_out("L0N1"):
            model(INPUT_IDS)


@pytest.mark.slow
def test_embedded_smollm2_neurons_equal_hand_zeroed(embedded_lm):
    lm = embedded_lm  # hf-headablate on the GGUF file, float32 on the CPU
    assert lm.neurons_per_layer == 1536
    ids = lm.tok_batch_encode(["When Mary and John went to the store, John gave a drink to"])[0]
    layers = lm.model.model.layers
    with torch.no_grad():
        plain = lm._model_call(ids)[0, -1]
        down, o_proj = layers[3].mlp.down_proj, layers[0].self_attn.o_proj
        saved = down.weight[:, 1234].clone(), o_proj.weight[:, 8 * 64:9 * 64].clone()
        lm.set_heads("L3N1234+L0H8")
        hooked = lm._model_call(ids)[0, -1]
        lm.set_heads([])
        down.weight[:, 1234] = 0
        o_proj.weight[:, 8 * 64:9 * 64] = 0
        by_hand = lm._model_call(ids)[0, -1]
        down.weight[:, 1234] = saved[0]
        o_proj.weight[:, 8 * 64:9 * 64] = saved[1]
        restored = lm._model_call(ids)[0, -1]
    assert torch.allclose(hooked, by_hand, atol=1e-4)
    assert not torch.allclose(hooked, plain, atol=1e-4)
    assert torch.equal(restored, plain)


@pytest.mark.slow
def test_stock_cli_knocks_out_heads_and_neurons(tiny_model_dir, tmp_path):
    """``lm_eval --model hf-headablate --model_args ...,ablate=L1N5+L0H1`` answers as the
    plain ``hf`` model does on a copy whose columns were zeroed by hand and saved."""
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import lm_eval
    from helpers import TASKS

    folder = tiny_model_dir("llama")
    edited = tmp_path / "edited"
    edited_copy(folder, "llama", heads=[(0, 1)], neurons=[(1, 5)]).save_pretrained(edited)
    for name in Path(folder).iterdir():
        if "token" in name.name:
            shutil.copy(name, edited / name.name)
    out = tmp_path / "out"
    cli = subprocess.run(
        [str(Path(sys.executable).parent / "lm_eval"), "--model", "hf-headablate",
         "--model_args", f"pretrained={folder},dtype=float32,ablate=L1N5+L0H1",
         "--device", "cpu", "--tasks", "tiny_choice", "--include_path", TASKS,
         "--output_path", str(out), "--log_samples"],
        capture_output=True, text=True, timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    cli_ll = [float(r[0]) for line in next(out.rglob("samples_tiny_choice_*.jsonl"))
              .read_text().splitlines() for r in json.loads(line)["filtered_resps"]]

    from lm_eval.tasks import TaskManager

    # The test tasks alone: indexing lm-eval's own thousands of YAMLs takes seconds.
    tasks = TaskManager(include_path=TASKS, include_defaults=False)

    def per_sample(model_args: str) -> list[float]:
        results = lm_eval.simple_evaluate(model="hf", model_args=model_args, device="cpu",
                                          tasks=["tiny_choice"], log_samples=True,
                                          task_manager=tasks)
        return [float(r[0]) for s in results["samples"]["tiny_choice"]
                for r in s["filtered_resps"]]

    by_hand = per_sample(f"pretrained={edited},dtype=float32")
    plain = per_sample(f"pretrained={folder},dtype=float32")
    assert cli_ll == pytest.approx(by_hand, abs=1e-5)
    assert cli_ll != pytest.approx(plain, abs=1e-5)
    config = json.loads(next(out.rglob("results_*.json")).read_text())["config"]
    assert config["model_args"]["ablate"] == "L1N5+L0H1"  # as given
