"""Rewrite the ranking files and the config.json of the committed run folders with today's
code.

    python benchmarks/refit_committed.py           # rewrite what changed, list it
    python benchmarks/refit_committed.py --check   # list what is stale, exit 1 if any

When the ranking code changes (the order, an interval, a sentence of report.md), the
run folders committed to this repository (packed in ``benchmarks/``'s archives, and any
other folder whose config.json git tracks, so a user's own runs are never touched) no
longer read as today's code writes them, and ``tests/test_run_result.py`` says so. The
archives are unpacked into a temporary folder (``benchmarks/bench_store.py``: the committed
bytes, not ``bench-work/``'s copy, which may hold runs not packed yet); without
``--check`` what changed is written there and packed back, so only the archives of the
parts that changed are rewritten. Each run is fitted again from its stored
measurements, in a copy (``locate`` runs by ``refit``, which loads no model; ``greedy``
runs by rerunning the finished run, which measures nothing, but loads the model once to
write the head types a greedy run without types.json now gets). Only the ranking files
the folder already holds (heads*.json, heads*.csv, report.md) are copied back, and only
when their text changed beyond the round-off of another machine's BLAS
(``same_up_to_round_off``), with a types.json the rerun wrote; the measurements and
anything else stay as committed.

config.json is rewritten in today's layout (``runs.folder.CONFIG_SCHEMA``), that of every
committed run folder, ranking or not: the embedded model by its name rather than the
folder it lay in on the machine that made the run, and what the run's model is (its
width, block layout and files' fingerprint, ``runs.record.model_facts``) read from the model's
config where a folder made before they were recorded lacks them; nothing measured changes.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from headloc_bench import ROOT
from headloc_bench.bench_store import STORE, pack, unpack
from lm_eval_headloc.commands import greedy, refit
from lm_eval_headloc.common.files import strict_json
from lm_eval_headloc.runs.record import RunRecord, load_run, model_facts

#: What a refit rewrites that a committed folder keeps.
RANKING_FILES = ("heads*.json", "heads*.csv", "report.md")


def committed_folders(tree: Path, root: Path = ROOT) -> list[Path]:
    """The config.json of every committed run folder (any command's): those of ``tree``
    (``benchmarks/`` unpacked, ``bench_store.unpack``), then any whose config.json git
    tracks elsewhere."""
    listed = subprocess.run(["git", "ls-files", "-z", "--", "*config.json"], cwd=root,
                            check=True, capture_output=True, text=True).stdout
    tracked = [root / name for name in sorted(filter(None, listed.split("\0")))
               if Path(name).name == "config.json" and (root / name).is_file()]
    return sorted(tree.rglob("config.json")) + tracked


def committed_runs(tree: Path, root: Path = ROOT) -> list[Path]:
    """Every committed locate or greedy run folder (``committed_folders``)."""
    return [config.parent for config in committed_folders(tree, root)
            if _command(config) in ("locate", "greedy")]


def _command(config: Path) -> object:
    return json.loads(config.read_text(encoding="utf-8")).get("command")


#: Each model's geometry and fingerprint, by its model args, once read.
_READ: dict[str, tuple[Any, str | None]] = {}


def with_model_facts(record: RunRecord) -> RunRecord:
    """``record`` with what config.json records of its model (``model_facts``) where a run
    made before they were recorded lacks them: read from the model's config (no weights),
    which must have the run's layers and heads. The MLP's width a run recorded (from its
    weights) is kept; a folder that recorded nothing of its model (a script's that only
    computed a prior) is left so."""
    from lm_eval_headloc.intervention.model_args import (
        config_geometry,
        model_config,
        model_fingerprint,
        resolve_model_args,
    )

    if record.layers is None or (record.d_model is not None
                                 and record.model_fingerprint is not None):
        return record  # a script's folder that recorded nothing of the model, or complete
    model_args = resolve_model_args(record.spec.model_args)
    if model_args not in _READ:  # a GGUF's config takes seconds to read: once a model
        _READ[model_args] = (config_geometry(model_config(model_args)),
                             model_fingerprint(model_args))
    geometry, fingerprint = _READ[model_args]
    facts = model_facts(geometry, fingerprint)
    shape = (geometry.num_layers, geometry.heads_per_layer)
    if shape != (record.layers, record.heads_per_layer):
        raise SystemExit(f"{record.spec.model_args}: {shape[0]} layers of {shape[1]} heads, "
                         f"but the run recorded {record.layers} of {record.heads_per_layer}")
    if record.neurons_per_layer is not None:
        del facts["neurons_per_layer"]
    for key, value in facts.items():
        setattr(record, key, value)
    return record


def upgraded_config(folder: Path) -> str:
    """config.json of the run in ``folder`` as today's code writes it (``with_model_facts``)."""
    return strict_json(with_model_facts(load_run(folder)).to_config())


#: A number with a fraction or an exponent, as the ranking files write the fitted effects.
_FLOAT = re.compile(r"-?\d+\.\d+(?:[eE][-+]?\d+)?|-?\d+[eE][-+]?\d+")


def same_up_to_round_off(old: str, new: str, rel: float = 1e-9) -> bool:
    """Whether two texts are the same but in the last bits of their floating-point numbers
    (and the sign of a zero): the Lasso's coordinate descent runs on the machine's BLAS,
    whose kernels (chosen for the CPU) round differently, so a refit on another machine
    moves an effect in its 16th digit without changing what the run says."""
    if _FLOAT.split(old) != _FLOAT.split(new):
        return False
    return all(math.isclose(float(a), float(b), rel_tol=rel, abs_tol=1e-15)
               for a, b in zip(_FLOAT.findall(old), _FLOAT.findall(new), strict=True))


def stale_files(folder: Path) -> dict[str, str]:
    """The ranking files and config.json of ``folder`` whose text today's code writes
    differently: name -> the new text. A folder of another command than locate or greedy:
    its config.json alone."""
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(shutil.copytree(folder, Path(scratch) / "run"))
        record = load_run(copy)
        if record.command == "greedy":
            greedy(copy, record.spec)
        elif record.command == "locate":
            refit(copy)
        changed = {}
        config = upgraded_config(copy)
        if config != (folder / "config.json").read_text(encoding="utf-8"):
            changed["config.json"] = config
        if (copy / "types.json").is_file() and not (folder / "types.json").is_file():
            changed["types.json"] = (copy / "types.json").read_text(encoding="utf-8")
        if record.command not in ("locate", "greedy"):
            return changed
        for pattern in RANKING_FILES:
            for old in sorted(folder.glob(pattern)):
                new = (copy / old.name).read_text(encoding="utf-8")
                if not same_up_to_round_off(old.read_text(encoding="utf-8"), new):
                    changed[old.name] = new
        return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="only list the stale folders; exit 1 if there are any")
    args = parser.parse_args(argv)
    stale = 0
    with tempfile.TemporaryDirectory() as scratch:
        tree = unpack(Path(scratch) / "benchmarks", STORE)
        for folder in (config.parent for config in committed_folders(tree)):
            changed = stale_files(folder)
            if not changed:
                continue
            stale += 1
            where = (Path("benchmarks") / folder.relative_to(tree)
                     if folder.is_relative_to(tree) else folder.relative_to(ROOT))
            print(f"{where}: {', '.join(changed)}")
            if not args.check:
                for name, text in changed.items():
                    (folder / name).write_text(text, encoding="utf-8")
        packed = [] if args.check or not stale else pack(tree, STORE)
    print(f"{stale} folder(s) {'stale' if args.check else 'rewritten'}"
          + (f"; archives rewritten: {', '.join(packed)}" if packed else ""), file=sys.stderr)
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    raise SystemExit(main())
