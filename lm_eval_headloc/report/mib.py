"""Export a run's head ranking for the Mechanistic Interpretability Benchmark (MIB).

``write_mib`` turns one task's ``heads-<task>.json`` of a ``locate`` or ``greedy`` run into
a node-level importance file of MIB's circuit-localization track (``MIB_FORMAT_VERSION``),
so the run's heads can be scored by MIB's own evaluator (``run_evaluation.py --level
node``) or submitted to its leaderboard. ``read_mib`` and ``check_mib`` read and check any
file of that format (ours or MIB's).

The format, as read in MIB's own code (hannamw/MIB-circuit-track at commit
b759df34433c, whose EAP-IG submodule is hannamw/EAP-IG at commit 7af394a5662d;
``src/eap/graph.py``: ``Graph.from_model``, ``Graph.to_json``, ``Graph.from_json``,
``Graph.apply_topn``; ``MIB_circuit_track/evaluation.py``; the README's "Submitting to the
MIB Leaderboard"):

- a JSON object with ``cfg`` (``n_layers``, ``n_heads``, ``d_model``,
  ``parallel_attn_mlp``: ``Graph.from_json`` builds the model's whole graph from these and
  needs all four), ``nodes`` and ``edges``;
- ``nodes``: node name -> ``{"in_graph": bool, "score": float}``. Names: ``input``,
  ``a{layer}.h{head}`` (attention head, zero-based), ``m{layer}`` (the layer's MLP),
  ``logits``. A node without ``score`` is unscored: node-level evaluation keeps it in every
  circuit. ``logits`` is skipped by the loader. (A node may also carry ``neurons`` /
  ``neurons_scores``, ``d_model`` long: MIB's neuron level scores the output dimensions of
  a head or an MLP, not an MLP's hidden neurons.);
- ``edges``: edge name (``parent->child``, ``parent->a{l}.h{h}<q|k|v>`` into a head) ->
  ``{"score": float, "in_graph": bool}``; each must be an edge of the graph. Node-level
  evaluation (``apply_topn(level="node")``) ranks the node scores and derives the edges
  from the chosen nodes, so a node-level file may leave ``edges`` empty;
- ranking: ``apply_topn`` keeps the top n nodes by score, highest first — signed for MIB's
  CPR (``--absolute`` off), by absolute value for its CMD — so a larger score means a more
  important node. MIB's own node scores (EAP's, exact patching's) are the task loss with the
  node patched minus the clean loss: positive when the node helps the task;
- a leaderboard submission is one folder per task and model, ``<task>_<model>`` with the
  task hyphenated (``ioi_gpt2``, ``arc-easy_llama3``: ``MIB_CELLS``), holding one
  importance file (``importances.json``, as ``run_attribution.py`` names it).

What the export writes: every node of the model's graph, in ``Graph.from_model``'s order.
A head's ``score`` is the task score's fall when the head is knocked out, in the metric's
units (``-effect`` where higher is better, ``effect`` where lower is better): positive =
the head helps, MIB's sign. It is measured (a head knocked out alone) or the Lasso's
estimate, as the run's ranking says, an estimate capped by what the run measured of it
(``_capped``: no larger than the harm of a group test that knocked it out, and a harm just
under the least measured alone, which the ranking puts first), so MIB's top-n is the run's;
heads of equal fall (a Lasso's many zeros) are told
apart by the run's further evidence, as its ranking file records it (``_ordered``), since
MIB's top-n ranks by score alone, by float32's smallest steps (MIB loads the scores as
float32). A head measured alone keeps its measured fall exactly unless another head measured
to that fall is told apart from it (one of them keeps it). A head with no effect (``null``),
excluded, or missing from the ranking has no ``score``; so do ``input`` and the MLPs, which
a heads run never knocks out — MIB keeps unscored nodes in every circuit, as the run kept
them. ``in_graph`` is false for every node but ``logits`` (the file holds scores, not one
circuit); ``edges`` is empty (nothing is measured per edge). The key ``headloc_export``
records the run, the task, the sign, what was left unscored, how the scores were ordered
(``order``: which heads each evidence moved, which moved to make room, which share a score
as MIB reads it, in float32, and why) and what the ranking says of its own evidence (ties,
shared masks, heads measured alone, the spread of single knockouts); MIB's loader ignores
it, and it marks the file as ours: an existing file without it is never overwritten.

MLP neurons (``L3N12``) have no place in the format (see above), so a run that ranks
neurons is refused.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.common.checks import as_python
from lm_eval_headloc.common.files import not_a_file, write_atomically
from lm_eval_headloc.intervention.components import (
    ComponentSpecError,
    Head,
    describe_layers,
    parse_heads,
)
from lm_eval_headloc.method.group_tests import HELPS, Harm, status, unmasked
from lm_eval_headloc.report.mib_format import (
    _HEAD_NODE,
    ExportError,
    _is_number,
    check_mib,
    mib_node_names,
)

__all__ = ["MARKER", "MIB_CELLS", "MIB_FORMAT_VERSION", "MIB_MODELS", "mib_graph", "write_mib"]

log = logging.getLogger(__name__)

#: The format followed: MIB's circuit-localization track, node-level importance JSON as
#: EAP-IG's ``Graph.to_json`` writes it and ``Graph.from_json`` reads it, at these commits.
MIB_FORMAT_VERSION = ("mib-circuit-track node importances JSON "
                      "(hannamw/MIB-circuit-track@b759df34433c, hannamw/EAP-IG@7af394a5662d)")

#: The key of our record in an exported file (ignored by MIB's loader).
MARKER = "headloc_export"
_MADE_BY = "lm-eval-headloc"

#: MIB's models: ``(n_layers, n_heads, d_model)`` of the graph its evaluator builds
#: (query heads: it ungroups grouped-query attention). Layers and heads agree with the
#: edge counts MIB's evaluation backend lists (gpt2 32491, qwen2.5 179749, gemma2 74218,
#: llama3 1592881); d_model is gpt2's in MIB's example circuit and the others' configs'.
MIB_MODELS: dict[str, tuple[int, int, int]] = {
    "gpt2": (12, 12, 768), "qwen2.5": (24, 14, 896), "gemma2": (26, 8, 2304),
    "llama3": (32, 32, 4096)}

#: The leaderboard's task/model folders (MIB_circuit_track/utils.py's COL_MAPPING).
MIB_CELLS: frozenset[str] = frozenset({
    "ioi_gpt2", "ioi_qwen2.5", "ioi_gemma2", "ioi_llama3", "mcqa_qwen2.5", "mcqa_gemma2",
    "mcqa_llama3", "arithmetic-addition_llama3", "arithmetic-subtraction_llama3",
    "arc-easy_gemma2", "arc-easy_llama3", "arc-challenge_llama3"})

_SCORE = ("the task score's fall when the head is knocked out, in the metric's units "
          "(-effect where higher is better, +effect where lower is better): positive = the "
          "head helps the task, as MIB's own node scores; an estimate capped by what the run "
          "measured (order.capped); heads of equal fall told apart by the evidence in "
          "'order'")
_COMMANDS = ("locate", "greedy")
#: What the ranking records of its own evidence, carried into our record as it is: which
#: heads tie with the one above, share their masks, were measured alone, and the largest
#: single help (harms no larger are within the spread of single knockouts).
_EVIDENCE = ("tied_with_above", "same_masks", "confirmed", "largest_single_help",
             "prior_found_nothing")
_EVIDENCE_WORDS = ("a score's fall is measured for the heads in 'confirmed' (all of them "
                   "after greedy), estimated by the fit otherwise; the ranking's own order "
                   "calls a head in tied_with_above tied with the one ranked above it (the "
                   "prior, which that order does not consult, may still tell them apart "
                   "here), and a fall no larger than largest_single_help's change is within "
                   "the spread of single knockouts")
_ORDER_WORDS = ("every scored head is ordered by its evidence, compared in the order of "
                "'by': a score is the head's fall, unless other heads have the same fall; "
                "then one of them keeps it (a head measured alone where one is, else one "
                "with no further evidence) and the others step away from it by float32's "
                "smallest steps (MIB loads the scores as float32: a smaller step vanishes), "
                "above where their evidence says they help more, below where less, so no "
                "score passes another and the sign still says help or harm. A head measured "
                "alone keeps its fall: the estimates of that fall are placed around it by "
                "their own evidence, and only another measurement of that fall, told apart "
                "by its own, steps off it. tie_broken_by lists the heads each evidence moved "
                "(their falls are heads-<task>.json's effects; measured_alone: an estimate "
                "placed after a measurement that nothing else tells it from); made_room the "
                "heads moved, as little as float32 allows, only so that no two scores meet; "
                "ties lists the heads whose scores MIB reads as equal (float32), and why: the "
                "only equal scores")


# --- the graph ---------------------------------------------------------------------------


# --- checking a file -----------------------------------------------------------------------


# --- building one ----------------------------------------------------------------------------

def _score(entry: Mapping[str, Any], higher_is_better: bool) -> float | None:
    effect = entry.get("effect")
    if effect is None:
        return None
    if not _is_number(effect):
        raise ExportError(f"head {entry.get('head')}: effect {effect!r} is not a number")
    if not math.isfinite(effect):
        return None  # undefined: as the run's own files write it (null)
    if abs(effect) > float(np.finfo(np.float32).max):  # MIB would read it as inf
        raise ExportError(f"head {entry.get('head')}: effect {effect!r} is past float32's "
                          "range, in which MIB loads the scores")
    return (-effect if higher_is_better else effect) + 0.0  # + 0.0: no "-0.0" in the file


#: The evidence a head's score is ordered by, most telling first (``_evidence``), each as
#: the fall it points to (larger = knocking the head out hurts more) and in words.
_LEVELS = {
    "effect": "score change on knockout (measured alone, or else the fit's estimate)",
    "estimate": "the fit's estimate before it was capped (order.capped), by how much it "
                "was above its cap",
    "logprob_change": "the gold answers' log-likelihood change, measured alone",
    "contrast": "the masks' marginal contrast (the fit's own tie-break)",
    "prior": "the attribution prior's estimates of the log-likelihood change",
}
#: The directions of float32's smallest steps (``np.nextafter``): MIB loads the scores as
#: float32, so a score moved by less than one of them would meet the one it was moved from.
_UP, _DOWN = np.float32(np.inf), np.float32(-np.inf)


def _evidence(entry: Mapping[str, Any], fall: float, higher_is_better: bool,
              points: int, estimate: float | None = None) -> tuple[float, ...]:
    """A head's evidence as falls (MIB's sign: positive = the head helps the task), in
    ``_LEVELS``' order, one per prior point for the prior: its score's fall (``fall``),
    how far its ``estimate`` was above that fall before ``_capped`` (the heads capped to
    one value keep the ranking's order, which is by the estimate), its measured
    log-likelihood's, the fit's marginal contrast's, the prior's estimated
    log-likelihood's; 0 for what the ranking does not record of it."""
    def number(name: str, value: object) -> float:
        if not (_is_number(value) and math.isfinite(value)):
            raise ExportError(f"head {entry.get('head')}: {name} {value!r} is not a finite "
                              "number")
        return float(value)

    logprob = entry.get("logprob_change")
    contrast = entry.get("contrast")
    prior = entry.get("prior")
    if prior is not None and not (isinstance(prior, list) and len(prior) <= points):
        raise ExportError(f"head {entry.get('head')}: prior {prior!r} is not a list of "
                          f"at most {points} numbers")
    estimates = [number("prior", value) for value in prior or ()]
    estimates += [0.0] * (points - len(estimates))
    return (fall, 0.0 if estimate is None else estimate - fall,
            0.0 if logprob is None else -number("logprob_change", logprob),
            0.0 if contrast is None else (-1 if higher_is_better else 1)
            * number("contrast", contrast),
            *(-value for value in estimates))


def _placed(keys: list[tuple[float, ...]], measured: list[bool]) -> list[tuple[float, ...]]:
    """Each head's evidence (``_evidence``) as the export compares it (``_ordered``): its
    fall; an estimate's further evidence; a measurement's; 1 for a head measured alone, 0
    for an estimate. A head measured alone keeps its fall, so it has none of an estimate's:
    the estimates of its fall are placed around it by their own evidence, and it is told
    from the other measurements of its fall by its own."""
    placed = []
    for key, alone in zip(keys, measured, strict=True):
        further, none = tuple(key[1:]), (0.0,) * (len(key) - 1)
        placed.append((key[0], *(none if alone else further), *(further if alone else none),
                       1.0 if alone else 0.0))
    return placed


def _first_difference(a: tuple[float, ...], b: tuple[float, ...]) -> int:
    return next(level for level, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


def _squeezed(values: list[np.float32], high: np.float32, low: np.float32
              ) -> list[np.float32]:
    """``values`` (best first) made strictly decreasing float32 numbers between ``high`` and
    ``low`` (both excluded), each moved as little as the others let it; where no float32
    number is left between them, equal (a tie), never passing one another."""
    out, ceiling = [], high
    for value in values:
        out.append(value if value < ceiling else np.nextafter(ceiling, _DOWN))
        ceiling = out[-1]
    floor = low
    for place in reversed(range(len(out))):
        if out[place] <= floor:
            out[place] = np.nextafter(floor, _UP)
        floor = out[place]
    ceiling = high
    for place, value in enumerate(out):
        out[place] = ceiling = min(value, ceiling)
    return out


def _ordered(placed: list[tuple[float, ...]]
             ) -> tuple[list[float], list[set[int]], set[int]]:
    """Scores that order heads as their evidence ``placed`` (``_placed``) does, compared
    level by level, as MIB reads them (float32); for each head the levels that moved its
    score off its fall; and the heads moved only so that no float32 score meets another.

    A head keeps its fall unless another has the same. Then one of them keeps it (the
    pivot: the measurement nearest to where no further evidence puts a head, else the head
    with none) and the others step away from it by float32's smallest steps, one a head,
    above where their evidence says more, below where less (a step of less than float32's
    would vanish: MIB loads the scores as float32); with no pivot the fall itself is the
    point they step from, so the sign still says help or harm. Heads equal at every level
    keep one score. Where steps reach another fall's score, the heads that do not keep a
    measured fall make room (``_squeezed``): a head that keeps its measured fall never
    moves."""
    classes = sorted(set(placed), reverse=True)
    score: dict[tuple[float, ...], float] = {}
    levels: dict[tuple[float, ...], set[int]] = {}
    pinned: set[tuple[float, ...]] = set()
    for fall, group in itertools.groupby(classes, key=lambda key: key[0]):
        group = list(group)
        if len(group) == 1:
            score[group[0]] = fall
            pinned.update(key for key in group if key[-1])
            continue
        point = (fall, *(0.0,) * (len(group[0]) - 1))  # no further evidence: an estimate's
        ours = [key for key in group if key[-1]]  # measured alone
        if ours:  # the measurement nearest the point: the lowest above it, else the highest
            pivot = min((key for key in ours if key > point), default=max(ours))
            pinned.add(pivot)
        else:
            pivot = point if point in group else None
        if pivot is not None:
            score[pivot] = fall
        centre = point if pivot is None else pivot
        above, below = [k for k in group if k > centre], [k for k in group if k < centre]
        for side, direction in ((above[::-1], _UP), (below, _DOWN)):
            value = np.float32(fall)
            for key in side:
                value = np.nextafter(value, direction)
                score[key] = float(value)
        # What moved each: what tells it from the head that kept the fall (or the fall's
        # point) and from the heads beside it.
        line = sorted({*group, centre}, reverse=True)
        for place, key in enumerate(line):
            if key != centre:
                beside = (*line[max(place - 1, 0):place], *line[place + 1:place + 2])
                levels[key] = {_first_difference(key, other) for other in (centre, *beside)}
    made_room: set[tuple[float, ...]] = set()
    values = [np.float32(score[key]) for key in classes]
    start = 0
    while start < len(classes):  # each run of movable scores between two measured falls
        if classes[start] in pinned:
            start += 1
            continue
        end = start
        while end + 1 < len(classes) and classes[end + 1] not in pinned:
            end += 1
        high = values[start - 1] if start else _UP
        low = values[end + 1] if end + 1 < len(classes) else _DOWN
        for place, value in enumerate(_squeezed(values[start:end + 1], high, low), start):
            if value != values[place]:
                score[classes[place]], values[place] = float(value), value
                made_room.add(classes[place])
        start = end + 1
    width = (len(placed[0]) - 2) // 2 if placed else 0  # further levels of one kind
    def raw(level: int) -> int:  # a placed level as ``_evidence``'s (one past: measured)
        return level if level <= width else level - width

    return ([score[key] + 0.0 for key in placed],
            [{raw(level) for level in levels.get(key, ())} for key in placed],
            {head for head, key in enumerate(placed) if key in made_room})


def _tie_words(entries: list[Mapping[str, Any]], points: int) -> str:
    """Why heads share a score: the evidence they have alike, and what would tell them
    apart that the run lacks."""
    def all_are(measured: bool) -> bool:
        evidence = "logprob_change" if measured else "contrast"
        return all(e.get("measured_alone") is measured or e.get(evidence) is not None
                   for e in entries)

    recorded = [words for name, words in (("logprob_change", "log-likelihood change"),
                                          ("contrast", "marginal contrast"),
                                          ("prior", "prior estimates"))
                if all(e.get(name) is not None for e in entries)]
    kind = ("score change measured alone" if all_are(True) else
            "fitted effect" if all_are(False) else "effect")
    same = [kind, *recorded]
    words = "the same " + (" and ".join(same) if len(same) < 3 else
                           ", ".join(same[:-1]) + " and " + same[-1])
    if not recorded:
        return (words + "; the ranking file records nothing else of them (it was written "
                "before rankings kept their evidence: refit the run, or rerun greedy)")
    return words + ("; the run has no prior to tell them apart" if not points else "")


def _scores(scored: Mapping[Head, Mapping[str, Any]], falls: Mapping[Head, float],
            higher_is_better: bool, estimates: Mapping[Head, float] | None = None
            ) -> tuple[dict[Head, float], dict[str, Any]]:
    """Each scored head's score (``_ordered`` over its ``_placed`` evidence), from its
    ranking entry, its fall and its fall before ``_capped`` (``estimates``), and our
    record of the order: the evidence compared, in order; the heads each moved; the
    heads moved to make room; the heads whose scores MIB reads as equal (float32), and
    why."""
    points = max((len(e["prior"]) for e in scored.values() if isinstance(e.get("prior"), list)),
                 default=0)
    estimates = estimates or {}
    evidence = [_evidence(entry, falls[head], higher_is_better, points,
                          estimates.get(head)) for head, entry in scored.items()]
    alone = [entry.get("measured_alone") is True for entry in scored.values()]
    keys = dict(zip(scored, _placed(evidence, alone), strict=True))
    ordered, moved, made_room = _ordered(list(keys.values()))
    scores = dict(zip(scored, ordered, strict=True))
    level_names = [*list(_LEVELS)[:-1], *(["prior"] * points), "measured_alone"]
    tie_broken: dict[str, list[str]] = {}
    for head, levels in zip(scored, moved, strict=True):
        for name in dict.fromkeys(level_names[level] for level in sorted(levels)):
            tie_broken.setdefault(name, []).append(str(head))
    sharing: dict[float, list[Head]] = {}
    for head, score in scores.items():
        sharing.setdefault(float(np.float32(score)), []).append(head)
    ties = [{"heads": [str(h) for h in heads],
             "score": (scores[heads[0]] if len({scores[h] for h in heads}) == 1 else value),
             "why": (_tie_words([scored[h] for h in heads], points)
                     if len({keys[h] for h in heads}) == 1 else
                     "evidence that tells them apart, but no float32 number is left between "
                     "their neighbours' scores (MIB reads scores as float32)")}
            for value, heads in sharing.items() if len(heads) > 1]
    capped = any(falls[head] != estimates.get(head, falls[head]) for head in scored)
    return scores, {"by": [words for name, words in _LEVELS.items()
                           if (name != "prior" or points) and (name != "estimate" or capped)],
                    "words": _ORDER_WORDS, "tie_broken_by": tie_broken,
                    "made_room": [str(head) for place, head in enumerate(scored)
                                  if place in made_room],
                    "ties": ties}


def _capped(falls: dict[Head, float], scored: Mapping[Head, Mapping[str, Any]],
            heads_json: Mapping[str, Any], n_layers: int, n_heads: int,
            higher_is_better: bool) -> dict[str, dict[str, Any]]:
    """Cap (in place) each estimated fall at what the run measured of it, so that MIB's
    top-n is the run's: a fall no larger than the harm of any group test the head was
    knocked out in (the certificate's rule: knocking out more never lessens the harm; a
    test that helps beyond the noise caps nothing, one that does not hurt caps at 0, the
    help of its members measured alone to help added back), and
    a harm no larger than the least measured alone to hurt, which the ranking puts first
    (just under it, in float32). A fit's estimate of 0.14 for a head whose group test
    changed the score by 0 outranked every measured head. Returns head -> its estimated
    fall, the cap and what set it."""
    capped: dict[str, dict[str, Any]] = {}
    alone = {head for head, entry in scored.items() if entry.get("measured_alone") is True}

    def cap(head: Head, value: float, by: str) -> None:
        if value < falls[head]:
            capped.setdefault(str(head), {"estimate": falls[head]})
            capped[str(head)].update(cap=value, by=by)
            falls[head] = value

    certificate = heads_json.get("certificate")
    tests = certificate.get("group_tests") if isinstance(certificate, Mapping) else None
    for test in tests if isinstance(tests, list) else ():
        if not (isinstance(test, Mapping) and _is_number(test.get("change"))
                and math.isfinite(test["change"]) and isinstance(test.get("components"), list)):
            raise ExportError(f"the certificate's group test {test!r} is not a set of heads "
                              "with a finite change")
        try:
            members = parse_heads(test["components"], n_layers, n_heads)
        except ComponentSpecError as err:
            raise ExportError(f"the certificate's group test {test['components']!r}: "
                              f"{err}") from None
        harm = (-test["change"] if higher_is_better else test["change"]) + 0.0
        se = test.get("se")
        se = float(se) if _is_number(se) and math.isfinite(se) else 0.0
        if status(Harm(harm, se), bar=0.0) == HELPS:
            continue  # a helpful member may hide a harmful one: it caps nothing
        # A member measured alone to help hides as much harm of the others: added back, as
        # the certificate reads the set (the file keeps no error of a head alone: any help).
        harm = unmasked(Harm(harm, se), [Harm(falls[head], 0.0) for head in members
                                         if head in alone and head in falls]).value
        for head in members:
            if head in falls and head not in alone:
                # At most no harm: the rule bounds a member's harm, not its help.
                cap(head, max(harm, 0.0), "group test " + "+".join(map(str, members)))
    hurting = [falls[head] for head in alone if falls[head] > 0]
    if hurting:
        below = float(np.nextafter(np.float32(min(hurting)), _DOWN))
        for head in falls:
            if head not in alone and falls[head] > 0:
                cap(head, below, "the ranking: the heads measured alone to hurt rank first")
    return capped


def mib_graph(heads_json: Mapping[str, Any], *, n_layers: int, n_heads: int, d_model: int,
              parallel_attn_mlp: bool = False) -> dict[str, Any]:
    """MIB's node-level importance graph of a ranking (a ``heads-<task>.json``'s content)
    for a model of ``n_layers`` layers of ``n_heads`` heads, ``d_model`` wide.

    Each ranked head's node gets ``score`` = the task score's fall when it is knocked out
    (``-effect`` where higher is better, ``effect`` where lower is better; an estimate
    capped by what the run measured of it, ``_capped``), heads of equal
    fall moved apart, by float32 steps, by the further evidence their entries record
    (``_scores``, said in our record's ``order``); a head with no
    effect, and ``input`` and the MLPs (never knocked out), get none: MIB keeps unscored
    nodes in every circuit. ``in_graph`` is false but for ``logits``; ``edges`` is empty
    (see the module's docstring). Neuron entries are refused: the format has no place
    for an MLP's hidden neurons.
    """
    entries = heads_json.get("heads") if isinstance(heads_json, Mapping) else None
    if not isinstance(entries, list):
        raise ExportError("a ranking (heads-<task>.json) has a 'heads' list")
    higher = heads_json.get("higher_is_better")
    if not isinstance(higher, bool):
        raise ExportError(f"the ranking's higher_is_better is {higher!r}; the sign of its "
                          "effects cannot be read without it")
    per_layer = heads_json.get("heads_per_layer", n_heads)
    if per_layer != n_heads:
        raise ExportError(f"the ranking has {per_layer} heads per layer, the model "
                          f"{n_heads}")
    falls: dict[Head, float | None] = {}
    scored: dict[Head, Mapping[str, Any]] = {}  # the heads with a fall: entry, fall
    known: dict[Head, float] = {}
    for entry in entries:
        if not isinstance(entry, Mapping) or "head" not in entry:
            what = (entry.get("neuron") or entry.get("group")
                    if isinstance(entry, Mapping) else None)
            raise ExportError(
                f"the ranking holds {what or repr(entry)}, not a head: MIB's node format "
                "scores heads, MLPs and their d_model output dimensions, not an MLP's hidden "
                "neurons; export a run that locates heads only")
        try:
            parsed = parse_heads([entry["head"]], n_layers, n_heads)
        except ComponentSpecError as err:
            raise ExportError(f"the ranking's head {entry['head']!r}: {err}") from None
        if len(parsed) != 1:
            raise ExportError(f"the ranking's entry {entry['head']!r} names {len(parsed)} "
                              "heads, not one")
        head = parsed[0]
        if head in falls:
            raise ExportError(f"the ranking lists head {head} twice")
        falls[head] = fall = _score(entry, higher)
        if fall is not None:
            scored[head], known[head] = entry, fall
    estimates = dict(known)
    capped = _capped(known, scored, heads_json, n_layers, n_heads, higher)
    scores, order = _scores(scored, known, higher, estimates)
    order["capped"] = capped
    nodes: dict[str, dict[str, Any]] = {}
    for name in mib_node_names(n_layers, n_heads):
        nodes[name] = {"in_graph": name == "logits"}
        match = _HEAD_NODE.fullmatch(name)
        score = None if match is None else scores.get(Head(int(match[1]), int(match[2])))
        if score is not None:
            nodes[name]["score"] = score
    unscored = [str(Head(layer, head)) for layer in range(n_layers) for head in range(n_heads)
                if scores.get(Head(layer, head)) is None]
    return {
        "cfg": {"n_layers": n_layers, "n_heads": n_heads,
                "parallel_attn_mlp": bool(parallel_attn_mlp), "d_model": d_model},
        "nodes": nodes,
        "edges": {},
        MARKER: {"made_by": _MADE_BY, "format": MIB_FORMAT_VERSION, "level": "node",
                 "task": heads_json.get("task"), "metric": heads_json.get("metric"),
                 "higher_is_better": higher, "baseline": heads_json.get("baseline"),
                 "score": _SCORE, "unscored_heads": unscored,
                 "unscored_nodes": "input, every MLP and the heads in unscored_heads "
                                   "(never knocked out, or no effect): MIB keeps them in "
                                   "every circuit; no edge is scored",
                 "order": order,
                 "evidence": {key: heads_json[key] for key in _EVIDENCE if key in heads_json},
                 "evidence_words": _EVIDENCE_WORDS},
    }


# --- writing one from a run folder -------------------------------------------------------------

def _is_ours(path: Path) -> bool:
    """Whether ``path`` is a file an export of ours wrote (it carries our marker)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    marker = data.get(MARKER) if isinstance(data, dict) else None
    return isinstance(marker, dict) and marker.get("made_by") == _MADE_BY


def _model_shape(record: Any, run_folder: Path, model_args: str | None
                 ) -> tuple[int, bool]:
    """The run's model's width and whether its attention and MLP read the same residual
    stream, as the run's config.json records them. ``model_args`` (``--model-args``): the
    model read for them instead (its config alone), where the record does not say them (a
    run from before runs recorded them) and the run's own model cannot be read here; it
    must have the run's layers and heads, and the recorded width where there is one."""
    from lm_eval_headloc.common.checks import UsageError
    from lm_eval_headloc.intervention.model_args import (
        config_geometry,
        model_config,
        resolve_model_args,
    )

    recorded = (record.d_model, record.parallel_attn_mlp)
    if model_args is None and isinstance(recorded[0], int) and isinstance(recorded[1], bool):
        return recorded[0], recorded[1]
    given = model_args is not None
    if not given:
        # The record's model args are data: read as given, trust_remote_code=True would
        # run the code of whatever model they name (a Hub name: downloaded first).
        from lm_eval_headloc.runs.folder import refuse_recorded_code
        from lm_eval_headloc.runs.folder_checks import RunFolderError

        try:
            refuse_recorded_code(run_folder, (), record.spec.model_args,
                                 "give --model-args with it, or --mib-model")
        except RunFolderError as err:
            raise ExportError(str(err)) from None
    try:
        geometry = config_geometry(model_config(resolve_model_args(
            model_args if given else record.spec.model_args)))
    except UsageError as err:
        if given:
            raise ExportError(f"--model-args {model_args}: {err}") from None
        raise ExportError(f"{run_folder}/config.json does not record the model's width (a run "
                          f"from before runs recorded it), and the run's model cannot be read "
                          f"here ({err}); give --model-args pretrained=<the model's folder or "
                          "Hub name>, or --mib-model for one of MIB's models") from None
    if given and ((geometry.num_layers, geometry.heads_per_layer)
                  != (record.layers, record.heads_per_layer)
                  or recorded[0] not in (None, geometry.d_model)):
        raise ExportError(f"--model-args {model_args}: a model of {geometry.num_layers} "
                          f"layers of {geometry.heads_per_layer} heads, "
                          f"{geometry.d_model} wide; the run's has {record.layers} of "
                          f"{record.heads_per_layer}"
                          + (f", {recorded[0]} wide" if recorded[0] is not None else "")
                          + ": not the run's model")
    if geometry.d_model is None:
        raise ExportError("the config of the run's model gives no hidden size; give "
                          "--mib-model for one of MIB's models")
    return geometry.d_model, geometry.parallel_attn_mlp


def write_mib(run_folder: str | Path, out: str | Path, task: str | None = None, *,
              d_model: int | None = None, parallel_attn_mlp: bool | None = None,
              mib_model: str | None = None, model_args: str | None = None) -> Path:
    """Write ``task``'s ranking of the locate or greedy run in ``run_folder`` to ``out``
    as MIB's node-level importance file (``mib_graph``); returns ``out``.

    ``task`` may be left out when the run has one. ``d_model`` and ``parallel_attn_mlp``
    default to what the run's config.json records of its model (no model files read; a
    run from before it recorded them: the model's config, or ``model_args``'s, the model
    where it is now); ``mib_model`` (a ``MIB_MODELS`` name)
    takes them from MIB's model instead, after checking that the run's model has its
    layers and heads. ``out`` is a ``.json`` file outside the run folder (its folder is
    made); an existing ``out`` is replaced only if an export of ours wrote it. Anything
    else is a one-line ``ExportError`` (a ``UserError``).
    """
    from lm_eval_headloc.measurement.metrics import parse_task_metric
    from lm_eval_headloc.runs.folder import RunFolder, checked_path, enclosing_run
    from lm_eval_headloc.runs.folder_checks import RunFolderError
    from lm_eval_headloc.runs.record import (  # torch and sklearn: only imported when needed
        load_run,
        read_ranking_file,
    )

    run_folder, out = (checked_path(run_folder, "the run folder", "runs/x", ExportError),
                       checked_path(out, "--out", "mib/importances.json", ExportError))
    d_model = as_python(d_model)  # a notebook's np.int64 is a width too
    if parallel_attn_mlp not in (None, True, False):
        # mib_graph writes bool() of it: "no" would export a parallel model's graph.
        raise ExportError(f"parallel_attn_mlp={parallel_attn_mlp!r}: must be True or False "
                          "(or None: the run's model's)")
    if model_args is not None and not isinstance(model_args, str):
        raise ExportError(f"model_args={model_args!r}: must be a string, e.g. "
                          "'pretrained=/models/x'")
    record = load_run(run_folder)
    if record.command not in _COMMANDS:
        hint = (" (a sweep: export one of its cell folders, m<M>-p<P>/)"
                if record.command == "sweep" else "")
        raise ExportError(f"{run_folder} is a {record.command} run{hint}; MIB export reads "
                          "the head ranking of a locate or greedy run")
    if record.spec.components != "heads":
        raise ExportError(f"{run_folder} locates {record.spec.components}: MIB's node format "
                          "scores heads, MLPs and their d_model output dimensions, not an "
                          "MLP's hidden neurons; export a run of --components heads")
    tasks = [parse_task_metric(name)[0] for name in record.spec.tasks]
    if task is None:
        if len(tasks) != 1:
            raise ExportError(f"{run_folder} ranks {len(tasks)} tasks ({', '.join(tasks)}); "
                              "name the one to export")
        task = tasks[0]
    elif task not in tasks:
        raise ExportError(f"task {task!r} is not one of {run_folder}'s: "
                          f"{', '.join(tasks)}")
    ranking = RunFolder(run_folder).ranking_file(task)
    if not ranking.is_file():
        raise ExportError(f"{run_folder} has no {ranking.name}: the run has not ranked its "
                          "heads yet; finish it first")
    layers, heads = record.layers, record.heads_per_layer
    if not (isinstance(layers, int) and isinstance(heads, int)):
        raise ExportError(f"{run_folder}/config.json records no model geometry (layers, "
                          "heads_per_layer); finish the run first")
    if record.head_layers is not None:
        raise ExportError(f"{run_folder} is a run of a hybrid model, with heads in layers "
                          f"{describe_layers(record.head_layers)} only; MIB's graph has "
                          "heads in every layer")
    if out.is_dir():
        raise ExportError(f"{out} is a folder; give the file to write, e.g. "
                          f"{out / 'importances.json'}")
    if out.suffix != ".json":
        raise ExportError(f"{out}: MIB reads a graph by its extension; write a .json file "
                          "(e.g. <task>_<model>/importances.json)")
    if out.is_symlink():
        raise ExportError(f"{out} is a link; name the file itself (the link would be "
                          "replaced by a file)")
    if (what := not_a_file(out)) is not None:  # _is_ours would wait on a FIFO for ever
        raise ExportError(f"{what}; name a file")
    if out.exists() and not _is_ours(out):
        raise ExportError(f"{out} exists and is not an export of lm-eval-headloc; not "
                          "overwritten: choose another path or remove it")
    inside = enclosing_run(out.parent)  # the run exported, or any other run of ours
    if inside is not None:
        raise ExportError(f"{out} is inside the run folder {inside}, whose files are its "
                          "command's alone; write it elsewhere")
    if mib_model is not None and model_args is not None:
        raise ExportError("--mib-model and --model-args both say the model's width; give one")
    if mib_model is not None:
        if mib_model not in MIB_MODELS:
            raise ExportError(f"unknown MIB model {mib_model!r}; MIB's models: "
                              f"{', '.join(MIB_MODELS)}")
        mib_layers, mib_heads, mib_width = MIB_MODELS[mib_model]
        if (layers, heads) != (mib_layers, mib_heads):
            raise ExportError(f"the run's model has {layers} layers of {heads} heads, MIB's "
                              f"{mib_model} {mib_layers} of {mib_heads}: not a run of it")
        if d_model not in (None, mib_width):
            raise ExportError(f"d_model={d_model}, but MIB's {mib_model} is {mib_width} wide")
        if parallel_attn_mlp:
            raise ExportError(f"parallel_attn_mlp=True, but MIB's {mib_model} runs attention "
                              "and MLP in sequence")
        d_model, parallel_attn_mlp = mib_width, False
    if d_model is None or parallel_attn_mlp is None:
        width, parallel = _model_shape(record, run_folder, model_args)
        d_model = width if d_model is None else d_model
        parallel_attn_mlp = parallel if parallel_attn_mlp is None else parallel_attn_mlp
    try:  # checked as every reader of a ranking checks it
        data = read_ranking_file(ranking)
    except RunFolderError as err:
        raise ExportError(str(err)) from None
    try:
        graph = mib_graph(data, n_layers=layers, n_heads=heads, d_model=d_model,
                          parallel_attn_mlp=parallel_attn_mlp)
    except ExportError as err:
        raise ExportError(f"{ranking}: {err}") from None
    graph[MARKER]["run"] = {"folder": str(run_folder), "command": record.command,
                            "model_args": record.spec.model_args,
                            "ablation": record.spec.ablation}
    check_mib(graph)  # what we write, MIB's loader reads
    if not any(node.get("score") for node in graph["nodes"].values()):
        # An all-zero file reads in MIB as a ranking; "nothing found" is said as such.
        log.warning(
            "%s: every head scores 0 (no knockout moved %s%s): the file ranks nothing",
            out, task, ", whose baseline is 0, so none could lower it"
            if data.get("baseline") == 0 and data.get("higher_is_better") else "")
    text = json.dumps(graph, allow_nan=False) + "\n"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(out, lambda partial: partial.write_text(text))
    except OSError as err:
        raise ExportError(f"cannot write {out}: {err.strerror or err}") from None
    return out
