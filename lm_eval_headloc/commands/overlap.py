"""``overlap``: CNL's stability check. The same ``locate`` run on two disjoint example
subsets of a task should find the same components; this compares two runs' top-k task by
task, so a ranking that only reflects the examples it was measured on shows up as one
that the other subset does not reproduce.

Definitions. CNL (Huang et al., "Capability Localization: Capabilities Can be Localized
rather than Individual Knowledge", ICLR 2025, arXiv 2502.20992) locates neurons on two
disjoint subsamples of a dataset and reports the "overlap rate" and the "IoU" of the two
located sets (96.42 % and 95.95 % on GSM8K). With A and B the two runs' top-k:

- **overlap rate** = |A ∩ B| / |A|: the share of one run's set found in the other's,
  given for each run (|A ∩ B| / |B| for the second). When both sets have k members, as
  two top-k do, every reading of an overlap rate (over |A|, over |B|, over the smaller or
  the larger set) is the same |A ∩ B| / k, and the IoU is then o / (2 - o) for an overlap
  rate o. CNL's sets are thresholded and differ in size: its 96.42 % would give an IoU of
  93.09 % for sets of one size, and its pair fits an overlap rate taken over the larger
  set (|A ∩ B| / |A| with A the larger; the IoU then lies between o / (2 - o) and o), not
  over the smaller (the IoU would then be at most o / (2 - o)).
- **IoU** = |A ∩ B| / |A ∪ B| (intersection over union, the Jaccard index).
- **stability curve**: for k = 1..K, |A_k ∩ B_k| / k, the share of either run's top-k
  found in the other's top-k (the same both ways: the two sets have k members each).

Component names are compared as strings (heads ``L0H29``, neurons ``L3N1234``): nothing
here depends on what kind of component a ranking ranks. Ties are not an order: where the
k-th and (k+1)-th of a ranking have the same evidence (``tied_with_above``), or at the run's
own top-k measured harms within the noise (its certificate's ``tied_at_k``), its top-k is
not well defined; the output says so and gives the fewest and most components the runs
can share over every way of breaking the ties.

A run locating neurons searches only its candidate neurons (the prior's picks on its own
examples; config.json's ``candidates``): a neuron of A's top-k that B never had among its
candidates could not be in B's top-k at all. The output says, per task, which of each
run's top-k the other never searched, so an overlap lost that way reads as the candidate
choice, not as a localization that the other examples do not reproduce.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lm_eval_headloc.common.checks import UsageError, check_number
from lm_eval_headloc.common.files import not_a_file, strict_json, write_atomically
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.components import (
    read_heads_file,
    recorded_harmless,
    shown_name,
)
from lm_eval_headloc.intervention.model_args import same_model
from lm_eval_headloc.report.pages import beyond_spread
from lm_eval_headloc.runs.folder import RunFolder, checked_path, refuse_writing_into
from lm_eval_headloc.runs.record import (
    RunRecord,
    load_run,
    ranking_files,
    read_ranking_file,
)

__all__ = ["MADE_BY", "RankingFile", "candidate_neurons", "markdown_path", "never_searched",
           "overlap", "overlap_markdown"]

MADE_BY = "headloc-harness overlap"  # marks a file of ours: the only kind we overwrite
_MARK = f"<!-- written by {MADE_BY}; rerunning it overwrites this file -->"
_NEURON = re.compile(r"L\d+N\d+", re.ASCII)  # one neuron's name (a group is LxGy)

DEFINITIONS = {
    "overlap_rate": "|A ∩ B| / |A|: the share of one run's top-k found in the other's "
                    "top-k (CNL's overlap rate), given for each run",
    "iou": "|A ∩ B| / |A ∪ B|: intersection over union",
    "curve": "for k = 1..K, |A_k ∩ B_k| / k: the share of either run's top-k found in the "
             "other's top-k (the same both ways)",
}


@dataclass(frozen=True)
class RankingFile:
    """One task's ranking as its heads-<task>.json holds it: names only, best first."""

    file: Path
    names: list[str]
    tied: frozenset[str]  # names whose evidence equals that of the name above them
    effects: list[float | None] | None  # None: the file records no effects
    harmless: frozenset[str] = frozenset()  # recorded to do no harm (components.recorded_harmless)
    higher_is_better: bool = True
    largest_help: Mapping[str, Any] | None = None  # its largest_single_help, if recorded
    # Its certificate's tie at its own top-k's edge (``tied_at_k``: measured harms within
    # the noise of the k-th), and that k.
    noise_tied: frozenset[str] = frozenset()
    noise_k: int | None = None

    @classmethod
    def read(cls, path: Path) -> RankingFile:
        """``path``'s ranking, read through the package's one check of a ranking file
        (``read_ranking_file``, as ``read_rankings``): a tampered file is one line naming it
        and its field, never a traceback or an overlap counted from it."""
        data = read_ranking_file(path)
        names = read_heads_file(path)  # its names, as every reader of a head list reads them
        entries = data["heads"]
        if data.get("tied_with_above") is not None:
            tied = frozenset(data["tied_with_above"])
        else:
            tied = frozenset(e.get("head") for e in entries if e.get("tied_with_above"))
        has_effects = all("effect" in e for e in entries)
        cert = data.get("certificate")
        noise = cert.get("tied_at_k") if isinstance(cert, Mapping) else None
        noise_k = cert.get("top_k") if isinstance(cert, Mapping) else None
        return cls(path, names, tied, [e["effect"] for e in entries] if has_effects else None,
                   frozenset(recorded_harmless(path)), data["higher_is_better"],
                   data.get("largest_single_help"),
                   frozenset(n for n in noise if isinstance(n, str))
                   if isinstance(noise, list) else frozenset(),
                   noise_k if type(noise_k) is int else None)

    def check_top_k(self, k: int, run: str | Path, own: bool = False,
                    longest: bool = False) -> None:
        """Refuse a top-k past the ranking's end (``own``: the run's own --top-k;
        ``longest``: the ranking is the longest of several)."""
        if k > len(self.names):
            whose = " (the run's own)" if own else ""
            named = f"{self.file.name} of {run}"
            named = f"the longest ranking, {named}," if longest else named
            raise UsageError(f"--top-k {k}{whose}: {named} ranks only "
                             f"{counted(len(self.names), 'component')}")

    def within_spread(self, k: int) -> list[str]:
        """The top-k names that hurt the task by no more than the ranking's largest single
        help (``report.pages.within_spread``, from the file): no evidence the task needs them."""
        if self.largest_help is None or self.effects is None or self.nothing_found(k):
            return []
        return [name for name, effect in zip(self.names[:k], self.effects, strict=False)
                if isinstance(effect, (int, float)) and name not in self.harmless
                and not beyond_spread(effect, self.largest_help, self.higher_is_better)]

    def harmless_places(self, k: int) -> tuple[list[str], dict[str, list[str]]]:
        """The top-k's names recorded to do no harm: those after the last that hurts
        (places filled because fewer hurt), and those ranked above one that hurts, each
        with the ones below it that hurt (iterative greedy ranks by the order its rounds
        were won, not by harm)."""
        top = self.names[:k]
        effects = self.effects or [None] * len(self.names)
        hurting = [i for i, (name, e) in enumerate(zip(top, effects, strict=False))
                   if isinstance(e, (int, float)) and (-e if self.higher_is_better else e) > 0]
        last = max(hurting, default=-1)
        after = [n for i, n in enumerate(top) if i > last and n in self.harmless]
        above = {name: [top[j] for j in hurting if j > i]
                 for i, name in enumerate(top[:max(last, 0)]) if name in self.harmless}
        return after, above

    def _joined(self, i: int, k: int) -> bool:
        """Whether the ``i``-th name (0-based) is tied with the one above it: the same
        evidence, or (at the run's own top-k) measured harms within the noise of each
        other (the certificate's ``tied_at_k``)."""
        noise = self.noise_tied if k == self.noise_k else frozenset()
        return self.names[i] in self.tied or {self.names[i - 1], self.names[i]} <= noise

    def tied_at(self, k: int) -> bool:
        """Whether the k-th and (k+1)-th are tied (``_joined``): no top-k set is defined."""
        return 0 < k < len(self.names) and self._joined(k, k)

    def cut(self, k: int) -> tuple[list[str], list[str], int]:
        """The top-k as ``(sure, group, places)``: the names above the tie group that
        straddles the k-th/(k+1)-th boundary (the whole top-k when none does), that group,
        and how many of its members the top-k holds."""
        if not self.tied_at(k):
            return self.names[:k], [], 0
        start, end = k - 1, k + 1
        while start > 0 and self._joined(start, k):
            start -= 1
        while end < len(self.names) and self._joined(end, k):
            end += 1
        return self.names[:start], self.names[start:end], k - start

    def nothing_found(self, k: int) -> str | None:
        """Why the ranking shows no component standing out, or None when one does."""
        top = self.names[:k]
        if len(top) > 1 and all(name in self.tied for name in top[1:]):
            return (f"no component stands out (the top {k} all have the same evidence, "
                    "so their order is the index)")
        if self.effects is not None and all(not e for e in self.effects):
            return "no effect found (every effect in the ranking is 0 or unknown)"
        if top and all(name in self.harmless for name in top):
            return (f"none of its top {k} hurts the task (each is recorded to do no "
                    "harm)")
        return None


def _shared_range(a: tuple[list[str], list[str], int],
                  b: tuple[list[str], list[str], int]) -> tuple[int, int]:
    """The fewest and most components two top-k sets (``RankingFile.cut``) can share over
    every way of breaking the ties at their boundaries (equal when neither is tied).

    A member of A's tie group is shared when B holds it for sure (``a1`` of them), or
    when both runs pick it from their groups (``both`` members are in both groups); the
    rest (``a3``) never are. Given how many each run picks from those in both groups (x,
    y), the rest of its picks are free, so trying every such pair finds both bounds.
    """
    (sure_a, group_a, take_a), (sure_b, group_b, take_b) = a, b
    sure_a, sure_b, group_a, group_b = map(set, (sure_a, sure_b, group_a, group_b))
    base, both = len(sure_a & sure_b), len(group_a & group_b)
    a1, b1 = len(group_a & sure_b), len(group_b & sure_a)
    a3, b3 = len(group_a) - a1 - both, len(group_b) - b1 - both
    low, high = None, None
    for x in range(min(both, take_a) + 1):
        if take_a - x > a1 + a3:
            continue
        for y in range(min(both, take_b) + 1):
            if take_b - y > b1 + b3:
                continue
            most = base + min(a1, take_a - x) + min(b1, take_b - y) + min(x, y)
            fewest = (base + max(0, take_a - x - a3) + max(0, take_b - y - b3)
                      + max(0, x + y - both))
            low = fewest if low is None else min(low, fewest)
            high = most if high is None else max(high, most)
    # Some pair always fits (x = min(both, take) leaves at most the rest of the group).
    assert low is not None and high is not None
    return low, high


def candidate_neurons(record: RunRecord) -> list[str] | None:
    """The neurons ``record``'s run searched: its candidates, the only neurons with a design
    column. None for a run that locates no neurons, or one whose config.json records no
    candidates (a folder from before they were recorded)."""
    if "neurons" not in record.spec.components.split("+"):
        return None
    candidates = getattr(record, "candidates", None)  # a LocateRun's (greedy ranks heads)
    return list(candidates) if isinstance(candidates, list) else None


def never_searched(names: Sequence[str], record: RunRecord) -> list[str] | None:
    """The neurons among ``names`` that ``record``'s run never searched (not among its
    candidates, so it could not rank them); [] for a run that locates no neurons (it
    searches every head); None where it locates neurons but records no candidates."""
    if "neurons" not in record.spec.components.split("+"):
        return []
    candidates = candidate_neurons(record)
    if candidates is None:
        return None
    searched = set(candidates)
    return [name for name in names if _NEURON.fullmatch(name) and name not in searched]


def _iou(shared: int, size_a: int, size_b: int) -> float:
    return shared / (size_a + size_b - shared)


def _rankings(folder: RunFolder, record: RunRecord) -> dict[str, RankingFile]:
    return {file.stem.removeprefix("heads-"): RankingFile.read(file)
            for file in ranking_files(folder, record)}


def _examples(a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """Whether the two runs measured disjoint example subsets (what CNL's check needs)."""
    subsets = a.example_subset, b.example_subset
    if subsets[0] is None or subsets[1] is None:
        which = [label for label, s in zip("AB", subsets, strict=True) if s is None]
        return {"status": "unknown", "shared": None, "tasks": {},
                "why": f"{'runs' if len(which) > 1 else 'run'} {' and '.join(which)} "
                       "recorded no example subset"}
    tasks = {task: {"a": len(subsets[0][task]), "b": len(subsets[1][task]),
                    "shared": len(set(subsets[0][task]) & set(subsets[1][task]))}
             for task in subsets[0] if task in subsets[1]}
    shared = sum(entry["shared"] for entry in tasks.values())
    result = {"status": "overlapping" if shared else "disjoint", "shared": shared,
              "tasks": tasks, "why": None}
    if not tasks:
        result.update(status="unknown", shared=None,
                      why="the runs' example subsets hold no task in common")
    elif tuple(a.spec.include_path) != tuple(b.spec.include_path):
        result.update(status="unknown",
                      why="the runs read their tasks from different --include-path folders, "
                          "so the same document index may be another example")
    return result


def _side(ranking: RankingFile, k: int, run: str, own: bool) -> dict[str, Any]:
    ranking.check_top_k(k, run, own)
    _, group, places = ranking.cut(k)
    # Recorded to do no harm: after the last that hurts; above one that hurts.
    after, above = ranking.harmless_places(k)
    return {"file": str(ranking.file.resolve()), "k": k, "top_k": ranking.names[:k],
            "tie": {"group": group, "places": places} if group else None,
            "nothing_found": ranking.nothing_found(k),
            "harmless": after, "harmless_above_hurting": above,
            "within_spread": ranking.within_spread(k)}


def _compare(a: RankingFile, b: RankingFile, k_a: int, k_b: int, runs: Sequence[str],
             own: bool, records: Sequence[RunRecord]) -> dict[str, Any]:
    side_a, side_b = _side(a, k_a, runs[0], own), _side(b, k_b, runs[1], own)
    # A neuron the other run never searched could not be shared: said apart (module doc).
    side_a["not_searched_by_other"] = never_searched(side_a["top_k"], records[1])
    side_b["not_searched_by_other"] = never_searched(side_b["top_k"], records[0])
    in_b = set(b.names[:k_b])
    shared = [name for name in a.names[:k_a] if name in in_b]
    low, high = _shared_range(a.cut(k_a), b.cut(k_b))
    curve = []
    for k in range(1, min(max(k_a, k_b), len(a.names), len(b.names)) + 1):
        n = len(set(a.names[:k]) & set(b.names[:k]))
        lo, hi = _shared_range(a.cut(k), b.cut(k))
        curve.append({"k": k, "shared": n, "share": n / k, "iou": _iou(n, k, k),
                      "shared_range": [lo, hi],
                      "tied": [label for label, r in (("a", a), ("b", b)) if r.tied_at(k)]})
    return {"a": side_a, "b": side_b, "shared": shared,
            "overlap_rate_a": len(shared) / k_a, "overlap_rate_b": len(shared) / k_b,
            "iou": _iou(len(shared), k_a, k_b), "well_defined": low == high,
            "shared_range": [low, high], "curve": curve}


def markdown_path(out: str | Path) -> Path:
    """Where the table goes: next to the JSON file, as ``.md``."""
    return Path(out).with_suffix(".md")


def _ours(path: Path) -> bool:
    try:
        text = path.read_text()
        if path.suffix == ".md":
            return text.splitlines()[:1] == [_MARK]
        return json.loads(text).get("made_by") == MADE_BY
    except (OSError, UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return False


def _check_out(out: Path, runs: Sequence[Path]) -> None:
    if out.suffix.lower() != ".json":
        raise UsageError(f"--out {out}: name a .json file (the table is written next to it "
                         "as .md)")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; overlap writes a JSON file and a "
                         f"Markdown file (e.g. {out / 'overlap.json'})")
    refuse_writing_into(out, runs)
    if markdown_path(out).is_symlink():
        raise UsageError(f"--out: {markdown_path(out)} is a link; name files that are not "
                         "(the link would be replaced by a file)")
    for path in (out, markdown_path(out)):
        if (what := not_a_file(path)) is not None:  # _ours would wait on a FIFO for ever
            raise UsageError(f"--out: {what}; name a file")
        if path.exists() and not _ours(path):
            raise UsageError(f"--out: {path} exists and was not written by {MADE_BY}; "
                             "choose another file")


def overlap(run_a: str | Path, run_b: str | Path, top_k: int | None = None,
            out: str | Path | None = None) -> dict[str, Any]:
    """Compare the top-k of two runs (of one model) on every task both rank.

    ``top_k``: the components compared per ranking (default: each run's own ``--top-k``).
    ``out``: a ``.json`` file to write the result to, with the table next to it as ``.md``
    (None: write nothing). Returns the result (``overlap.json``'s content).
    """
    if top_k is not None:
        top_k = check_number(top_k, "--top-k", whole=True, min_val=1)
    paths = [RunFolder(run_a).path.resolve(), RunFolder(run_b).path.resolve()]
    if paths[0] == paths[1]:
        raise UsageError(f"RUN_A and RUN_B are the same folder ({paths[0]}); overlap "
                         "compares two runs")
    folders = [RunFolder(run_a), RunFolder(run_b)]
    records = [load_run(folder) for folder in folders]
    rankings = [_rankings(folder, record) for folder, record in zip(folders, records,
                                                                    strict=True)]
    models = [record.spec.model_args or "" for record in records]
    if not same_model(*models):
        raise UsageError(f"the runs are of different models ({run_a}: {models[0]!r}; "
                         f"{run_b}: {models[1]!r}); overlap compares one model's runs")
    kinds = [record.spec.components for record in records]
    if kinds[0] != kinds[1]:
        # Heads and neurons are never the same component: 0 % shared would say nothing.
        raise UsageError(f"the runs locate different components ({run_a}: {kinds[0]}; "
                         f"{run_b}: {kinds[1]}); overlap compares runs of the same "
                         "--components")
    tasks = [task for task in rankings[0] if task in rankings[1]]
    if not tasks:
        raise UsageError(f"the runs rank no task in common ({run_a}: "
                         f"{', '.join(rankings[0])}; {run_b}: {', '.join(rankings[1])})")
    if out is not None:
        out = checked_path(out, "--out", "overlap.json")
        _check_out(out, paths)
    k_a, k_b = (top_k or record.spec.top_k for record in records)
    # What the runs differ in: what they measured (identity), and what ranked it (the
    # settings refit may change: --exclude, --alpha, the run's own --top-k…), so a run and
    # a refit of it with --exclude do not read as the same settings.
    identities = [{**record.identity, **record.spec.settings(record.command)}
                  for record in records]
    result = {
        "made_by": MADE_BY, "model_args": models[0], "definitions": DEFINITIONS,
        "runs": {label: {"path": str(path), "top_k": k, "seed": record.spec.seed,
                         "num_samples": record.spec.num_samples,
                         "examples_part": record.spec.examples_part,
                         "examples_used": record.examples_used,
                         "candidate_neurons": None if cands is None else len(cands)}
                 for label, path, k, record, cands in zip("ab", paths, (k_a, k_b), records,
                                                          map(candidate_neurons, records),
                                                          strict=True)},
        "differs_in": sorted(key for key in {*identities[0], *identities[1]}
                             if identities[0].get(key) != identities[1].get(key)),
        "examples": _examples(*records),
        "only_in_a": [task for task in rankings[0] if task not in rankings[1]],
        "only_in_b": [task for task in rankings[1] if task not in rankings[0]],
        "tasks": {task: _compare(rankings[0][task], rankings[1][task], k_a, k_b,
                                 (str(run_a), str(run_b)), own=top_k is None,
                                 records=records)
                  for task in tasks},
    }
    if out is not None:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            text, table = strict_json(result), f"{_MARK}\n{overlap_markdown(result)}\n"
            write_atomically(out, lambda partial: partial.write_text(text))
            write_atomically(markdown_path(out), lambda partial: partial.write_text(table))
        except OSError as err:
            raise UsageError(f"cannot write --out {out}: {err.strerror or err}") from None
    return result


# --- the table ---------------------------------------------------------------------------

def _span(low: float, high: float, fmt: str = "{:.1%}") -> str:
    """One value, or the range a tie-break leaves it in."""
    return fmt.format(low) if low == high else f"{fmt.format(low)}–{fmt.format(high)}"


def _examples_used_words(run: Mapping[str, Any]) -> str:
    """The examples a run measured: --num-samples is what it asked, and a task with fewer
    documents (or the part --examples-part leaves) gives fewer (config.json's
    examples_used)."""
    part = run.get("examples_part")
    asked = f"--num-samples {run['num_samples']}" + (f", --examples-part {part}" if part
                                                     else "")
    used = run.get("examples_used")
    if not used:  # a run folder from before examples_used was recorded
        return f"{run['num_samples']} examples per task asked ({asked}; used: not recorded)"
    return ("examples used: " + ", ".join(f"{task} {n}" for task, n in used.items())
            + f" ({asked})")


def _examples_words(examples: Mapping[str, Any]) -> str:
    tasks = examples["tasks"]
    counts = ", ".join(f"{task}: {e['shared']} of {e['a']}/{e['b']}" for task, e in
                       tasks.items())
    if examples["status"] == "disjoint":
        return f"disjoint ({counts} shared), as CNL's check needs."
    if examples["status"] == "overlapping":
        shared = counted(examples["shared"], "example")
        return (f"**overlapping**: {shared} shared ({counts}). CNL's "
                "check needs disjoint subsets; shared examples make the runs agree more "
                "(--seed draws each run's subset on its own, so two seeds may share some).")
    return (f"**unknown**: {examples['why']}" + (f" ({counts} indices shared)" if tasks else "")
            + ". CNL's check needs disjoint subsets.")


def _tie_words(label: str, side: Mapping[str, Any]) -> str:
    tie, k = side["tie"], side["k"]
    return (f"{label}'s top-{k} is not well defined: its ranks {k} and {k + 1} have the "
            f"same evidence or measured harms within the noise of each other (tied: "
            f"{', '.join(tie['group'])}; the top-{k} holds {tie['places']} of these "
            f"{len(tie['group'])}, listed in the ranking's order).")


def _not_searched_words(entry: Mapping[str, Any], runs: Mapping[str, Any]) -> list[str]:
    """What each run's top-k holds that the other run never searched (neuron runs only:
    each searches its own candidates), and how to read the overlap rate then."""
    notes, lost = [], False
    for label, other in (("a", "b"), ("b", "a")):
        side, mine, theirs = entry[label], label.upper(), other.upper()
        names = side.get("not_searched_by_other", [])  # absent: an older overlap.json
        count = runs[other].get("candidate_neurons")
        if names is None:
            notes.append(f"{theirs} records no candidate neurons (a run folder from an older "
                         f"version): whether it searched {mine}'s top-{side['k']} is unknown.")
        elif names:
            lost, one = True, len(names) == 1
            notes.append(f"{len(names)} of {mine}'s top-{side['k']} "
                         f"({', '.join(map(shown_name, names))}) {'was' if one else 'were'} "
                         f"never searched by {theirs}: not among {theirs}'s {count} "
                         f"candidate neurons (its prior's picks on {theirs}'s own examples; "
                         f"it searched no other), so {theirs} could not rank "
                         f"{'it' if one else 'them'}.")
    if lost:
        notes.append("The overlap rate and IoU count those as not shared: that part of the "
                     "gap is which candidates each run's prior picked, not a localization the "
                     "other examples fail to reproduce (more --candidates make the two "
                     "searches share more neurons).")
    return notes


def _task_lines(task: str, entry: Mapping[str, Any], runs: Mapping[str, Any]) -> list[str]:
    """One task's section: where a tie straddles a boundary, every figure is the range
    the tie-breaks leave it in (the files' order, which is the index, is said apart)."""
    a, b = entry["a"], entry["b"]
    k_a, k_b = a["k"], b["k"]
    low, high = entry["shared_range"]
    shared = entry["shared"]
    lines = [f"## {task}", "", "| run | top-k | overlap rate |", "| --- | --- | --- |",
             f"| A | {', '.join(map(shown_name, a['top_k']))} | "
             f"{_span(low / k_a, high / k_a)} |",
             f"| B | {', '.join(map(shown_name, b['top_k']))} | "
             f"{_span(low / k_b, high / k_b)} |", "",
             (f"Shared ({len(shared)}): " if entry["well_defined"] else
              f"Shared {low}–{high} depending on how the ties are broken ({len(shared)} in "
              "the files' order: ") + f"{', '.join(map(shown_name, shared)) if shared else 'none'}"
             + ("" if entry["well_defined"] else ")")
             + f"; IoU {_span(_iou(low, k_a, k_b), _iou(high, k_a, k_b))}.", ""]
    notes = [f"{label} found nothing: {side['nothing_found']}."
             for label, side in (("A", a), ("B", b)) if side["nothing_found"]]
    notes += _not_searched_words(entry, runs)
    notes += [_tie_words(label, side) for label, side in (("A", a), ("B", b)) if side["tie"]]
    notes += [_harmless_words(label, side) for label, side in (("A", a), ("B", b))
              if side.get("harmless") and not side["nothing_found"]]
    notes += [_harmless_above_words(label, side) for label, side in (("A", a), ("B", b))
              if side.get("harmless_above_hurting") and not side["nothing_found"]]
    notes += [_within_spread_words(label, side) for label, side in (("A", a), ("B", b))
              if side.get("within_spread")]
    lines += [*(f"- {note}" for note in notes), *([""] if notes else [])]
    lines += ["| k | shared | share | IoU | ties |", "| --- | --- | --- | --- | --- |"]
    for point in entry["curve"]:
        k, (low, high) = point["k"], point["shared_range"]
        tied = (f"{' and '.join(x.upper() for x in point['tied'])} tied at k "
                f"(files' order: {point['shared']})") if point["tied"] else ""
        lines.append(f"| {k} | {_span(low, high, '{}')} | {_span(low / k, high / k)} | "
                     f"{_span(_iou(low, k, k), _iou(high, k, k))} | {tied} |")
    return [*lines, ""]


def _harmless_words(label: str, side: dict[str, Any]) -> str:
    names, one = side["harmless"], len(side["harmless"]) == 1
    return (f"{label}'s top-{side['k']} holds {len(names)} that its ranking records as "
            f"doing no harm ({', '.join(map(shown_name, names))}): "
            + ("a place filled because fewer hurt, not a find; it counts" if one else
               "places filled because fewer hurt, not finds; they count")
            + " above as listed.")


def _harmless_above_words(label: str, side: dict[str, Any]) -> str:
    above = side["harmless_above_hurting"]
    return (f"{label}'s top-{side['k']} ranks "
            + "; ".join(f"{shown_name(name)} above {', '.join(map(shown_name, below))}"
                        for name, below in above.items())
            + f", though its ranking records {'it' if len(above) == 1 else 'them'} as doing "
            "no harm and the ones below as hurting: a place in the run's order (iterative "
            "greedy ranks by the round won), not a find; "
            + ("it counts" if len(above) == 1 else "they count") + " above as listed.")


def _within_spread_words(label: str, side: dict[str, Any]) -> str:
    names, one = side["within_spread"], len(side["within_spread"]) == 1
    return (f"{label}'s top-{side['k']} holds {len(names)} that hurt{'s' if one else ''} "
            "the task by no more than a single knockout helps it in that run "
            f"({', '.join(map(shown_name, names))}): within the spread of single knockouts, "
            f"no evidence the task needs {'it; it counts' if one else 'them; they count'} "
            "above as listed.")


def overlap_markdown(result: Mapping[str, Any]) -> str:
    """The result as Markdown: the runs, their example subsets, and per task the two
    top-k, the shared components, overlap rate, IoU and the stability curve."""
    runs = result["runs"]
    lines = ["# Overlap of two runs' located components", ""]
    for label in "ab":
        run = runs[label]
        lines.append(f"- {label.upper()}: `{run['path']}`: seed {run['seed']}, "
                     f"top-{run['top_k']}; {_examples_used_words(run)}")
    lines += [f"- Model: `{result['model_args']}`",
              f"- Example subsets: {_examples_words(result['examples'])}"]
    if result["differs_in"]:
        lines.append(f"- The runs' settings differ in: {', '.join(result['differs_in'])}.")
    for label in "ab":
        if result[f"only_in_{label}"]:
            lines.append(f"- Ranked only by {label.upper()} (not compared): "
                         f"{', '.join(map(shown_name, result[f'only_in_{label}']))}.")
    lines += ["", "Overlap rate = |A ∩ B| / |A| (per run); IoU = |A ∩ B| / |A ∪ B|; the "
              "curve's share at k = |A_k ∩ B_k| / k.", ""]
    for task, entry in result["tasks"].items():
        lines += _task_lines(task, entry, runs)
    return "\n".join(lines).rstrip("\n")
