"""NEURONS.md: which unit a capability lives in — attention heads or MLP neurons — on the
embedded model's offline tasks, by the product's own commands.

    python benchmarks/bench_neurons.py                 # measure what is missing, render
    python benchmarks/bench_neurons.py --render-only   # render from the committed runs

Per task, on two disjoint halves of its documents (``--examples-part 1/2`` and ``2/2``):

- ``heads-p1``, ``heads-p2``: ``locate`` with the defaults (compressed sensing over heads);
- ``neurons-p1``, ``neurons-p2``: ``locate --components neurons`` with the defaults;
- ``cnl-p1.json``, ``cnl-p2.json``: CNL-style attribution alone — the integrated-gradients
  prior over every MLP neuron (``--prior ig``'s 8 points), ranked, no masks;
- ``eval``: each method's half-1 top-k knocked out together on half 2's examples (held
  out), next to ``DRAWS`` random sets of the same size and kind: at equal counts (k = 1, 5)
  and at an equal share of the parameters (one head's share is ``neurons_per_head``
  neurons: k = 1 and 3 heads);
- ``groups-p1``: ``neurons-p1`` with ``--neuron-groups GROUPS`` (the same prior, so the same
  candidates, and every other neuron in a group column): does a group the prior passed over
  matter, and does the top-k change?

Runs live under ``benchmarks/neurons/`` and resume when the script is rerun (each is a run
folder of the product's). Nothing here is tuned: the defaults, as a user gets them.
They are stored packed there, one archive per task (``benchmarks/bench_store.py``); the script
works in their unpacked copy ``bench-work/neurons/`` (unpacked where the archives are newer
before it starts, packed back into ``benchmarks/`` when it ends). ``--runs`` elsewhere
reads and writes that folder as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from headloc_bench import ROOT
from headloc_bench.bench_store import WORK_TREE, store_work, work_tree
from lm_eval_headloc.commands.locate import locate
from lm_eval_headloc.commands.verify import random_sets
from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.common.files import page_refusal, write_atomically, write_page
from lm_eval_headloc.intervention.components import Neuron, parse_components, read_heads_file
from lm_eval_headloc.intervention.model_args import model_config
from lm_eval_headloc.measurement.attribution import PRIOR_POINTS
from lm_eval_headloc.method.ranking import relative_drop
from lm_eval_headloc.runs.plan import load_model, measured_plan, open_measurement
from lm_eval_headloc.runs.setup import prepare
from lm_eval_headloc.runs.spec import RunSpec

TASKS = ("headloc_induction", "headloc_ioi", "headloc_arith")
#: How the page begins (the model's name follows): --out writes only over such a page.
TITLE = "# Heads or MLP neurons? ("
OUT = WORK_TREE / "neurons"  # benchmarks/neurons/, unpacked
NUM_SAMPLES = 50  # per half: the runs' examples, and the held-out evaluation's
DRAWS = 5
EQUAL_COUNTS = (1, 5)
EQUAL_SHARE_HEADS = (1, 3)
CNL_KEEP = 400  # neurons of the attribution ranking kept on disk
GROUPS = 4  # --neuron-groups of the groups run: 120 groups of ~380 neurons on the embedded model
COMMAND = "python benchmarks/bench_neurons.py"


def neurons_per_head(config: Any) -> int:
    """How many MLP neurons hold as many parameters as one attention head: a head's query
    and output slices and its share of its key/value group, against a neuron's up (and
    gate) row and down column."""
    from lm_eval_headloc.intervention.geometry import text_config

    text = text_config(config)
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv = getattr(text, "num_key_value_heads", None) or heads
    head = 2 * hidden * head_dim + 2 * hidden * head_dim * kv / heads
    gated = getattr(text, "hidden_act", "") in ("silu", "swiglu", "gelu_pytorch_tanh") or \
        getattr(text, "model_type", "") in ("llama", "mistral", "qwen2", "qwen3", "gemma2")
    neuron = (3 if gated else 2) * hidden
    return max(1, round(head / neuron))


def _spec(base: RunSpec, task: str, part: int, **changes: Any) -> RunSpec:
    return base.replace(tasks=(task,), examples_part=f"{part}/2", num_samples=NUM_SAMPLES,
                        progress=False, **changes)


def cnl_ranking(runs: Path, base: RunSpec, task: str, part: int) -> dict[str, Any]:
    """The integrated-gradients attribution of every neuron on half ``part``, ranked
    (most harmful knockout first): CNL's selection without its recurrence threshold."""
    path = runs / task / f"cnl-p{part}.json"
    if path.is_file():
        return json.loads(path.read_text())
    spec = _spec(base, task, part, components="neurons", prior="ig")
    setup = prepare(spec)
    measure = open_measurement(setup, load_model(setup), None, num_samples=NUM_SAMPLES)
    start = time.perf_counter()
    (estimates,) = measure.attribution(PRIOR_POINTS["ig"], kind="neurons")[task]
    width = measure.lm.neurons_per_layer
    order = np.argsort(estimates, kind="stable")[:CNL_KEEP]
    result = {"method": "integrated gradients (8 midpoints) of the gold answers' mean "
                        "log-likelihood, every MLP neuron moved towards zero together; "
                        "ranked by the estimated change, most negative first",
              "task": task, "examples_part": f"{part}/2", "seconds": round(
                  time.perf_counter() - start, 2),
              "ranking": [str(Neuron(*divmod(int(i), width))) for i in order],
              "estimates": [float(estimates[i]) for i in order]}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda partial: partial.write_text(json.dumps(result, indent=1)))
    return result


def rankings(runs: Path, base: RunSpec, task: str) -> dict[str, dict[int, list[str]]]:
    """method -> half -> ranked component names (each run made or resumed)."""
    ranked: dict[str, dict[int, list[str]]] = {"heads": {}, "neurons": {}, "cnl": {}}
    for part in (1, 2):
        for method, components in (("heads", "heads"), ("neurons", "neurons")):
            out = runs / task / f"{method}-p{part}"
            locate(out, _spec(base, task, part, components=components))
            ranked[method][part] = read_heads_file(out / f"heads-{task}.json")
        ranked["cnl"][part] = cnl_ranking(runs, base, task, part)["ranking"]
    return ranked


def evaluation_sets(ranked: Mapping[str, Mapping[int, list[str]]], per_head: int
                    ) -> list[dict[str, Any]]:
    """The half-1 sets knocked out on half 2: each method at equal counts, and the two
    neuron methods at the parameter share of 1 and 3 heads."""
    sets = []
    for method, by_part in ranked.items():
        sizes = [(k, "equal count") for k in EQUAL_COUNTS]
        if method != "heads":
            sizes += [(k * per_head, f"as many parameters as {k} head{'s' * (k > 1)}")
                      for k in EQUAL_SHARE_HEADS]
        else:
            sizes += [(k, f"as many parameters as {k} head{'s' * (k > 1)}")
                      for k in EQUAL_SHARE_HEADS if k not in EQUAL_COUNTS]
        for k, basis in sizes:
            if k <= len(by_part[1]):
                sets.append({"method": method, "k": k, "basis": basis,
                             "set": list(by_part[1][:k])})
    return sets


def evaluate(runs: Path, base: RunSpec, task: str, sets: list[dict[str, Any]]
             ) -> dict[str, Any]:
    """Each set and its random draws knocked out on half 2 (one model load, resumable)."""
    spec = _spec(base, task, 2)
    setup = prepare(spec)
    plan: list[tuple[str, list]] = [("baseline", [])]
    for index, entry in enumerate(sets):
        try:
            entry["random"] = random_sets(entry["set"], setup.geometry, DRAWS, spec.seed,
                                          f"{task}-{index}")
        except UsageError:  # a model too small for random sets of this size
            entry["random"] = []
        plan.append((f"set{index}", parse_components(entry["set"])))
        plan += [(f"set{index}-random{d}", parse_components(drawn))
                 for d, drawn in enumerate(entry["random"], start=1)]
    identity = {**spec.identity("verify"), "sets": [e["set"] for e in sets]}
    with measured_plan(runs / task / "eval", "bench-neurons", spec, setup, plan,
                       identity=identity, num_samples=NUM_SAMPLES) as (_, records):
        base_record = records["baseline"]
        higher = bool(base_record["higher_is_better"][task])

        def drop(key: str) -> float:
            return relative_drop(base_record["scores"][task], records[key]["scores"][task],
                                 higher)

        for index, entry in enumerate(sets):
            entry["drop"] = drop(f"set{index}")
            entry["random_drops"] = [drop(f"set{index}-random{d}")
                                     for d in range(1, len(entry["random"]) + 1)]
        return {"baseline": base_record["scores"][task],
                "metric": base_record["metrics"][task], "sets": sets}


def group_findings(runs: Path, base: RunSpec, task: str, k: int = 5) -> dict[str, Any]:
    """``neurons-p1`` again with ``--neuron-groups GROUPS``: every group the run measured
    alone (its measured change), the groups in its top-k, and its top-k next to the plain
    run's (the candidates are the same: the same prior on the same examples)."""
    out = runs / task / "groups-p1"
    locate(out, _spec(base, task, 1, components="neurons", neuron_groups=GROUPS))
    ranking = json.loads((out / f"heads-{task}.json").read_text())
    plain = json.loads((runs / task / "neurons-p1" / f"heads-{task}.json").read_text())
    entries = ranking["heads"]
    groups = [e for e in entries if "group" in e]
    top = [e.get("group", e.get("neuron")) for e in entries[:k]]
    plain_top = [e["neuron"] for e in plain["heads"][:k]]
    return {"neuron_groups": GROUPS, "groups": len(groups),
            "group_sizes": [min(e["size"] for e in groups), max(e["size"] for e in groups)],
            "baseline": ranking["baseline"],
            "measured_alone": [{"group": e["group"], "size": e["size"], "rank": e["rank"],
                                "change": e["effect"]}
                               for e in groups if e.get("measured_alone")],
            "implicated": [g for g in ranking.get("implicated", []) if "G" in g],
            "top_k": top, "plain_top_k": plain_top,
            "shared_top_k": len(set(top) & set(plain_top))}


def top_evidence(runs: Path, task: str, k: int = 5) -> dict[str, dict[int, dict[str, Any]]]:
    """What stands behind each compressed-sensing run's top-k (read from its ranking file):
    method -> half -> the members measured alone to hurt, those the fit implicates without
    a measurement (and, of those, the ones the masks knocked out only together with
    others: ``same_masks``), and those that do not hurt."""
    found: dict[str, dict[int, dict[str, Any]]] = {}
    for method in ("heads", "neurons"):
        for part in (1, 2):
            ranking = json.loads((runs / task / f"{method}-p{part}" / f"heads-{task}.json")
                                 .read_text())
            higher = ranking["higher_is_better"]
            entries = ranking["heads"][:k]
            hurts = [e for e in entries
                     if e["effect"] is not None and (-e["effect"] if higher else e["effect"]) > 0]
            name = [e.get("head") or e.get("neuron") or e.get("group") for e in entries]
            found.setdefault(method, {})[part] = {
                "measured": [n for n, e in zip(name, entries, strict=True)
                             if e in hurts and e.get("measured_alone")],
                "estimated": [n for n, e in zip(name, entries, strict=True)
                              if e in hurts and not e.get("measured_alone")],
                "same_masks": {n: len(o) for n, o in ranking.get("same_masks", {}).items()},
                "no_harm": [n for n, e in zip(name, entries, strict=True) if e not in hurts]}
    return found


def evidence_lines(evidence: Mapping[str, Mapping[int, Mapping[str, Any]]]) -> list[str]:
    """A table of :func:`top_evidence`."""
    lines = ["What stands behind each top-5 (its run's ranking file): measured alone to hurt, "
             "or implicated by the masks' fit without a measurement (× n: the masks knocked "
             "it out only together with n other components not measured alone, so they cannot "
             "tell it from them).", "",
             "| method | half | measured alone to hurt | implicated, not measured | do not hurt |",
             "| --- | --- | --- | --- | --- |"]
    for method, halves in evidence.items():
        for part, entry in halves.items():
            estimated = [n + (f" (× {entry['same_masks'][n]})" if n in entry["same_masks"]
                              else "") for n in entry["estimated"]]
            lines.append(f"| {method} | {part} | {len(entry['measured'])} | "
                         f"{', '.join(estimated) or 'none'} | "
                         f"{', '.join(entry['no_harm']) or 'none'} |")
    return lines + [""]


def overlaps(ranked: Mapping[str, Mapping[int, list[str]]], k: int) -> dict[str, float]:
    """Per method: |A ∩ B| / k of the two halves' top-k (both sets have k members, so this
    is either half's overlap rate) and the IoU |A ∩ B| / |A ∪ B|."""
    rates = {}
    for method, by_part in ranked.items():
        a, b = set(by_part[1][:k]), set(by_part[2][:k])
        rates[method] = {"overlap": len(a & b) / k, "iou": len(a & b) / len(a | b)}
    return rates


def _pct(value: float) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{100 * value + 0.0:+.1f} %" if round(100 * value, 1) else "0.0 %"  # no "-0.0"


METHODS = {"heads": "heads, compressed sensing (locate defaults)",
           "neurons": "MLP neurons, compressed sensing (locate --components neurons)",
           "cnl": "MLP neurons, attribution alone (CNL-style: integrated gradients)"}


def render(results: Mapping[str, Any], per_head: int, model: str) -> str:
    lines = [f"{TITLE}{model})", "",
             f"Generated by `{COMMAND}` from the runs under `benchmarks/neurons/` "
             "(rerun to measure what is missing; `--render-only` to render). Each task's "
             f"documents are cut in two disjoint halves; every method runs on {NUM_SAMPLES} "
             "examples of half 1, and its top-k is knocked out together on "
             f"{NUM_SAMPLES} examples of half 2 (held out). Drops are relative to the "
             "unablated score on half 2 (positive = worse); each set is compared with "
             f"{DRAWS} random sets of the same size and kind (never sharing a component "
             "with it). One head holds as many parameters as "
             f"{per_head} MLP neurons (query and output slices and its share of the "
             "key/value group, against a neuron's gate and up rows and down column).", ""]
    for task, result in results.items():
        lines += [f"## {task} ({result['metric']}, half-2 baseline "
                  f"{result['baseline']:.3f})", "",
                  "| method | k | basis | drop of the set | random: mean ± sd | random: "
                  "min – max | beats |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for entry in result["sets"]:
            drawn = np.array(entry["random_drops"], dtype=np.float64)
            finite = drawn[np.isfinite(drawn)]
            beats = int(np.sum(entry["drop"] > finite)) if math.isfinite(entry["drop"]) \
                else None
            lines.append(
                f"| {entry['method']} | {entry['k']} | {entry['basis']} | "
                f"{_pct(entry['drop'])} | "
                + (f"{_pct(finite.mean())} ± {100 * finite.std(ddof=1):.1f} | "
                   f"{_pct(finite.min())} – {_pct(finite.max())} | "
                   if finite.size > 1 else "n/a | n/a | ")
                + (f"{beats}/{finite.size} |" if beats is not None else "n/a |"))
        lines += ["", "Stability across the halves (top-5; overlap rate = |A ∩ B| / 5):", "",
                  "| method | overlap | IoU |", "| --- | --- | --- |"]
        for method, rates in result["overlap"].items():
            lines.append(f"| {method} | {rates['overlap']:.0%} | {rates['iou']:.0%} |")
        lines.append("")
        if "evidence" in result:
            lines += evidence_lines(result["evidence"])
    lines += group_section(results)
    lines += ["Methods: " + "; ".join(f"**{k}**: {v}" for k, v in METHODS.items()) + ".", ""]
    return "\n".join(lines)


def group_section(results: Mapping[str, Any]) -> list[str]:
    """What ``--neuron-groups`` found: the groups measured alone and the top-5, per task."""
    found = {task: r["neuron_groups"] for task, r in results.items() if "neuron_groups" in r}
    if not found:
        return []
    first = next(iter(found.values()))
    lines = ["## Neuron groups: what the candidates miss", "",
             f"`neurons-p1` again with `--neuron-groups {first['neuron_groups']}` (half 1, the "
             "same prior and so the same candidates; every other neuron in one of "
             f"{first['groups']} groups of {first['group_sizes'][0]}–"
             f"{first['group_sizes'][1]} neurons, one design column each). A group measured "
             "alone was implicated by the masks' fit (a group has no prior); its change is "
             "measured on half 1's examples.", "",
             "| task | groups measured alone (change) | groups the fit implicates, not "
             "measured | top-5 | shared with the plain run's top-5 |",
             "| --- | --- | --- | --- | --- |"]
    for task, entry in found.items():
        alone = ", ".join(f"{g['group']} ({g['size']}: {g['change']:+.3f})"
                          for g in entry["measured_alone"]) or "none"
        lines.append(f"| {task} | {alone} | {', '.join(entry['implicated']) or 'none'} | "
                     f"{', '.join(entry['top_k'])} | {entry['shared_top_k']}/5 |")
    measured = [g for entry in found.values() for g in entry["measured_alone"]]
    moved = [g for g in measured if g["change"]]
    in_top = sum(any("G" in c for c in e["top_k"]) for e in found.values())
    lines += ["", f"Groups measured alone: {len(measured)}, of which {len(moved)} changed "
              "their task's score"
              + (": " + ", ".join(f"{g['group']} {g['change']:+.3f}" for g in moved)
                 if moved else "")
              + f". Tasks with a group in their top-5: {in_top} of {len(found)}."]
    return lines + [""]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--model-args", default=None)
    parser.add_argument("--include-path", action="append", default=[])
    parser.add_argument("--out", type=Path, default=ROOT / "NEURONS.md")
    parser.add_argument("--runs", default=str(OUT), help="where the runs live")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if (why := page_refusal(args.out, TITLE)) is not None:
        parser.error(f"--out: {why}")  # before the runs, not after them
    runs = Path(args.runs)
    stored = runs.resolve() == OUT.resolve()
    if stored:
        work_tree()  # the committed runs unpacked (bench_store.py), up to date
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    base = RunSpec(model_args=args.model_args, include_path=tuple(args.include_path))
    tasks = [t for t in args.tasks.split(",") if t]
    setup = prepare(base.replace(tasks=(tasks[0],)))
    per_head = neurons_per_head(model_config(setup.spec.model_args))
    results = {}
    for task in tasks:
        saved = runs / task / "result.json"
        if args.render_only:
            results[task] = json.loads(saved.read_text())
            continue
        ranked = rankings(runs, base, task)
        result = evaluate(runs, base, task, evaluation_sets(ranked, per_head))
        result["overlap"] = overlaps(ranked, 5)
        result["neuron_groups"] = group_findings(runs, base, task)
        write_atomically(saved, lambda partial, r=result: partial.write_text(
            json.dumps(r, indent=1)))
        results[task] = result
    for task in tasks:  # read from the runs' ranking files at every render
        results[task]["evidence"] = top_evidence(runs, task)
    name = "embedded SmolLM2-135M-Instruct" if args.model_args is None else args.model_args
    write_page(args.out, render(results, per_head, name), TITLE)
    print(f"wrote {args.out}")
    if stored:
        store_work()  # what the runs added, packed into benchmarks/
    return 0


if __name__ == "__main__":
    sys.exit(main())
