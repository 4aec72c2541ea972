"""What a first run spends that a later one does not: a whole ``headloc-harness locate``,
twice, each in a process of its own, phase by phase (the run's config.json ``timings``).

The first run starts with every cache this package and its libraries keep empty — our task
index (``$XDG_CACHE_HOME/lm_eval_headloc``), Hugging Face datasets' prepared data
(``$HF_DATASETS_CACHE``), matplotlib's font list (``$MPLCONFIGDIR``) — as on a fresh machine
(the operating system's file cache aside: the model's file may still be in memory); the
later run finds them filled. Both measure everything (separate run folders)::

    python benchmarks/bench_first_run.py                    # the default job, embedded model
    python benchmarks/bench_first_run.py --device cuda --config llama-3.1-8b --task scale_choice
    python benchmarks/bench_first_run.py --device cuda -- --model-args pretrained=...,dtype=bfloat16

``--config`` builds a random-weight model of a published shape and writes ``bench_shapes``'
MMLU-shaped and gsm8k-shaped tasks first (not timed), as the GPU benchmarks do; the runs
then locate ``--task`` on it.

Arguments after ``--`` go to ``headloc-harness locate``. Writes its section of ``BENCH.md``
(``first run <device>``; on the CPU ``first run``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from headloc_bench import ROOT, bench_shapes
from headloc_bench.bench_sections import bench_refusal, section_name, write_section

#: The caches a first run fills, by the variable that places each.
CACHES = ("XDG_CACHE_HOME", "HF_DATASETS_CACHE", "MPLCONFIGDIR")


def harness_command() -> list[str]:
    """``headloc-harness`` of the environment this script runs in (its console script, or
    the function that script calls: either counts start-up from the process's start)."""
    script = Path(sys.executable).with_name("headloc-harness")
    return [str(script)] if script.is_file() else [
        sys.executable, "-c",
        "from lm_eval_headloc.cli.console import main; raise SystemExit(main())"]


def timed_run(arguments: Sequence[str], out: Path, environment: Mapping[str, str]
              ) -> dict[str, Any]:
    """One locate in a process of its own: its wall clock from outside, and the timings
    it recorded (the last session's) with the line it printed last."""
    start = time.perf_counter()
    done = subprocess.run([*harness_command(), "locate", *arguments, "--out", str(out)],
                          env={**os.environ, **environment}, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"locate failed ({done.returncode}):\n{done.stderr[-2000:]}")
    sessions = json.loads((out / "config.json").read_text())["timings"]
    return {"wall": wall, "recorded": sessions[-1],
            "last_line": done.stdout.strip().splitlines()[-1]}


def lm_eval_task_configs() -> int:
    """The YAML files of lm-eval's own tasks in this environment: what its task index, which a
    first run builds, reads (about 14,000 in a whole install; a wheel slimmed for a machine
    without network has none)."""
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return 0
    return sum(1 for _ in (Path(spec.origin).parent / "tasks").rglob("*.yaml"))


def render(first: Mapping[str, Any], later: Mapping[str, Any], command: str,
           device: str, task_configs: int | None = None) -> str:
    def seconds(run: Mapping[str, Any], name: str) -> float:
        recorded = run["recorded"]
        return recorded["other"] if name == "other" else recorded["phases"].get(name, 0.0)

    phases = [*dict.fromkeys([*first["recorded"]["phases"], *later["recorded"]["phases"]]),
              "other"]
    rows = [f"| {name} | {seconds(first, name):.2f} | {seconds(later, name):.2f} | "
            f"{seconds(first, name) - seconds(later, name):+.2f} |" for name in phases]
    return "\n".join([
        f"## A first run against a later one ({device})", "",
        f"`{command}`: the same `headloc-harness locate` twice, each in a process of its own, "
        "the first with empty caches (our task index, Hugging Face datasets' prepared data, "
        "matplotlib's fonts), the second with them filled; seconds per phase from each "
        "run's config.json (`timings`), the whole wall clock from outside the process."
        + ("" if task_configs is None else
           f" lm-eval's own task configs here, which the first run's task index reads: "
           f"{task_configs:,} YAML files (a whole install has about 14,000)."), "",
        "| phase | first run (s) | later run (s) | first − later (s) |",
        "| --- | --- | --- | --- |", *rows,
        f"| **whole (recorded)** | **{first['recorded']['whole']:.2f}** | "
        f"**{later['recorded']['whole']:.2f}** | "
        f"{first['recorded']['whole'] - later['recorded']['whole']:+.2f} |",
        f"| whole (wall clock, outside) | {first['wall']:.2f} | {later['wall']:.2f} | "
        f"{first['wall'] - later['wall']:+.2f} |", "",
        "Phases that read no cache (the measurements, the prior, the fit) vary from run to "
        "run on a shared machine: read their difference against that spread.", "",
        f"Last line of the first run: `{first['last_line']}`; of the later one: "
        f"`{later['last_line']}`.", ""])


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This script's options, and the ``locate`` arguments after ``--``."""
    argv = list(argv)
    locate_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="for the section's name (the "
                        "model's device is --model-args')")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCH.md")
    parser.add_argument("--config", default=None, choices=bench_shapes.shape_names(),
                        help="a random-weight model of this shape (bench_shapes.py)")
    parser.add_argument("--task", default=bench_shapes.GEN_TASK,
                        choices=(bench_shapes.CHOICE_TASK, bench_shapes.GEN_TASK),
                        help="with --config: the MMLU-shaped or the gsm8k-shaped task")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="with --config")
    args = parser.parse_args(own)
    problem = bench_refusal(args.out)
    if problem is not None:
        parser.error(problem)
    return args, locate_args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, locate_args = parse_args(argv)
    command = "python benchmarks/bench_first_run.py " + shlex.join(argv)
    work = Path(tempfile.mkdtemp(prefix="headloc-first-"))
    try:
        environment = {name: str(work / "cache" / name) for name in CACHES}
        environment.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                           TOKENIZERS_PARALLELISM="false")
        if args.config is not None:
            model_dir = work / f"{args.config}-{args.dtype}"
            print(f"building a random-weight {args.config} ({args.dtype}) ...", flush=True)
            bench_shapes.build_random_model(args.config, model_dir, args.dtype, args.device)
            bench_shapes.write_tasks(work / "tasks")
            locate_args = ["--model-args", f"pretrained={model_dir},dtype={args.dtype},"
                           f"device={args.device}", "--include-path", str(work / "tasks"),
                           "--tasks", args.task, *locate_args]
        first = timed_run(locate_args, work / "first", environment)
        print(f"first run: {first['last_line']}", flush=True)
        later = timed_run(locate_args, work / "later", environment)
        print(f"later run: {later['last_line']}", flush=True)
        write_section(args.out, section_name("first run", args.device),
                      render(first, later, command, args.device, lm_eval_task_configs()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
