"""Several masks per ``generate`` call: what a generation task's measurement costs per mask.

For a generation task measured by its metric (``multigen``: K masks share each ``generate``
call, every row stopping on its own), it times ``measure_many`` at K = 1, the ``--ks`` and the
automatic K (``measure.HarnessMeasurement.auto_masks_per_pass``), seconds per mask, against the bare
``model.generate`` of the very calls ours made (the same rows and new tokens, no harness, no
hooks); with ``--step-profile STEPS``, where a decoding step's time goes (``step_profile``:
the automatic K's largest call bare, with the knockout, with the row stops, and ours); then,
with ``--locate``, a whole default ``headloc-harness locate`` of the task in a process of its
own, timed from its start (imports and model load included) to its end
(``--locate-max-measurements N``: with that ``--max-measurements``).

On a random-weight model of a published shape (``--config llama-3.1-8b``, ``bench_shapes``:
the gsm8k-shaped task, 100 documents, up to 256 tokens; the random model always generates
all 256, the worst case) or the embedded SmolLM2 (``--embedded``, e.g. ``--task rhyme``)::

    python benchmarks/bench_generation.py --config llama-3.1-8b --device cuda --locate
    python benchmarks/bench_generation.py --embedded --task rhyme --num-samples 16 --ks 4 \
        --step-profile 12

Writes its own section of ``BENCH.md`` (``bench_generation <model> <device>``, the embedded
model's ``bench_generation SmolLM2-135M-Instruct <task>``) after each stage, so a run cut
short keeps what it measured.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# As headloc-harness sets it (console.py): what the timed measurements run with.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from transformers import StoppingCriteria  # noqa: E402

from headloc_bench import ROOT, bench_shapes  # noqa: E402
from headloc_bench.bench_sections import (  # noqa: E402
    bench_refusal,
    section_name,
    shown_command,
    write_section,
)
from headloc_bench.measuring import machine_lines, sync  # noqa: E402
from lm_eval_headloc.common.checks import UsageError  # noqa: E402
from lm_eval_headloc.intervention.components import Head  # noqa: E402
from lm_eval_headloc.intervention.embedded import smollm2_model_args  # noqa: E402
from lm_eval_headloc.measurement.sizing import is_out_of_memory  # noqa: E402
from lm_eval_headloc.method.designs import design_matrix  # noqa: E402
from lm_eval_headloc.runs.option_values import parse_max_measurements  # noqa: E402
from lm_eval_headloc.runs.plan import load_model, open_measurement  # noqa: E402
from lm_eval_headloc.runs.setup import prepare  # noqa: E402
from lm_eval_headloc.runs.spec import RunSpec  # noqa: E402


@dataclass
class Call:
    """One ``generate`` call ours made: its prompts, how many tokens it generated, and the
    stop strings it was given."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    new_tokens: int
    stop: list[str] = field(default_factory=list)


@dataclass
class StepRow:
    """One way of running the largest call of the automatic K (``step_profile``): its
    generated steps and seconds (the fastest of the repeats), and when each step ended
    (``StepClock``)."""

    name: str
    steps: int
    seconds: float
    rows: int = 0
    changed_rows: int | None = None  # knockout: the rows whose tokens differ from the bare's
    same_tokens: bool | None = None  # row stops: its tokens are the knockout's
    step_ends: list[float] = field(default_factory=list)  # seconds from the call's start
    peak_gib: float | None = None  # on a GPU: the most memory allocated during the call

    @property
    def prompt_seconds(self) -> float:
        """The prompts' pass and the first token: up to the first step's end."""
        return self.step_ends[0] if self.step_ends else self.seconds

    @property
    def per_step(self) -> float:
        """Seconds a decoding step after the first token (the prompts' pass apart); with
        one step, the call's seconds."""
        if len(self.step_ends) < 2:
            return self.seconds / max(self.steps, 1)
        return (self.step_ends[-1] - self.step_ends[0]) / (len(self.step_ends) - 1)


class StepClock(StoppingCriteria):
    """Stops no row: notes when each step of a ``generate`` call ended (the device
    synchronised first; ``generate`` itself waits for the device once a step, to know
    whether every row has finished, so this adds no wait of its own), so that the prompts'
    pass and the decoding steps are timed apart."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.ends: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        sync(self.device)
        self.ends.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@contextlib.contextmanager
def clocked(model: Any, clock: StepClock) -> Iterator[None]:
    """Inside, every ``model.generate`` call also has ``clock`` among its stopping criteria
    (ours' own call included, which makes its criteria itself)."""
    from transformers import StoppingCriteriaList

    real, own = model.generate, vars(model).get("generate")

    def generate(*args: Any, stopping_criteria: Any = None, **kwargs: Any) -> Any:
        criteria = StoppingCriteriaList([*(stopping_criteria or ()), clock])
        return real(*args, stopping_criteria=criteria, **kwargs)

    model.generate = generate
    try:
        yield
    finally:
        if own is None:
            del model.generate  # the class's own again
        else:
            model.generate = own


@dataclass
class KRow:
    per_call: int  # K
    auto: bool = False
    seconds_per_mask: float | None = None  # None: out of memory
    bare_per_mask: float | None = None  # None: not timed
    rows_per_call: int = 0
    calls: int = 0
    peak_gib: float | None = None
    scores: list[float] = field(default_factory=list)
    largest: Call | None = None  # its largest generate call (``step_profile``)


@dataclass
class LocateRun:
    command: str
    wall: float = 0.0
    measured: float = 0.0  # seconds inside the measurements (measurements.jsonl)
    measurements: int = 0
    ok: bool = False
    tail: str = ""
    phases: str = ""  # where its time went, as the run recorded it (config.json's timings)


@dataclass
class Report:
    model: str
    task: str
    docs: int
    rows: int = 0
    auto: int = 0
    new_tokens: int = 0
    setup_seconds: float = 0.0
    ks: list[KRow] = field(default_factory=list)
    locate: LocateRun | None = None
    steps: list[StepRow] = field(default_factory=list)  # --step-profile
    notes: list[str] = field(default_factory=list)


def record_calls(lm: Any, calls: list[Call]) -> Callable[[], None]:
    """From now on every ``lm._model_generate`` call is kept in ``calls`` (its prompts and
    new tokens); the returned function stops it."""
    real = lm._model_generate

    def keep(context: torch.Tensor, max_length: int, stop: list[str], **kwargs: Any
             ) -> torch.Tensor:
        out = real(context, max_length, stop, **kwargs)
        mask = kwargs.get("attention_mask")
        calls.append(Call(context, mask, int(out.shape[1] - context.shape[1]), list(stop)))
        return out

    lm._model_generate = keep
    return lambda: delattr(lm, "_model_generate")


@torch.no_grad()
def bare_generate(lm: Any, calls: Sequence[Call], device: str) -> float:
    """Seconds of ``model.generate`` on ``calls``' very prompts for their new tokens: no
    harness, no knockout hooks (outside ``lm.forward_pass`` they do nothing), no stopping
    criteria but the token count."""
    sync(device)
    start = time.perf_counter()
    for call in calls:
        lm.model.generate(input_ids=call.input_ids, attention_mask=call.attention_mask,
                          max_new_tokens=call.new_tokens, min_new_tokens=call.new_tokens,
                          do_sample=False, pad_token_id=lm.tokenizer.pad_token_id,
                          use_cache=True)
    sync(device)
    return time.perf_counter() - start


@torch.no_grad()
def step_profile(lm: Any, call: Call, masks: Sequence[Sequence[Head]], device: str,
                 steps: int, repeats: int = 3) -> list[StepRow]:
    """Where a decoding step's time goes: ``call`` (the automatic K's largest ``generate``
    call, one row per prompt and mask, the ``masks`` in turn), for its first ``steps``
    new tokens at most, run four ways, in turn ``repeats`` times (each time starting one
    way further on, so that none always runs first), the fastest of each kept. **bare**:
    ``model.generate`` for those tokens, nothing else. **knockout**: the same with every
    layer's hook applying each row's mask (``knocking_out`` with per-row masks, inside
    ``forward_pass``). **row stops**: that, with the criteria that end each row on its own
    (``multigen.RowStops``) looking at every step. **ours**: ours' own call
    (``_model_generate``, as ``measure_many`` made it: also the prompts' common start once
    per mask and, on a CPU, finished rows leaving the batch), which ends early where every
    row stopped. The first three generate as many tokens, so their differences per step
    are the knockout's and the stop checks' cost. Each step's end is noted (``StepClock``),
    so a step's time is told apart from the prompts' pass, which ours computes otherwise
    and which, over a few steps of a large call, is most of the time."""
    from transformers import StoppingCriteriaList

    from lm_eval_headloc.intervention.multigen import row_stops_for, rows_stop_on_their_own

    ids, attention, new = call.input_ids, call.attention_mask, min(call.new_tokens, steps)
    rows, width = int(ids.shape[0]), int(ids.shape[1]) + new
    per_mask = lm.knockout.row_masks(masks).repeat_interleave(rows // len(masks), dim=0)
    fixed = {"input_ids": ids, "attention_mask": attention, "max_new_tokens": new,
             "min_new_tokens": new, "do_sample": False, "use_cache": True,
             "pad_token_id": lm.tokenizer.pad_token_id}

    def bare() -> torch.Tensor:
        return lm.model.generate(**fixed)

    ended: list[list[int | None]] = []  # the row stops' finishing widths, per run

    def knockout(stopping: bool = False) -> torch.Tensor:
        with lm.knocking_out(row_masks=per_mask), lm.forward_pass(ids, attention, width), \
                rows_stop_on_their_own(lm):
            criteria = [row_stops_for(lm, call.stop, int(ids.shape[1]), rows)] if stopping \
                else []
            out = lm.model.generate(**fixed, stopping_criteria=StoppingCriteriaList(criteria))
        if stopping:
            ended.append(criteria[0].finished_at)
        return out

    def ours() -> torch.Tensor:
        with lm.knocking_out(row_masks=per_mask):
            return lm._model_generate(ids, width, call.stop, attention_mask=attention)

    ways: dict[str, Callable[[], torch.Tensor]] = {
        "bare": bare, "knockout": knockout, "row stops": lambda: knockout(True), "ours": ours}
    best: dict[str, StepRow] = {}
    tokens: dict[str, torch.Tensor] = {}
    names, on_gpu = list(ways), device.startswith("cuda")
    for turn in range(repeats):
        for name in names[turn % len(names):] + names[:turn % len(names)]:
            run, clock = ways[name], StepClock(device)
            if on_gpu:  # a way that holds more memory may make the allocator work a step
                torch.cuda.reset_peak_memory_stats()
            with clocked(lm.model, clock):
                sync(device)
                start = time.perf_counter()
                out = run()
                sync(device)
                seconds = time.perf_counter() - start
            tokens[name] = out
            if name not in best or seconds < best[name].seconds:
                best[name] = StepRow(
                    name, int(out.shape[1]) - int(ids.shape[1]), seconds, rows,
                    step_ends=[end - start for end in clock.ends],
                    peak_gib=torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None)
    # The knockout timed is applied (the rows whose tokens it changed from the bare's), and
    # the row stops only end rows: each row's tokens are the knockout's up to its end (after
    # it, generate pads it).
    changed = (tokens["knockout"] != tokens["bare"]).any(dim=1)
    best["knockout"].changed_rows = int(changed.sum())
    stopped, full = tokens["row stops"], tokens["knockout"]
    best["row stops"].same_tokens = all(
        torch.equal(stopped[row, :end], full[row, :end])
        for row, end in enumerate(int(e) if e is not None else stopped.shape[1]
                                  for e in ended[-1]))
    return [best[name] for name in ways]


def premap(share: float = 0.9) -> None:
    """Have the CUDA allocator map ``share`` of the free memory now, and keep it: whichever
    of ours and the bare generate ran first at a K would otherwise pay for growing into the
    memory (on an H200 without it, ours ran first and was 1.29-1.41x the bare generate)."""
    free, _ = torch.cuda.mem_get_info()
    block = torch.empty(int(free * share), dtype=torch.uint8, device="cuda")
    del block  # back to the allocator's cache, still mapped (no empty_cache after it)


def time_k(measure: Any, masks: Sequence[Sequence[Head]], k: int, device: str,
           bare: bool) -> KRow:
    """``measure_many`` of ``k`` masks at ``k`` per call, once, and (``bare``) the bare
    generate of the same calls."""
    row = KRow(k)
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        premap()
        torch.cuda.reset_peak_memory_stats()
    calls: list[Call] = []
    stop = record_calls(measure.lm, calls)
    measure.most_masks_per_pass = None
    try:
        sync(device)
        start = time.perf_counter()
        scores = measure.measure_many(list(masks[:k]), masks_per_pass=k)
        sync(device)
        seconds = time.perf_counter() - start
    except (RuntimeError, MemoryError) as error:
        if not is_out_of_memory(error):
            raise
        return row
    finally:
        stop()
    if measure.most_masks_per_pass is not None:  # halved: this K does not fit
        measure.most_masks_per_pass = None
        return row
    row.seconds_per_mask = seconds / k
    row.calls = len(calls)
    row.rows_per_call = max(int(c.input_ids.shape[0]) for c in calls)
    row.largest = max(calls, key=lambda c: int(c.input_ids.numel()))
    row.scores = [s[measure.tasks[0][0]].value for s in scores]
    if device.startswith("cuda"):
        row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    if bare:
        row.bare_per_mask = bare_generate(measure.lm, calls, device) / k
    return row


def run_locate(model_args: str, task: str, include: str | None, seed: int, out: Path,
               timeout: float, max_measurements: int | str | None = None) -> LocateRun:
    """A default ``locate`` of ``task`` as a user starts it: a new process; with
    ``max_measurements``, its ``--max-measurements`` (54: the default run before its group
    tests, which a certified run of a random-weight model's hundreds of heads would spend
    up to half an evaluation per head on)."""
    argv = [sys.executable, "-c", "from lm_eval_headloc.cli.console import main; "
            "raise SystemExit(main())", "locate", "--model-args", model_args,
            "--tasks", task, "--seed", str(seed), "--out", str(out)]
    if max_measurements is not None:
        argv[argv.index("--out"):argv.index("--out")] = [
            "--max-measurements", str(max_measurements)]
    if include:
        argv[argv.index("--tasks"):argv.index("--tasks")] = ["--include-path", include]
    # Said without this machine's temporary folders.
    shown = "headloc-harness " + shlex.join(argv[3:]).replace(str(out.parent), "<work>")
    run = LocateRun(shown)
    print(f"{shown} ...", flush=True)
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
        run.ok = done.returncode == 0
        run.tail = (done.stdout + done.stderr)[-2000:]
    except subprocess.TimeoutExpired as expired:
        run.tail = f"stopped after {timeout:.0f} s: {str(expired.stdout or '')[-1000:]}"
    run.wall = time.perf_counter() - start
    records = out / "measurements.jsonl"
    if records.is_file():
        lines = [json.loads(line) for line in records.read_text(encoding="utf-8").splitlines()
                 if line.strip()]
        run.measurements = len(lines)
        run.measured = sum(float(r["seconds"]) for r in lines)
    config = out / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("timings"):
        from lm_eval_headloc.common.timing import timings_line

        run.phases = timings_line(json.loads(config.read_text())["timings"])
    print(f"  {'ok' if run.ok else 'FAILED'} in {run.wall:.1f} s: {run.measurements} "
          f"measurements, {run.measured:.1f} s of them", flush=True)
    if not run.ok:
        print(run.tail, flush=True)
    return run


def _cell(value: float | None, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def step_lines(report: Report) -> list[str]:
    """The step profile's table (``step_profile``): each way's steps and time a step, and
    what it adds to the way before it."""
    rows = {step.name: step for step in report.steps}
    bare = rows["bare"]
    lines = ["### One `generate` call taken apart", "",
             f"The automatic K's largest `generate` call ({bare.rows} rows: {report.auto} "
             f"masks' {bare.rows // max(report.auto, 1)} prompts each) for its first "
             f"{bare.steps} new tokens, run four ways in turn, three times (each time "
             "starting one way further on), the fastest of each kept: **bare** "
             "`model.generate` for them; **knockout**: the same with every layer's hook "
             "applying each row's mask; **row stops**: that, with the criteria ending each "
             "row on its own looking at every step; **ours**: ours' own call (also the "
             "prompts' common start once per mask and, on a CPU, finished rows leaving the "
             "batch; it ends early where every row stopped). The first three generate as "
             "many tokens. Each step's end is noted as it happens (the device waited for "
             "first, as `generate` waits for it once a step anyway): **the prompts' pass** "
             "is the call's start to its first token's end, **ms a step** the mean of the "
             "steps after it; **peak GiB**, on a GPU, the most memory the call held.", "",
             "| way | steps | seconds | the prompts' pass (s) | ms a step | "
             "ms a step over the way before | ms a step over the bare | peak GiB |",
             "|---|---|---|---|---|---|---|---|"]
    before = None
    for step in report.steps:
        over_before = "" if before is None else \
            f"{(step.per_step - before.per_step) * 1000:+.2f}"
        lines.append(f"| {step.name} | {step.steps} | {step.seconds:.3f} | "
                     f"{step.prompt_seconds:.3f} | {step.per_step * 1000:.2f} | {over_before} | "
                     f"{(step.per_step - bare.per_step) * 1000:+.2f} | "
                     f"{_cell(step.peak_gib, 1)} |")
        before = step
    knockout, stops = rows["knockout"], rows["row stops"]
    lines += ["", f"The knockout changed the tokens of {knockout.changed_rows} of the call's "
              f"{knockout.rows} rows from the bare's (so it is applied); the row stops' tokens "
              f"are the knockout's up to each row's end: "
              f"{'yes' if stops.same_tokens else '**no**'}."]
    return lines


def render(report: Report, args: argparse.Namespace, command: str, total: float) -> str:
    device = "GPU" if args.device == "cuda" else "CPU"
    lines = [f"# Generation: several masks per `generate` call ({report.model}, {device})", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}` "
             f"({total:.0f} s in all).", "", *machine_lines(args.device), "",
             f"- task: `{report.task}`, {report.docs} documents, greedy, up to "
             f"{report.new_tokens} new tokens; {report.rows} rows per mask in each `generate` "
             f"call (the measurement's batch: every document where memory allows on a GPU); "
             f"the automatic K is **{report.auto}**",
             "- **ours**: `measure_many(K masks, masks_per_pass=K)`: K masks share each "
             "`generate` call (each row its own mask, rows stopping on their own), lm-eval "
             "scores each mask; timed once per K, in seconds per mask",
             "- **bare generate**: `model.generate` on the very prompts of ours' calls for "
             "the tokens they generated: no harness, no knockout, no stopping criteria, "
             "every prompt computed whole (ours computes the prompts' common start once "
             "per mask: `intervention/prompt_start.py`)", ""]
    timed = [r for r in report.ks if r.seconds_per_mask is not None]
    one = next((r for r in timed if r.per_call == 1), None)
    best = min(timed, key=lambda r: r.seconds_per_mask) if timed else None
    lines += ["| K | rows per call | calls | s per mask | speed-up vs K = 1 | bare generate, "
              "s per mask | ours / bare | peak GiB | scores as K = 1 |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in report.ks:
        label = f"{r.per_call}" + (" (automatic)" if r.auto else "") + \
            (" (best)" if r is best else "")
        if r.seconds_per_mask is None:
            lines.append(f"| {label} | | | out of memory | | | | | |")
            continue
        speed = "" if one is None else f"{one.seconds_per_mask / r.seconds_per_mask:.2f}×"
        ratio = "" if r.bare_per_mask is None else \
            f"{r.seconds_per_mask / r.bare_per_mask:.2f}×"
        same = "" if one is None or not one.scores else \
            ("yes" if r.scores[:len(one.scores)] == one.scores else "**no**")
        lines.append(f"| {label} | {r.rows_per_call} | {r.calls} | "
                     f"{_cell(r.seconds_per_mask)} | {speed} | {_cell(r.bare_per_mask)} | "
                     f"{ratio} | {_cell(r.peak_gib, 1)} | {same} |")
    auto = next((r for r in timed if r.auto), None)
    if auto is not None and best is not None:
        lines += ["", f"The automatic K = {auto.per_call} takes "
                  f"{auto.seconds_per_mask / best.seconds_per_mask:.2f}× the seconds per mask "
                  f"of the best measured K = {best.per_call} (the bar: within 1.10×)."]
    if report.steps:
        lines += ["", *step_lines(report)]
    if report.locate is not None:
        run = report.locate
        capped = "" if args.locate_max_measurements is None else \
            f" with `--max-measurements {args.locate_max_measurements}`"
        lines += ["", f"### A whole default `locate`{capped}", "",
                  f"`{run.command}`: a new process, timed from its start (imports and the "
                  "model load included) to its end" + ("" if run.ok else " — **it failed**") +
                  ".", "",
                  "| wall clock | measurements | seconds in them |", "|---|---|---|",
                  f"| {run.wall:.1f} s ({run.wall / 60:.1f} min) | {run.measurements} | "
                  f"{run.measured:.1f} |"]
        if run.phases:
            lines += ["", f"Its phases, as the run recorded them (config.json's `timings`, "
                      f"up to its last phase before the report): {run.phases}."]
        if not run.ok:
            lines += ["", "```", run.tail.strip(), "```"]
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines)


def locate_cap(text: str) -> int | str:
    """``--locate-max-measurements``: what locate's ``--max-measurements`` takes, checked
    before the benchmark's minutes rather than by the locate after them."""
    try:
        return parse_max_measurements(text)
    except UsageError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", choices=bench_shapes.shape_names(),
                       help="a random-weight model of this shape, on the gsm8k-shaped task")
    which.add_argument("--embedded", action="store_true", help="the embedded SmolLM2")
    parser.add_argument("--task", default=None,
                        help="with --embedded: the task (default rhyme)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 "
                        "on the CPU")
    parser.add_argument("--num-samples", type=int, default=100)
    parser.add_argument("--max-gen-toks", type=int, default=256, help="with --config")
    parser.add_argument("--ks", default="4,8", help="K values timed besides 1 and the "
                        "automatic K (default 4,8)")
    parser.add_argument("--bare", default="1,auto",
                        help="the K values whose bare generate is timed too (default 1,auto)")
    parser.add_argument("--step-profile", type=int, default=0, metavar="STEPS",
                        help="take the automatic K's largest generate call apart for its "
                             "first STEPS new tokens: bare, with the knockout, with the row "
                             "stops, ours (step_profile; default 0: not)")
    parser.add_argument("--locate", action="store_true", help="time a whole default locate")
    parser.add_argument("--locate-timeout", type=float, default=480.0)
    parser.add_argument("--locate-max-measurements", type=locate_cap, default=None,
                        metavar="N",
                        help="with --locate: the locate's --max-measurements (default: "
                             "none given, the default certified run)")
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "BENCH.md")
    args = parser.parse_args(argv)
    try:
        args.k_values = sorted({1, *(int(k) for k in args.ks.split(",") if k.strip())})
        args.bare_values = {k.strip() for k in args.bare.split(",") if k.strip()}
    except ValueError:
        parser.error(f"--ks {args.ks!r}: whole numbers separated by commas")
    if any(k < 1 for k in args.k_values) or args.num_samples < 1:
        parser.error("--ks and --num-samples: whole numbers >= 1")
    if args.locate_max_measurements is not None and not args.locate:
        parser.error(f"--locate-max-measurements {args.locate_max_measurements}: only "
                     "with --locate")
    if args.step_profile < 0:
        parser.error(f"--step-profile {args.step_profile}: a number of steps >= 1 (0: not)")
    problem = bench_refusal(args.out)
    if problem is not None:
        parser.error(problem)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shown_command("python benchmarks/bench_generation.py",
                            sys.argv[1:] if argv is None else list(argv))
    started = time.perf_counter()
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    work = Path(tempfile.mkdtemp(prefix="headloc-gen-"))
    include = None
    if args.embedded:
        name, task = "SmolLM2-135M-Instruct", args.task or "rhyme"
        model_args = smollm2_model_args(device=args.device)
    else:
        name, task = args.config, bench_shapes.GEN_TASK
        model_dir = args.model_dir or work / f"{args.config}-{args.dtype}"
        print(f"building a random-weight {name} ({args.dtype}) ...", flush=True)
        bench_shapes.build_random_model(name, model_dir, args.dtype, args.device, args.seed)
        include = str(work / "tasks")
        bench_shapes.write_tasks(Path(include), docs=args.num_samples,
                                 max_gen_toks=args.max_gen_toks, seed=args.seed)
        model_args = f"pretrained={model_dir},dtype={args.dtype},device={args.device}"
    # The embedded model's tasks each have a section of their own.
    section = section_name(f"bench_generation {name}" + (f" {task}" if args.embedded else ""),
                           args.device)
    report = Report(name, task, args.num_samples)

    def emit() -> None:
        write_section(args.out, section, render(report, args, command,
                                                time.perf_counter() - started))

    spec = RunSpec(model_args=model_args, tasks=(task,), seed=args.seed,
                   include_path=(include,) if include else ())
    setup = prepare(spec)
    lm = load_model(setup)
    measure = open_measurement(setup, lm, num_samples=args.num_samples)
    if not measure.generates_together:
        raise SystemExit(f"{task}: its masks cannot share generate calls")
    report.rows = min(measure.rows_per_generate(), len(measure.generating_instances()))
    report.auto = auto = measure.auto_masks_per_pass()
    instances = measure.generating_instances()
    report.docs = len(instances)
    report.new_tokens = max(int(i.args[1].get("max_gen_toks", lm.max_gen_toks))
                            for i in instances)
    report.setup_seconds = time.perf_counter() - started
    print(f"{len(instances)} requests, {report.rows} rows per mask, automatic K = {auto} "
          f"({report.setup_seconds:.0f} s)", flush=True)
    values = sorted({*args.k_values, auto})
    matrix = design_matrix("stratified", max(values), setup.total_heads, 0.02, args.seed)
    masks = [[Head.from_flat_index(int(i), setup.heads_per_layer) for i in row.nonzero()[0]]
             for row in matrix]
    measure.measure_many(masks[:1], masks_per_pass=1)  # warm-up: kernels, allocator
    out_of_memory = None
    for k in values:
        if out_of_memory is not None and k >= out_of_memory:
            report.ks.append(KRow(k, auto=k == auto))
            continue
        bare = str(k) in args.bare_values or (k == auto and "auto" in args.bare_values)
        print(f"K = {k} ...", flush=True)
        row = time_k(measure, masks, k, args.device, bare)
        row.auto = k == auto
        if row.seconds_per_mask is None:
            out_of_memory = k
            print("  out of memory", flush=True)
        else:
            print(f"  {row.seconds_per_mask:.3f} s per mask ({row.calls} calls of up to "
                  f"{row.rows_per_call} rows)" + ("" if row.bare_per_mask is None else
                                                   f", bare {row.bare_per_mask:.3f}"),
                  flush=True)
        report.ks.append(row)
        emit()
    largest = next((r.largest for r in report.ks if r.auto and r.largest is not None), None)
    if args.step_profile and largest is not None:
        print(f"one call of K = {auto} taken apart ...", flush=True)
        report.steps = step_profile(lm, largest, masks[:auto], args.device,
                                    args.step_profile)
        for step in report.steps:
            print(f"  {step.name}: {step.steps} steps, the prompts' pass "
                  f"{step.prompt_seconds:.3f} s, {step.per_step * 1000:.2f} ms a step",
                  flush=True)
        emit()
    del lm, measure
    gc.collect()
    if args.device == "cuda":
        torch.cuda.empty_cache()
        print(f"left allocated here: {torch.cuda.memory_allocated() / 2**30:.2f} GiB",
              flush=True)
    if args.locate:
        report.locate = run_locate(model_args, task, include, args.seed, work / "locate",
                                   args.locate_timeout, args.locate_max_measurements)
        emit()
    shutil.rmtree(work, ignore_errors=True)  # our own temporary folder
    print(f"wrote {args.out} ({time.perf_counter() - started:.0f} s in all)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
