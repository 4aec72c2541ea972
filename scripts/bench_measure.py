"""Benchmark one head-knockout measurement three ways and write ``BENCH.md`` (issue 5, part 1).

On the embedded SmolLM2-135M, for a loglikelihood task (``headloc_induction``, a seeded
subset of 100 documents) and a small generation task (``rhyme``, a seeded subset of 16,
through the chat template), one measurement under one random stratified mask is timed:

- **reference**: what the paper's released code does per mask: construct a fresh
  ``hf-headablate`` model from disk with the mask, then ``lm_eval.simple_evaluate(...,
  batch_size=1)`` on the same documents (``samples=``);
- **ours**: ``headloc-harness``'s measurement on the already-loaded model
  (``driver.prepare`` + ``load_model`` + ``open_measurement`` once, then ``measure(heads)``);
- **limit**: the very token batches ``ours`` sends to the model (recorded from one
  ``ours`` call), replayed through the bare model: ``model(input_ids)`` under
  ``torch.no_grad()`` for loglikelihood, ``model.generate`` with the same number of new
  tokens for generation, with the mask set by ``lm.set_heads``.

Each is repeated; the median and the spread (min-max) in seconds per measurement and the
ratios reference/ours and ours/limit are printed and written to ``BENCH.md``, which the
script regenerates entirely. With ``--profile`` it also profiles ``ours`` on the
loglikelihood task with cProfile and adds a "where the time goes" section.

Usage (from the repository root, inside the virtualenv)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python scripts/bench_measure.py --profile
    python scripts/bench_measure.py --device cuda --repeats 5 --reference-repeats 3 --profile
    python scripts/bench_measure.py --reference-repeats 0 --out /tmp/BENCH.md   # no reference

Options: ``--device cpu|cuda``, ``--repeats N`` (ours and limit, default 5),
``--reference-repeats N`` (default 3; each costs a model load), ``--num-samples N``
(loglikelihood documents, default 100), ``--gen-samples N`` (generation documents, default
16), ``--batch-size N`` (ours and limit, default 32), ``--seed N`` (mask and subsets, default
0), ``--profile``, ``--out PATH`` (default ``BENCH.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import datetime as dt  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from lm_eval_headloc.designs import design_matrix  # noqa: E402
from lm_eval_headloc.driver import Setup, load_model, open_measurement, prepare  # noqa: E402
from lm_eval_headloc.embedded import smollm2_model_args  # noqa: E402
from lm_eval_headloc.heads import Head, format_heads  # noqa: E402
from lm_eval_headloc.measure import quiet_harness  # noqa: E402
from lm_eval_headloc.metrics import task_score  # noqa: E402
from lm_eval_headloc.tasks import make_task_manager  # noqa: E402

LOGLIK_TASK = "headloc_induction"
GEN_TASK = "rhyme"
REPO = Path(__file__).resolve().parent.parent


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


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_calls(fn: Callable[[], Any], repeats: int, device: str) -> Timing:
    timing = Timing()
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        timing.seconds.append(time.perf_counter() - start)
    return timing


def time_interleaved(fns: Sequence[Callable[[], Any]], repeats: int,
                     device: str) -> list[Timing]:
    """Time several ways round-robin (a, b, a, b, ...), so that drift in the machine's speed
    (other processes, thermal state, allocator) hits them alike."""
    timings = [Timing() for _ in fns]
    for _ in range(repeats):
        for fn, timing in zip(fns, timings, strict=True):
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

    lm._model_call, lm._model_generate = recording_call, recording_generate
    try:
        result = call()
    finally:
        del lm._model_call, lm._model_generate  # back to the class's methods
    return recording, result


def limit_fn(lm: Any, recording: Recording) -> Callable[[], None]:
    """The bare-model floor: the recorded batches through ``model`` / ``model.generate``."""
    model, pad = lm.model, lm.tokenizer.pad_token_id

    def run() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                model(inps).logits  # noqa: B018 — the forward is what is timed
            for call in recording.generate_calls:
                model.generate(input_ids=call.input_ids, attention_mask=call.attention_mask,
                               max_new_tokens=call.new_tokens, do_sample=False,
                               pad_token_id=pad, use_cache=True)

    return run


def check_limit_generation(lm: Any, recording: Recording) -> bool:
    """The floor's generate gives the same tokens as the harness's (up to its stop)."""
    pad = lm.tokenizer.pad_token_id
    with torch.no_grad():
        for call in recording.generate_calls:
            out = lm.model.generate(input_ids=call.input_ids, attention_mask=call.attention_mask,
                                    max_new_tokens=call.new_tokens, do_sample=False,
                                    pad_token_id=pad, use_cache=True)
            width = min(out.shape[1], call.output.shape[1])
            if not torch.equal(out[:, :width], call.output[:, :width]):
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
    notes: list[str] = field(default_factory=list)


def run_reference(model_args: str, task: str, heads: Sequence[Head], subset: dict[str, list[int]],
                  chat: bool, task_manager: Any, repeats: int
                  ) -> tuple[Timing, Timing, float | None]:
    """Per repeat: a fresh model from disk with the mask, then simple_evaluate(batch_size=1).

    Returns the whole time, the model-load part of it, and the score.
    """
    import lm_eval

    from lm_eval_headloc.model import HFHeadAblateLM

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
        timing.seconds.append(end - start)
        loading.seconds.append(loaded - start)
        score = task_score(results, task).value
        del results, lm
    gc.collect()
    return timing, loading, score


def bench_task(setup: Setup, lm: Any, task: str, kind: str, heads: Sequence[Head],
               num_samples: int, seed: int, repeats: int, reference_repeats: int,
               device: str, task_manager: Any) -> tuple[TaskResult, Any, Recording]:
    measure = open_measurement(setup, lm, num_samples, seed, None, False)
    chat = measure.chat_template[next(iter(measure.chat_template))]
    subset = measure.subset
    docs = sum(len(v) for v in subset.values())
    # One untimed call: warms up and records the token batches for the limit.
    recording, scores = record_batches(lm, lambda: measure(heads))
    score_ours = scores[task].value
    lm.set_heads(heads)  # the limit runs under the same mask (ours sets it on every call)
    notes = []
    if recording.generate_calls and not check_limit_generation(lm, recording):
        notes.append("limit's generate differs from the harness's tokens")
    ours, limit = time_interleaved([lambda: measure(heads), limit_fn(lm, recording)],
                                   repeats, device)
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
    reference, loading, score_ref = run_reference(setup.model_args, task, heads, subset, chat,
                                                  task_manager, reference_repeats)
    return TaskResult(task, kind, docs, batches, reference, loading, ours, limit, score_ref,
                      score_ours, notes), measure, recording


# --- profile ------------------------------------------------------------------------------

# (label, file-name fragment, function name): cumulative time of these functions.
PROFILE_ROWS: list[tuple[str, str, str]] = [
    ("`measure(heads)` (whole call)", "lm_eval_headloc/measure.py", "__call__"),
    ("lm-eval `evaluate`", "lm_eval/evaluator.py", "evaluate"),
    ("build requests (`Task.build_all_requests`)", "lm_eval/api/task.py", "build_all_requests"),
    ("`lm.loglikelihood` (all model work)", "lm_eval/api/model.py", "loglikelihood"),
    ("tokenization (`TemplateLM._encode_pair`)", "lm_eval/api/model.py", "_encode_pair"),
    ("`HFLM._loglikelihood_tokens`", "lm_eval/models/huggingface.py", "_loglikelihood_tokens"),
    ("model forward (`HFLM._model_call`)", "lm_eval/models/huggingface.py", "_model_call"),
    ("head-knockout hooks (inside the forward)", "lm_eval_headloc/hooks.py", "knock_out_heads"),
    ("`log_softmax` over the vocabulary", "~", "<method 'log_softmax' of"),
    ("collation (`Collator` sort/batch/cache)", "lm_eval/models/utils.py", "get_batched"),
    ("per-request `Collator.get_cache`", "lm_eval/models/utils.py", "get_cache"),
    ("metrics (`Task.process_results`)", "lm_eval/api/task.py", "process_results"),
    ("aggregation (`_process_results`)", "lm_eval/evaluator_utils.py", "_process_results"),
]


def _cumulative(stats: pstats.Stats, fragment: str, name: str) -> float:
    total = 0.0
    for (filename, _, funcname), (_, _, _, cum, _) in stats.stats.items():  # type: ignore[attr-defined]
        if fragment == "~":
            if filename == "~" and funcname.startswith(name):
                total += cum
        elif funcname == name and filename.endswith(fragment):
            total += cum
    return total


@dataclass
class Profile:
    calls: int
    rows: list[tuple[str, float]]
    derived: list[tuple[str, float]]
    top: str
    anatomy: list[tuple[str, Timing]] = field(default_factory=list)


def forward_anatomy(lm: Any, recording: Recording, repeats: int,
                    device: str) -> list[tuple[str, Timing]]:
    """The limit's forward taken apart on the same batches: the transformer body alone
    (hidden states, no output projection), the full forward (the limit), and the full
    forward plus the log_softmax over the vocabulary that the harness computes."""
    model = lm.model
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def body_only() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                body(inps).last_hidden_state  # noqa: B018

    def with_log_softmax() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                torch.log_softmax(model(inps).logits, dim=-1, dtype=torch.float32)

    labels = ["transformer body only (no `lm_head`)", "full forward (= limit)",
              "full forward + `log_softmax` (what the harness computes per batch)"]
    fns = [body_only, limit_fn(lm, recording), with_log_softmax]
    for fn in fns:
        fn()  # warm-up
    return list(zip(labels, time_interleaved(fns, repeats, device), strict=True))


def profile_ours(measure: Any, heads: Sequence[Head], calls: int) -> Profile:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        measure(heads)
    profiler.disable()
    stats = pstats.Stats(profiler)
    per = {label: _cumulative(stats, frag, name) / calls for label, frag, name in PROFILE_ROWS}
    labels = [label for label, _, _ in PROFILE_ROWS]
    whole, evaluate, build, loglik, encode, tokens, forward, _, softmax, collate, cache, \
        metrics, aggregate = (per[label] for label in labels)
    derived = [
        ("outside `evaluate` (set_heads, logging/tqdm switch, score lookup)", whole - evaluate),
        ("`evaluate` minus requests, model work, metrics, aggregation (bookkeeping)",
         evaluate - build - loglik - metrics - aggregate),
        ("`loglikelihood` minus `_loglikelihood_tokens` (request unpacking, tokenization)",
         loglik - tokens),
        ("`_loglikelihood_tokens` minus forward, log_softmax, collation (per-request "
         "tensors, padding, slicing, argmax, gather)", tokens - forward - softmax - collate),
        ("everything but the model forward", whole - forward),
    ]
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    site = str(Path(torch.__file__).resolve().parent.parent) + os.sep
    return Profile(calls, list(per.items()), derived, text.getvalue().replace(site, ""))


# --- report ---------------------------------------------------------------------------------

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


def render(results: list[TaskResult], profile: Profile | None, args: argparse.Namespace,
           heads: Sequence[Head], command: str, model_args: str, total_s: float,
           load: tuple[float, float]) -> str:
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Measurement throughput: reference vs ours vs the forward-pass limit", "",
        "Generated by `scripts/bench_measure.py` (issue 5, part 1); do not edit by hand.", "",
        "```bash", command, "```", "",
        f"- date: {now}; whole benchmark run {total_s:.0f} s; load average (1 min) "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end (above the core count means "
        "other processes shared the CPU)",
        *machine_lines(args.device),
        f"- model: embedded SmolLM2-135M-Instruct (GGUF Q4_1, float32), `{model_args}`",
        f"- mask: one stratified mask, sparsity 0.02, seed {args.seed}: {len(heads)} heads "
        f"knocked out ({format_heads(heads)})",
        f"- ours and limit: batch size {args.batch_size}; reference: batch size 1", "",
        "Seconds per measurement: median (min–max, n repetitions). Ours and limit are "
        "timed alternately (ours, limit, ours, …) after one untimed warm-up call.", "",
        "| task | docs | reference | of which model load | ours | limit | reference/ours | "
        "ours/limit | score reference / ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| `{r.task}` ({r.kind}) | {r.docs} | {r.reference.cell()} | "
            f"{r.reference_load.cell()} | {r.ours.cell()} | "
            f"{r.limit.cell()} | {fmt_ratio(ratio(r.reference, r.ours))} | "
            f"{fmt_ratio(ratio(r.ours, r.limit))} | {fmt_score(r.score_reference)} / "
            f"{fmt_score(r.score_ours)} |")
    lines.append("")
    for r in results:
        gap = r.ours.median - r.limit.median
        lines.append(f"- `{r.task}`: ours − limit = {gap:.3f} s per measurement "
                     f"({1000 * gap / r.docs:.1f} ms per document)")
    lines += ["", "What each column times:", "",
              "- **reference**: per mask, what the paper's released code does: a fresh "
              "`hf-headablate` model loaded from disk with the mask (`ablate=`), then "
              "`lm_eval.simple_evaluate(..., batch_size=1, samples=<the same documents>)`. "
              "In its favour: the TaskManager (indexing every lm-eval task) is built once "
              "outside the timing, and `bootstrap_iters=0`, `log_samples=False` as in ours.",
              "- **ours**: `measure(heads)` of `headloc-harness` "
              "(`driver.prepare` + `load_model` + `open_measurement` once, untimed), i.e. "
              "`set_heads` on the loaded model and lm-eval's `evaluate` on the fixed subset.",
              "- **limit**: the exact token batches ours sends to the model (recorded from "
              "one ours call) replayed through the bare model with the same mask: "
              "`model(input_ids)` under `torch.no_grad()` (loglikelihood; lm-eval passes no "
              "attention mask, right padding) or `model.generate(..., max_new_tokens=<the "
              "tokens the harness generated>)` (generation). No harness, no per-request "
              "Python, no log_softmax.", "",
              "Batches:", ""]
    lines += [f"- `{r.task}`: {r.batches}" for r in results]
    for r in results:
        lines += [f"- `{r.task}`: note: {note}" for note in r.notes]
    if profile is not None:
        whole = dict(profile.rows)["`measure(heads)` (whole call)"]
        lines += ["", f"## Where the time goes (ours, `{LOGLIK_TASK}`)", "",
                  f"cProfile over {profile.calls} calls of `measure(heads)`, seconds per call "
                  "(cumulative time, profiler overhead included, so Python-heavy rows are "
                  "inflated relative to the timings above).", "",
                  "| part | s per call | share |", "| --- | --- | --- |"]
        for label, seconds in profile.rows:
            lines.append(f"| {label} | {seconds:.3f} | {100 * seconds / whole:.1f} % |")
        lines += ["", "Derived:", "", "| part | s per call | share |", "| --- | --- | --- |"]
        for label, seconds in profile.derived:
            lines.append(f"| {label} | {seconds:.3f} | {100 * seconds / whole:.1f} % |")
        if profile.anatomy:
            lines += ["", "The limit's forward taken apart on the same batches (timed "
                      "alternately, no profiler), seconds per measurement:", "",
                      "| forward variant | s | share of the limit |", "| --- | --- | --- |"]
            full = profile.anatomy[1][1].median
            for label, timing in profile.anatomy:
                lines.append(f"| {label} | {timing.cell()} | {100 * timing.median / full:.0f} % |")
        lines += ["", "<details><summary>Top functions by own time (paths relative to "
                  "site-packages)</summary>", "", "```",
                  profile.top.strip(), "```", "", "</details>"]
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------

def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=5, help="ours and limit (default 5)")
    parser.add_argument("--reference-repeats", type=int, default=3,
                        help="reference; each loads the model (default 3; 0 skips it)")
    parser.add_argument("--num-samples", type=int, default=100,
                        help=f"{LOGLIK_TASK} documents (default 100)")
    parser.add_argument("--gen-samples", type=int, default=16,
                        help=f"{GEN_TASK} documents (default 16)")
    parser.add_argument("--batch-size", type=int, default=32, help="ours and limit (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="mask and subsets (default 0)")
    parser.add_argument("--profile", action="store_true",
                        help=f"profile ours on {LOGLIK_TASK} and add it to the report")
    parser.add_argument("--profile-calls", type=int, default=2)
    parser.add_argument("--out", type=Path, default=REPO / "BENCH.md")
    args = parser.parse_args(argv)
    for name in ("repeats", "num_samples", "gen_samples", "batch_size", "profile_calls"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.reference_repeats < 0 or args.seed < 0:
        parser.error("--reference-repeats and --seed must be >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = "HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python scripts/bench_measure.py " + \
        shlex.join(sys.argv[1:] if argv is None else list(argv))
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model_args = smollm2_model_args(device=args.device)

    setups = {task: prepare(model_args, [task]) for task in (LOGLIK_TASK, GEN_TASK)}
    task_manager = make_task_manager()
    first = setups[LOGLIK_TASK]
    matrix = design_matrix("stratified", 1, first.total_heads, 0.02, args.seed)
    heads = [Head.from_index(int(i), first.num_heads) for i in matrix[0].nonzero()[0]]
    print(f"mask ({len(heads)} heads): {format_heads(heads)}", flush=True)

    loading = time.perf_counter()
    lm = load_model(first, args.batch_size)
    print(f"model loaded in {time.perf_counter() - loading:.1f} s", flush=True)

    results, measures, recordings = [], {}, {}
    for task, kind, samples in ((LOGLIK_TASK, "loglikelihood", args.num_samples),
                                (GEN_TASK, "generation", args.gen_samples)):
        print(f"benchmarking {task} ...", flush=True)
        result, measures[task], recordings[task] = bench_task(
            setups[task], lm, task, kind, heads, samples, args.seed, args.repeats,
            args.reference_repeats, args.device, task_manager)
        results.append(result)
        print(f"  reference {result.reference.cell()} s (model load "
              f"{result.reference_load.cell()} s), ours {result.ours.cell()} s, "
              f"limit {result.limit.cell()} s; reference/ours "
              f"{fmt_ratio(ratio(result.reference, result.ours))}, ours/limit "
              f"{fmt_ratio(ratio(result.ours, result.limit))}; score reference "
              f"{fmt_score(result.score_reference)}, ours {fmt_score(result.score_ours)}",
              flush=True)
        for note in result.notes:
            print(f"  note: {note}", flush=True)

    profile = None
    if args.profile:
        print(f"profiling ours on {LOGLIK_TASK} ...", flush=True)
        profile = profile_ours(measures[LOGLIK_TASK], heads, args.profile_calls)
        for label, seconds in [*profile.rows, *profile.derived]:
            print(f"  {seconds:7.3f} s  {label}", flush=True)
        lm.set_heads(heads)
        profile.anatomy = forward_anatomy(lm, recordings[LOGLIK_TASK], args.repeats,
                                          args.device)
        for label, timing in profile.anatomy:
            print(f"  {timing.cell()} s  {label}", flush=True)

    total = time.perf_counter() - started
    args.out.write_text(render(results, profile, args, heads, command, model_args, total,
                               (load_start, os.getloadavg()[0])))
    print(f"wrote {args.out} ({total:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
