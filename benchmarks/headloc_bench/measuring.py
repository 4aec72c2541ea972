"""One measurement timed three ways, and the timing helpers the measurement benchmarks share.

The three ways (``bench_task``): **reference**, what the paper's released code does per mask
(a fresh ``hf-headablate`` model from disk with the mask, then ``lm_eval.simple_evaluate``
at batch size 1); **ours**, ``headloc-harness``'s measurement on the loaded model; and
**limit**, the token batches ours sent to the model (recorded from one ours call) replayed
through the bare model under the same mask. ``bench_measure`` (BENCH.md's head and its GPU
section), ``bench_scale`` (``bench_measure.py --config``) and ``bench_generation`` import
them from here.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lm_eval_headloc.intervention import multimask
from lm_eval_headloc.intervention.components import Head, format_heads
from lm_eval_headloc.measurement.harness import quiet_harness
from lm_eval_headloc.measurement.metrics import task_score
from lm_eval_headloc.runs.plan import open_measurement
from lm_eval_headloc.runs.setup import Setup

# --- timing helpers ---------------------------------------------------------------------

@dataclass
class Timing:
    """Seconds of each repetition of one way of measuring."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds) if self.seconds else float("nan")

    def cell(self) -> str:
        if not self.seconds:
            return "not run"
        return (f"{self.median:.3f} ({min(self.seconds):.3f}–{max(self.seconds):.3f}, "
                f"n={len(self.seconds)})")


def sync(device: str) -> None:
    """Wait for the work queued on ``device`` (CUDA), so that a timing covers it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], Any], repeats: int, device: str) -> Timing:
    timing = Timing()
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        timing.seconds.append(time.perf_counter() - start)
    return timing


def time_interleaved(fns: Sequence[Callable[[], Any]], repeats: int,
                     device: str) -> list[Timing]:
    """Time several ways round-robin, every other round backwards (a, b, b, a, a, b, ...),
    so that drift in the machine's speed (other processes, thermal state, allocator) hits
    them alike, and no way always runs first after the other's work."""
    timings = [Timing() for _ in fns]
    for round_ in range(repeats):
        pairs = list(zip(fns, timings, strict=True))
        for fn, timing in pairs[::-1] if round_ % 2 else pairs:
            timing.seconds += time_calls(fn, 1, device).seconds
    return timings


def ratio(num: Timing, den: Timing) -> float:
    if not num.seconds or not den.seconds:
        return float("nan")
    return num.median / den.median


# --- recording the token batches ours sends to the model ---------------------------------

@dataclass
class GenBatch:
    """One batched ``generate`` call of the harness: its inputs and what it produced."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    new_tokens: int
    output: torch.Tensor


@dataclass
class Recording:
    forward_inputs: list[torch.Tensor] = field(default_factory=list)
    generate_calls: list[GenBatch] = field(default_factory=list)
    # (rows, positions) of the logits ours computes in each forward (loglikelihood).
    scored: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def record_batches(lm: Any, call: Callable[[], Any]) -> tuple[Recording, Any]:
    """Run ``call`` once with ``lm._model_call``/``lm._model_generate`` wrapped, keeping the
    exact tensors the harness passes to the model."""
    recording = Recording()
    model_call, model_generate = lm._model_call, lm._model_generate

    def recording_call(inps: torch.Tensor, attn_mask: Any = None, labels: Any = None) -> Any:
        recording.forward_inputs.append(inps.detach().clone())
        return model_call(inps, attn_mask, labels)

    def recording_generate(context: torch.Tensor, max_length: int, stop: list[str],
                           **kwargs: Any) -> torch.Tensor:
        mask = kwargs.get("attention_mask")
        out = model_generate(context, max_length, stop, **kwargs)
        recording.generate_calls.append(GenBatch(
            context.detach().clone(), None if mask is None else mask.detach().clone(),
            int(out.shape[1] - context.shape[1]), out.detach().clone()))
        return out

    narrow = multimask.logits_only_at

    def recording_narrow(model: Any, rows: torch.Tensor, positions: torch.Tensor) -> Any:
        recording.scored.append((rows.detach().clone(), positions.detach().clone()))
        return narrow(model, rows, positions)

    lm._model_call, lm._model_generate = recording_call, recording_generate
    multimask.logits_only_at = recording_narrow
    try:
        result = call()
    finally:
        del lm._model_call, lm._model_generate  # back to the class's methods
        multimask.logits_only_at = narrow
    return recording, result


def masked_generate(lm: Any, call: GenBatch) -> torch.Tensor:
    """``model.generate`` on a recorded call's prompts under the model's standing mask
    (``lm.forward_pass``: the knockout hooks, nothing of the harness)."""
    width = int(call.input_ids.shape[1]) + call.new_tokens
    with torch.no_grad(), lm.forward_pass(call.input_ids, call.attention_mask, width):
        return lm.model.generate(input_ids=call.input_ids, attention_mask=call.attention_mask,
                                 max_new_tokens=call.new_tokens, do_sample=False,
                                 pad_token_id=lm.tokenizer.pad_token_id, use_cache=True)


def limit_fn(lm: Any, recording: Recording,
             outputs: list[torch.Tensor] | None = None) -> Callable[[], None]:
    """The bare-model floor: the recorded batches through ``model`` / ``model.generate``
    under the standing mask (``lm.set_heads``; the knockout hooks are applied only inside
    ``lm.forward_pass``, so the floor enters it as the harness's calls do). The first
    run's generated tokens go to ``outputs`` when given (``same_generation`` checks them)."""
    model = lm.model

    def run() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                with lm.forward_pass(inps):
                    model(inps).logits  # noqa: B018 — the forward is what is timed
            generated = [masked_generate(lm, call) for call in recording.generate_calls]
            if outputs is not None and not outputs:
                outputs.extend(generated)

    return run


def same_generation(recording: Recording, outputs: Sequence[torch.Tensor]) -> bool:
    """The floor generated the same tokens as the harness (up to the harness's stop)."""
    for call, out in zip(recording.generate_calls, outputs, strict=True):
        width = min(out.shape[1], call.output.shape[1])
        if not torch.equal(out[:, :width].cpu(), call.output[:, :width].cpu()):
            return False
    return True


# --- the three ways ----------------------------------------------------------------------

@dataclass
class TaskResult:
    task: str
    kind: str
    docs: int
    batches: str
    reference: Timing
    reference_load: Timing
    ours: Timing
    limit: Timing
    score_reference: float | None
    score_ours: float
    # Ours with lm-eval's HFLM answering the requests itself (what ours did before
    # loglikelihood tasks got the scored-positions path); empty for generation, where
    # that is what ours does.
    before: Timing = field(default_factory=Timing)
    score_before: float | None = None
    notes: list[str] = field(default_factory=list)
    # Loglikelihood tasks, with ``answers=True``: ours' answers alone (the forward passes
    # and the scored tokens' sums, ``loglikelihoods_for_masks``), without lm-eval's
    # ``evaluate`` scoring them: ours minus this is lm-eval's share, this minus the limit
    # the forward path's.
    answers: Timing = field(default_factory=Timing)


def run_reference(model_args: str, task: str, heads: Sequence[Head], subset: dict[str, list[int]],
                  chat: bool, task_manager: Any, repeats: int, docs: int | None = None
                  ) -> tuple[Timing, Timing, float | None]:
    """Per repeat: a fresh model from disk with the mask, then simple_evaluate(batch_size=1).

    Returns the whole time, the model-load part of it, and the score. With ``docs``, the
    evaluation runs on the first ``docs`` documents of each task and its time is scaled to
    the whole subset (at batch size 1 it is linear in the documents); the score is then
    that of the fewer documents.
    """
    total = sum(len(v) for v in subset.values())
    factor = 1.0
    if docs is not None and docs < total:
        factor = total / sum(min(docs, len(v)) for v in subset.values())
        subset = {name: v[:docs] for name, v in subset.items()}
    import lm_eval

    from lm_eval_headloc.intervention.model import HFHeadAblateLM

    args = f"{model_args},ablate={format_heads(heads)}" if heads else model_args
    timing, loading, score = Timing(), Timing(), None
    for _ in range(repeats):
        gc.collect()
        with quiet_harness(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            start = time.perf_counter()
            lm = HFHeadAblateLM.create_from_arg_string(args, {"batch_size": 1})
            loaded = time.perf_counter()
            results = lm_eval.simple_evaluate(
                model=lm, tasks=[task], samples=subset, task_manager=task_manager,
                apply_chat_template=chat, bootstrap_iters=0, log_samples=False)
            end = time.perf_counter()
        timing.seconds.append(loaded - start + factor * (end - loaded))
        loading.seconds.append(loaded - start)
        score = task_score(results, task).value
        del results, lm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the reference's model: not left to the timings after
    return timing, loading, score


def bench_task(setup: Setup, lm: Any, task: str, kind: str, heads: Sequence[Head],
               num_samples: int, seed: int, repeats: int, reference_repeats: int,
               device: str, task_manager: Any, before: bool = True,
               reference_docs: int | None = None, answers: bool = False
               ) -> tuple[TaskResult, Any, Recording]:
    measure = open_measurement(setup, lm, num_samples=num_samples)  # seed: setup.spec's
    chat = measure.chat_template[next(iter(measure.chat_template))]
    subset = measure.subset
    docs = sum(len(v) for v in subset.values())
    # One untimed call: warms up and records the token batches for the limit.
    recording, scores = record_batches(lm, lambda: measure(heads))
    score_ours = scores[task].value
    lm.set_heads(heads)  # the limit runs under the same mask (ours sets it on every call)
    notes = []
    generated: list[torch.Tensor] = []
    fns = [lambda: measure(heads), limit_fn(lm, recording, generated)]
    score_before = None
    if kind == "loglikelihood" and before:
        score_before = measure.measure_with_model(heads)[task].value  # also a warm-up
        fns.append(lambda: measure.measure_with_model(heads))
    timed_answers = answers and kind == "loglikelihood" and measure.scored_positions
    if timed_answers:
        requests, rows = measure.requests(), measure.resolved_batch_size()
        fns.append(lambda: multimask.loglikelihoods_for_masks(lm, requests, [heads], rows))
    ours, limit, *extra = time_interleaved(fns, repeats, device)
    answered = extra.pop() if timed_answers else Timing()
    before = extra
    if recording.generate_calls and not same_generation(recording, generated):
        notes.append("limit's generate differs from the harness's tokens")
    if recording.forward_inputs:
        shapes = [tuple(x.shape) for x in recording.forward_inputs]
        batches = (f"{len(shapes)} forward(s) of {' + '.join(f'{b}×{t}' for b, t in shapes)} "
                   "tokens")
    else:
        shapes = [tuple(c.input_ids.shape) for c in recording.generate_calls]
        steps = [c.new_tokens for c in recording.generate_calls]
        batches = (f"{len(shapes)} generate call(s): prompts "
                   f"{' + '.join(f'{b}×{t}' for b, t in shapes)}, "
                   f"{'/'.join(map(str, steps))} new tokens")
    reference, loading, score_ref = run_reference(setup.spec.model_args, task, heads, subset, chat,
                                                  task_manager, reference_repeats,
                                                  reference_docs)
    return TaskResult(task, kind, docs, batches, reference, loading, ours, limit, score_ref,
                      score_ours, before[0] if before else Timing(), score_before,
                      notes, answered), measure, recording


# --- the machine and the numbers, as the reports show them ----------------------------

def machine_lines(device: str) -> list[str]:
    import lm_eval
    import transformers

    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        cpu = platform.processor() or cpu
    memory = ""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                memory = f", {int(line.split()[1]) / 2**20:.0f} GiB RAM"
    except OSError:
        pass
    lines = [f"- CPU: {cpu}, {os.cpu_count()} cores (torch threads: "
             f"{torch.get_num_threads()}){memory}"]
    if device.startswith("cuda"):
        lines.append(f"- GPU: {torch.cuda.get_device_name()}")
    lines.append(f"- Python {platform.python_version()}, torch {torch.__version__}, transformers "
                 f"{transformers.__version__}, lm_eval {lm_eval.__version__}")
    return lines


def fmt_ratio(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}×"


def fmt_score(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
