"""Rewrite the ranking files of the committed run folders with today's code.

    python scripts/refit_committed.py           # rewrite what changed, list it
    python scripts/refit_committed.py --check   # list what is stale, exit 1 if any

When the ranking code changes (the order, an interval, a sentence of report.md), the
run folders committed to this repository (under ``benchmarks/``; ``git ls-files`` says
which, so a user's own runs are never touched) no longer read as today's code writes
them, and ``tests/test_run_result.py`` says so. Each run is fitted again from its stored
measurements, in a copy (``locate`` runs by ``refit``, which loads no model; ``greedy``
runs by rerunning the finished run, which measures nothing, but loads the model once to
write the head types a greedy run without types.json now gets). Only the ranking files
the folder already holds (heads*.json, heads*.csv, report.md) are copied back, and only
when their text changed, with a types.json the rerun wrote; config.json, the measurements
and anything else stay as committed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout

from lm_eval_headloc.commands import greedy, refit  # noqa: E402
from lm_eval_headloc.commands.result import load_run  # noqa: E402

#: What a refit rewrites that a committed folder keeps.
RANKING_FILES = ("heads*.json", "heads*.csv", "report.md")


def committed_runs(root: Path = ROOT) -> list[Path]:
    """Every locate or greedy run folder whose config.json git tracks."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*config.json"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    runs = []
    for name in sorted(filter(None, listed.split("\0"))):
        config = root / name
        if config.name != "config.json" or not config.is_file():
            continue
        command = json.loads(config.read_text(encoding="utf-8")).get("command")
        if command in ("locate", "greedy"):
            runs.append(config.parent)
    return runs


def stale_files(folder: Path) -> dict[str, str]:
    """The ranking files of ``folder`` whose text today's code writes differently:
    name -> the new text."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(shutil.copytree(folder, Path(scratch) / "run"))
        record = load_run(copy)
        if record.command == "greedy":
            greedy(copy, record.spec)
        else:
            refit(copy)
        changed = {}
        if (copy / "types.json").is_file() and not (folder / "types.json").is_file():
            changed["types.json"] = (copy / "types.json").read_text(encoding="utf-8")
        for pattern in RANKING_FILES:
            for old in sorted(folder.glob(pattern)):
                new = (copy / old.name).read_text(encoding="utf-8")
                if new != old.read_text(encoding="utf-8"):
                    changed[old.name] = new
        return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only list the stale folders; exit 1 if there are any")
    args = parser.parse_args(argv)
    stale = 0
    for folder in committed_runs():
        changed = stale_files(folder)
        if not changed:
            continue
        stale += 1
        print(f"{folder.relative_to(ROOT)}: {', '.join(changed)}")
        if not args.check:
            for name, text in changed.items():
                (folder / name).write_text(text, encoding="utf-8")
    print(f"{stale} folder(s) {'stale' if args.check else 'rewritten'}", file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
