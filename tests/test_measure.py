"""``HarnessMeasurement``: the examples it uses, its batch size, masks per pass, the models
whose loglikelihoods only HFLM computes right, and the tasks it gives a chat template."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import TASKS, Request, load_lm

from lm_eval_headloc.intervention.components import parse_heads
from lm_eval_headloc.intervention.multimask import RecordingLM, ReplayLM, loglikelihoods_for_masks
from lm_eval_headloc.measurement.measure import HarnessMeasurement
from lm_eval_headloc.runs import setup as engine
from lm_eval_headloc.runs.spec import RunSpec

BOTH = ["tiny_copy_ppl", "tiny_choice"]
DOCS = {"tiny_choice": 4, "tiny_copy_ppl": 12}  # as tests/tasks/*/utils.py define them


def open_measurement(manager, lm, tasks=BOTH, **options):
    return HarnessMeasurement(lm, tasks=[(name, None) for name in tasks],
                              loaded_tasks={name: manager.load([name]) for name in tasks},
                              seed=0, **options)


@pytest.fixture(scope="module")
def llama_lm(tiny_model_dir):
    return load_lm(tiny_model_dir("llama"))


@pytest.mark.parametrize(("options", "expected"), [
    ({"num_samples": 10}, {"tiny_choice": 4, "tiny_copy_ppl": 10}),  # fewer docs: all
    ({"num_samples": 100}, DOCS),
    ({"num_samples": None}, DOCS),
    ({"limit": 0.5}, {"tiny_choice": 2, "tiny_copy_ppl": 6}),  # a fraction, rounded up
    ({"limit": 7}, {"tiny_choice": 4, "tiny_copy_ppl": 7}),
])
def test_examples_used_per_leaf_task(task_manager, llama_lm, options, expected):
    measurement = open_measurement(task_manager, llama_lm, **options)
    assert measurement.examples_used == expected
    # lm-eval's own count of the documents it evaluated agrees.
    results = measurement.evaluate([], model=RecordingLM(llama_lm))
    assert {task: n["effective"] for task, n in results["n-samples"].items()} == expected


def test_auto_batch_size_is_lm_evals_detection_on_the_widest_request(
        tiny_model_dir, task_manager, llama_lm, monkeypatch):
    lm = load_lm(tiny_model_dir("llama"), batch_size="auto:4", max_batch_size=6)
    assert lm.batch_size == "auto"
    measurement = open_measurement(task_manager, lm, num_samples=10)
    detected, passes = [], []  # passes: (input shape, made by the detection?)
    detect, call = lm._detect_batch_size, lm._model_call
    detecting = [False]

    def spy_detect(requests=None, pos=0):
        detecting[0] = True
        detected.append(detect(requests, pos))
        detecting[0] = False
        return detected[-1]

    def spy_call(inps, *args, **kwargs):
        passes.append((tuple(inps.shape), detecting[0]))
        return call(inps, *args, **kwargs)

    monkeypatch.setattr(lm, "_detect_batch_size", spy_detect)
    monkeypatch.setattr(lm, "_model_call", spy_call)
    masks = [[], parse_heads("L0H1+L1H2", 2, 4), parse_heads("L1H*", 2, 4)]
    first = measurement.measure_many(masks[:1])
    again = measurement.measure_many(masks[1:], masks_per_pass=2)
    assert detected == [6]  # on a CPU nothing runs out of memory: max_batch_size; once
    probes = [shape for shape, probe in passes if probe]
    used = [shape for shape, probe in passes if not probe]
    # 18 requests (4 x 2 choices + 10): 6 rows per mask in each pass, 2 masks per pass.
    assert [rows for rows, _ in used] == [6, 6, 6, 12, 12, 12]
    # The probe is as wide as the widest batch sent, not max_length (128) wide.
    widest = max(width for _, width in used)
    assert widest < llama_lm.max_length == 128
    assert {width for _, width in probes} == {widest}
    # Scores equal HFLM's own at a fixed batch size.
    fixed = open_measurement(task_manager, llama_lm, num_samples=10)
    for heads, scores in zip(masks, first + again, strict=True):
        expected = fixed.measure_with_model(heads)
        for task in expected:
            assert scores[task].value == pytest.approx(expected[task].value, rel=1e-5)


def test_auto_batch_size_of_generation_is_probed_with_the_widest_prompt_once(
        tiny_model_dir, task_manager, llama_lm, monkeypatch):
    """HFLM's generate_until would probe rows of max_length tokens on every call (minutes
    on a CPU for SmolLM2, out of memory at 8B); the measurement probes once, with the
    widest prompt plus the tokens a request may generate, from at most as many rows as
    there are requests."""
    lm = load_lm(tiny_model_dir("llama"), batch_size="auto")
    measurement = open_measurement(task_manager, lm, tasks=["tiny_generate"], num_samples=10)
    detected, starts, generated = [], [], []
    detect, generate = lm._detect_batch_size, lm._model_generate

    def spy_detect(requests=None, pos=0):
        assert requests is not None, "probed with max_length-wide rows"
        starts.append(lm.max_batch_size)
        detected.append((requests[pos], detect(requests, pos)))
        return detected[-1][1]

    def spy_generate(context, *args, **kwargs):
        generated.append(context.shape[0])
        return generate(context, *args, **kwargs)

    monkeypatch.setattr(lm, "_detect_batch_size", spy_detect)
    monkeypatch.setattr(lm, "_model_generate", spy_generate)
    masks = [[], parse_heads("L0H1+L1H2", 2, 4), parse_heads("L1H*", 2, 4)]
    scores = [measurement.measure_with_model(heads) for heads in masks]
    assert len(detected) == 1 and starts == [10]  # once; 10 requests, not 64 rows
    (_, prompt, continuation), rows = detected[0]
    contexts = [i.args[0] for i in measurement.recorded_instances()]
    assert prompt == max((lm.tok_encode(c) for c in contexts), key=len)
    assert len(continuation) == 3 + 1  # tiny_generate's max_gen_toks, and the first token
    assert rows == 10 and generated == [10, 10, 10]  # one generate call per measurement
    assert lm.batch_size == "auto"  # restored after each measurement
    # Scores equal the same measurement at a fixed batch size.
    fixed = open_measurement(task_manager, llama_lm, tasks=["tiny_generate"], num_samples=10)
    for heads, got in zip(masks, scores, strict=True):
        assert got["tiny_generate"].value == fixed.measure_with_model(heads)[
            "tiny_generate"].value


def test_auto_masks_per_pass_is_sized_from_the_batches_sent(task_manager, llama_lm,
                                                            monkeypatch):
    measurement = open_measurement(task_manager, llama_lm, num_samples=10)
    assert measurement.auto_masks_per_pass() == 1  # a CPU
    passes, scored = [], []
    call = llama_lm._model_call
    monkeypatch.setattr(llama_lm, "_model_call", lambda inps, *args, **kwargs: (
        passes.append(tuple(inps.shape)) or call(inps, *args, **kwargs)))
    head = llama_lm.model.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, i, out: scored.append(out.shape[1]))
    try:
        measurement.measure_many([[]])
    finally:
        handle.remove()
    assert len(passes) == len(scored) == math.ceil(18 / 4)
    # Per mask copy of a (rows R, width W, S scored tokens) pass of the tiny Llama
    # (hidden 32, MLP 64, 2 layers, 4 heads of 8, 2 K/V heads, vocab 300, float32):
    #   activations R*W*(6*32 + 3*64)*4 = 1536*R*W;  K/V cache R*W*2*2*2*8*4 = 256*R*W
    #   attention R*4*W*W*4 = 16*R*W*W;  logits S*300*(4 + 8) = 3600*S
    need = max(1792 * r * w + 16 * r * w * w + 3600 * s
               for (r, w), s in zip(passes, scored, strict=True))
    monkeypatch.setattr(llama_lm, "_device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need * 5, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    assert measurement.auto_masks_per_pass() == 5
    # Blocks the allocator caches unused are this process's to reuse: they count as free.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2 * need * 3, 0))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 2 * need * 2 + 7)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 7)
    assert measurement.auto_masks_per_pass() == 5
    monkeypatch.setattr(HarnessMeasurement, "loglikelihood_only", property(lambda s: False))
    assert measurement.auto_masks_per_pass() == 1  # masks are measured one at a time


def test_prompt_tuning_adapter_answers_through_hflm(tiny_model_dir, task_manager, tmp_path):
    from peft import PromptTuningConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir("llama")
    torch.manual_seed(1)  # the virtual tokens start random
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(folder),
                             PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    adapter.save_pretrained(tmp_path / "adapter")
    lm = load_lm(folder, peft=str(tmp_path / "adapter"))
    measurement = open_measurement(task_manager, lm, num_samples=6)
    assert not measurement.scored_positions
    masks = [[], parse_heads("L0H1+L1H2", 2, 4)]
    measured = measurement.measure_many(masks, masks_per_pass=2)
    # HFLM's own answers to the recorded requests, scored by lm-eval.
    recorder = RecordingLM(lm)
    measurement.evaluate([], model=recorder)
    values = []
    for heads, scores in zip(masks, measured, strict=True):
        lm.set_heads(heads)
        answers = lm.loglikelihood([Request(r) for r in recorder.requests],
                                   disable_tqdm=True)
        replay = ReplayLM(lm, dict(zip(recorder.requests, answers, strict=True)))
        expected = measurement.evaluate(heads, replay)["results"]
        assert scores["tiny_copy_ppl"].value == pytest.approx(
            expected["tiny_copy_ppl"]["perplexity,none"], rel=1e-6)
        assert scores["tiny_choice"].value == pytest.approx(
            expected["tiny_choice"]["acc,none"], rel=1e-6)
        values.append(scores["tiny_copy_ppl"].value)
    assert values[0] != values[1]  # the mask matters
    with pytest.raises(ValueError, match="prompt-learning"):
        loglikelihoods_for_masks(lm, recorder.requests, masks)
    # And the adapter matters: the bare model's perplexity differs.
    bare = open_measurement(task_manager, load_lm(folder), num_samples=6)
    assert bare.measure_many(masks[:1])[0]["tiny_copy_ppl"].value != pytest.approx(
        values[0], rel=1e-3)


def test_each_prompt_template_is_compiled_once_across_measurements(task_manager, llama_lm,
                                                                   monkeypatch):
    """lm-eval compiles a task's Jinja template for every document in every measurement;
    inside ours each template string is compiled once, and the scores are the same."""
    from jinja2 import Environment
    from lm_eval import utils

    from lm_eval_headloc.measurement import harness
    from lm_eval_headloc.measurement import measure as measure_module

    harness._compiled.cache_clear()
    compiled: list[str] = []
    from_string = Environment.from_string

    def counting(env, source, *args, **kwargs):
        compiled.append(source)
        return from_string(env, source, *args, **kwargs)

    monkeypatch.setattr(Environment, "from_string", counting)
    measurement = open_measurement(task_manager, llama_lm, tasks=["tiny_choice"])
    compiled.clear()  # loading the task renders its first document (lm-eval's checks)
    masks = [parse_heads("L0H1"), parse_heads("L1H0+L1H2")]
    ours = measurement.measure_many(masks)
    templates = set(compiled)
    assert templates == {"{{question}}", "{{choices}}", "{{answer}}"}
    assert len(compiled) == len(templates)  # lm-eval alone: once per document and use
    assert utils.apply_template is not harness._apply_template  # put back

    # lm-eval's own apply_template, compiling every time, scores alike.
    monkeypatch.setattr(measure_module, "templates_compiled_once", contextlib.nullcontext)
    compiled.clear()
    assert measurement.measure_many(masks) == ours
    assert len(compiled) > 4 * len(masks) * len(templates)


def test_a_measurement_shows_none_of_lm_evals_progress_bars_unless_verbose(
        task_manager, llama_lm, capsys):
    """lm-eval draws a bar per measurement while it builds the requests, tokenizes and
    scores them (hundreds in a run): a quiet measurement draws none and puts lm-eval's
    own ``tqdm`` back after; a verbose one shows them."""
    import importlib

    from lm_eval_headloc.measurement.harness import _HARNESS_TQDM_MODULES

    modules = [importlib.import_module(name) for name in _HARNESS_TQDM_MODULES]
    before = [module.tqdm for module in modules]
    masks = [parse_heads("L0H1")]
    capsys.readouterr()
    open_measurement(task_manager, llama_lm, tasks=["tiny_choice"]).measure_many(masks)
    quiet = capsys.readouterr().err
    assert "it/s]" not in quiet and "%|" not in quiet, quiet
    assert [module.tqdm for module in modules] == before
    open_measurement(task_manager, llama_lm, tasks=["tiny_choice"],
                     verbose=True).measure_many(masks)
    shown = capsys.readouterr().err
    assert "%|" in shown  # the same measurement, lm-eval's bars drawn


# --- the chat template --------------------------------------------------------------------

def test_chat_template_goes_to_generation_tasks_when_the_model_has_one(tiny_model_dir):
    from types import SimpleNamespace

    from lm_eval_headloc.measurement.measure import HarnessMeasurement

    setup = engine.prepare(RunSpec(model_args=f"pretrained={tiny_model_dir('llama')},"
                                              "dtype=float32",
                                   tasks=("swear", "tiny_copy"), include_path=(TASKS,)))
    with_template = SimpleNamespace(tokenizer=SimpleNamespace(chat_template="{{ x }}"))
    without = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=None))

    def chat(lm, override=None):
        return HarnessMeasurement(lm, setup.tasks, setup.loaded, num_samples=2,
                                  apply_chat_template=override).chat_template

    assert chat(with_template) == {"swear": True, "tiny_copy": False}
    assert chat(without) == {"swear": False, "tiny_copy": False}
    assert chat(with_template, override=False) == {"swear": False, "tiny_copy": False}
    assert chat(without, override=True) == {"swear": True, "tiny_copy": True}
