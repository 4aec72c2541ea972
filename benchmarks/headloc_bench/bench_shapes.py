"""Random-weight models of published shapes, a byte-level tokenizer, and tasks of
realistic lengths: what ``bench_measure.py --config NAME`` times at the sizes users run.

A forward pass costs the same whatever the weights hold, so the cost of a measurement on
Llama-3.1-8B is the cost on a model of its shape with random weights, which needs no
download. Each shape is the published ``config.json`` of the model (architecture numbers
only); ``tiny-llama`` is the same family at toy size, for tests on a CPU.

The tokenizer is byte-level (one token per byte, 256 tokens plus two specials): prompts
are written to exact token lengths, and the random model's output rows of every other
token are zeroed, so greedy generation never emits an end-of-text token and always runs
to ``max_gen_toks``, the worst case of a task such as gsm8k (its answers stop at
"Question:" after ~100-200 tokens on a real model). The output projection keeps its full
vocabulary width, so its cost is the real model's.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Any

#: Published shapes (the architecture fields of each model's config.json).
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    "llama-3.1-8b": {
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    },
    # The same family at toy size: the benchmark's own tests run it on a CPU.
    "tiny-llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "rope_theta": 10000.0,
    },
}

#: The published model each shape is, for the report.
PUBLISHED_AS: dict[str, str] = {
    "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "tiny-llama": "a toy Llama (tests)",
}

BYTE_TOKENS = 256
EOS, PAD = "<|endoftext|>", "<pad>"
MARKER = "headloc_random_model.json"  # says a model folder is this module's and how made

CHOICE_TASK, GEN_TASK = "scale_choice", "scale_gen"
_WORDS = ("apple river stone cloud paper green seven house north light table quiet "
          "bread music water field glass winter silver orange garden number thirty "
          "market yellow simple doctor engine forest letter summer bridge candle").split()


def shape_names() -> tuple[str, ...]:
    return tuple(SHAPES)


def model_config(name: str) -> Any:
    """The transformers config of shape ``name`` (``SHAPES``), with the byte tokenizer's
    special tokens."""
    from transformers import AutoConfig

    if name not in SHAPES:
        raise ValueError(f"--config {name!r}: expected one of {', '.join(SHAPES)}")
    fields = dict(SHAPES[name])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, bos_token_id=BYTE_TOKENS,
                                eos_token_id=BYTE_TOKENS, pad_token_id=BYTE_TOKENS + 1,
                                **fields)


def byte_tokenizer() -> Any:
    """One token per byte (ids 0-255) plus ``EOS`` (256) and ``PAD`` (257)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[EOS], vocab[PAD] = BYTE_TOKENS, BYTE_TOKENS + 1
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                       use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS,
                                   pad_token=PAD)


def model_dir_problem(folder: Path) -> str | None:
    """Why ``folder`` may not hold a random model of ours (None: it may): it is not a
    folder, or holds files this module did not write (never written into)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"--model-dir {str(folder)!r} is not a folder"
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER).is_file():
        return (f"--model-dir {str(folder)!r} is not empty and was not made by this "
                f"benchmark (no {MARKER}); name a new folder")
    return None


def build_random_model(name: str, folder: Path, dtype: str = "bfloat16",
                       device: str = "cpu", seed: int = 0) -> tuple[Path, float, bool]:
    """A random-weight model of shape ``name`` saved in ``folder`` with the byte
    tokenizer; returns the folder, the seconds it took, and whether it was built (False:
    a folder this function made with the same settings was reused).

    A folder that exists, is not empty and has no ``MARKER`` of ours is refused: it is
    never written into.
    """
    import torch
    from transformers import AutoModelForCausalLM

    settings = {"config": name, "dtype": dtype, "seed": seed, "shape": SHAPES.get(name)}
    folder = Path(folder)
    marker = folder / MARKER
    problem = model_dir_problem(folder)
    if problem is not None:
        raise FileExistsError(problem)
    if marker.is_file() and json.loads(marker.read_text(encoding="utf-8")) == settings:
        return folder, 0.0, False
    start = time.perf_counter()
    config = model_config(name)
    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    with torch.no_grad():
        # Greedy decoding then stays on byte tokens: never the end of text, nor an id the
        # tokenizer cannot decode. The projection's width (its cost) is unchanged.
        model.get_output_embeddings().weight[BYTE_TOKENS:] = 0
    folder.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)  # an unfinished folder is not reused
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    marker.write_text(json.dumps(settings), encoding="utf-8")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder, time.perf_counter() - start, True


def parameter_count(name: str) -> int:
    """Parameters of shape ``name``, counted on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(name))
    return sum(p.numel() for p in model.parameters())


def _text(rng: random.Random, length: int) -> str:
    """Words to exactly ``length`` bytes (= tokens of the byte tokenizer)."""
    words: list[str] = []
    size = -1
    while size < length:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length].rstrip().ljust(length, ".")


UTILS = '''"""Loads this benchmark task's data file, found next to this file."""

from pathlib import Path

from lm_eval_headloc.tasks.data import jsonl_docs

load_docs = jsonl_docs(Path(__file__).parent / "{name}.jsonl")
'''

CHOICE_YAML = """# Written by headloc_bench.bench_shapes: an MMLU-shaped task, for timing.
task: scale_choice
custom_dataset: !function utils.load_docs
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}\\nAnswer:"
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

GEN_YAML = """# Written by headloc_bench.bench_shapes: a gsm8k-shaped task, for timing.
task: scale_gen
custom_dataset: !function utils.load_docs
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: " {{answer}}"
target_delimiter: ""
generation_kwargs:
  until: ["Question:"]
  do_sample: false
  max_gen_toks: MAX_GEN_TOKS
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks(folder: Path, docs: int = 100, choice_tokens: int = 250,
                gen_prompt_tokens: int = 200, gen_answer_tokens: int = 150,
                max_gen_toks: int = 256, seed: int = 0) -> dict[str, int]:
    """``CHOICE_TASK`` (4 one-letter choices after a ~``choice_tokens``-token question,
    MMLU's shape) and ``GEN_TASK`` (~``gen_prompt_tokens``-token questions, gold answers of
    ~``gen_answer_tokens`` tokens, up to ``max_gen_toks`` generated: gsm8k's shape) in
    ``folder``, one sub-folder each. Lengths vary ±20 % across documents, as real ones
    do (so batches carry padding). Returns each task's prompt tokens on average."""
    rng = random.Random(seed)

    def around(mean: int) -> int:
        return max(1, round(mean * rng.uniform(0.8, 1.2)))

    choice = [{"question": _text(rng, around(choice_tokens)), "answer": rng.randrange(4)}
              for _ in range(docs)]
    gen = [{"question": _text(rng, around(gen_prompt_tokens)),
            "answer": _text(rng, around(gen_answer_tokens))} for _ in range(docs)]
    for name, rows, yaml in ((CHOICE_TASK, choice, CHOICE_YAML),
                             (GEN_TASK, gen, GEN_YAML.replace("MAX_GEN_TOKS", str(max_gen_toks)))):
        task = Path(folder) / name
        task.mkdir(parents=True, exist_ok=True)
        (task / f"{name}.yaml").write_text(yaml, encoding="utf-8")
        (task / "utils.py").write_text(UTILS.format(name=name), encoding="utf-8")
        with (task / f"{name}.jsonl").open("w", encoding="utf-8") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")
    # The prompts as the model sees them: the template adds "\nAnswer:" or "Question: ".
    return {CHOICE_TASK: round(sum(len(r["question"]) + 8 for r in choice) / docs),
            GEN_TASK: round(sum(len(r["question"]) + 18 for r in gen) / docs)}
