"""Verify one run's top heads under several ablation kinds, side by side.

    python benchmarks/compare_ablations.py runs/locate --kinds zero,mean,resample \
        --general headloc_ioi,headloc_arith --limit 100 --out docs/ablation_kinds.md

Runs ``headloc-harness verify`` once per kind (into RUN/verify-KIND, resumable) and
writes a table of each task's score with the top 1..k heads knocked out under each kind.
Heads found under one kind that matter under another are not an artefact of that kind.
"""

from __future__ import annotations

import argparse
import datetime as dt
import shlex
import sys
import time
from pathlib import Path

from lm_eval_headloc.commands.verify import verify
from lm_eval_headloc.common.files import page_refusal, write_page
from lm_eval_headloc.common.options import ABLATIONS

#: The page's first line: --out writes only over a page that begins with it.
TITLE = "# One run's top heads verified under each ablation kind"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished locate or greedy run folder")
    parser.add_argument("--kinds", default="zero,mean,resample",
                        help="comma-separated ablation kinds (default zero,mean,resample)")
    parser.add_argument("--top-k", type=int, default=5)
    parser.add_argument("--general", default=None, help="verify's --general")
    parser.add_argument("--limit", type=int, default=None, help="verify's --limit")
    parser.add_argument("--out", type=Path, default=None, help="markdown file to write")
    args = parser.parse_args(argv)
    args.kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    for kind in args.kinds:
        if kind not in ABLATIONS:
            parser.error(f"--kinds {kind!r}: each must be one of {', '.join(ABLATIONS)}")
    if not args.kinds:
        parser.error("--kinds is empty")
    if args.out is not None and (why := page_refusal(args.out, TITLE)) is not None:
        parser.error(f"--out: {why}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # The kinds' cumulative top-k rows, as ablation_kinds.md has always shown them; no
    # random baseline (verify's --random-draws), which would multiply the cost.
    options = {"top_k": args.top_k, "limit": args.limit, "random_draws": 0}
    if args.general is not None:
        options["general"] = tuple(g for g in args.general.split(",") if g)
    tables, seconds = {}, {}
    for kind in args.kinds:
        started = time.perf_counter()
        tables[kind] = verify(args.run, args.run / f"verify-{kind}", ablation=kind, **options)
        seconds[kind] = time.perf_counter() - started
    first = tables[args.kinds[0]]
    general = first["general"]
    command = "python benchmarks/compare_ablations.py " + " ".join(shlex.quote(a) for a in argv)
    lines = [TITLE, "",
             f"Generated {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC} by", "",
             f"```bash\n{command}\n```", "",
             "Each cell: the task's score with the top 1..k heads knocked out together "
             "(baseline in the header); columns per kind. " + ", ".join(
                 f"{kind} verify took {seconds[kind]:.0f} s" for kind in args.kinds) + ".", ""]
    for task, rows in first["rows"].items():
        for measured in [task, *general]:
            header = f"## {measured}" + (" (the run's task)" if measured == task else "")
            metric = first["metrics"][measured]
            lines += [header, "", f"{metric}, baseline {first['baseline'][measured]:.2f}.", "",
                      "| k | heads | " + " | ".join(args.kinds) + " |",
                      "| --- | --- |" + " ---: |" * len(args.kinds)]
            for index, row in enumerate(rows):
                cells = []
                for kind in args.kinds:
                    other = tables[kind]["rows"][task][index]
                    score = (other["score"] if measured == task
                             else other["general_scores"][measured])
                    cells.append(f"{score:.2f}")
                lines.append(f"| {row['k']} | {'+'.join(row['heads'])} | " + " | ".join(cells)
                             + " |")
            lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.out is not None:
        write_page(args.out, text, TITLE)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
