"""What ending each row on its own costs a decoding step (``multigen.RowStops``), at the
rows of a GPU's generating call.

Rows of random ids, the gsm8k-shaped task's stop strings (``Question:`` and the end-of-text
token's); each step appends a column and asks the criteria about it. Two kinds of ids:

- **byte ids**, what the GPU benchmarks' random-weight models generate (``bench_shapes``
  zeroes their output rows past the byte tokens, so greedy decoding stays on them): the
  stop checks of those benchmarks' calls;
- **any of 128,256 ids**, a model that generates ids past its tokenizer's (a vocabulary
  padded past it): looked up in the table over the model's vocabulary (``could_end`` with
  ``vocab_size``: such an id decodes to nothing and ends no stop string), and over the
  tokenizer's only, where every row whose id is past it is decoded.

Rows decoded a step and milliseconds a step, the fastest of ``--repeats``::

    python benchmarks/bench_stop_checks.py --rows 1500,3700

Writes its section of ``BENCH.md`` (``bench_stop_checks``; with ``--device cuda``,
``bench_stop_checks cuda``: the ids on the GPU, its copies to the host included).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from headloc_bench import ROOT, bench_shapes
from headloc_bench.bench_sections import bench_refusal, section_name, shown_command, write_section
from headloc_bench.measuring import machine_lines, sync
from lm_eval_headloc.intervention.multigen import RowStops

#: Llama-3's vocabulary, the random-weight 1B's and 8B's output width.
MODEL_VOCABULARY = 128_256
PROMPT_WIDTH = 250  # the gsm8k-shaped task's prompts, about
#: (the ids drawn, how many there are to draw from, the table's vocabulary: 0 = the
#: tokenizer's only).
WAYS = (("byte ids", bench_shapes.BYTE_TOKENS, MODEL_VOCABULARY),
        ("any of 128,256 ids", MODEL_VOCABULARY, MODEL_VOCABULARY),
        ("any of 128,256 ids", MODEL_VOCABULARY, 0))
TABLES = {MODEL_VOCABULARY: "the model's vocabulary", 0: "the tokenizer's only"}


def time_stop_checks(tokenizer: Any, rows: int, drawn_from: int, vocab_size: int,
                     steps: int, device: str, seed: int = 0) -> tuple[float, float]:
    """Seconds a step and rows decoded a step of ``RowStops`` with ``tokenizer`` (the byte
    tokenizer, one for every call: ``could_end``'s table is made once per tokenizer) over
    ``steps`` columns of ``rows`` rows of ids drawn from ``range(drawn_from)`` (its table
    over ``vocab_size`` ids; 0: the tokenizer's)."""
    stops = ["Question:", bench_shapes.EOS]
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, bench_shapes.BYTE_TOKENS, (rows, PROMPT_WIDTH), generator=generator)
    columns = torch.randint(0, drawn_from, (rows, steps), generator=generator)
    ids = torch.cat([ids, columns], dim=1).to(device)
    criteria = RowStops(tokenizer, stops, PROMPT_WIDTH, rows,
                        [bench_shapes.BYTE_TOKENS], vocab_size)
    criteria(ids[:, :PROMPT_WIDTH + 1], None)  # its table made once a process: not timed
    decoded = 0
    real = tokenizer.batch_decode

    def counting(tails: list[list[int]]) -> list[str]:
        nonlocal decoded
        decoded += len(tails)
        return real(tails)

    tokenizer.batch_decode = counting
    try:
        sync(device)
        start = time.perf_counter()
        for step in range(2, steps + 1):
            criteria(ids[:, :PROMPT_WIDTH + step], None)
        sync(device)
        seconds = time.perf_counter() - start
    finally:
        del tokenizer.batch_decode  # its class's own again
    return seconds / (steps - 1), decoded / (steps - 1)


def render(results: list[tuple[int, str, str, float, float]], command: str,
           device: str) -> str:
    lines = ["## Ending each row on its own: the stop checks a decoding step", "",
             f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by `{command}`.",
             "", *machine_lines(device), "",
             "`multigen.RowStops` asked about each new column of rows of random ids, the "
             "gsm8k-shaped task's stop strings. **byte ids**: what the GPU benchmarks' "
             "random-weight models generate (their output rows past the byte tokens are "
             "zeroed), so these are those calls' stop checks. **any of 128,256 ids**: a "
             f"model generating ids past its tokenizer's (the byte tokenizer knows "
             f"{bench_shapes.BYTE_TOKENS + 2}), looked up in the table over the model's "
             "vocabulary, and over the tokenizer's only (every row whose id is past it "
             "decoded).", "",
             "| rows | ids | table over | rows decoded a step | ms a step |",
             "|---|---|---|---|---|"]
    lines += [f"| {rows} | {ids} | {table} | {decoded:.1f} | {seconds * 1000:.2f} |"
              for rows, ids, table, seconds, decoded in results]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1500,3700", help="row counts, comma-separated")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCH.md")
    args = parser.parse_args(argv)
    try:
        args.row_counts = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows {args.rows!r}: whole numbers separated by commas")
    # The ids are made whole up front: bounds that keep them within memory.
    if not 1 <= min(args.row_counts) <= max(args.row_counts) <= 100_000 \
            or not 2 <= args.steps <= 4096 or args.repeats < 1:
        parser.error(f"--rows {args.rows} --steps {args.steps} --repeats {args.repeats}: "
                     "rows 1 to 100000 each, steps 2 to 4096, repeats >= 1")
    problem = bench_refusal(args.out)
    if problem is not None:
        parser.error(problem)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    command = shown_command("python benchmarks/bench_stop_checks.py",
                            list(argv) if argv is not None else sys.argv[1:])
    results, tokenizer = [], bench_shapes.byte_tokenizer()
    for rows in args.row_counts:
        for ids, drawn_from, vocab_size in WAYS:
            runs = [time_stop_checks(tokenizer, rows, drawn_from, vocab_size, args.steps,
                                     args.device) for _ in range(args.repeats)]
            seconds, decoded = min(runs)
            table = TABLES[vocab_size]
            print(f"{rows} rows of {ids}, table over {table}: {decoded:.1f} rows decoded a "
                  f"step, {seconds * 1000:.2f} ms a step", flush=True)
            results.append((rows, ids, table, seconds, decoded))
    write_section(args.out, section_name("bench_stop_checks", args.device),
                  render(results, command, args.device))
    print(f"wrote {args.out}")
    return 0
