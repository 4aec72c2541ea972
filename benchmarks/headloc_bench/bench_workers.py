"""Measurements per second with 1 and 2 workers on the embedded model.

    python benchmarks/bench_workers.py                       # writes its section of BENCH.md
    python benchmarks/bench_workers.py --workers 1,2,4 --masks 60 --device cuda
    python benchmarks/bench_workers.py --config llama-3.1-8b --device cuda   # at 8B's size

Runs ``headloc-harness locate`` (the Lasso alone: ``--prior none --confirm 0``) once per
worker count on fresh run folders, and times the measuring (``run_plan``, the run's
"measurements" phase) apart from the start-up (model load, and the workers' own loads
and checks). The section between the markers in BENCH.md is replaced; the rest of the
file is left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from headloc_bench import ROOT, bench_shapes
from headloc_bench.bench_sections import (
    bench_refusal,
    measured_now,
    section_name,
    shown_command,
    write_section,
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    parser.add_argument("--masks", type=int, default=40, help="masks per run (default 40)")
    parser.add_argument("--task", default="headloc_induction")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCH.md")
    parser.add_argument("--config", default=None,
                        help="a random-weight model of this published shape (bench_shapes: "
                        "llama-3.2-1b, llama-3.1-8b) on its MMLU-shaped task, instead of "
                        "the embedded model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="with --config: where the random model is saved (default: a "
                        "temporary folder); one made earlier with the same settings is reused")
    args = parser.parse_args(argv)
    if args.config is not None:
        if args.config not in bench_shapes.SHAPES:
            parser.error(f"--config {args.config!r}: expected one of "
                         f"{', '.join(bench_shapes.SHAPES)}")
    if args.model_dir is not None:
        if (problem := bench_shapes.model_dir_problem(args.model_dir)) is not None:
            parser.error(problem)
    try:
        args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    except ValueError:
        parser.error(f"--workers {args.workers!r}: whole numbers joined by commas")
    if not args.workers or min(args.workers) < 1 or args.masks < 1:
        parser.error("--workers and --masks must be whole numbers >= 1")
    if (why := bench_refusal(args.out)) is not None:
        parser.error(f"--out: {why}")
    return args


def model_and_tasks(args: argparse.Namespace, scratch: Path) -> tuple[str, str, list[str]]:
    """The model_args, task and include path of the runs: the embedded model on
    ``args.task``, or with ``--config`` a random model of that shape on its MMLU-shaped
    task."""
    if args.config is None:
        from lm_eval_headloc.intervention.embedded import smollm2_model_args

        args_ = smollm2_model_args().rsplit(",device=", 1)[0] + f",device={args.device}"
        return args_, args.task, []
    folder = args.model_dir or scratch / f"{args.config}-{args.dtype}"
    bench_shapes.build_random_model(args.config, folder, args.dtype, args.device)
    bench_shapes.write_tasks(scratch / "tasks")
    return (f"pretrained={folder},dtype={args.dtype},device={args.device}",
            bench_shapes.CHOICE_TASK, [str(scratch / "tasks")])


def timed_locate(workers: int, args: argparse.Namespace, folder: Path,
                 model_args: str, task: str, include: list[str]) -> dict:
    from lm_eval_headloc.commands import locate

    started = time.perf_counter()
    locate(folder, model_args=model_args, tasks=[task], include_path=include,
           masks=args.masks,
           prior="none", confirm=0, workers=workers, progress=False,
           **({"gpus_per_worker": 1.0 / workers} if args.device == "cuda"
              and workers > 1 else {}))
    total = time.perf_counter() - started
    # The run's clock charges the time inside run_plan (the masks and the baseline) to
    # its "measurements" phase: config.json's timings say it.
    timings = json.loads((folder / "config.json").read_text())["timings"][-1]
    measuring = float(timings["phases"]["measurements"])
    measured = args.masks + 1  # the masks and the baseline
    return {"workers": workers, "total": total, "measuring": measuring,
            "per_second": measured / measuring, "measured": measured}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        model_args, task, include = model_and_tasks(args, Path(scratch))
        for workers in args.workers:
            row = timed_locate(workers, args, Path(scratch) / f"w{workers}", model_args,
                               task, include)
            print(f"workers {workers}: {row['per_second']:.3f} measurements/s "
                  f"({row['measuring']:.0f} s measuring, {row['total']:.0f} s in all)",
                  file=sys.stderr)
            rows.append(row)
    import torch

    base = rows[0]["per_second"]
    command = shown_command("python benchmarks/bench_workers.py", list(argv))
    on_gpu = args.device != "cpu"
    lines = [f"## Workers{' on the GPU' if on_gpu else ''} (`--workers N`)", "",
             f"Generated by `{command.strip()}` on "
             f"{measured_now()}: {platform.machine()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, device {args.device}; "
             f"`locate --tasks {task} --masks {args.masks} --prior none --confirm 0` on "
             + (f"a random-weight `{args.config}` ({args.dtype}; `bench_measure.py --config` "
                "says how it is made)" if args.config else "the embedded SmolLM2")
             + " (100 examples), a fresh run folder per row. Measuring: "
             "the time inside `run_plan` (the masks and the baseline); start-up: the rest "
             "(model load, the workers' loads and fingerprint/baseline checks).", "",
             "| workers | measurements | measuring (s) | measurements / s | vs 1 worker "
             "| whole run (s) |", "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in rows:
        lines.append(f"| {row['workers']} | {row['measured']} | {row['measuring']:.1f} | "
                     f"{row['per_second']:.3f} | {row['per_second'] / base:.2f}× | "
                     f"{row['total']:.0f} |")
    lines += ["", "Workers share the one GPU (`gpus_per_worker` = 1 / workers): what two "
              "workers gain is the GPU time one worker leaves idle between its forward "
              "passes." if on_gpu else
              "Each worker on a CPU gets cores / workers torch threads, so on 2 cores two "
              "workers split the same compute: the point of the row is that the path works "
              "and costs little, not speed."]
    section = "\n".join(lines)
    print(section)
    name = "bench_workers" + (f" {args.config}" if args.config else "")
    write_section(args.out, section_name(name, args.device), section)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
