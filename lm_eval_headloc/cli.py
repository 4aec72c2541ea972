"""``headloc-harness``: a thin command line over ``lm_eval_headloc.driver``/``analyses``.

    headloc-harness locate --model-args pretrained=...,dtype=bfloat16 --tasks gsm8k \\
        --num-samples 100 --masks 100 --sparsity 0.02 --design stratified \\
        --alpha 0.01 --top-k 5 --seed 0 --out runs/gsm8k

With no arguments at all, ``locate`` runs on the embedded SmolLM2-135M-Instruct and the
offline ``headloc_induction`` task.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from . import __version__, analyses, driver
from .designs import DESIGNS
from .driver import UsageError
from .heads import HeadSpecError
from .metrics import MetricError
from .runfolder import RunFolderError

__all__ = ["build_parser", "main"]

# Mistakes a user can make; anything else is a bug and keeps its traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (UsageError, HeadSpecError, MetricError,
                                                RunFolderError, FileNotFoundError)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _int_list(text: str) -> list[int]:
    return [_positive_int(part) for part in text.split(",") if part.strip()]


def _float_list(text: str) -> list[float]:
    return [_number(part) for part in text.split(",") if part.strip()]


def _task_list(text: str) -> list[str]:
    # A metric's filter also follows a comma (gsm8k:exact_match,strict-match); the
    # driver re-joins such parts once it knows the task names.
    return [part.strip() for part in text.split(",") if part.strip()]


def _add_model_options(parser: argparse.ArgumentParser, default_tasks: bool = True) -> None:
    parser.add_argument("--model-args", default=None, metavar="ARGS",
                        help="hf model_args, e.g. pretrained=meta-llama/Llama-3.1-8B,"
                             "dtype=bfloat16 (default: the embedded SmolLM2-135M-Instruct)")
    if default_tasks:
        parser.add_argument("--tasks", type=_task_list, default=["headloc_induction"],
                            metavar="TASKS",
                            help="comma-separated lm-eval tasks, each optionally TASK:METRIC "
                                 "(default: headloc_induction)")
    parser.add_argument("--include-path", action="append", default=[], metavar="DIR",
                        help="a folder of your own lm-eval task YAMLs (repeatable); our "
                             "task_configs are always included")
    parser.add_argument("--batch-size", default="32", metavar="N",
                        help="batch size for the model (default 32)")
    parser.add_argument("--apply-chat-template", action=argparse.BooleanOptionalAction,
                        default=None, help="ask through the chat template (default: for "
                                           "generation tasks when the model has one)")
    parser.add_argument("--confirm-run-unsafe-code", action="store_true",
                        help="allow tasks that execute model-written code (mbpp, humaneval)")
    parser.add_argument("--force", action="store_true",
                        help="start over in an existing run folder")
    parser.add_argument("--verbose", action="store_true",
                        help="show lm-eval's per-measurement logging")


def _add_search_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-samples", type=_positive_int, default=100, metavar="N",
                        help="examples per task, the same seeded subset in every "
                             "measurement (default 100)")
    parser.add_argument("--top-k", type=_positive_int, default=5, metavar="K")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exclude", default=None, metavar="HEADS|FILE",
                        help="heads kept out of the ranking (L0H1+L2H3 or a head file)")
    parser.add_argument("--never-ablate", default=None, metavar="HEADS|FILE",
                        help="heads kept out of every mask, e.g. universal.json")
    parser.add_argument("--masks-per-pass", type=_positive_int, default=None, metavar="K",
                        help="masks evaluated together in one forward pass (loglikelihood "
                             "tasks; default: 1 on CPU, from free memory on a GPU)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="headloc-harness",
        description="Find the attention heads a capability lives in, through lm-eval.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("locate", help="compressed-sensing localization (the main job)")
    _add_model_options(p)
    _add_search_options(p)
    p.add_argument("--masks", type=_positive_int, default=100, metavar="M")
    p.add_argument("--sparsity", type=_number, default=0.02, metavar="P",
                   help="fraction of heads knocked out per mask (default 0.02)")
    p.add_argument("--design", choices=DESIGNS, default="stratified")
    p.add_argument("--alpha", type=_number, default=0.01, help="Lasso penalty (default 0.01)")
    p.add_argument("--out", default="runs/locate", metavar="DIR")

    p = sub.add_parser("refit", help="fit a locate run again from its stored measurements")
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--alpha", type=_number, default=None)
    p.add_argument("--top-k", type=_positive_int, default=None, metavar="K")
    p.add_argument("--exclude", default=None, metavar="HEADS|FILE")

    p = sub.add_parser("greedy", help="one-shot (N evaluations) or iterative greedy baseline")
    _add_model_options(p)
    _add_search_options(p)
    p.add_argument("--rounds", type=_positive_int, default=1, metavar="K",
                   help="1: one-shot; K: iterative, K*N measurements")
    p.add_argument("--out", default="runs/greedy", metavar="DIR")

    p = sub.add_parser("verify", help="knock out a run's top 1..k heads on task + general tasks")
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument("--top-k", type=_positive_int, default=5, metavar="K")
    p.add_argument("--general", type=_task_list,
                   default=["hellaswag", "boolq", "arc_challenge", "mmlu"],
                   help="general tasks for the Gen drop (default hellaswag,boolq,"
                        "arc_challenge,mmlu)")
    p.add_argument("--limit", type=_positive_int, default=None,
                   help="examples per task (default: full datasets)")
    p.add_argument("--batch-size", default="32", metavar="N")
    p.add_argument("--confirm-run-unsafe-code", action="store_true")
    p.add_argument("--out", default=None, metavar="DIR", help="default: RUN_DIR/verify")
    p.add_argument("--force", action="store_true")
    p.add_argument("--verbose", action="store_true")

    p = sub.add_parser("universal", help="heads in the top-k of several tasks' runs")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--top-k", type=_positive_int, default=5, metavar="K")
    p.add_argument("--min-tasks", type=_positive_int, default=2, metavar="N")
    p.add_argument("--out", default="universal.json", metavar="FILE")

    p = sub.add_parser("sweep", help="search --masks x --sparsity (paper appendix A.1)")
    _add_model_options(p)
    _add_search_options(p)
    p.add_argument("--masks", type=_int_list, default=[100, 200], metavar="M1,M2,...")
    p.add_argument("--sparsity", type=_float_list, default=[0.01, 0.02, 0.05],
                   metavar="P1,P2,...")
    p.add_argument("--design", choices=DESIGNS, default="stratified")
    p.add_argument("--alpha", type=_number, default=0.01)
    p.add_argument("--out", default="runs/sweep", metavar="DIR")
    return parser


def _batch_size(text: str) -> int | str:
    if text == "auto" or text.startswith("auto:"):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"--batch-size {text!r}: must be a whole number >= 1 or 'auto'")
    return value


def _common(args: argparse.Namespace) -> dict:
    return dict(model_args=args.model_args, tasks=args.tasks, include_path=args.include_path,
                apply_chat_template=args.apply_chat_template,
                confirm_run_unsafe_code=args.confirm_run_unsafe_code,
                batch_size=_batch_size(args.batch_size), force=args.force, verbose=args.verbose,
                num_samples=args.num_samples, top_k=args.top_k, seed=args.seed,
                exclude=args.exclude, never_ablate=args.never_ablate,
                masks_per_pass=args.masks_per_pass)


def run(args: argparse.Namespace) -> None:
    if args.command in (None, "locate"):
        rankings = driver.locate(out=args.out, masks=args.masks, sparsity=args.sparsity,
                                 design=args.design, alpha=args.alpha,
                                 **_common(args))
        _print_rankings(rankings, args.top_k, args.out)
    elif args.command == "refit":
        rankings = driver.refit(args.run, alpha=args.alpha, top_k=args.top_k,
                                exclude=args.exclude)
        config_top = args.top_k or 5
        _print_rankings(rankings, config_top, args.run)
    elif args.command == "greedy":
        rankings = analyses.greedy(out=args.out, rounds=args.rounds, **_common(args))
        _print_rankings(rankings, args.top_k, args.out)
    elif args.command == "verify":
        table = analyses.verify(args.run, out=args.out, top_k=args.top_k, general=args.general,
                                limit=args.limit, batch_size=_batch_size(args.batch_size),
                                confirm_run_unsafe_code=args.confirm_run_unsafe_code,
                                force=args.force, verbose=args.verbose)
        print(analyses._verification_markdown(table))
    elif args.command == "universal":
        result = analyses.universal(args.runs, args.out, top_k=args.top_k,
                                    min_tasks=args.min_tasks)
        print(analyses.universal_table(result))
        print(f"\n{len(result['heads'])} universal head(s) written to {args.out}")
    elif args.command == "sweep":
        result = analyses.sweep(out=args.out, masks=args.masks, sparsity=args.sparsity,
                                design=args.design, alpha=args.alpha, **_common(args))
        print(analyses.sweep_table(result))


def _print_rankings(rankings: dict, top_k: int, out: str) -> None:
    for task, ranking in rankings.items():
        r2 = ranking.extra.get("r2")
        fit = f", R² {r2:.3f}" if r2 is not None else ""
        print(f"{task} ({ranking.metric}): baseline {ranking.baseline:.4f}{fit}")
        for rank, head in enumerate(ranking.top(top_k), start=1):
            print(f"  {rank}. {head}  {ranking.effects[head.index(ranking.num_heads)]:+.4f}")
    print(f"Results in {out}/ (report.md, heads.json, heatmap.png)")


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # no arguments at all: the embedded default run
        args = parser.parse_args(["locate", *(argv or [])])
    if not getattr(args, "verbose", False):  # the harness's chatter, unless --verbose
        logging.getLogger("lm_eval").setLevel(logging.ERROR)
    try:
        run(args)
    except KeyboardInterrupt:
        print("\nheadloc-harness: interrupted; rerun the same command to continue",
              file=sys.stderr)
        return 130
    except USER_ERRORS as err:
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"headloc-harness: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

