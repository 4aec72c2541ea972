"""A ranking: one task's components, most harmful first, with the evidence behind the order.

``Ranking`` is what locate, refit and greedy produce; ``ranked_heads_json`` writes it as
heads.json (which ``hf-headablate ablate_file=`` reads) and ``ranking_from_json`` reads it
back, the one inverse of the other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from lm_eval_headloc.common.checks import check_number
from lm_eval_headloc.common.equality import same_values
from lm_eval_headloc.intervention.components import (
    Component,
    Head,
    Neuron,
    format_heads,
)
from lm_eval_headloc.method.columns import Column, Columns, NeuronGroup
from lm_eval_headloc.method.lasso import STABLE, Stability, harm

__all__ = ["TIE_EVIDENCE", "CertificateRecord", "GroupTestRecord", "Ranking", "RankingFacts",
           "all_measured_alone", "largest_single_help", "ranked_heads_json", "ranking_from_json",
           "relative_drop", "type_fields"]


#: What a ranking records of each column beyond its effect, for orders that must tell equal
#: effects apart (``export``): a column measured alone, its measured change of the gold
#: answers' log-likelihood (the ranking's own tie-break among equal measured changes); one
#: the fit estimated, its marginal contrast (mean score of the masks that knock it out
#: less that of the others, on what the measured changes leave: the ranking's tie-break
#: among equal fitted effects); and, where the run has a prior, its attribution estimates
#: of the log-likelihood's change, one per path point.
TIE_EVIDENCE = ("logprob_change", "contrast", "prior")


@dataclass
class GroupTestRecord:
    """One group test as heads.json records it: the set knocked out, the score's change
    and its paired standard error (None where the run recorded no per-example scores)."""

    components: list[str]
    change: float
    se: float | None = None


@dataclass(kw_only=True)
class CertificateRecord:
    """heads.json's ``certificate`` (``rank._certificate``, from ``group_tests.certificate``):
    what a task's measurements rule out under ``rule`` and what they leave unchecked, in
    names. ``certified``: nothing is left unchecked. ``confidence``: the one-sided
    confidence each ruling-out holds at (None: the run recorded no per-example scores, and
    the harms were taken as exact). ``entry_bar``: the top-k's bar (the k-th largest harm
    measured alone); ``measured_alone`` and ``ruled_out`` (by a measured set clearly under
    the bar, each at most ``bound`` alone) count components; ``unchecked`` names the rest,
    likeliest first, with how many of them no mask or one mask knocked out and which sat
    beside a measured one; ``tied_at_k``, the components measured alone the noise cannot
    tell from the k-th; ``helps`` and ``violations``, the measured sets that ruled nothing
    out because they helped beyond the noise or harmed clearly less than a measured part
    of them; ``group_size``, the group tests run (sets measured) and those that would
    cover the unchecked; ``measurements_spent`` (measurement-equivalents, the prior's
    allowance included, the baseline aside), the run's ``max_measurements`` and, where it
    is not certified, the least ``max_measurements_to_finish`` that would test every
    unchecked component in a group (None where the run does not say)."""

    certified: bool = False
    rule: str
    confidence: float | None = None
    entry_bar: float
    top_k: int
    measured_alone: int
    ruled_out: int
    bound: float | None
    unchecked: list[str]
    unchecked_never_in_a_mask: int
    unchecked_in_one_mask: int
    unchecked_beside_measured: list[str]
    tied_at_k: list[str] = field(default_factory=list)
    helps: int = 0
    violations: int = 0
    group_size: int
    group_tests_run: int
    group_tests: list[GroupTestRecord]
    group_tests_to_cover: int
    measurements_spent: int | None = None
    max_measurements: int | None = None
    max_measurements_to_finish: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # field order: the file's key order

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> CertificateRecord:
        # A file written before ``certified`` was recorded: certified when complete.
        return cls(**{"certified": not data["unchecked"], **data,
                      "group_tests": [GroupTestRecord(**g) for g in data["group_tests"]]})


@dataclass
class RankingFacts:
    """What a ranking says of itself beside each column's effect: heads.json's keys between
    ``top_k`` and ``heads``, typed, each None where the ranking does not record it.

    The method and its size (``method``, ``measurements``); what a knockout did
    (``knockout``: ``{"ablation": "zero", "scale": 0.0}`` by default); greedy's ``rounds`` and
    ``winners``; the Lasso's diagnostics (``alpha``, and with it ``r2`` and ``r2_held_out``,
    null where they say nothing: every change measured alone); the order's caveats
    (``tied_with_above``: components whose evidence equals the one ranked above;
    ``same_masks``: top components the masks cannot tell from others; ``excluded``,
    ``never_knocked_out``); the confirmation (``confirmed`` measured alone, ``implicated``
    by the screen, ``next`` the round that would come next); the prior's own top-k
    (``prior_top_k``, ``prior_found_nothing``); the completeness ``certificate``
    (``rank._certificate``); and ``largest_single_help`` (``{"head", "change"}``). ``other``:
    keys a file holds that this version does not know, kept as read.
    """

    method: str | None = None
    knockout: dict[str, Any] | None = None  # {"ablation", "scale"}: what a knockout did
    rounds: int | None = None
    winners: list[str] | None = None
    r2: float | None = None
    r2_held_out: float | None = None
    alpha: float | None = None
    measurements: int | None = None
    tied_with_above: list[str] | None = None
    same_masks: dict[str, list[str]] | None = None
    excluded: list[str] | None = None
    never_knocked_out: list[str] | None = None
    confirmed: list[str] | None = None
    implicated: list[str] | None = None
    next: list[str] | None = None
    prior_top_k: list[str] | None = None
    prior_found_nothing: bool = False
    certificate: CertificateRecord | None = None
    largest_single_help: dict[str, Any] | None = None
    other: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """heads.json's keys, in the order the file has them: a field that is None is left
        out, except the fit's R²s, written (null or not) wherever a Lasso was fitted."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "other":
                out.update(value)
            elif f.name in _FIT_DIAGNOSTICS and self.alpha is not None:
                out[f.name] = value
            elif f.name == "prior_found_nothing":
                if value:
                    out[f.name] = True
            elif isinstance(value, CertificateRecord):
                out[f.name] = value.to_json()
            elif value is not None:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankingFacts:
        """``to_json``'s inverse (a heads.json's keys less the ranking's own)."""
        known = {f.name for f in fields(cls)} - {"other"}
        if "alpha" not in data:  # R²s without a fit's alpha: kept as read, not as the fit's
            known -= set(_FIT_DIAGNOSTICS)
        given = {k: v for k, v in data.items() if k in known}
        if given.get("certificate") is not None:
            given["certificate"] = CertificateRecord.from_json(given["certificate"])
        return cls(**given, other={k: v for k, v in data.items() if k not in known})


#: The Lasso's diagnostics, null in a file where they say nothing (``RankingFacts``).
_FIT_DIAGNOSTICS = ("r2", "r2_held_out")


@dataclass
class Ranking:
    """One task's result: every column's (head's, or neuron's) estimated effect, most
    harmful first."""

    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    effects: np.ndarray  # (columns,), score change from knocking out each; NaN unknown
    order: list[int]  # column indices, most harmful first (excluded ones left out)
    heads_per_layer: int
    facts: RankingFacts = field(default_factory=RankingFacts)  # method, r2, confirmed...
    stability: Stability | None = None  # bootstrap over the measurements (locate, refit)
    columns: Columns | None = None  # the component of each column; None: every head
    head_types: Any = None  # the run's types.json (``head_types.HeadTypes``), None without one
    #: ``TIE_EVIDENCE`` name -> per column values (``prior``: (points, columns)); NaN (or
    #: inf) where a column has none.
    evidence: dict[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A fit's zero (or a measured 0 with the sign flipped) is 0, never "-0.0000".
        self.effects = np.asarray(self.effects, dtype=float)
        if np.signbit(self.effects[self.effects == 0]).any():
            self.effects = self.effects + 0.0
        if self.columns is None:
            layers = max(1, len(self.effects) // self.heads_per_layer)
            self.columns = Columns.heads(layers, self.heads_per_layer)

    def __eq__(self, other: object) -> bool:
        # The dataclass's own == compared the numpy fields as a tuple, which raised
        # ("truth value of an array is ambiguous"): equal contents are equal rankings.
        return same_values(self, other) if isinstance(other, Ranking) else NotImplemented

    def top(self, k: int) -> list[Column]:
        """The first ``k`` columns (all of them where fewer are ranked)."""
        k = check_number(k, "k", whole=True, min_val=0)  # top(-1) was all but the last
        return [self.columns[i] for i in self.order[:k]]

    def top_knocked_out(self, k: int) -> list[Component]:
        """What knocking out the top ``k`` columns knocks out (a group: its neurons)."""
        k = check_number(k, "k", whole=True, min_val=0)  # as top's: -1 was all but the last
        return [c for i in self.order[:k] for c in self.columns.members(i)]

    def effect(self, head: Component) -> float:
        return float(self.effects[self.columns.index(head)])

    def confidence(self, head: Component) -> dict[str, Any]:
        """``selected`` (fraction of bootstrap refits with the head in the top-k) and
        ``effect_interval`` (95 %); empty when the ranking has no bootstrap."""
        if self.stability is None:
            return {}
        i = self.columns.index(head)
        low, high = float(self.stability.low[i]), float(self.stability.high[i])
        # None for a head measured alone (--confirm): one measurement has no spread.
        return {"selected": float(self.stability.selected[i]),
                "effect_interval": [low, high] if np.isfinite(low) else None}

    def measured_alone(self, head: Component) -> bool | None:
        """Whether ``head``'s effect was measured alone (``--confirm``), rather than
        estimated; None when the run confirmed nothing."""
        confirmed = self.facts.confirmed
        return None if confirmed is None else str(head) in confirmed

    def harmless(self, k: int) -> list[Column]:
        """The top-k columns whose effect (measured or estimated) does not hurt the task:
        listed because a top-k has k places, not because the task needs them. An unknown
        (NaN) effect is not among them."""
        effects = {c: float(self.effects[self.columns.index(c)]) for c in self.top(k)}
        return [c for c, e in effects.items()
                if np.isfinite(e) and not harm(e, self.higher_is_better) > 0]

    def settled(self, k: int) -> bool:
        """Whether at least ``STABLE`` of the bootstrap refits put every top-k head in the
        top-k hurting the task (``--masks auto``'s stop: a top-k place filled by a head that
        does not hurt is not settled); True without a bootstrap."""
        if self.stability is None:
            return True
        return all(self.stability.selected[self.columns.index(h)] >= STABLE
                   for h in self.top(k))

    def unstable(self, k: int) -> list[Component]:
        """The top-k heads that hurt the task and that fewer than ``STABLE`` of the
        bootstrap refits put in the top-k hurting it (a head that does not hurt is said as
        such, ``harmless``; no refit counts it, so "unstable" would say it twice, wrongly)."""
        if self.stability is None:
            return []
        harmless = set(self.harmless(k))
        return [h for h in self.top(k) if h not in harmless
                and self.stability.selected[self.columns.index(h)] < STABLE]


def relative_drop(baseline: float, score: float, higher_is_better: bool) -> float:
    """How much of the baseline a knockout removed (positive = worse); NaN at a zero
    baseline, where a relative drop is undefined."""
    change = float(harm(score - baseline, higher_is_better))
    # + 0.0: a score that held drops by 0, not -0.0 (cross.json recorded "-0.0")
    return change / abs(baseline) + 0.0 if baseline else float("nan")


def ranked_heads_json(ranking: Ranking, top_k: int) -> dict[str, Any]:
    """heads.json: read by ``hf-headablate ablate_file=…,ablate_top=K`` (the 'heads' list).

    Each entry: ``head`` (its name, L{layer}H{head}), ``layer``, ``head_in_layer`` and
    ``effect`` (null where no effect was estimated) — an MLP neuron's has ``neuron``
    (L{layer}N{neuron}) and ``neuron_in_layer`` instead; with a bootstrap also ``selected``
    (fraction of refits with the head in the top-k) and ``effect_interval`` (95 %; null
    for a head measured alone); after a confirmation (``--confirm``) ``measured_alone``;
    from locate ``tied_with_above``: the head's evidence equals the head ranked above it
    (their order is then the head index, which says nothing); and where recorded its
    ``TIE_EVIDENCE``: ``logprob_change`` (measured alone), ``contrast`` (estimated by the
    fit), ``prior`` (one estimate per prior point).
    """
    stability = {} if ranking.stability is None else {
        "bootstrap": {"resamples": ranking.stability.resamples, "stable_at": STABLE,
                      "unstable_in_top_k": [str(h) for h in ranking.unstable(top_k)]}}
    return tidy_numbers({
        "task": ranking.task, "metric": ranking.metric,
        "higher_is_better": ranking.higher_is_better, "baseline": ranking.baseline,
        "heads_per_layer": ranking.heads_per_layer,
        "top_k": [str(h) for h in ranking.top(top_k)], **ranking.facts.to_json(), **stability,
        "heads": [
            {"rank": rank, **_name_fields(head),
             "effect": ranking.effect(head), **ranking.confidence(head),
             **type_fields(ranking, head),
             **_alone_field(ranking, head),
             **({"tied_with_above": str(head) in ranking.facts.tied_with_above}
                if ranking.facts.tied_with_above is not None else {}),
             **_evidence_fields(ranking, head)}
            for rank, head in enumerate(ranking.top(len(ranking.order)), start=1)
        ],
    })


def tidy_numbers(data: Any) -> Any:
    """``data`` with each float as a reader expects it: 12 significant digits (a
    difference of two scores reads 0.17 and 0.004, not 0.16999999999999998 and
    0.004000000000000059: the last digits are the subtraction's rounding; nothing measured
    or fitted is known to more) and no negative zero (an effect of -0.0 is an effect of
    0)."""
    if isinstance(data, float):
        return float(f"{data:.12g}") + 0.0 if np.isfinite(data) else data
    if isinstance(data, Mapping):
        return {k: tidy_numbers(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [tidy_numbers(v) for v in data]
    return data

#: heads.json's keys that are not a ranking's ``facts`` (``ranked_heads_json``).
_RANKING_KEYS = ("task", "metric", "higher_is_better", "baseline", "heads_per_layer", "top_k",
                 "bootstrap", "heads")


def ranking_from_json(data: Mapping[str, Any], columns: Columns,
                      head_types: Any = None) -> Ranking:
    """The ranking a heads-<task>.json holds (``ranked_heads_json``'s inverse), over the
    run's ``columns``: its order, effects (NaN for what it does not rank: excluded, never
    knocked out, never measured), bootstrap and the rest (``facts``); ``head_types`` the
    run's types.json. What ``ranked_heads_json`` writes of it is the file again."""
    entries = data["heads"]
    order = [columns.named(entry.get("head") or entry.get("neuron") or entry["group"])
             for entry in entries]
    effects = np.full(len(columns), np.nan)
    for index, entry in zip(order, entries, strict=True):
        effects[index] = np.nan if entry.get("effect") is None else entry["effect"]
    evidence: dict[str, np.ndarray] = {}
    for name in TIE_EVIDENCE:
        given = [(index, entry[name]) for index, entry in zip(order, entries, strict=True)
                 if entry.get(name) is not None]
        if given:
            values = np.full((*np.shape(given[0][1]), len(columns)), np.nan)
            for index, value in given:
                values[..., index] = value
            evidence[name] = values
    stability = None
    if "bootstrap" in data:
        selected, low, high = np.zeros(len(columns)), *np.full((2, len(columns)), np.nan)
        for index, entry in zip(order, entries, strict=True):
            selected[index] = entry["selected"]
            if entry.get("effect_interval") is not None:
                low[index], high[index] = entry["effect_interval"]
        stability = Stability(selected, low, high, int(data["bootstrap"]["resamples"]))
    return Ranking(
        task=data["task"], metric=data["metric"], higher_is_better=data["higher_is_better"],
        baseline=data["baseline"], effects=effects, order=order,
        heads_per_layer=data["heads_per_layer"], columns=columns, stability=stability,
        facts=RankingFacts.from_json({k: v for k, v in data.items() if k not in _RANKING_KEYS}),
        head_types=head_types, evidence=evidence)


def _name_fields(component: Column) -> dict[str, Any]:
    if isinstance(component, NeuronGroup):
        # Its name means something only in its run: the neurons travel with it, as one
        # '+'-joined name that ablate_file= and verify read as one entry of the ranking.
        return {"group": str(component), "layer": component.layer,
                "group_in_layer": component.group, "size": len(component.neurons),
                "neurons": format_heads(component.members)}
    if isinstance(component, Neuron):
        return {"neuron": str(component), "layer": component.layer,
                "neuron_in_layer": component.neuron}
    return {"head": str(component), "layer": component.layer, "head_in_layer": component.head}


def type_fields(ranking: Ranking, head: Column) -> dict[str, Any]:
    # A head's attention-pattern scores (types.json), where the run has them.
    if ranking.head_types is None or not isinstance(head, Head):
        return {}
    near = ranking.head_types.borderline(head.layer, head.head)
    return {"types": ranking.head_types.of(head.layer, head.head),
            "type": ranking.head_types.label(head.layer, head.head),
            **({"type_borderline": near} if near else {})}


def _evidence_fields(ranking: Ranking, head: Column) -> dict[str, Any]:
    # A column's TIE_EVIDENCE, each only where it has one (finite).
    index = ranking.columns.index(head)
    fields: dict[str, Any] = {}
    for name in TIE_EVIDENCE:
        if name not in ranking.evidence:
            continue
        value = np.asarray(ranking.evidence[name][..., index], dtype=np.float64)
        if np.isfinite(value).all():
            fields[name] = value.tolist() if value.ndim else float(value)
    return fields


def _alone_field(ranking: Ranking, head: Component) -> dict[str, bool]:
    alone = ranking.measured_alone(head)
    return {} if alone is None else {"measured_alone": alone}


def largest_single_help(ranking: Ranking, all_measured: bool = False,
                        alone: Mapping[Column, float] | None = None
                        ) -> dict[str, Any] | None:
    """The single knockout that helps the task most, as heads.json records it
    (``largest_single_help``): ``{"head": name, "change": score change}``. Knocking out one
    component flips a few examples either way, and such a help shows how large those flips
    come (``within_spread``). ``all_measured``: every effect is a measurement of its
    component knocked out alone (one-shot greedy); otherwise only those measured alone
    (``--confirm``) count. ``alone``: each component's score change knocked out alone,
    where the ranking's effects are not that (iterative greedy: a head's effect is its
    change in its last round, on top of the earlier winners); only these count then.
    None where fewer than two were measured or none helps."""
    higher = ranking.higher_is_better
    # One component's knockout: a neuron group's (--neuron-groups) knocks out many, so
    # its help is no measure of what one flips.
    if alone is not None:
        changes = {c: float(change) for c, change in alone.items()
                   if np.isfinite(change) and not isinstance(c, NeuronGroup)}
    else:
        changes = {c: ranking.effect(c) for c in ranking.columns
                   if np.isfinite(ranking.effect(c))
                   and (all_measured or ranking.measured_alone(c))
                   and not isinstance(c, NeuronGroup)}
    if len(changes) < 2:
        return None
    helper = max(changes, key=lambda c: -harm(changes[c], higher))
    if not -harm(changes[helper], higher) > 0:
        return None  # nothing measured helps: no spread to compare with
    return {"head": str(helper), "change": changes[helper]}


def all_measured_alone(ranking: Ranking) -> bool:
    """Whether the confirmation measured every component the run ranks (a small model
    under the default budget): the fit then estimates nothing and its R² says nothing."""
    confirmed = ranking.facts.confirmed
    if not confirmed:
        return False
    facts = ranking.facts
    ranked = (len(ranking.effects) - len(facts.excluded or ())
              - len(facts.never_knocked_out or ()))
    return len(set(confirmed)) >= ranked
