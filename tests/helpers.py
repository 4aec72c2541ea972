"""What the tests share that is not a fixture: the tiny models' shapes and configs, the
command run in this process, hand-written run folders, and readers of what a run writes.

A plain module: tests/ is on sys.path (pytest puts it there for conftest.py), so a test
module does ``from helpers import ...``. The fixtures are in conftest.py, and conftest.py
has pytest rewrite this module's asserts as it does a test module's. No test module
imports another.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

# --- the tiny models ----------------------------------------------------------------------
#
# Each has 2 layers and 4 query heads (2 key/value heads where the family uses grouped-query
# attention) and a small BPE tokenizer trained here, so everything runs offline in seconds.

HIDDEN, LAYERS, HEADS, KV_HEADS, VOCAB = 32, 2, 4, 2, 300
MLP_WIDTH = 64  # the llama-style families' intermediate_size: their MLP neurons per layer
TASKS = str(Path(__file__).parent / "tasks")  # tiny lm-eval task YAMLs for the tests
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
#: The benchmarks: their code is the package ``headloc_bench`` in this folder (not installed).
BENCHMARKS = SCRIPTS.parent / "benchmarks"

#: Tests that start Ray workers: skipped where Ray (an optional extra) is not installed.
needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install 'lm-eval-headloc[ray]')")

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


def tiny_config(family: str):
    """The transformers config of the tiny random model of ``family`` (ARCHITECTURES)."""
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


def save_tiny_tokenizer(folder: Path):
    """The tiny BPE tokenizer, trained here on a few words, saved into ``folder``."""
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


def lose_last_measurement_and_count_loads(out: Path, monkeypatch) -> list[int]:
    """Drop the last record of run folder ``out`` and count the model loads from now on
    (one entry per ``HFHeadAblateLM`` built): a rerun must load the model to measure it
    again, once."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    lines = (out / "measurements.jsonl").read_text().splitlines(keepends=True)
    (out / "measurements.jsonl").write_text("".join(lines[:-1]))
    loads: list[int] = []
    original = HFHeadAblateLM.__init__
    monkeypatch.setattr(HFHeadAblateLM, "__init__",
                        lambda self, *a, **k: loads.append(1) or original(self, *a, **k))
    return loads


def load_lm(folder: Path, **model_args):
    """hf-headablate on a tiny model folder, float32 on the CPU, batch size 4."""
    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    return HFHeadAblateLM(pretrained=str(folder), **{"dtype": "float32", "device": "cpu",
                                                     "batch_size": 4, **model_args})


def with_chat_template(model_dir: Path, folder: Path) -> Path:
    """A copy of a tiny model whose tokenizer has a chat template."""
    import shutil

    shutil.copytree(model_dir, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}"
                               "</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:"
                               "{% endif %}")
    config_file.write_text(json.dumps(config))
    return folder


# --- the command line, in this process ----------------------------------------------------

def harness(*args: str) -> int:
    """``headloc-harness ARGS`` in this process: its exit status (argparse's own too)."""
    from lm_eval_headloc.cli.main import main

    try:
        return main([*args])
    except SystemExit as exit_:
        return exit_.code


class ShownBars(list):
    """``shown_bars``' list of (desc, n, total), and ``drawn``: what each bar wrote."""

    drawn: list[str]


@contextmanager
def shown_bars(monkeypatch):
    """The progress bars a command run inside the block shows, as (desc, n, total) each
    once it has closed (drawn into a StringIO, not the terminal; its text in the list's
    ``drawn``, in the same order)."""
    import io

    import tqdm as tqdm_module

    bars: list = []

    class Recorded(tqdm_module.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})
            if not self.disable:  # shown (close() disables it later)
                bars.append(self)

    real = tqdm_module.tqdm
    shown = ShownBars()
    monkeypatch.setattr(tqdm_module, "tqdm", Recorded)
    try:
        yield shown
    finally:
        # A module first imported during the run bound Recorded as its tqdm: later tests
        # in this process drew lm-eval's bars into a StringIO (test_measure's verbose one).
        for module in list(sys.modules.values()):
            if getattr(module, "tqdm", None) is Recorded:
                module.tqdm = real
        shown += [(bar.desc, bar.n, bar.total) for bar in bars]
        shown.drawn = [bar.fp.getvalue() for bar in bars]


def tiny_args(folder) -> list[str]:
    """The model and task options of a command on the tiny model in ``folder``."""
    return ["--model-args", f"pretrained={folder},dtype=float32", "--include-path", TASKS]


#: locate's ranking from the masks' Lasso alone (before --confirm and --prior auto).
LASSO_ONLY = ["--prior", "none", "--confirm", "0"]


def last_error(capsys) -> str:
    """The last line a command printed to stderr (there must be one)."""
    err = capsys.readouterr().err.strip().splitlines()
    assert err, "no error message"
    return err[-1]


def error_line(capsys) -> str:
    """The one line a refused command prints (and checks that it is one line)."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("headloc-harness: error: "), lines[0]
    return lines[0]


# --- errors: their class and the values they name, not their wording ----------------------

def assert_names(message: str, *values: str) -> None:
    """``message`` names each of ``values`` (plain substrings: the user's bad input, what is
    allowed), whatever words are around them."""
    for value in values:
        assert value in message, f"{value!r} not in {message!r}"


@contextmanager
def raises_naming(error: type[BaseException], *values: str):
    """The block raises ``error`` whose message names each of ``values`` (not its wording)."""
    with pytest.raises(error) as caught:
        yield caught
    assert_names(str(caught.value), *values)


def _imported(folder: Path, name: str):
    """Module ``name`` imported with ``folder`` on sys.path for the import alone."""
    import importlib

    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(folder))


def bench_module(name: str = ""):
    """The benchmarks' module ``headloc_bench.<name>`` (benchmarks/headloc_bench/<name>.py),
    or without a name the package itself. Once the package is imported, its modules import
    by name through it."""
    return _imported(BENCHMARKS, ".".join(filter(None, ("headloc_bench", name))))


def unpacked_benchmarks(folder: Path) -> Path:
    """The committed run folders (benchmarks/'s archives) unpacked into ``folder``
    (``bench_store.unpack``), laid out as ``bench_store`` names them (``exhaustive/``,
    ``recovery-runs/<task>/...``); the test is skipped where there are no archives."""
    import pytest

    store = bench_module("bench_store")
    if not store.archives():
        pytest.skip("not a checkout with the committed runs")
    return store.unpack(folder)


def script_module(name: str):
    """``scripts/<name>.py`` imported as a module (the scripts are not a package), or a
    benchmark's (``bench_store``, ``refit_committed``): its ``bench_module``."""
    if (BENCHMARKS / "headloc_bench" / f"{name}.py").is_file():
        return bench_module(name)
    return _imported(SCRIPTS, name)


#: Seconds a stopped run pauses after each measurement it writes (``stopped_part_way``).
PAUSE = 0.25


def stopped_part_way(args: list[str], out: Path, after: int, stop: int,
                     seconds: float = 120, fresh: bool = False) -> int:
    """Run ``headloc-harness args --out out`` in a child process, send it the signal
    ``stop`` (SIGKILL, SIGINT) once ``after`` measurements are on disk; the measurements it
    left. The child is a fork of this process, which has imported what the command needs
    (a new interpreter spends seconds on it), or a new interpreter: with ``fresh`` (a fork
    of a process that runs Ray would share its connections), and where this process runs
    torch on several threads (a forked child hangs in the OpenMP pool it inherits; torch
    on one thread never enters it, and xdist's workers run on one, conftest.py)."""
    import torch

    # Each measurement's line is followed by a pause, so that the stop lands before the next
    # one: a tiny model measures in milliseconds, faster than this loop looks (it once
    # finished the run before the kill).
    log = out / "measurements.jsonl"
    fork = not fresh and torch.get_num_threads() == 1
    child = _forked_child(args, out) if fork else _fresh_child(args, out)
    deadline = time.time() + seconds
    while time.time() < deadline and child.poll() is None:
        if log.is_file() and len(log.read_text().splitlines()) >= after:
            child.send_signal(stop)
            break
        time.sleep(0.02)
    child.wait(timeout=seconds)
    return len(log.read_text().splitlines())


# SIGINT as a terminal user's process has it: a child inherits an ignored or blocked SIGINT
# from this process (a library earlier in the suite may leave it so), and then a SIGINT
# stop would do nothing.
_PAUSED_RUN = ("import signal, sys, time; "
               "signal.signal(signal.SIGINT, signal.default_int_handler); "
               "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT}); "
               "from lm_eval_headloc.runs.folder import RunFolder; "
               "append = RunFolder.append_measurement; "
               "RunFolder.append_measurement = lambda self, record: "
               f"(append(self, record), time.sleep({PAUSE})); "
               "from lm_eval_headloc.cli.main import main; ")


def _fresh_child(args: list[str], out: Path) -> subprocess.Popen:
    code = _PAUSED_RUN + f"sys.exit(main({args!r} + sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", code, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _ForkedChild:
    """A forked child, waited for as ``subprocess.Popen`` waits."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        deadline = time.time() + timeout
        while self.poll() is None:
            if time.time() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise subprocess.TimeoutExpired(f"fork {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


def _forked_child(args: list[str], out: Path) -> _ForkedChild:
    for stream in (sys.stdout, sys.stderr):  # nothing buffered here is written twice
        stream.flush()
    pid = os.fork()
    if pid:
        return _ForkedChild(pid)
    code = 1
    try:  # the child: its output goes nowhere, and it leaves without pytest's clean-up
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)
        sys.stdout = sys.stderr = open(os.devnull, "w")
        from tqdm import tqdm
        from tqdm.std import TqdmDefaultWriteLock

        # tqdm's monitor thread (not forked) may have held the bars' lock at the fork.
        tqdm.set_lock(TqdmDefaultWriteLock())
        scope = {"__name__": "stopped_part_way"}
        exec(_PAUSED_RUN, scope)
        code = scope["main"]([*args, "--out", str(out)])
    except BaseException:  # SystemExit and KeyboardInterrupt included
        pass
    finally:
        os._exit(code if isinstance(code, int) else 1)


# --- a model several tests share -----------------------------------------------------------

#: The prompt a shared model's answers are compared on (``as_loaded``, ``put_back``).
PROBE_PROMPT = "When Mary and John went to the store, John gave a drink to"


def last_logits(lm):
    """The next-token logits of hf-headablate ``lm`` after PROBE_PROMPT."""
    import torch

    with torch.no_grad():
        return lm._model_call(lm.tok_batch_encode([PROBE_PROMPT])[0])[0, -1]


def _settings(lm) -> dict:
    """What a test can change on hf-headablate ``lm`` other than its weights. The hooks
    counted are neither its own knockout's (installed once, the MLP's at the first neuron)
    nor transformers' (which records attention weights through hooks it installs at the
    first ``output_attentions=True`` and keeps): both are idle outside the passes that use
    them."""
    model = lm.model
    own = sum(len(site.handles) for site in lm.knockout._sites.values())
    hooks = [hook for m in model.modules()
             for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values())]
    theirs = sum(getattr(hook, "__module__", "").startswith("transformers.") for hook in hooks)
    return {"knocked out": lm.knocked_out, "override": lm._override is not None,
            "ablation": lm.ablation, "scale": lm.scale, "batch size": lm.batch_size,
            "response cache": lm._cache_db is not None, "training": model.training,
            "attention": model.config._attn_implementation,
            "hooks": len(hooks) - own - theirs}


def as_loaded(lm) -> dict:
    """hf-headablate ``lm`` as it is now (its weights copied), for ``put_back``."""
    return {"settings": _settings(lm), "logits": last_logits(lm),
            "weights": {name: t.detach().clone() for name, t in lm.model.state_dict().items()}}


def put_back(lm, loaded: dict) -> list[str]:
    """Put ``lm`` back as ``loaded`` (``as_loaded``'s) was: no head or neuron knocked out,
    its ablation kind, scale and batch size, eval mode, the weights as loaded (where a test
    edited them by hand). Returns what still differs: settings, hooks left on its modules,
    or answers to PROBE_PROMPT other than the loaded model's (empty: as loaded)."""
    import torch

    settings = loaded["settings"]
    lm.set_heads([])
    if lm.ablation != settings["ablation"]:
        lm.set_ablation(settings["ablation"])
    lm.scale, lm.batch_size_per_gpu = settings["scale"], settings["batch size"]
    lm.model.train(settings["training"])
    with torch.no_grad():
        for name, tensor in lm.model.state_dict().items():
            if not torch.equal(tensor, loaded["weights"][name]):
                tensor.copy_(loaded["weights"][name])
    now = _settings(lm)
    differ = [f"{name}: {now[name]!r}, loaded {value!r}" for name, value in settings.items()
              if now[name] != value]
    if not torch.equal(last_logits(lm), loaded["logits"]):
        differ.append(f"its answer to {PROBE_PROMPT!r} is not the loaded model's")
    return differ


# --- what a run writes ----------------------------------------------------------------------

def strict_json(path: Path):
    """json.loads that refuses NaN/Infinity, as any strict JSON parser does."""
    def refuse(name):
        raise ValueError(f"{path} holds {name}, which is not JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def measurement_lines(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "measurements.jsonl").read_text().splitlines()]


def read_run(folder: Path) -> tuple[list[dict], dict]:
    return measurement_lines(folder), strict_json(folder / "heads.json")


def assert_same_run(resumed: Path, full: Path) -> None:
    """The same measurements (timings aside) and the same ranking."""
    resumed_records, resumed_heads = read_run(resumed)
    full_records, full_heads = read_run(full)
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in resumed_records]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in full_records]
    assert resumed_heads == full_heads


def measurements_by_key(folder):
    """A run's measurements as ``{key: (mask, scores)}`` (no key measured twice)."""
    lines = (folder / "measurements.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    keys = [r["key"] for r in records]
    assert len(keys) == len(set(keys)), "a mask key was measured twice"
    return {r["key"]: (r["mask"], r["scores"]) for r in records}


def assert_same_run_by_key(a, b):
    """The same measurements per mask key in any order (scores to float round-off, as
    workers' batches may differ), the same design and the same top-k."""
    assert measurements_by_key(a).keys() == measurements_by_key(b).keys()
    for key, (mask, scores) in measurements_by_key(a).items():
        other_mask, other_scores = measurements_by_key(b)[key]
        assert mask == other_mask
        assert scores == pytest.approx(other_scores, rel=1e-5, abs=1e-6), key
    assert np.array_equal(np.load(a / "design_matrix.npy"), np.load(b / "design_matrix.npy"))
    heads = [json.loads((f / "heads.json").read_text())["top_k"] for f in (a, b)]
    assert heads[0] == heads[1]


#: The --workers tests' locate run (options after the model's).
WORKERS_LOCATE = ["--tasks", "tiny_copy_ppl", "--masks", "10", "--sparsity", "0.25",
                  "--num-samples", "6", "--confirm", "3"]


# --- run folders written by hand ----------------------------------------------------------

def finished_run(folder: Path, model_dir: Path, task: str, heads: tuple[str, ...],
                 model_args: str | None = None, seed: int = 0) -> Path:
    """A finished-looking locate run written by hand (config.json and heads-<task>.json,
    no model needed to make it), for verify and cross to read. ``heads`` may name MLP
    neurons (L1N5): the run then located them (``--components``), and its ranking holds
    ``{"neuron": …}`` records, as locate writes them."""
    from lm_eval_headloc.intervention.components import Neuron, parse_components
    from lm_eval_headloc.runs.spec import RunSpec

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
    (folder / f"heads-{task}.json").write_text(json.dumps({"higher_is_better": True, "heads": [
        {"rank": r, "neuron" if isinstance(c, Neuron) else "head": name}
        for r, (name, c) in enumerate(zip(heads, ranked, strict=True), start=1)]}))
    return folder


def fake_run(folder: Path, model_dir: Path) -> Path:
    """``finished_run`` of tiny_copy on the tiny model in ``model_dir``, ranking six of its
    eight heads (L1H2 first)."""
    return finished_run(folder, model_dir, "tiny_copy",
                        ("L1H2", "L0H0", "L0H3", "L1H0", "L0H1", "L1H1"))


def write_heads(folder: Path, task: str, heads: list[str], model_args: str = "m",
                effects: list[float] | None = None, tied: tuple[str, ...] = (),
                components: str = "heads") -> Path:
    """A run folder of ``task``'s ranking alone (config.json and heads-<task>.json), for
    the commands that compare rankings (universal, overlap)."""
    from lm_eval_headloc.runs.spec import RunSpec

    folder.mkdir(parents=True, exist_ok=True)
    spec = RunSpec(model_args=model_args, tasks=(task,), components=components)
    (folder / "config.json").write_text(json.dumps({
        "command": "locate", "identity": spec.identity("locate"), "spec": spec.as_config(),
        "settings": {}}))
    effects = [-0.1] * len(heads) if effects is None else effects
    (folder / f"heads-{task}.json").write_text(json.dumps(
        {"higher_is_better": True,
         "heads": [{"head": h, "effect": e} | ({"tied_with_above": True} if h in tied else {})
                   for h, e in zip(heads, effects, strict=True)]}))
    return folder


#: Ranking files altered by hand, as ``tamper(path)`` does them, each with what its refusal
#: names: one check reads them all (``read_ranking_file``, read_rankings' own), where
#: overlap and universal counted a head named twice twice (an overlap of 1.0 where it was
#: 0.8), took an effect "abc" and a higher_is_better "no" on trust, and ended a help of "x"
#: in a traceback. A ranking ranks every component the run did not exclude, so an empty
#: ``heads`` is no ranking either (refused, not read as ranking nothing).
TAMPERED_RANKINGS = {
    "a head twice": (lambda data: data["heads"][4].update(head=data["heads"][0]["head"]),
                     ("twice",)),  # its 5th named as its 1st
    "heads missing": (lambda data: data.pop("heads"), ("heads",)),
    "effect text": (lambda data: data["heads"][0].update(effect="abc"), ("effect",)),
    "higher_is_better text": (lambda data: data.update(higher_is_better="no"),
                              ("higher_is_better", "'no'")),
    "help text": (lambda data: data.update(largest_single_help={"head": "L0H1",
                                                                "change": "x"}),
                  ("largest_single_help", "change")),
    "heads empty": (lambda data: data.update(heads=[]), ("heads",)),
}


def without_waiting_on(fifo: Path, call, seconds: float = 20):
    """What ``call()`` returns, or the exception it raises (returned, not raised), called in
    a thread: a call that opens the FIFO ``fifo`` blocks until the other end is opened, so
    one still running after ``seconds`` fails the test, once a writer that closes at once
    has let it go."""
    import threading

    outcome: list = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as err:  # noqa: BLE001 (handed to the test's thread)
            outcome.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    hung = thread.is_alive()
    if hung:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=seconds)
    assert not hung, f"{call} waited on the FIFO {fifo}"
    return outcome[0]


def tamper(path: Path, how: str) -> None:
    """Alter the ranking file at ``path`` as ``TAMPERED_RANKINGS[how]`` says."""
    data = json.loads(path.read_text())
    TAMPERED_RANKINGS[how][0](data)
    path.write_text(json.dumps(data))


#: A 2-layer x 3-head ranking (``ranking``'s), most harmful first (higher is better: a
#: negative effect hurts). L0H2 has no effect; L1H2 is left out of the ranking (as
#: --exclude leaves it).
RANKED = [("L0H0", -0.5), ("L1H0", -0.125), ("L1H1", 0.0), ("L0H1", 0.25), ("L0H2", None)]
RANKED_HEADS_PER_LAYER = 3


def ranking(task: str = "toy", higher_is_better: bool = True,
            entries: list | None = None) -> dict:
    """A heads-<task>.json as locate writes it (the fields export reads, and some it
    does not)."""
    heads = entries if entries is not None else [
        {"rank": rank, "head": name, "layer": int(name[1]), "head_in_layer": int(name[3]),
         "effect": effect, "selected": 1.0, "measured_alone": effect is not None}
        for rank, (name, effect) in enumerate(RANKED, start=1)]
    return {"task": task, "metric": "acc,none", "higher_is_better": higher_is_better,
            "baseline": 0.75, "heads_per_layer": RANKED_HEADS_PER_LAYER,
            "top_k": ["L0H0", "L1H0"],
            "confirmed": ["L0H0", "L1H0", "L1H1", "L0H1"], "tied_with_above": [],
            "same_masks": {}, "largest_single_help": {"head": "L0H1", "change": 0.25},
            "heads": heads}


# --- lm-eval's own evaluation and requests ------------------------------------------------

def per_sample_loglikelihoods(results: dict) -> list[float]:
    """Every choice's loglikelihood, sample by sample, flattened."""
    return [float(r[0]) for s in results["samples"]["tiny_choice"] for r in s["filtered_resps"]]


def simple_evaluate(model_args: str | None = None, model=None, **kwargs) -> dict:
    """lm-eval's ``simple_evaluate`` of tiny_choice (samples logged) on hf-headablate with
    ``model_args``, or on ``model``."""
    import lm_eval

    from lm_eval_headloc.tasks import make_task_manager

    # The package's manager is kept per process: indexing lm-eval's tasks takes seconds.
    return lm_eval.simple_evaluate(
        model=model if model is not None else "hf-headablate", model_args=model_args,
        tasks=["tiny_choice"], task_manager=make_task_manager([TASKS]),
        log_samples=True, **kwargs,
    )


#: Masks several of which go through one forward pass (test_multimask, test_ablation).
MASKS = ["L0H1", "", "L0H0+L1H3", "L1H*", "L0H2+L1H1", "L0H3"]


def open_measurement(manager, lm, tasks, num_samples=10, **kwargs):
    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    return HarnessMeasurement(lm, tasks=[(name, None) for name in tasks],
                              loaded_tasks={name: manager.load([name]) for name in tasks},
                              num_samples=num_samples, seed=0, **kwargs)


class Request:  # what HFLM.loglikelihood reads of lm-eval's Instance
    def __init__(self, args):
        self.args = args


def tiny_task_docs(task: str) -> list[dict]:
    """The test documents of one of tests/tasks' tiny tasks, from its own utils.py
    (``tiny_copy``'s variants share tiny_copy's)."""
    import importlib.util

    folder = "tiny_copy" if task.startswith("tiny_copy") or task == "tiny_generate" else task
    spec = importlib.util.spec_from_file_location(f"{folder}_utils",
                                                  Path(TASKS) / folder / "utils.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.load_docs()["test"])


GENERATION_TASK = "tiny_generate_stops"  # stops ["J", "V", "ry"]: rows end after different steps
GENERATION_MASKS = ["", "L0H1", "L0H0+L1H3", "L1H*", "L0H2+L1H1"]


def open_generation_measurement(manager, lm, tasks=(GENERATION_TASK,), **kwargs):
    """Every test document of ``tasks`` (tiny_generate_stops by default) measured."""
    return open_measurement(manager, lm, tasks, num_samples=None, **kwargs)


def lm_evals_own(lm, instances, heads, rows, monkeypatch):
    """lm-eval's ``generate_until`` with ``heads`` knocked out, its own stopping criteria
    (``MultiTokenEOSCriteria``: a batch ends when one stop string is in every row) and
    ``rows`` requests per batch: what one mask alone gets from the stock harness."""
    from lm_eval.models.huggingface import HFLM

    import lm_eval_headloc.intervention.multigen as multigen

    with monkeypatch.context() as patch:
        patch.setattr(multigen, "stops_per_row", lambda *_: False)
        patch.setattr(lm, "batch_size_per_gpu", rows)
        with lm.knocking_out(heads):
            return HFLM.generate_until(lm, list(instances), disable_tqdm=True)


def with_stops_that_end_rows(lm, instances, monkeypatch, every_row=False):
    """``instances`` generating until strings that this random model writes in some rows,
    after a different number of tokens (what each family writes differs, so the stop
    strings are read off its own answers): leaving a row or more to run to max_gen_toks
    where the answers allow, or (``every_row``) ending every row, no one string in all."""
    from lm_eval.api.instance import Instance

    def until(stops):
        return [Instance("generate_until", doc=i.doc, idx=i.idx,
                         arguments=(i.args[0], {**i.args[1], "until": stops}))
                for i in instances]

    texts = lm_evals_own(lm, until([]), [], len(instances), monkeypatch)
    rows_with: dict[str, set[int]] = {}
    for row, text in enumerate(texts):
        for start in range(len(text)):
            for end in range(start + 1, min(len(text), start + 4) + 1):
                if "\ufffd" not in text[start:end]:  # a byte left over, not a character
                    rows_with.setdefault(text[start:end], set()).add(row)
    everyone = set(range(len(texts)))
    most = len(texts) if every_row else len(texts) - 1  # rows the stops may cover
    stops, covered = [], set()
    for stop, rows in sorted(rows_with.items(), key=lambda item: (-len(item[1]), item[0])):
        if len(stops) < 6 and rows != everyone and rows - covered \
                and len(covered | rows) <= most:
            stops.append(stop)
            covered |= rows
    if not stops:  # the same string in every answer: it ends them at different steps
        stops = [min(rows_with, key=lambda stop: (-len(rows_with[stop]), stop))]
    assert not every_row or covered == everyone, (texts, stops)
    return until(stops)


def capped_fall(entry: dict, data: dict) -> float:
    """An entry's fall as the export scores it, read here from the ranking file on its
    own: measured alone, its fall; an estimate's, no more than the harm of a group test
    that knocked it out with the help of its members measured alone to help added back,
    or 0 where that did not hurt (a test that helped by more than the one-sided 95 % noise
    margin caps nothing), and a harm no more than just under
    (float32) the least harm measured alone, which the ranking puts first."""
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.95)
    sign = -1 if data["higher_is_better"] else 1
    fall = sign * entry["effect"]
    if entry.get("measured_alone") is True:
        return fall
    # The falls of the heads measured alone: a member's help hides as much harm of the
    # others, so a set's harm counts it back (the file keeps no error for them).
    alone = {e["head"]: sign * e["effect"] for e in data["heads"]
             if e.get("measured_alone") is True and e["effect"] is not None}
    for test in (data.get("certificate") or {}).get("group_tests", []):
        harm = sign * test["change"] + 0.0
        if entry["head"] in test["components"] and not harm < -z * (test.get("se") or 0.0):
            hidden = sum(-alone[h] for h in test["components"] if alone.get(h, 0.0) < 0)
            fall = min(fall, max(harm + hidden, 0.0))
    hurting = [sign * e["effect"] for e in data["heads"] if e.get("measured_alone") is True
               and e["effect"] is not None and sign * e["effect"] > 0]
    if hurting and fall > 0:
        fall = min(fall, float(np.nextafter(np.float32(min(hurting)), np.float32(-np.inf))))
    return fall
