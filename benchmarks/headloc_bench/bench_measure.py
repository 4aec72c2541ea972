"""Benchmark one head-knockout measurement three ways and write ``BENCH.md``.

On the embedded SmolLM2-135M, for a loglikelihood task (``headloc_induction``, a seeded
subset of 100 documents) and a small generation task (``rhyme``, a seeded subset of 16,
through the chat template), one measurement under one random stratified mask is timed:

- **reference**: what the paper's released code does per mask: construct a fresh
  ``hf-headablate`` model from disk with the mask, then ``lm_eval.simple_evaluate(...,
  batch_size=1)`` on the same documents (``samples=``);
- **ours**: ``headloc-harness``'s measurement on the already-loaded model
  (``runs.setup.prepare`` + ``load_model`` + ``open_measurement`` once, then ``measure(heads)``);
- **limit**: the very token batches ``ours`` sends to the model (recorded from one
  ``ours`` call), replayed through the bare model: ``model(input_ids)`` under
  ``torch.no_grad()`` for loglikelihood, ``model.generate`` with the same number of new
  tokens for generation, with the mask set by ``lm.set_heads``.

For the loglikelihood task, **ours before** (``measure_with_model``: lm-eval's HFLM
answering the requests itself, full logits) is timed too, as the before of the
scored-positions change. Then ``measure_many(masks, masks_per_pass=K)``
is timed on the same masks for K = 1, 4, 16, 64 (seconds per mask, and the largest score
difference from K = 1; peak GPU memory on CUDA).

Each is repeated; the median and the spread (min-max) in seconds per measurement and the
ratios reference/ours and ours/limit are printed and written to ``BENCH.md``, which the
script regenerates entirely. With ``--profile`` it also profiles ``ours`` on the
loglikelihood task with cProfile and adds a "where the time goes" section.

With ``--config NAME`` (``llama-3.2-1b``, ``llama-3.1-8b``) it benchmarks a random-weight
model of that published shape instead, on tasks of realistic lengths, and writes its own
section of ``BENCH.md`` (``bench_scale.py`` says what it measures)::

    python benchmarks/bench_measure.py --config llama-3.1-8b --dtype bfloat16 --device cuda

Usage (from the repository root, inside the virtualenv)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python benchmarks/bench_measure.py --profile
    python benchmarks/bench_measure.py --device cuda --repeats 5 --reference-repeats 3 --profile
    python benchmarks/bench_measure.py --reference-repeats 0 --out /tmp/BENCH.md   # no reference

Options: ``--device cpu|cuda``, ``--repeats N`` (ours and limit, default 5),
``--reference-repeats N`` (default 3; each costs a model load), ``--num-samples N``
(loglikelihood documents, default 100), ``--gen-samples N`` (generation documents, default
16), ``--batch-size N`` (ours and limit, default 32), ``--seed N`` (mask and subsets, default
0), ``--profile``, ``--masks-per-pass 1,4,16,64`` (0 skips that table), ``--multi-masks N``
(masks per K, default 64), ``--multi-repeats N`` (default 2), ``--out PATH`` (default
``BENCH.md``).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import io  # noqa: E402
import logging  # noqa: E402
import pstats  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from headloc_bench import ROOT  # noqa: E402
from headloc_bench.bench_scale import add_arguments, run_scale  # noqa: E402
from headloc_bench.bench_sections import (  # noqa: E402
    bench_refusal,
    demote,
    measured_now,
    section_name,
    shown_command,
    shown_model_args,
    write_head,
    write_section,
)
from headloc_bench.bench_shapes import model_dir_problem  # noqa: E402
from headloc_bench.measuring import (  # noqa: E402
    Recording,
    TaskResult,
    Timing,
    bench_task,
    fmt_ratio,
    fmt_score,
    limit_fn,
    machine_lines,
    ratio,
    sync,
    time_interleaved,
)
from lm_eval_headloc.intervention import multimask  # noqa: E402
from lm_eval_headloc.intervention.components import Head, format_heads  # noqa: E402
from lm_eval_headloc.intervention.embedded import smollm2_model_args  # noqa: E402
from lm_eval_headloc.method.designs import design_matrix  # noqa: E402
from lm_eval_headloc.runs.plan import load_model  # noqa: E402
from lm_eval_headloc.runs.setup import prepare  # noqa: E402
from lm_eval_headloc.runs.spec import RunSpec  # noqa: E402
from lm_eval_headloc.tasks import make_task_manager  # noqa: E402

LOGLIK_TASK = "headloc_induction"
LIMIT_LABEL = "full forward (= limit)"
GEN_TASK = "rhyme"


# --- several masks per forward pass ------------------------------------------------------

@dataclass
class PerPassResult:
    """``measure_many(masks, masks_per_pass=K)``: seconds per mask, agreement, memory."""

    per_pass: int
    seconds_per_mask: Timing = field(default_factory=Timing)
    max_score_diff: float = 0.0  # largest |score - score at the first K| over the masks
    peak_gib: float | None = None  # peak GPU memory allocated (CUDA only)


def bench_masks_per_pass(measure: Any, task: str, masks: Sequence[Sequence[Head]],
                         values: Sequence[int], repeats: int, device: str
                         ) -> list[PerPassResult]:
    """Time every K on the same masks, round-robin over K in each repetition."""
    results = [PerPassResult(k) for k in values]
    scores: dict[int, list[float]] = {}
    for _ in range(repeats):
        for result in results:
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            sync(device)
            start = time.perf_counter()
            out = measure.measure_many(masks, masks_per_pass=result.per_pass)
            sync(device)
            result.seconds_per_mask.seconds.append((time.perf_counter() - start) / len(masks))
            scores[result.per_pass] = [o[task].value for o in out]
            if device.startswith("cuda"):
                result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    first = scores[values[0]]
    for result in results:
        result.max_score_diff = max(abs(a - b) for a, b in
                                    zip(first, scores[result.per_pass], strict=True))
    return results


# --- profile ------------------------------------------------------------------------------

# (label, file-name fragment, function name): cumulative time of these functions.
PROFILE_ROWS: list[tuple[str, str, str]] = [
    ("`measure(heads)` (whole call)", "lm_eval_headloc/measurement/measure.py", "__call__"),
    ("answers (`multimask.loglikelihoods_for_masks`: all model work)",
     "lm_eval_headloc/intervention/multimask.py", "loglikelihoods_for_masks"),
    ("tokenization (`TemplateLM._encode_pair`)", "lm_eval/api/model.py", "_encode_pair"),
    ("model forward (`HFLM._model_call`)", "lm_eval/models/huggingface.py", "_model_call"),
    ("head-knockout hooks (inside the forward)", "lm_eval_headloc/intervention/hooks.py",
     "knock_out_heads"),
    ("scored-position pick before `lm_head` (inside the forward)",
     "lm_eval_headloc/intervention/multimask.py", "pick_scored"),
    ("`log_softmax` (scored positions only)", "~", "<method 'log_softmax' of"),
    ("lm-eval `evaluate` (scoring the answers)", "lm_eval/evaluator.py", "evaluate"),
    ("build requests (`Task.build_all_requests`)", "lm_eval/api/task.py", "build_all_requests"),
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
    (hidden states, no output projection), the body plus the output projection at the
    scored positions (what ours runs), the full forward (the limit), and the full forward
    plus the log_softmax over the vocabulary that lm-eval's HFLM computes."""
    model = lm.model
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    def body_only() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                with lm.forward_pass(inps):
                    body(inps).last_hidden_state  # noqa: B018

    def with_log_softmax() -> None:
        with torch.no_grad():
            for inps in recording.forward_inputs:
                with lm.forward_pass(inps):
                    torch.log_softmax(model(inps).logits, dim=-1, dtype=torch.float32)

    def scored_only() -> None:
        with torch.no_grad():
            for inps, (rows, positions) in zip(recording.forward_inputs, recording.scored,
                                               strict=True):
                with lm.forward_pass(inps), multimask.logits_only_at(model, rows, positions):
                    model(inps).logits  # noqa: B018

    labels = ["transformer body only (no `lm_head`)",
              "body + `lm_head` at the scored positions only (ours' forward)",
              LIMIT_LABEL,
              "full forward + `log_softmax` (what lm-eval's HFLM computes per batch)"]
    fns = [body_only, scored_only, limit_fn(lm, recording), with_log_softmax]
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
    whole, answers, encode, forward, _, _, softmax, evaluate, build, metrics, aggregate = \
        (per[label] for label in labels)
    derived = [
        ("outside answers and `evaluate` (set_heads, logging/tqdm switch, score lookup)",
         whole - answers - evaluate),
        ("answers minus forward, tokenization, log_softmax (batching, gather, sums)",
         answers - forward - encode - softmax),
        ("`evaluate` minus requests, metrics, aggregation (bookkeeping)",
         evaluate - build - metrics - aggregate),
        ("everything but the model forward", whole - forward),
    ]
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(15)
    site = str(Path(torch.__file__).resolve().parent.parent) + os.sep
    return Profile(calls, list(per.items()), derived, text.getvalue().replace(site, ""))


# --- report ---------------------------------------------------------------------------------

def render(results: list[TaskResult], profile: Profile | None, args: argparse.Namespace,
           heads: Sequence[Head], command: str, model_args: str, total_s: float,
           load: tuple[float, float], per_pass: list[PerPassResult]) -> str:
    now = measured_now()
    lines = [
        f"# Measurement throughput{' on the GPU' if args.device != 'cpu' else ''}: "
        "reference vs ours vs the forward-pass limit", "",
        "Generated by `benchmarks/bench_measure.py`; do not edit by hand.", "",
        "```bash", command, "```", "",
        f"- date: {now}; whole benchmark run {total_s:.0f} s; load average (1 min) "
        f"{load[0]:.2f} at the start, {load[1]:.2f} at the end (above the core count means "
        "other processes shared the CPU)",
        *machine_lines(args.device),
        f"- model: embedded SmolLM2-135M-Instruct (GGUF Q4_1, float32), "
        f"`{shown_model_args(model_args)}`",
        f"- mask: one stratified mask, sparsity 0.02, seed {args.seed}: {len(heads)} heads "
        f"knocked out ({format_heads(heads)})",
        f"- ours and limit: batch size {args.batch_size}; reference: batch size 1", "",
        "Seconds per measurement: median (min–max, n repetitions). Ours, limit and "
        "ours-before are timed alternately, every other round in reverse (ours, limit, before, "
        "before, limit, ours, …), after one untimed warm-up call each.", "",
        "| task | docs | reference | of which model load | ours | limit | reference/ours | "
        "ours/limit | ours before (HFLM answers) | score reference / ours / before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        before = r.before.cell() if r.before.seconds else "= ours"
        lines.append(
            f"| `{r.task}` ({r.kind}) | {r.docs} | {r.reference.cell()} | "
            f"{r.reference_load.cell()} | {r.ours.cell()} | "
            f"{r.limit.cell()} | {fmt_ratio(ratio(r.reference, r.ours))} | "
            f"{fmt_ratio(ratio(r.ours, r.limit))} | {before} | "
            f"{fmt_score(r.score_reference)} / {fmt_score(r.score_ours)} / "
            f"{fmt_score(r.score_before if r.before.seconds else r.score_ours)} |")
    lines.append("")
    for r in results:
        gap = r.ours.median - r.limit.median
        lines.append(f"- `{r.task}`: ours − limit = {gap:.3f} s per measurement "
                     f"({1000 * gap / r.docs:.1f} ms per document)")
        if r.before.seconds:
            lines.append(f"- `{r.task}`: before/ours = {fmt_ratio(ratio(r.before, r.ours))}, "
                         f"before/limit = {fmt_ratio(ratio(r.before, r.limit))}, "
                         f"reference/before = {fmt_ratio(ratio(r.reference, r.before))}")
    lines += ["", "What each column times:", "",
              "- **reference**: per mask, what the paper's released code does: a fresh "
              "`hf-headablate` model loaded from disk with the mask (`ablate=`), then "
              "`lm_eval.simple_evaluate(..., batch_size=1, samples=<the same documents>)`. "
              "In its favour: the TaskManager (indexing every lm-eval task) is built once "
              "outside the timing, and `bootstrap_iters=0`, `log_samples=False` as in ours.",
              "- **ours**: `measure(heads)` of `headloc-harness` "
              "(`engine.prepare` + `load_model` + `open_measurement` once, untimed). For "
              "loglikelihood tasks: the subset's requests (recorded once, untimed in the "
              "warm-up) are answered by `multimask.loglikelihoods_for_masks` (the mask set "
              "per row, logits only at the continuation tokens), then lm-eval's `evaluate` "
              "scores those answers. For generation tasks: `set_heads` on the loaded model "
              "and lm-eval's `evaluate` on the fixed subset.",
              "- **ours before (HFLM answers)**: `measure_with_model(heads)`, the same "
              "measurement with lm-eval's HFLM answering the loglikelihood requests itself "
              "(full logits, `log_softmax` over the vocabulary at every position): what ours "
              "was before the scored-positions path.",
              "- **limit**: the exact token batches ours sends to the model (recorded from "
              "one ours call) replayed through the bare model with the same mask: "
              "`model(input_ids)` under `torch.no_grad()` (loglikelihood; lm-eval passes no "
              "attention mask, right padding) or `model.generate(..., max_new_tokens=<the "
              "tokens the harness generated>)` (generation). No harness, no per-request "
              "Python, no log_softmax. By definition the limit computes the "
              "logits at every position; ours computes them only where they are scored, "
              "so for loglikelihood ours can be below the limit (ours/limit < 1). The "
              "anatomy table below gives the floor of ours' own forward.", "",
              "Batches:", ""]
    lines += [f"- `{r.task}`: {r.batches}" for r in results]
    for r in results:
        lines += [f"- `{r.task}`: note: {note}" for note in r.notes]
    if per_pass:
        before = results[0].before if results[0].before.seconds else results[0].ours
        first = per_pass[0]
        docs_per_pass = min(args.batch_size, results[0].docs)
        lines += ["", f"## Several masks per forward pass (`{LOGLIK_TASK}`, "
                  f"{results[0].docs} documents)", "",
                  f"`measure_many(masks, masks_per_pass=K)` on the same {args.multi_masks} "
                  f"stratified masks (sparsity 0.02, seed {args.seed}) for each K: a batch "
                  f"of {docs_per_pass} documents is replicated K times and every copy gets "
                  "its own head mask, then lm-eval's `evaluate` scores each mask. Seconds per "
                  f"mask: median (min–max) over {args.multi_repeats} repetition(s), K "
                  "round-robin within each.", "",
                  "| K (masks per pass) | rows per forward | s per mask | speed-up vs K = "
                  f"{first.per_pass} | speed-up vs ours before (HFLM answers, one mask) | "
                  f"max \\|score − score at K = {first.per_pass}\\| | peak GPU memory |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in per_pass:
            peak = "n/a (CPU)" if r.peak_gib is None else f"{r.peak_gib:.1f} GiB"
            lines.append(
                f"| {r.per_pass} | {docs_per_pass * r.per_pass} | "
                f"{r.seconds_per_mask.cell()} | "
                f"{fmt_ratio(ratio(first.seconds_per_mask, r.seconds_per_mask))} | "
                f"{fmt_ratio(ratio(before, r.seconds_per_mask))} | "
                f"{r.max_score_diff:.2g} | {peak} |")
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
            lines += ["", "The limit's forward taken apart on the same batches (under the mask, "
                      "timed alternately, no profiler), seconds per measurement:", "",
                      "| forward variant | s | share of the limit |", "| --- | --- | --- |"]
            full = dict(profile.anatomy)[LIMIT_LABEL].median
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
    parser.add_argument("--masks-per-pass", default="1,4,16,64",
                        help="K values for the several-masks-per-pass table, comma-separated "
                        "(default 1,4,16,64; 0 skips the table)")
    parser.add_argument("--multi-masks", type=int, default=64,
                        help="masks measured for each K (default 64)")
    parser.add_argument("--multi-repeats", type=int, default=2,
                        help="repetitions of each K (default 2)")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCH.md")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        values = [int(v) for v in args.masks_per_pass.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--masks-per-pass {args.masks_per_pass!r}: expected integers like 1,4,16")
    if any(v < 0 for v in values):
        parser.error(f"--masks-per-pass {args.masks_per_pass!r}: values must be >= 1 (or 0)")
    args.per_pass_values = [] if values in ([], [0]) else values
    if 0 in args.per_pass_values:
        parser.error(f"--masks-per-pass {args.masks_per_pass!r}: 0 alone skips the table")
    for name in ("repeats", "num_samples", "gen_samples", "batch_size", "profile_calls",
                 "multi_masks", "multi_repeats", "max_gen_toks", "reference_gen_docs",
                 "max_masks_per_pass", "sweep_masks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.locate_gen_masks < 2:  # locate's own --masks: a fit needs two
        parser.error(f"--locate-gen-masks {args.locate_gen_masks}: must be >= 2")
    if args.reference_repeats < 0 or args.seed < 0 or args.locate_gen_confirm < 0:
        parser.error("--reference-repeats, --seed and --locate-gen-confirm must be >= 0")
    for name, most in (("max_masks_per_pass", 1024), ("sweep_masks", 1024),
                       ("max_gen_toks", 32768)):
        if getattr(args, name) > most:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)}: at most {most}")
    if args.model_dir is not None:
        if (problem := model_dir_problem(args.model_dir)) is not None:
            parser.error(problem)
    if args.gen_repeats is not None and args.gen_repeats < 1:
        parser.error(f"--gen-repeats {args.gen_repeats}: must be >= 1")
    if not 0 < args.sparsity < 1:
        parser.error(f"--sparsity {args.sparsity}: must be between 0 and 1")
    for entry in args.locate:
        task, _, signal = entry.partition(":")
        if task not in ("choice", "gen") or signal not in ("", "metric", "logprob"):
            parser.error(f"--locate {entry!r}: expected choice or gen, optionally with "
                         ":metric or :logprob (gen:logprob)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    if (why := bench_refusal(args.out)) is not None:
        parser.error(f"--out: {why}")  # before the benchmark, not after it
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shown_command("HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 python "
                            "benchmarks/bench_measure.py",
                            sys.argv[1:] if argv is None else list(argv))
    started, load_start = time.perf_counter(), os.getloadavg()[0]
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    if args.config:
        name = section_name(f"bench_measure {args.config}", args.device)
        run_scale(args, command, lambda text: write_section(args.out, name, demote(text)))
        print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s in all)", flush=True)
        return 0
    model_args = smollm2_model_args(device=args.device)

    setups = {task: prepare(RunSpec(model_args=model_args, tasks=(task,), seed=args.seed,
                                    batch_size=args.batch_size))
              for task in (LOGLIK_TASK, GEN_TASK)}
    task_manager = make_task_manager()
    first = setups[LOGLIK_TASK]
    matrix = design_matrix("stratified", 1, first.total_heads, 0.02, args.seed)
    heads = [Head.from_flat_index(int(i), first.heads_per_layer) for i in matrix[0].nonzero()[0]]
    print(f"mask ({len(heads)} heads): {format_heads(heads)}", flush=True)

    loading = time.perf_counter()
    lm = load_model(first)
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
              f"{fmt_ratio(ratio(result.ours, result.limit))}"
              + (f"; before {result.before.cell()} s" if result.before.seconds else "")
              + f"; score reference "
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

    per_pass = []
    if args.per_pass_values:
        matrix = design_matrix("stratified", args.multi_masks, first.total_heads, 0.02,
                               args.seed)
        masks = [[Head.from_flat_index(int(i), first.heads_per_layer) for i in row.nonzero()[0]]
                 for row in matrix]
        print(f"masks per pass {args.per_pass_values} on {len(masks)} masks ...", flush=True)
        per_pass = bench_masks_per_pass(measures[LOGLIK_TASK], LOGLIK_TASK, masks,
                                        args.per_pass_values, args.multi_repeats, args.device)
        for r in per_pass:
            print(f"  K={r.per_pass}: {r.seconds_per_mask.cell()} s per mask, max score "
                  f"difference {r.max_score_diff:.2g}", flush=True)

    total = time.perf_counter() - started
    text = render(results, profile, args, heads, command, model_args, total,
                  (load_start, os.getloadavg()[0]), per_pass)
    # The CPU run owns the head of the file, a GPU run its own section; the other
    # benchmarks' sections are kept as they are.
    if args.device == "cpu":
        write_head(args.out, text)
    else:
        write_section(args.out, section_name("bench_measure", args.device), demote(text))
    print(f"wrote {args.out} ({total:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
