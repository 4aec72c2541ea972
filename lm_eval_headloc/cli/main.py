"""``headloc-harness``: a thin command line over ``lm_eval_headloc.commands``.

    headloc-harness locate --model-args pretrained=...,dtype=bfloat16 --tasks gsm8k \\
        --num-samples 100 --masks 100 --sparsity 0.02 --design stratified \\
        --alpha 0.01 --top-k 5 --seed 0 --out runs/gsm8k

With no arguments at all, ``locate`` runs on the embedded SmolLM2-135M-Instruct and the
offline ``headloc_induction`` task. Every measuring option and its default come from
``RunSpec`` (``spec.py``); this module only adds the positional arguments, ``--out`` and
``--force``, and prints results.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from lm_eval_headloc import __version__
from lm_eval_headloc.cli.options import add_options
from lm_eval_headloc.commands.cross import PROMPT_OPTIONS, cross, cross_markdown
from lm_eval_headloc.commands.greedy import greedy
from lm_eval_headloc.commands.locate import locate, refit
from lm_eval_headloc.commands.overlap import markdown_path, overlap, overlap_markdown
from lm_eval_headloc.commands.sweep import SWEEP_MASKS, SWEEP_SPARSITY, sweep, sweep_table
from lm_eval_headloc.commands.types import types
from lm_eval_headloc.commands.universal import component_word, universal, universal_table
from lm_eval_headloc.commands.verify import verification_markdown, verify
from lm_eval_headloc.common import timing
from lm_eval_headloc.common.errors import UserError, one_line
from lm_eval_headloc.common.words import counted, signed
from lm_eval_headloc.method.columns import UNIT, column_label, components_of
from lm_eval_headloc.method.ranking import Ranking
from lm_eval_headloc.report.locate_report import certificate_line, fit_summary
from lm_eval_headloc.report.pages import (
    FLOOR_HINT,
    at_floor,
    none_hurts_words,
    why_nothing_stands_out,
    within_spread,
)
from lm_eval_headloc.report.type_pages import types_summary
from lm_eval_headloc.runs.record import LocateRun, load_run
from lm_eval_headloc.runs.spec import ABLATION_FLAGS, COMMAND_OPTIONS, RunSpec

__all__ = ["build_parser", "main"]

# Mistakes a user can make, each raised with a one-line message written for them. Anything
# else keeps its traceback: a FileNotFoundError or ValueError from inside the package or a
# library is a bug to report, not the user's to fix, so it is never taken for one.
USER_ERRORS: tuple[type[BaseException], ...] = (UserError,)


def _list_of(convert: type) -> object:
    def parse(text: str) -> list:
        parts = text.split(",")
        if not all(part.strip() for part in parts):
            # An empty entry is a typo, not a value: '4,,8' was read as 4,8.
            what = "is empty" if not text.strip() else "has an empty entry"
            raise argparse.ArgumentTypeError(f"{text!r} {what}; give comma-separated "
                                             "values, none of them empty")
        try:
            return [convert(part) for part in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a comma-separated list of "
                f"{'whole numbers' if convert is int else 'numbers'}") from None
    return parse


def _folder(value: str) -> str:
    if not value.strip():  # Path("") is the current folder: never what was meant
        raise argparse.ArgumentTypeError(f"{value!r} is not a folder name")
    return value


def _add_out(parser: argparse.ArgumentParser, default: str | None, help_text: str) -> None:
    parser.add_argument("--out", default=default, metavar="DIR", type=_folder, help=help_text)
    parser.add_argument("--force", action="store_true",
                        help="start over in an existing run folder of this tool (never "
                             "clears anything else)")


class _Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake is the one line every other error is: argparse
    prints the whole usage first (23 lines for locate), which buries the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} -h lists the options)\n")

    def parse_known_args(self, args: Sequence[str] | None = None,
                         namespace: argparse.Namespace | None = None
                         ) -> tuple[argparse.Namespace, list[str]]:
        return super().parse_known_args(
            _numbers_as_values(sys.argv[1:] if args is None else args), namespace)


def _numbers_as_values(args: Sequence[str]) -> list[str]:
    """``--scale -inf`` read as ``--scale=-inf``: argparse takes a token that begins with
    '-' for an option unless it looks like -1 or -.5, so -inf, -nan and -1e-3 got
    "expected one argument" instead of the option's own check. A token ``float`` reads
    (or a comma-separated list of such: sweep's grids) is never an option's name, so it
    is the value of the option before it."""
    out: list[str] = []
    for token in args:
        previous = out[-1] if out else ""
        if (token.startswith("-") and previous.startswith("--") and "=" not in previous
                and "--" not in out and all(map(_is_number, token.split(",")))):
            out[-1] = f"{previous}={token}"
        else:
            out.append(token)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="headloc-harness",
        description="Find the attention heads a capability lives in, through lm-eval.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("locate", help="compressed-sensing localization (the main job)")
    add_options(p, COMMAND_OPTIONS["locate"])
    _add_out(p, "runs/locate", "run folder (default runs/locate)")

    p = sub.add_parser("refit", help="fit a locate run again from its stored measurements")
    p.add_argument("run", metavar="RUN_DIR")
    add_options(p, COMMAND_OPTIONS["refit"], keep_stored=True)

    p = sub.add_parser("greedy", help="one-shot (N evaluations) or iterative greedy baseline")
    add_options(p, COMMAND_OPTIONS["greedy"])
    _add_out(p, "runs/greedy", "run folder (default runs/greedy)")

    p = sub.add_parser("verify", help="knock out a run's top 1..k heads on task + general tasks")
    p.add_argument("run", metavar="RUN_DIR")
    add_options(p, COMMAND_OPTIONS["verify"])
    add_options(p, ABLATION_FLAGS, keep_stored=True)  # default: the run's ablation
    # Verify scores by the tasks' metrics, so it generates where the run may not have (a
    # run located by --signal logprob): a generation too long for the model is shortened
    # here, as lm-eval's --gen_kwargs (default: the run's).
    add_options(p, ("gen_kwargs",), keep_stored=True)
    p.add_argument("--model-args", "--model_args", default=None, metavar="ARGS",
                   help="the run's model args with its model where it is now (a run whose "
                        "model folder has moved; its files must be the ones the run "
                        "recorded) (default: the run's)")
    _add_out(p, None, "folder for the table (default RUN_DIR/verify)")

    p = sub.add_parser("universal", help="heads in the top-k of several tasks' runs")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    add_options(p, ("top_k",))
    p.add_argument("--min-tasks", type=int, default=2, metavar="N",
                   help="distinct tasks a head must be in the top-k of (default 2)")
    p.add_argument("--out", default="universal.json", metavar="FILE",
                   help="JSON file to write (default universal.json)")

    p = sub.add_parser("overlap", help="overlap rate and IoU of two runs' top-k, found on "
                                       "other examples (CNL's stability check)")
    p.add_argument("run_a", metavar="RUN_A")
    p.add_argument("run_b", metavar="RUN_B")
    p.add_argument("--top-k", type=int, default=None, metavar="K",
                   help="components compared per ranking (default: each run's own --top-k)")
    p.add_argument("--out", default="overlap.json", metavar="FILE",
                   help="JSON file to write, the table next to it as .md (default "
                        "overlap.json)")

    p = sub.add_parser("cross", help="knock out each run's top-k heads per task and measure "
                                     "every task (CNL's task x task matrix)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    add_options(p, ("tasks",), keep_stored="the runs' own tasks")
    add_options(p, PROMPT_OPTIONS, keep_stored="the runs', where they agree")
    add_options(p, COMMAND_OPTIONS["cross"])
    _add_out(p, "runs/cross", "folder for the matrix (default runs/cross)")

    p = sub.add_parser("export", help="write a run's head ranking in another tool's format "
                                      "(mib: the MIB circuit track's node importances)")
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--format", choices=("mib",), default="mib",
                   help="the format (default mib)")
    p.add_argument("--task", default=None, metavar="TASK",
                   help="the run's task to export (default: its only one)")
    p.add_argument("--mib-model", default=None, metavar="MODEL",
                   help="MIB's model the run's model is (its width and block layout; "
                        "default: what the run recorded of its model)")
    p.add_argument("--model-args", "--model_args", default=None, metavar="ARGS",
                   help="the run's model where it is now (pretrained=...), read for its "
                        "width and block layout (its config alone), which runs made before "
                        "they were recorded do not say (default: the run's model)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="the .json file to write (for a MIB submission: "
                        "<task>_<model>/importances.json)")

    p = sub.add_parser("types", help="what kind of head each head is (previous-token, "
                                     "duplicate-token, induction, attention sink), from "
                                     "attention patterns on a probe and the tasks' examples")
    add_options(p, COMMAND_OPTIONS["types"])
    _add_out(p, "runs/types", "folder for types.json and types.csv (default runs/types)")

    p = sub.add_parser("sweep", help="search --masks x --sparsity (paper appendix A.1)")
    add_options(p, COMMAND_OPTIONS["sweep"])
    # dest: the grids are sweep's own, not RunSpec's single masks/sparsity values.
    p.add_argument("--masks", dest="masks_grid", type=_list_of(int), default=list(SWEEP_MASKS),
                   metavar="M1,M2,...", help="masks per cell (default "
                   + ",".join(map(str, SWEEP_MASKS)) + ")")
    p.add_argument("--sparsity", dest="sparsity_grid", type=_list_of(float),
                   default=list(SWEEP_SPARSITY),
                   metavar="P1,P2,...", help="sparsity per cell (default "
                   + ",".join(map(str, SWEEP_SPARSITY)) + ")")
    _add_out(p, "runs/sweep", "run folder (default runs/sweep)")
    return parser


def run(args: argparse.Namespace) -> None:
    """Run the subcommand ``args`` were parsed for, printing what it prints."""
    command = args.command
    if command == "locate":
        _print_rankings(locate(args.out, RunSpec.from_namespace(args), force=args.force),
                        args.out)
    elif command == "refit":
        _print_rankings(refit(args.run, **{name: getattr(args, name)
                                           for name in COMMAND_OPTIONS["refit"]}), args.run,
                        measured=False)
    elif command == "greedy":
        _print_rankings(greedy(args.out, RunSpec.from_namespace(args), force=args.force),
                        args.out)
    elif command == "verify":
        kind = {name: vars(args).pop(name) for name in ABLATION_FLAGS}  # None: the run's
        table = verify(args.run, args.out, RunSpec.from_namespace(args), force=args.force,
                       **kind)
        print(verification_markdown(table))
    elif command == "universal":
        result = universal(args.runs, args.out, top_k=args.top_k, min_tasks=args.min_tasks)
        print(universal_table(result))
        undecided = len(result["undecided"])
        word = component_word(result["components"])  # a neuron run's are neurons
        print(f"\n{counted(len(result['heads']), f'universal {word}')} written to {args.out}"
              + (f"; {undecided} more undecided: ties at a ranking's top-{args.top_k} "
                 "boundary decide whether they reach --min-tasks" if undecided else ""))
    elif command == "overlap":
        print(overlap_markdown(overlap(args.run_a, args.run_b, top_k=args.top_k,
                                       out=args.out)))
        print(f"\nWritten to {args.out} and {markdown_path(args.out)}")
    elif command == "cross":
        print(cross_markdown(cross(args.runs, args.out, RunSpec.from_namespace(args),
                                   force=args.force)))
    elif command == "export":
        from lm_eval_headloc.report.mib import write_mib

        path = write_mib(args.run, args.out, args.task, mib_model=args.mib_model,
                         model_args=args.model_args)
        print(f"Written to {path}")
    elif command == "types":
        print(types_summary(types(args.out, RunSpec.from_namespace(args), force=args.force)))
        print(f"Results in {_folder_words(args.out)} (types.json, types.csv)")
    elif command == "sweep":
        result = sweep(args.out, args.masks_grid, args.sparsity_grid,
                       RunSpec.from_namespace(args), force=args.force)
        print(sweep_table(result))


def _folder_words(out: str | os.PathLike[str]) -> str:
    """A run folder as the last line names it: with one trailing slash (``--out runs/x/``
    printed ``runs/x//``)."""
    return str(out).rstrip("/") + "/"


def _print_rankings(rankings: Mapping[str, Ranking], out: str, measured: bool = True
                    ) -> None:
    """Each task's top-k in the terminal; ``measured``: the command measured (refit does
    not: how many masks a pass took is none of its business)."""
    record = load_run(out)
    top_k = record.spec.top_k
    for task, ranking in rankings.items():
        print(f"{task} ({ranking.metric}): baseline {ranking.baseline:.4f}"
              + fit_summary(ranking, top_k))
        if at_floor(ranking):
            print(f"  no knockout can lower a score of 0; {FLOOR_HINT}")
        checked = certificate_line(ranking, record if isinstance(record, LocateRun) else None)
        tied = set(ranking.facts.tied_with_above or [])
        top = ranking.top(top_k)
        if len(top) > 1 and all(str(h) in tied for h in top[1:]):
            print(f"  no {UNIT[components_of(ranking.columns)]} stands out: "
                  f"{why_nothing_stands_out(ranking)}")
            if checked:
                print(checked)
            continue
        alike = ranking.facts.same_masks or {}
        harmless = set(ranking.harmless(top_k))
        if harmless and len(harmless) == len(top):  # report.md's "Nothing found", here too
            print("  nothing found: "
                  + none_hurts_words(len(top), UNIT[components_of(ranking.columns)]))
        noise = set(within_spread(ranking, top_k))
        unit = UNIT[components_of(ranking.columns)]
        for rank, head in enumerate(top, start=1):
            print(f"  {rank}. {column_label(head)}  {signed(ranking.effect(head))}"
                  + (f"  (tied with the {unit} above)" if str(head) in tied else "")
                  + ("  (does not hurt)" if head in harmless else "")
                  + ("  (within the spread of single knockouts: see report.md)"
                     if head in noise else "")
                  + (f"  (knocked out in the same masks as {len(alike[str(head)])} "
                     f"other{'s' if len(alike[str(head)]) > 1 else ''}: see report.md)"
                     if str(head) in alike else ""))
        if checked:
            print(checked)
    files = "report.md, heads.json, heatmap.png"
    if len(rankings) > 1:  # heads.json (what ablate_file= reads) is one task's
        first = next(iter(rankings))
        files = (f"report.md, heatmap.png, heads-<task>.json for each task; heads.json is "
                 f"{first}'s")
    if measured and isinstance(record.masks_per_pass, int):  # as the run recorded it
        print(f"Masks per pass: {record.masks_per_pass} (automatic; --masks-per-pass "
              "sets it)")
    print(f"Results in {_folder_words(out)} ({files})")


class _OneLineWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        print(f"headloc-harness: warning: {record.getMessage()}", file=sys.stderr)


#: The commands that measure (load the model): their last line says where the time went.
MEASURING = frozenset({"locate", "greedy", "verify", "cross", "types", "sweep"})


def main(argv: Sequence[str] | None = None, started: float | None = None) -> int:
    """The command line; ``started``: the process's start (``time.perf_counter``'s clock),
    from which the run's "start-up and imports" phase counts (None: from this call)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no arguments at all: the embedded default run
        args = parser.parse_args(["locate", *(argv or [])])
    if not getattr(args, "verbose", False):  # the harness's chatter, unless --verbose
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    ours = logging.getLogger("lm_eval_headloc")
    handler = _OneLineWarnings(logging.WARNING)
    ours.addHandler(handler)
    ours.propagate = False
    try:
        with timing.run_clock(started, first=timing.STARTUP) as clock:
            run(args)
            if args.command in MEASURING:
                print(f"Time: {timing.timings_line([clock.snapshot()])}")
    except KeyboardInterrupt:
        out = getattr(args, "out", None)
        if out is None and args.command == "verify":  # its default, RUN/verify
            out = Path(args.run, "verify")
        started_run = args.command not in MEASURING or (
            out is not None and Path(out, "config.json").is_file())
        # With --force the same command would clear what this one kept, and start over.
        resume = ("rerun it without --force to continue" if getattr(args, "force", False)
                  else "rerun the same command to continue")
        print("\nheadloc-harness: interrupted; " + (
            resume if started_run else
            "it had not started its run folder, so nothing is kept"), file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        print(f"headloc-harness: error: {one_line(err)}", file=sys.stderr)
        return 2
    finally:
        ours.removeHandler(handler)
        ours.propagate = True
    return 0


if __name__ == "__main__":
    sys.exit(main())
