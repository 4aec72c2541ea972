"""``bench_measure.py --config NAME``: one measurement's cost at the sizes users run.

On a random-weight model of a published shape (``bench_shapes``: Llama-3.2-1B,
Llama-3.1-8B) with a byte-level tokenizer, for an MMLU-shaped loglikelihood task and a
gsm8k-shaped generation task (``bench_shapes.write_tasks``), it times:

1. ours vs the bare forward (the limit) vs the paper's reload-per-mask reference, one
   mask, as ``measuring.bench_task`` does for the embedded model; the reference's
   evaluation on a generation task runs on ``--reference-gen-docs`` documents and is
   scaled to all of them (batch size 1 makes it linear in the documents);
2. K masks per forward pass, K doubling from 1 until the GPU runs out of memory (or
   ``--max-masks-per-pass``), with peak memory, and the automatic K
   (``measure.HarnessMeasurement.auto_masks_per_pass``) against the best measured;
3. the generation task measured by generating against ``--signal logprob`` (the gold
   answers' teacher-forced log-likelihood, several masks per pass);
4. whole ``locate`` runs with the default settings but fewer masks and confirmations,
   their fixed part (load, prior, head types, fit) measured, and the default run's wall
   clock extrapolated from the measured parts (``extrapolate_default``).

Writes its own section of ``BENCH.md`` (``bench_measure <config> <device>``).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from headloc_bench import bench_shapes
from headloc_bench.bench_sections import measured_now
from headloc_bench.measuring import (
    TaskResult,
    Timing,
    bench_task,
    fmt_ratio,
    fmt_score,
    machine_lines,
    ratio,
    sync,
    time_interleaved,
)
from lm_eval_headloc.intervention.components import Head, format_heads
from lm_eval_headloc.measurement.harness import batching
from lm_eval_headloc.measurement.sizing import MOST_MASKS_PER_PASS, is_out_of_memory
from lm_eval_headloc.method.designs import design_matrix
from lm_eval_headloc.runs.plan import load_model, open_measurement
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import RunSpec
from lm_eval_headloc.tasks import make_task_manager

#: Bars the issue sets: ours within 10 % of the bare forward at K = 1, and the automatic
#: K within 10 % of the best measured K.
BAR = 1.10
DEFAULTS = RunSpec().budgeted("atp-path")  # the defaults of a run with its prior


# --- several masks per pass, up to the memory limit ----------------------------------------

@dataclass
class PassRow:
    per_pass: int
    seconds_per_mask: float | None = None  # None: out of memory
    peak_gib: float | None = None
    masks: int = 0


def sweep_masks_per_pass(measure: Any, masks: Sequence[Sequence[Head]], device: str,
                         most: int, auto: int, least: int = 16) -> list[PassRow]:
    """Seconds per mask for K = 1, 2, 4, … up to ``most`` or the first out-of-memory
    error, and for ``auto`` if the doubling skipped it (also beyond ``most``). Each K
    measures ``max(K, least)`` of ``masks`` (at least one whole pass) after an untimed
    warm-up pass of the same shape."""
    values, k = [], 1
    while k <= most:
        values.append(k)
        k *= 2
    if auto not in values:
        values.append(auto)
    rows = []
    oom_at = None
    for k in sorted(values):
        if oom_at is not None and k >= oom_at:
            rows.append(PassRow(k))
            continue
        count = min(len(masks), max(k, least))
        row = PassRow(k, masks=count)
        try:
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            # measure_many halves K for good after an out-of-memory error: a K that
            # needed halving is this sweep's memory limit, not a timing of K.
            measure.most_masks_per_pass = None
            measure.measure_many(masks[:k], masks_per_pass=k)  # warm-up, same shape
            sync(device)
            start = time.perf_counter()
            measure.measure_many(masks[:count], masks_per_pass=k)
            sync(device)
            if measure.most_masks_per_pass is not None:
                raise torch.OutOfMemoryError(f"K = {k} was halved to "
                                             f"{measure.most_masks_per_pass}")
            row.seconds_per_mask = (time.perf_counter() - start) / count
            if device.startswith("cuda"):
                row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        except (RuntimeError, MemoryError) as error:
            if not is_out_of_memory(error):
                raise
            oom_at = k
            gc.collect()
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        rows.append(row)
        print(f"  K={k}: " + (f"{row.seconds_per_mask:.4f} s per mask over {count} masks"
                              if row.seconds_per_mask is not None else "out of memory"),
              flush=True)
    measure.most_masks_per_pass = None
    return rows


def best_row(rows: Sequence[PassRow]) -> PassRow | None:
    timed = [r for r in rows if r.seconds_per_mask is not None]
    return min(timed, key=lambda r: r.seconds_per_mask) if timed else None


# --- the generation task by generating vs by its gold log-likelihood -------------------------

@dataclass
class SignalRow:
    label: str
    per_pass: int
    seconds: Timing = field(default_factory=Timing)


def bench_logprob_signal(setup: Any, lm: Any, heads: Sequence[Head],
                         masks: Sequence[Sequence[Head]], num_samples: int, repeats: int,
                         device: str) -> list[SignalRow]:
    """``--signal logprob`` on the generation task: one mask (K = 1) and the automatic
    K, seconds per mask."""
    measure = open_measurement(setup, lm, num_samples=num_samples)
    measure(heads)  # warm-up; records the requests
    auto = measure.auto_masks_per_pass()
    one = SignalRow("`--signal logprob`, one mask per pass", 1)
    one.seconds = time_interleaved([lambda: measure(heads)], repeats, device)[0]
    rows = [one]
    if auto > 1:
        many = SignalRow(f"`--signal logprob`, automatic K = {auto} masks per pass", auto)
        chosen = list(masks[:auto])
        measure.measure_many(chosen, masks_per_pass=auto)  # warm-up
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            measure.measure_many(chosen, masks_per_pass=auto)
            sync(device)
            many.seconds.seconds.append((time.perf_counter() - start) / len(chosen))
        rows.append(many)
    return rows


def bench_one_batch(measure: Any, heads: Sequence[Head], docs: int, repeats: int,
                    device: str) -> SignalRow | None:
    """The generation task's measurement with all ``docs`` documents in one ``generate``
    batch rather than ``--batch-size`` rows: on a GPU a decoding step costs about the same
    for 32 rows or 100, so this says what a larger generation batch would buy. None when
    the batch already holds every document."""
    batch = measure.lm.batch_size
    if not isinstance(batch, int) or batch >= docs:
        return None
    row = SignalRow(f"generating, all {docs} documents in one batch (batch size {docs})", 1)
    with batching(measure.lm, docs):
        measure(heads)  # warm-up at this batch's shapes
        row.seconds = time_interleaved([lambda: measure(heads)], repeats, device)[0]
    return row


# --- a default locate, measured short and extrapolated ---------------------------------------

@dataclass
class LocateRow:
    task: str
    signal: str
    masks: int
    confirm: int
    wall: float = 0.0
    measured: float = 0.0  # seconds inside the measurements (measurements.jsonl)
    baseline: float = 0.0
    per_mask: float = 0.0
    per_confirm: float = 0.0
    prior: float = 0.0  # prior.json's own seconds (part of the fixed part)
    derived: bool = False  # not run: ``derived_generating_row``


    @property
    def fixed(self) -> float:
        """Everything but the measurements: model load, prior, head types, fit, files."""
        return self.wall - self.measured

    def default_seconds(self, masks: int = DEFAULTS.masks,
                        confirm: int = DEFAULTS.confirm) -> float:
        return extrapolate_default(self.fixed, self.baseline, self.per_mask,
                                   self.per_confirm, masks, confirm)


def derived_generating_row(logprob: LocateRow, generating: float) -> LocateRow:
    """The generating locate where it is too long to run (8B: ~40 s a measurement): the
    ``--signal logprob`` run's fixed part (load, prior, head types, fits: the same passes
    on the same task) and every measurement at ``generating`` seconds, what one
    measurement by generating took at the "one measurement" stage."""
    return LocateRow(logprob.task, "metric", 0, 0, wall=logprob.fixed, prior=logprob.prior,
                     baseline=generating, per_mask=generating, per_confirm=generating,
                     derived=True)


def extrapolate_default(fixed: float, baseline: float, per_mask: float, per_confirm: float,
                        masks: int, confirm: int) -> float:
    """A locate run's wall clock from its parts: the fixed part (independent of the
    number of measurements), the baseline, ``masks`` masks and ``confirm`` single-head
    confirmations at their measured seconds each."""
    return fixed + baseline + masks * per_mask + confirm * per_confirm


def read_locate_row(row: LocateRow, folder: Path) -> LocateRow:
    """Fill ``row``'s measured parts from the run folder's measurements.jsonl and
    prior.json."""
    records = [json.loads(line) for line in
               (folder / "measurements.jsonl").read_text(encoding="utf-8").splitlines()
               if line.strip()]
    seconds = {"baseline": [], "mask": [], "alone": []}
    for record in records:
        kind = record["key"].split("-", 1)[0]
        seconds.setdefault(kind, []).append(float(record["seconds"]))
    row.measured = sum(sum(v) for v in seconds.values())
    row.baseline = sum(seconds["baseline"])
    row.per_mask = statistics.mean(seconds["mask"]) if seconds["mask"] else 0.0
    row.per_confirm = statistics.mean(seconds["alone"]) if seconds["alone"] else 0.0
    prior = folder / "prior.json"
    if prior.is_file():
        row.prior = float(json.loads(prior.read_text(encoding="utf-8")).get("seconds", 0.0))
    return row


def run_locates(model_args: str, include: str, runs: Sequence[tuple[str, str, int, int]],
                batch_size: int, num_samples: int, seed: int, out: Path,
                done: Callable[[LocateRow], None] = lambda _row: None) -> list[LocateRow]:
    """Each ``(task, signal, masks, confirm)`` as a whole ``locate`` with the default
    settings otherwise, timed from the call to its return (the model load included);
    ``done`` is called with each row as it is measured."""
    from lm_eval_headloc.commands import locate

    rows = []
    for task, signal, masks, confirm in runs:
        folder = out / f"{task}-{signal}"
        spec = RunSpec(model_args=model_args, tasks=(task,), include_path=(include,),
                       signal=signal, masks=masks, confirm=confirm, batch_size=batch_size,
                       num_samples=num_samples, seed=seed, progress=False)
        print(f"locate {task} --signal {signal} --masks {masks} --confirm {confirm} ...",
              flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        start = time.perf_counter()
        locate(folder, spec, force=True)
        row = read_locate_row(LocateRow(task, signal, masks, confirm,
                                        wall=time.perf_counter() - start), folder)
        print(f"  {row.wall:.1f} s: fixed {row.fixed:.1f} s (prior {row.prior:.1f} s), "
              f"{row.per_mask:.3f} s per mask, {row.per_confirm:.3f} s per confirmation; "
              f"default run ≈ {row.default_seconds():.0f} s", flush=True)
        rows.append(row)
        done(row)
    return rows


# --- the whole benchmark --------------------------------------------------------------------

STAGES = ("one measurement", "masks per pass", "generating vs logprob", "locate runs")


@dataclass
class ScaleReport:
    """What the benchmark has measured so far (rendered after each stage, so a run cut
    short keeps what it measured)."""

    config: str
    params: int
    build_seconds: float
    prompt_tokens: dict[str, int]
    heads: list[Head]
    reference_gen_docs: int
    load_seconds: float = 0.0
    tasks: list[TaskResult] = field(default_factory=list)
    passes: list[PassRow] = field(default_factory=list)
    auto_per_pass: int = 0
    signal_rows: list[SignalRow] = field(default_factory=list)
    locates: list[LocateRow] = field(default_factory=list)
    total: float = 0.0
    left: list[str] = field(default_factory=lambda: list(STAGES))  # stages not finished
    notes: list[str] = field(default_factory=list)


def run_scale(args: argparse.Namespace, command: str, emit: Callable[[str], None]) -> None:
    """The benchmark of ``args.config``: ``emit`` gets the markdown section after each
    stage (a run cut short keeps the stages it finished)."""
    started = time.perf_counter()
    name, device = args.config, args.device
    work = Path(tempfile.mkdtemp(prefix="headloc-scale-"))
    model_dir = args.model_dir or work / f"{name}-{args.dtype}"
    print(f"building a random-weight {name} ({args.dtype}) in {model_dir} ...", flush=True)
    _, build_seconds, _ = bench_shapes.build_random_model(name, model_dir, args.dtype, device,
                                                          args.seed)
    include = work / "tasks"
    prompt_tokens = bench_shapes.write_tasks(include, docs=args.num_samples,
                                             max_gen_toks=args.max_gen_toks, seed=args.seed)
    model_args = f"pretrained={model_dir},dtype={args.dtype},device={device}"
    choice, gen = bench_shapes.CHOICE_TASK, bench_shapes.GEN_TASK

    def spec(task: str, signal: str = "metric") -> RunSpec:
        return RunSpec(model_args=model_args, tasks=(task,), include_path=(str(include),),
                       seed=args.seed, batch_size=args.batch_size, signal=signal)

    setups = {task: prepare(spec(task)) for task in (choice, gen)}
    first = setups[choice]
    task_manager = make_task_manager(str(include))
    # Enough masks for the automatic K too (at most sizing's cap), whatever the sweep's.
    matrix = design_matrix("stratified", max(args.max_masks_per_pass, args.sweep_masks,
                                             MOST_MASKS_PER_PASS),
                           first.total_heads, args.sparsity, args.seed)
    masks = [[Head.from_flat_index(int(i), first.heads_per_layer) for i in row.nonzero()[0]]
             for row in matrix]
    report = ScaleReport(name, bench_shapes.parameter_count(name), build_seconds,
                         prompt_tokens, masks[0], args.reference_gen_docs)

    def stage_done(stage: str | None = None) -> None:
        if stage is not None:
            report.left.remove(stage)
        report.total = time.perf_counter() - started
        print(f"[{report.total:.0f} s] {stage or 'progress'} written", flush=True)
        emit(render_scale(report, args, command))

    heads = report.heads
    loading = time.perf_counter()
    lm = load_model(first)
    report.load_seconds = time.perf_counter() - loading
    print(f"model loaded in {report.load_seconds:.1f} s; mask: {format_heads(heads)}",
          flush=True)

    measures = {}
    for task, kind, reference_docs, repeats in (
            (choice, "loglikelihood", None, args.repeats),
            (gen, "generation", args.reference_gen_docs, args.gen_repeats or args.repeats)):
        print(f"benchmarking {task} ...", flush=True)
        result, measures[task], _ = bench_task(
            setups[task], lm, task, kind, heads, args.num_samples, args.seed, repeats,
            args.reference_repeats, device, task_manager, before=False,
            reference_docs=reference_docs, answers=True)
        report.tasks.append(result)
        print(f"  ours {result.ours.cell()} s, limit {result.limit.cell()} s, reference "
              f"{result.reference.cell()} s; ours/limit "
              f"{fmt_ratio(ratio(result.ours, result.limit))}", flush=True)
        stage_done("one measurement" if task == gen else None)

    report.auto_per_pass = auto = measures[choice].auto_masks_per_pass()
    print(f"masks per pass on {choice} (automatic K = {auto}) ...", flush=True)
    report.passes = sweep_masks_per_pass(measures[choice], masks, device,
                                         args.max_masks_per_pass, auto, args.sweep_masks)
    stage_done("masks per pass")
    print(f"{gen} in one batch, and with --signal logprob ...", flush=True)
    one_batch = bench_one_batch(measures[gen], heads, args.num_samples,
                                args.gen_repeats or args.repeats, device)
    report.signal_rows = bench_logprob_signal(prepare(spec(gen, "logprob")), lm, heads,
                                                 masks, args.num_samples, args.repeats, device)
    report.signal_rows[:0] = [one_batch] if one_batch is not None else []
    stage_done("generating vs logprob")
    del lm, measures
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()

    runs = []
    for entry in args.locate:
        short, _, signal = entry.partition(":")
        task, signal = {"choice": choice, "gen": gen}[short], signal or "metric"
        generating = task == gen and signal == "metric"
        runs.append((task, signal, *((args.locate_gen_masks, args.locate_gen_confirm)
                                     if generating else (DEFAULTS.masks, 5))))
    run_locates(model_args, str(include), runs, args.batch_size, args.num_samples, args.seed,
                work / "runs", done=lambda row: (report.locates.append(row), stage_done()))
    logprob = next((r for r in report.locates if (r.task, r.signal) == (gen, "logprob")), None)
    generating = next((r for r in report.tasks if r.task == gen), None)
    if logprob is not None and generating is not None:
        # Beside a measured generating run it shows how far the derivation is off.
        report.locates.append(derived_generating_row(logprob, generating.ours.median))
    stage_done("locate runs")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)  # our own temporary folder


# --- report -----------------------------------------------------------------------------------

def _count(parameters: int) -> str:
    return (f"{parameters / 1e9:.2f} B" if parameters >= 1e8 else
            f"{parameters / 1e6:.2f} M")


def _minutes(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def render_scale(report: ScaleReport, args: argparse.Namespace, command: str) -> str:
    now = measured_now()
    shape = bench_shapes.SHAPES[report.config]
    heads_total = shape["num_hidden_layers"] * shape["num_attention_heads"]
    on = "the GPU" if args.device != "cpu" else "the CPU"
    lines = [
        f"# A measurement at {bench_shapes.PUBLISHED_AS[report.config]}'s size on {on}",
        "", "Generated by `benchmarks/bench_measure.py --config`; do not edit by hand.", "",
        "```bash", command, "```", "",
        f"- date: {now}; whole benchmark run {report.total:.0f} s"
        + (f"; **incomplete**: it stopped before finishing {', '.join(report.left)} "
           "(what is below was measured)" if report.left else ""),
        *machine_lines(args.device),
        f"- model: random weights of {bench_shapes.PUBLISHED_AS[report.config]}'s published "
        f"shape (`{report.config}`: {_count(report.params)} parameters, "
        f"{shape['num_hidden_layers']} layers × {shape['num_attention_heads']} heads = "
        f"{heads_total} heads, {shape['num_key_value_heads']} key/value heads, vocabulary "
        f"{shape['vocab_size']:,}), {args.dtype}, built and saved in "
        f"{report.build_seconds:.0f} s, loaded by `hf-headablate` in "
        f"{report.load_seconds:.1f} s; a byte-level tokenizer (one token per byte). A "
        "forward pass costs what the real model's does; the scores mean nothing.",
        f"- tasks ({args.num_samples} documents each): `{bench_shapes.CHOICE_TASK}`, "
        f"MMLU-shaped (multiple choice, 4 one-token letters after a prompt of "
        f"~{report.prompt_tokens[bench_shapes.CHOICE_TASK]} tokens); "
        f"`{bench_shapes.GEN_TASK}`, gsm8k-shaped (prompts of "
        f"~{report.prompt_tokens[bench_shapes.GEN_TASK]} tokens, gold answers of ~150, "
        f"greedy generation until \"Question:\" or {args.max_gen_toks} tokens: the random "
        f"model always generates all {args.max_gen_toks}, the worst case)",
        f"- mask: one stratified mask, sparsity {args.sparsity}: {len(report.heads)} "
        f"head{'s' if len(report.heads) != 1 else ''} knocked out; ours and limit: batch "
        f"size {args.batch_size}; reference: batch size 1",
        *summary_lines(report, args),
        "", "## One measurement: reference vs ours vs the forward-pass limit", "",
        "Seconds per measurement: median (min–max, n). Ours and the limit are timed "
        "alternately (every other round the limit first) after a warm-up; what each "
        "column is: see the embedded model's section above.", "",
        "| task | reference (reload + evaluate) | of which model load | ours | limit | "
        "reference/ours | ours/limit | score ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in report.tasks:
        lines.append(f"| `{r.task}` ({r.kind}) | {r.reference.cell()} | "
                     f"{r.reference_load.cell()} | {r.ours.cell()} | {r.limit.cell()} | "
                     f"{fmt_ratio(ratio(r.reference, r.ours))} | "
                     f"{fmt_ratio(ratio(r.ours, r.limit))} | {fmt_score(r.score_ours)} |")
    lines.append("")
    for r in report.tasks:
        value = ratio(r.ours, r.limit)
        verdict = ("n/a" if value != value else
                   f"{'within' if value <= BAR else 'over'} the bar of {BAR:.2f}")
        lines.append(f"- `{r.task}`: ours/limit {fmt_ratio(value)}, {verdict}; batches: "
                     f"{r.batches}")
        if r.answers.seconds:
            lines.append(f"  - of ours, the answers alone (forward passes and sums, no "
                         f"lm-eval `evaluate`): {r.answers.cell()} s, "
                         f"{fmt_ratio(ratio(r.answers, r.limit))} the limit; lm-eval's "
                         f"share {r.ours.median - r.answers.median:.3f} s")
        lines += [f"  - note: {note}" for note in r.notes]
    gen = next((r for r in report.tasks if r.task == bench_shapes.GEN_TASK), None)
    if report.reference_gen_docs and gen is not None:
        lines.append(f"- the reference's evaluation on `{bench_shapes.GEN_TASK}` ran on "
                     f"{report.reference_gen_docs} documents and is scaled to "
                     f"{args.num_samples} (batch size 1: one document after another); its "
                     "model load is measured whole")
    if report.passes:
        lines += _passes_lines(report, args)
    if gen is not None and report.signal_rows:
        lines += _signal_lines(report, gen)
    if report.locates:
        lines += _locate_lines(report)
    lines += [f"- note: {note}" for note in report.notes]
    return "\n".join(lines) + "\n"


def summary_lines(report: ScaleReport, args: argparse.Namespace) -> list[str]:
    """The section's findings in one sentence (what README quotes), once the locate runs
    are measured."""
    if not report.locates:
        return []
    device = "the CPU"
    if args.device.startswith("cuda") and torch.cuda.is_available():
        device = f"one {torch.cuda.get_device_name()}"
    words = {(bench_shapes.CHOICE_TASK, "metric"): "an MMLU-shaped task",
             (bench_shapes.GEN_TASK, "logprob"): "a gsm8k-shaped task with `--signal "
                                                 "logprob`",
             (bench_shapes.GEN_TASK, "metric"): "a gsm8k-shaped task generating "
                                                f"{args.max_gen_toks} tokens"}
    measured = {(row.task, row.signal) for row in report.locates if not row.derived}
    parts = [f"≈ {_minutes(row.default_seconds())} on {words[(row.task, row.signal)]}"
             + (" (derived from one measurement)" if row.derived else "")
             for row in report.locates
             if not (row.derived and (row.task, row.signal) in measured)]
    return ["", f"**In short**: a default `locate` (100 examples, {DEFAULTS.masks} masks + "
            f"{DEFAULTS.confirm} confirmations) on {bench_shapes.PUBLISHED_AS[report.config]}"
            f" ({args.dtype}) on {device} takes {'; '.join(parts)} (extrapolated from the "
            "measured parts below)."]


def _passes_lines(report: ScaleReport, args: argparse.Namespace) -> list[str]:
    lines = ["", f"## Several masks per forward pass (`{bench_shapes.CHOICE_TASK}`)", "",
              "K doubles from 1 until the GPU runs out of memory or K = "
              f"{args.max_masks_per_pass}, and the automatic K; each K measures "
              f"max(K, {args.sweep_masks}) "
              f"stratified masks (sparsity {args.sparsity}) after an untimed warm-up pass "
              "of the same shape.", "",
              "| K | rows per forward | s per mask | speed-up vs K = 1 | peak GPU memory | |",
              "| --- | --- | --- | --- | --- | --- |"]
    best = best_row(report.passes)
    first = next((r for r in report.passes if r.per_pass == 1), None)
    for r in report.passes:
        marks = []
        if r.per_pass == report.auto_per_pass:
            marks.append("automatic K")
        if best is not None and r is best:
            marks.append("best")
        if r.seconds_per_mask is None:
            lines.append(f"| {r.per_pass} | {args.batch_size * r.per_pass} | out of memory | "
                         f"| | {', '.join(marks)} |")
            continue
        speed = (first.seconds_per_mask / r.seconds_per_mask
                 if first and first.seconds_per_mask else float("nan"))
        peak = "n/a (CPU)" if r.peak_gib is None else f"{r.peak_gib:.1f} GiB"
        lines.append(f"| {r.per_pass} | {args.batch_size * r.per_pass} | "
                     f"{r.seconds_per_mask:.4f} | {fmt_ratio(speed)} | {peak} | "
                     f"{', '.join(marks)} |")
    auto_row = next((r for r in report.passes if r.per_pass == report.auto_per_pass), None)
    if best is not None and auto_row is not None and auto_row.seconds_per_mask is not None:
        value = auto_row.seconds_per_mask / best.seconds_per_mask
        lines += ["", f"Automatic K = {report.auto_per_pass}: {value:.2f}× the best measured "
                  f"K = {best.per_pass}'s seconds per mask, "
                  f"{'within' if value <= BAR else 'over'} the bar of {BAR:.2f}."]
    elif auto_row is not None:
        lines += ["", f"Automatic K = {report.auto_per_pass} ran out of memory."]
    return lines


def _signal_lines(report: ScaleReport, gen: TaskResult) -> list[str]:
    lines = ["", f"## The generation task: generating vs `--signal logprob` "
              f"(`{bench_shapes.GEN_TASK}`)", "",
              "`--signal logprob` scores each mask by the gold answers' mean "
              "log-likelihood, teacher-forced: one forward pass over prompt + answer, no "
              "generation, and several masks share a pass. The one-batch row generates "
              "as ours does, with every document in one `generate` call.", "",
              "| measuring by | s per mask | speed-up vs generating |",
              "| --- | --- | --- |",
              f"| generating (the task's metric; ours) | {gen.ours.cell()} | 1.00× |"]
    for row in report.signal_rows:
        lines.append(f"| {row.label} | {row.seconds.cell()} | "
                     f"{fmt_ratio(ratio(gen.ours, row.seconds))} |")
    return lines


def _locate_lines(report: ScaleReport) -> list[str]:
    default_total = DEFAULTS.masks + DEFAULTS.confirm + 1
    lines = ["", "## A whole default `locate`, measured short and extrapolated", "",
             f"Each row is a real `locate` (default settings: prior "
             f"{DEFAULTS.prior}, sparsity {DEFAULTS.sparsity}, bootstrap "
             f"{DEFAULTS.bootstrap}, head types) with fewer masks and confirmations "
             "than the default's; its wall clock is split into the fixed part "
             "(model load, attribution prior, head types, fits, files) and the "
             "measurements (measurements.jsonl's seconds), and the default run "
             f"(baseline + {DEFAULTS.masks} masks + {DEFAULTS.confirm} confirmations "
             f"= {default_total} measurements) is extrapolated from those parts.", "",
             "| task, signal | measured run | wall clock | fixed part (of which prior) | "
             "s per mask | s per confirmation | default run (extrapolated) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report.locates:
        if row.derived:
            lines.append(
                f"| `{row.task}`, {row.signal} | not run: the logprob run's fixed part, "
                f"every measurement at the seconds one took above | | {row.fixed:.0f} s "
                f"({row.prior:.0f} s) | {row.per_mask:.2f} | {row.per_confirm:.2f} | "
                f"**{_minutes(row.default_seconds())}** |")
            continue
        lines.append(
            f"| `{row.task}`, {row.signal} | {row.masks} masks + {row.confirm} "
            f"confirmations | {row.wall:.0f} s | {row.fixed:.0f} s ({row.prior:.0f} s) | "
            f"{row.per_mask:.2f} | {row.per_confirm:.2f} | "
            f"**{_minutes(row.default_seconds())}** |")
    reference = next(r for r in report.tasks if r.task == bench_shapes.CHOICE_TASK)
    ref_gen = next(r for r in report.tasks if r.task == bench_shapes.GEN_TASK).reference
    lines += ["", "The paper's own budget (its Appendix A.1): at least 100 masks, up to "
              "400, of 100 examples, each evaluated by reloading the model (its released "
              "code; the reference column above). At the reference's measured seconds "
              f"that is {_minutes(100 * reference.reference.median)}–"
              f"{_minutes(400 * reference.reference.median)} on "
              f"`{bench_shapes.CHOICE_TASK}` and {_minutes(100 * ref_gen.median)}–"
              f"{_minutes(400 * ref_gen.median)} on `{bench_shapes.GEN_TASK}`."]
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--config: a random-weight model of a published shape")
    group.add_argument("--config", choices=bench_shapes.shape_names(),
                       help="benchmark this shape instead of the embedded model")
    group.add_argument("--dtype", default="bfloat16",
                       choices=("bfloat16", "float16", "float32"))
    group.add_argument("--model-dir", type=Path, default=None,
                       help="where the random model is saved (default: a temporary folder); "
                       "a folder made earlier with the same settings is reused")
    group.add_argument("--max-gen-toks", type=int, default=256)
    group.add_argument("--sparsity", type=float, default=0.02)
    group.add_argument("--reference-gen-docs", type=int, default=10,
                       help="documents the generation reference evaluates (scaled to all)")
    group.add_argument("--max-masks-per-pass", type=int, default=64,
                       help="the largest K tried (default 64)")
    group.add_argument("--sweep-masks", type=int, default=16,
                       help="masks timed per K, at least K (default 16)")
    group.add_argument("--gen-repeats", type=int, default=None,
                       help="repetitions of ours and the limit on the generation task "
                       "(default: --repeats)")
    group.add_argument("--locate", nargs="*", default=["choice", "gen:logprob", "gen"],
                       help="locate runs: TASK[:SIGNAL], choice or gen (default: choice "
                       "gen:logprob gen)")
    group.add_argument("--locate-gen-masks", type=int, default=2)
    group.add_argument("--locate-gen-confirm", type=int, default=2)
    group.add_argument("--keep", action="store_true", help="keep the temporary folder")
