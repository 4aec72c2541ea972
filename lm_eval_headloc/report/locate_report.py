"""A locate run's report.md and its ranking files (``write_results``), and the sentences
the report and the terminal share (the fit, the certificate, the prior)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lm_eval_headloc.common import timing
from lm_eval_headloc.common.words import counted, ordinal, signed
from lm_eval_headloc.method.budget import ALL_ALONE_MASKS, DEFAULT_BUDGET, PRIOR_ALLOWANCE
from lm_eval_headloc.method.columns import (
    UNIT,
    UNITS,
    NeuronGroup,
    certificate_unit,
    column_label,
)
from lm_eval_headloc.method.pilot import levels_kept
from lm_eval_headloc.method.ranking import (
    CertificateRecord,
    Ranking,
    RankingFacts,
    all_measured_alone,
)
from lm_eval_headloc.report.pages import (
    equal_change_words,
    examples_words,
    floor_words,
    harmless_words,
    knockout_words,
    ranking_table,
    recorded_knockout,
    signal_words,
    spread_words,
    tie_words,
    write_ranking,
)
from lm_eval_headloc.runs.folder import RunFolder
from lm_eval_headloc.runs.record import (
    LocateRun,
)

__all__ = ["BELOW_ZERO", "certificate_line", "certificate_words", "fit_summary", "held_out_words",
           "locate_report", "same_masks_words", "write_results"]


def locate_report(run: LocateRun) -> str:
    """report.md of a fitted locate run (``run.rankings``), from its record alone."""
    spec, top_k = run.spec, run.spec.top_k
    all_alone = _measured_all_alone(run)
    units = UNITS[spec.components]
    lines = [
        f"# {_TITLES[spec.components]} by compressed sensing", "",
        f"- model: `{spec.model_args}`",
        *([f"- components: {units}; the design's neuron columns are the attribution "
           f"prior's {len(run.candidates or ())} likeliest of the model's "
           f"{run.layers * run.neurons_per_layer:,} MLP neurons (--candidates)"
           + _group_words(run)]
          if "neurons" in spec.components and run.neurons_per_layer else []),
        signal_words(spec),
        knockout_words(spec, UNIT[spec.components]),
        *([f"- chat template: {_chat_words(run.chat_template)}"]
          if run.chat_template is not None else []),
        *([f"- few-shot examples per prompt: {spec.num_fewshot} (--num-fewshot; a task "
           "whose YAML fixes 0 keeps 0)"] if spec.num_fewshot is not None else []),
        *([f"- system instruction: {spec.system_instruction!r} (--system-instruction)"]
          if spec.system_instruction is not None else []),
        *([f"- generation arguments: `{spec.gen_kwargs}` (--gen-kwargs, over each "
           "generation task's own)"] if spec.gen_kwargs is not None else []),
        f"- design: {spec.design}, {_masks_words(run)}, sparsity "
        f"{_sparsity_words(run)}, seed {spec.seed}"
        + (f", masks drawn with seed {spec.design_seed}"
           if spec.design_seed is not None else "") + _all_alone_words(all_alone),
        examples_words(spec, run.examples_used),
        f"- attribution prior: {_prior_words(run)}"
        + (f" (--prior {spec.prior}" + (f": {run.prior_skipped})" if run.prior_skipped
                                        else ")") if spec.prior == "auto" else ""),
        f"- confirmation: {_confirm_words(run)}",
        f"- Lasso alpha: {spec.alpha}",
        f"- never knocked out: {spec.never_ablate or 'none'}"
        + (" (not ranked: no measurement knocked them out)" if spec.never_ablate else ""),
        f"- excluded from the ranking: {_excluded_words(run)}",
        *([timing.timings_item(run.timings)] if run.timings else []), "",
    ]
    for task, ranking in run.rankings.items():
        lines += [
            f"## {task} ({ranking.metric}, {'higher' if ranking.higher_is_better else 'lower'}"
            " is better)", "",
            f"Baseline (nothing knocked out): {ranking.baseline:.4f}. "
            + (f"Every {UNIT[spec.components]} was measured alone, so each ranks by its "
               "measurement; the masks' fit, with those changes held fixed, has nothing "
               "left to estimate (no R²)." if all_measured_alone(ranking) else
               f"Fit R² = {ranking.facts.r2:.3f} over {ranking.facts.measurements} "
               f"measurements{held_out_words(ranking, UNIT[spec.components])}."), "",
            *ranking_table(ranking, top_k, "change on knockout"
                           if ranking.facts.confirmed is not None
                           else "estimated change on knockout"), "",
            *floor_words(ranking),
            *tie_words(ranking, top_k),
            *harmless_words(ranking, top_k, UNIT[spec.components]),
            *spread_words(ranking, top_k, UNIT[spec.components]),
            *equal_change_words(ranking, top_k),
            *same_masks_words(ranking.facts, UNIT[spec.components], run.uses_prior),
            *_unconfirmed_words(ranking.facts, UNIT[spec.components]),
            *certificate_words(ranking, certificate_unit(ranking.columns),
                              _searched_words(run),
                              cap_given=spec.max_measurements not in (None, "auto"),
                              all_alone=all_alone,
                              prior_allowance=PRIOR_ALLOWANCE.get(run.prior_method or "", 0)
                              if run.prior_used else 0),
            *_prior_top_words(ranking.facts, top_k, run.prior_kind, UNIT[spec.components])]
    lines.append(f"Check the {units} with `headloc-harness verify` (knocks them out for "
                 "real).")
    return "\n".join(lines) + "\n"


def _prior_top_words(facts: RankingFacts, top_k: int, prior_kind: str | None,
                     unit: str) -> list[str]:
    """The attribution prior's own top-k, or that it found nothing to order."""
    if facts.prior_top_k is None:
        return []
    source = "prior.json" + (", its rankings in turn" if prior_kind == "atp-path" else "")
    if facts.prior_found_nothing:
        return [f"The attribution prior ({source}) estimated the same change for every "
                f"{unit}: it found no effect, and its top-{top_k} "
                f"({', '.join(facts.prior_top_k)}) is the {unit} index, not an order.", ""]
    return [f"The attribution prior's own top-{top_k} ({source}): "
            + ", ".join(facts.prior_top_k) + ".", ""]


#: What a held-out R² below 0 means (a newcomer reads a negative number as a failed run).
BELOW_ZERO = ("below 0: the fit predicts a measurement it did not see worse than the "
              "measurements' mean does")


def held_out_words(ranking: Ranking, unit: str = "head") -> str:
    """The fit's R² on measurements it did not see, beside the in-sample one (``r2``)."""
    facts = ranking.facts
    if facts.alpha is None:  # no Lasso fitted (greedy): no R² to speak of
        return ""
    value, rows, columns = facts.r2_held_out, facts.measurements, len(ranking.effects)
    shown = "n/a (too few measurements, or none that vary)" if value is None else f"{value:.2f}"
    if value is not None and value < 0:
        shown += f" ({BELOW_ZERO})"
    crowded = (f" ({columns} {unit}s, {rows} measurements: a fit comes close whatever the "
               "truth)" if columns > rows else "")
    alone = (f"; the {unit}s measured alone rank by their measurement, not by this fit"
             if facts.confirmed else "")
    return (f", in-sample{crowded}; each measurement predicted by a fit on the others: "
            f"R² = {shown}{alone}")


def fit_summary(ranking: Ranking, top_k: int) -> str:
    """The terminal's words on the masks' fit, after a task's baseline: where every top-k
    component was measured alone the fit ordered none of them, so its R² (which report.md
    gives) is left out rather than shown as a verdict on the run; otherwise its R² in-sample
    and held out, with what a held-out R² below 0 means. "" without a fit."""
    r2, held_out = ranking.facts.r2, ranking.facts.r2_held_out
    if r2 is None:
        return ""
    top = ranking.top(top_k)
    if top and all(ranking.measured_alone(c) for c in top):
        return ("; the top one measured alone: its place is measured, not fitted"
                if len(top) == 1 else
                f"; the top {len(top)} measured alone: their order is measured, not fitted"
                ) + " (the masks' fit: report.md)"
    words = f", fit R² {r2:.3f} in-sample"
    if held_out is not None:
        words += f", {held_out:.2f} held out" + (f" ({BELOW_ZERO})" if held_out < 0 else "")
    return words


def _unsearched(run: LocateRun) -> tuple[int, int, int] | None:
    """A run locating MLP neurons: (candidates, neurons in groups, the model's neurons it
    did not search); None for a heads run, which searches every head."""
    if "neurons" not in run.spec.components or not run.neurons_per_layer:
        return None
    searched = len(run.candidates or ())
    grouped = sum(len(c.neurons) for c in run.columns if isinstance(c, NeuronGroup))
    return searched, grouped, run.layers * run.neurons_per_layer - searched - grouped


def _searched_words(run: LocateRun) -> str:
    """What a run that locates MLP neurons searched, for its certificate: the candidates
    (and groups), not the model's other neurons."""
    counts = _unsearched(run)
    if counts is None:
        return ""
    searched, grouped, rest = counts
    # What --exclude (or --never-ablate) left out is not ranked, so not in the certificate:
    # "every one of the 30 components checked" beside "over the 32 ... searched" disagreed.
    first = next(iter(run.rankings.values()), None)
    left_out = 0 if first is None else (len(first.facts.excluded or ())
                                        + len(first.facts.never_knocked_out or ()))
    over = (f"the {len(run.columns) - left_out:,} components the run ranks, of the "
            f"{len(run.columns):,} the design searched ({left_out:,} left out of the "
            "ranking)" if left_out else
            f"the {len(run.columns):,} components the design searched")
    return (f"The certificate is over {over}: the prior's {searched:,} likeliest MLP neurons"
            + (f", {grouped:,} more in groups (a group is ruled out or measured as one)"
               if grouped else "")
            + (", and the heads" if "heads" in run.spec.components else "")
            + (f". The model's other {rest:,} neurons were not searched: nothing here "
               "says anything of them." if rest > 0 else "."))


def _group_words(run: LocateRun) -> str:
    groups = [c for c in run.columns if isinstance(c, NeuronGroup)]
    if not groups:
        return ""
    sizes = [len(g.neurons) for g in groups]
    return (f", and the other neurons in {len(groups)} groups (--neuron-groups "
            f"{run.spec.neuron_groups} per layer, {min(sizes):,}–{max(sizes):,} neurons "
            "each), one column per group: the attribution prior does not rank a group, "
            "so the masks alone implicate one")


def _prior_words(run: LocateRun) -> str:
    if run.prior_kind is None:
        return "none"
    one, all_ = UNIT[run.spec.components], UNITS[run.spec.components]
    return {"atp": "atp (prior.json): attribution patching at the clean run",
            "atp-path": "atp-path (prior.json): attribution patching at the clean run and "
                        f"with every {one} half ablated, each ranking the {all_}",
            "ig": "ig (prior.json): integrated gradients, the attribution averaged along "
                  "the path from the clean run to every component ablated"}[run.prior_kind]


_TITLES = {"heads": "Head localization", "neurons": "MLP neuron localization",
           "heads+neurons": "Head and MLP neuron localization"}


def _chat_words(chat_template: Mapping[str, bool]) -> str:
    """Which tasks were asked through the chat template, as the run recorded it."""
    through = [task for task, chat in chat_template.items() if chat]
    if not through:
        return "not used"
    if len(through) == len(chat_template):
        return "every task asked through it"
    return "asked through it: " + ", ".join(through) + "; the others plain"


def _rounds_words(rounds: list[list[str]] | None, size: int | None) -> str:
    """" in 7 rounds of 5" where every round had 5, else the sizes, so the words add up
    to the heads measured ("in 7 rounds of 5" for 34 did not)."""
    if not rounds:
        return ""
    sizes = [len(r) for r in rounds]
    if len(sizes) == 1:
        return " in one round"
    if all(n == size for n in sizes):
        return f" in {len(sizes)} rounds of {size}"
    if all(n == size for n in sizes[:-1]):
        return f" in {len(sizes)} rounds of {size} (the last of {sizes[-1]})"
    return f" in {len(sizes)} rounds ({'+'.join(map(str, sizes))})"


def _confirm_words(run: LocateRun) -> str:
    confirmed = run.confirm
    if not confirmed:
        return f"none (every {UNIT[run.spec.components]} ranked by the Lasso's estimate)"
    rounds = _rounds_words(confirmed.rounds, confirmed.round_size)
    units = UNITS[run.spec.components]
    return (f"{counted(len(confirmed.heads), UNIT[run.spec.components], units)} knocked "
            "out one at a "
            f"time{rounds}, "
            + ("the attribution prior's rankings and the masks' fit's likeliest in turn"
               if run.uses_prior else "the masks' fit's likeliest")
            + " (the fit redone after each round with "
            f"the measured {units}' changes held fixed); those that hurt rank first, by "
            "their measured change (equal ones by the gold answers' log-likelihood change), "
            f"then the {units} the fit implicates, then those that did no harm "
            "(their stability: how often a replay of the confirmation on a bootstrap "
            "resample of the masks would have confirmed them into the top-k)")


def same_masks_words(facts: RankingFacts, unit: str = "head",
                     uses_prior: bool = False) -> list[str]:
    """The top heads the masks cannot tell from others (``facts.same_masks``), said as
    such: the fit's credit among identical columns is not the masks' evidence."""
    found = facts.same_masks or {}
    if not found:
        return []
    # Not "the lowest index": coordinate descent leaves some credit on the other copies
    # of a column (an audit's run split it -0.041 / -0.022 between two such heads).
    chooser = ("the attribution prior's penalty and the solver's order" if uses_prior
               else "the solver's order")

    def clause(head: str, alike: list[str]) -> str:
        shown = ", ".join(alike[:5]) + (f" and {len(alike) - 5} more" if len(alike) > 5
                                        else "")
        return f"{head} was knocked out in exactly the same masks as {shown}"

    return ["Not told apart by the masks: "
            + "; ".join(clause(head, alike) for head, alike in found.items())
            + f", none of them measured alone. The masks cannot say which {unit} of such a "
            f"set moved the score: how the fit shares the credit among them follows {chooser}, "
            "not the masks. Measuring it alone (a larger `--confirm`) settles it.", ""]


def _unconfirmed_words(facts: RankingFacts, unit: str = "head") -> list[str]:
    """Where to look next: heads the masks' fit implicates that no one measured alone, and
    the round a larger --confirm would measure."""
    if facts.confirmed is None:
        return []
    implicated = facts.implicated or []
    lines = ["Not measured alone: " + (
        f"the masks' fit (with the measured {unit}s held fixed) implicates "
        + ", ".join(implicated[:10]) + (f" and {len(implicated) - 10} more"
                                        if len(implicated) > 10 else "")
        if implicated else f"the masks' fit implicates no other {unit}") + "."]
    if facts.next:
        lines.append("A larger `--confirm` would measure next: "
                     + ", ".join(facts.next) + ".")
    return [" ".join(lines), ""]


def _listed(names: Sequence[str], most: int = 10) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more"
                                      if len(names) > most else "")


def certificate_words(ranking: Ranking, unit: str = "head", scope: str = "",
                      cap_given: bool = False, all_alone: bool = False,
                      prior_allowance: int = 0) -> list[str]:
    """report.md's certificate (``facts.certificate``): certified or not, the rule and the
    confidence it holds at, what the run measured alone, what a measured set ruled out and
    by how much at most, what the group tests measured, the sets that ruled nothing out,
    the ties at the k-th place, and what nothing checked, with the flag that would check
    it. ``scope``: a sentence on what the run searched (a neuron run: its candidates);
    ``cap_given``: the user gave ``--max-measurements`` a number (else it is automatic);
    ``all_alone``: the run measured every head alone after the fewest masks
    (``_measured_all_alone``), which no cap stops; ``prior_allowance``: what its prior
    counts (a prior given with that plan)."""
    cert = ranking.facts.certificate
    if not cert:
        return []
    k, bar = cert.top_k, cert.entry_bar
    total = cert.measured_alone + cert.ruled_out + len(cert.unchecked)
    head = (f"### Certified: every one of the {total} {unit}s checked" if cert.certified
            else f"### Not certified: {len(cert.unchecked)} of {total} {unit}s unchecked")
    noise = (f"by more than {_z_words(cert)} standard errors of its change (the paired "
             f"standard error from the per-example scores: one-sided "
             f"{cert.confidence:.0%} confidence)" if cert.confidence is not None else
             "(the run recorded no per-example scores: each harm is taken as measured, and "
             "no confidence is stated)")
    # "a measured set whose harm does not hurt the task" read as a harm that hurts.
    entry = (f"whose harm stays under the top-{k}'s entry bar, a harm of {bar:.4g} (the "
             f"{ordinal(k)} largest measured alone), {noise}," if bar > 0 else
             "that does not hurt the task at all ("
             + (f"no {unit} measured alone hurts it" if k == 1 else
                f"fewer than {k} {unit}s measured alone hurt it")
             + f", so any harm would enter the top-{k}),")
    lines = [head, "", *([scope, ""] if scope else []),
             f"Under the rule that {cert.rule} — an assumption, checked against the "
             f"measurements: a set whose change helps beyond the noise, or harms clearly "
             f"less than a measured part of it, rules out nothing — a measured set "
             f"{entry} rules out each of its members.", "",
             f"- measured alone: {counted(cert.measured_alone, unit)} (the table shows the "
             f"top-{k}; "
             f"each one's measured change is in `heads-{ranking.task}.csv`, `measured_alone` "
             "1)" if cert.measured_alone else
             # "0 heads (... each one's measured change is in ...)" read as a promise.
             "- measured alone: none" + (f" (`--confirm 0`: every {unit} ranks by the masks' "
                                         "fit)" if ranking.facts.confirmed is None else "")]
    if cert.ruled_out:
        lines.append(f"- ruled out by a mask or group test: {counted(cert.ruled_out, unit)}; "
                     + (("alone it harms the task by no more than" if cert.ruled_out == 1
                         else "none of them alone harms the task by more than")
                        + f" {cert.bound:.4g} "
                        "(the harm of the set that ruled it out"
                        + (", plus its margin)" if cert.confidence is not None else ")")
                        if cert.bound is not None and cert.bound > 0 else
                        ("it does not hurt the task alone" if cert.ruled_out == 1 else
                         "none of them alone hurts the task")))
    else:
        lines.append(f"- ruled out by a mask or group test: none (no measured set with an "
                     f"unmeasured {unit} in it stayed clearly under the bar)")
    groups = cert.group_tests
    if groups:
        shown = "; ".join(f"{'+'.join(g.components[:4])}"
                          + (f"+{len(g.components) - 4} more" if len(g.components) > 4
                             else "") + f" {signed(g.change)}" for g in groups[:8])
        largest = max(len(g.components) for g in groups)
        # The count is of every set; the sizes are of the sets a round starts with
        # ("21 sets of 16 heads at first" read as 21 sets of that size).
        sizes = (f"of up to {cert.group_size} {unit}s" if largest <= cert.group_size else
                 f"of {cert.group_size} {unit}s at first and of twice as many after a "
                 f"round whose new groups all ruled theirs out (up to {largest})")
        lines.append(f"- group tests ({counted(cert.group_tests_run, 'measurement')}: "
                     f"{counted(len(groups), 'set')}, {sizes}, halved where they were not "
                     f"clearly under the bar (a set that helped: its likeliest helper "
                     f"apart), and the {unit}s that splitting narrowed down "
                     f"to, measured alone): {shown}"
                     + (f"; and {len(groups) - 8} more (heads.json)" if len(groups) > 8
                        else ""))
    if cert.helps or cert.violations:
        lines.append(f"- sets that ruled out nothing against the rule: {cert.helps} helped "
                     f"the task beyond the noise, {cert.violations} harmed it clearly less "
                     f"than a measured part of them (violations of the rule, observed)")
    if cert.tied_at_k:
        lines.append(f"- tied at the {ordinal(k)} place: {', '.join(cert.tied_at_k)} — "
                     "their measured harms are within the noise of each other, so which of "
                     f"them make the top-{k} is the measurement's order, not a finding")
    if cert.measurements_spent is not None:
        lines.append(f"- measurements: {cert.measurements_spent} measurement-equivalents "
                     f"(the prior's allowance, masks, {unit}s measured alone and group tests)"
                     + (": " + (f"the prior's {prior_allowance}, " if prior_allowance
                                else "")
                        + f"{ALL_ALONE_MASKS} masks and every {unit} it ranks alone, "
                        "which no cap stops (the design line says why)" if all_alone else
                        _of_the_cap(cert.measurements_spent, cert.max_measurements, unit,
                                    cap_given)))
    unchecked = cert.unchecked
    if not unchecked:
        lines += ["", f"Every {unit} the run ranks was measured alone or ruled out: under "
                  f"the rule{', at that confidence,' if cert.confidence is not None else ''}"
                  f" no {unit} but those measured alone would enter the top-{k}.",
                  ""]
        return lines
    beside = cert.unchecked_beside_measured
    more = len(unchecked) - cert.unchecked_never_in_a_mask - cert.unchecked_in_one_mask
    never = cert.unchecked_never_in_a_mask
    lines += [f"- **not checked: {counted(len(unchecked), unit)}**: {_listed(unchecked)}. Of "
              f"them, {never} {'was' if never == 1 else 'were'} never knocked out by a mask, "
              f"{cert.unchecked_in_one_mask} by one mask only and {more} by two or more"
              + (f"; {len(beside)} of the {len(unchecked)} (whatever their masks' count) "
                 f"only in masks beside a {unit} measured to reach the bar"
                 if beside else "")
              + f". Any of them could enter the top-{k}; the masks' estimate is all the run "
              f"has for them.", "", _finish_advice(ranking, cert) + ".", ""]
    return lines


def _z_words(cert: CertificateRecord) -> str:
    from statistics import NormalDist

    return f"{NormalDist().inv_cdf(cert.confidence or 0.5):.3g}"


def _finish_advice(ranking: Ranking, cert: CertificateRecord) -> str:
    """What would check the unchecked: a larger ``--max-measurements`` where the run
    records its cap, else ``--group-tests`` (a run that confirmed nothing needs a
    confirmation first: group tests follow one)."""
    if ranking.facts.confirmed is None:
        return (f"`--confirm` above 0 with `--group-tests "
                f"{cert.group_tests_run + cert.group_tests_to_cover}` would knock each of "
                f"them out in at least one group of {cert.group_size}")
    if cert.max_measurements_to_finish is not None:
        return (f"Rerun with `--max-measurements {cert.max_measurements_to_finish}` or more "
                f"to go on: that tests each of them in a group of {cert.group_size}, and "
                "more where a group is split; a larger `--confirm` measures the likeliest "
                "alone")
    return (f"`--group-tests {cert.group_tests_run + cert.group_tests_to_cover}` would knock "
            f"each of them out in at least one group of {cert.group_size} (more tests where "
            "a group is split); a larger `--confirm` measures the likeliest alone")


def _of_the_cap(spent: int, cap: int | None, unit: str, given: bool = False) -> str:
    """How the spent measurements stand to ``--max-measurements``: the masks, the prior and
    the heads measured alone are spent whatever the cap (auto, half the units, is below
    them where a model has few), which stops only the group tests ('28 of
    --max-measurements 4' read as a cap broken). ``given``: the cap is the user's number,
    said as the option; else it is the automatic one."""
    if cap is None:
        return ""
    if spent <= cap:
        return (f" of `--max-measurements {cap}`" if given else
                f" of the run's automatic cap of {cap} (`--max-measurements auto`: half the "
                f"{unit}s it ranks)")
    # The cap may be the automatic one: "more than `--max-measurements 8`" read as an
    # option the user never gave.
    return (f", more than the run's cap of {cap} (`--max-measurements`; by default half the "
            f"{unit}s it ranks): the prior, the masks and the {unit}s measured alone are spent "
            "whatever the cap, which stops only the group tests")


def certificate_line(ranking: Ranking, run: LocateRun | None = None) -> str | None:
    """The terminal's line on the certificate (and one on the ties at the k-th place, where
    it found any), or None without one; for ``run``'s MLP neurons, what it searched."""
    cert = ranking.facts.certificate
    if not cert:
        return None
    counts = None if run is None else _unsearched(run)
    scope = "" if counts is None or counts[2] <= 0 else (
        f" (of the {len(ranking.columns):,} components searched; the model's other "
        f"{counts[2]:,} neurons were not)")
    unit = certificate_unit(ranking.columns)
    confidence = f", {cert.confidence:.0%}" if cert.confidence is not None else ""
    ruled = (f", {cert.ruled_out} ruled out by sets under the top-{cert.top_k}'s bar "
             + (f"(each ≤ {cert.bound:.4g} alone{confidence})"
                if cert.bound is not None and cert.bound > 0 else
                "(none of them hurts alone)") if cert.ruled_out else "")
    checked = f"{cert.measured_alone} measured alone{ruled}"
    tied = (f"\n  tied at the {ordinal(cert.top_k)} place within the noise: "
            + ", ".join(cert.tied_at_k) if cert.tied_at_k else "")
    if cert.certified:
        return f"  certified{scope}: {checked}{tied}"
    finish = (f"; --max-measurements {cert.max_measurements_to_finish} or more would test "
              "them" if cert.max_measurements_to_finish is not None
              and ranking.facts.confirmed is not None else "")
    return (f"  not certified{scope}: {counted(len(cert.unchecked), unit)} unchecked ({checked}"
            f"{finish}; report.md says which){tied}")


def _sparsity_words(run: LocateRun) -> str:
    if run.spec.sparsity != "auto" or run.pilot is None:
        return f"{run.spec.sparsity}"
    pilot = run.pilot
    # pilot.choose_sparsity: the largest level that keeps enough, else the smallest tried.
    chosen = ("the largest whose pilot masks kept ≥"
              if levels_kept(pilot["kept"], pilot["keep_at_least"]) else
              "the smallest tried: no level's pilot masks kept")
    return (f"auto: {pilot['sparsity']:g}, {chosen} "
            f"{pilot['keep_at_least']:.0%} of the score's distance to a mask of half the "
            f"{UNITS[run.spec.components]} (" + "; ".join(f"p={level}: " + ", ".join(
                f"{share:.0%}" for share in shares.values())
                for level, shares in pilot["kept"].items()) + ")")


def _masks_words(run: LocateRun) -> str:
    if run.spec.masks != "auto":
        floor = _floor_mask_words(run, run.spec.masks)
        return f"{run.spec.masks} masks" + (f" ({floor})" if floor else "")
    unit = UNIT[run.spec.components]
    floor = _floor_mask_words(run, run.masks_used)
    floor += "; " if floor else ""
    if run.masks_used is not None and run.masks_used >= run.spec.max_masks:
        # Stopped by the cap, stable or not: "measured until every top-k head was stable"
        # read as a promise where a top-k head was still unstable.
        return (f"{run.masks_used} masks ({floor}--masks auto: stopped at --max-masks "
                f"{run.spec.max_masks}, its most; it stops sooner once every top-k {unit} "
                "is stable)")
    return (f"{run.masks_used} masks ({floor}--masks auto: measured until every top-k "
            f"{unit} was stable, at most {run.spec.max_masks})")


def _floor_mask_words(run: LocateRun, masks: int | None) -> str:
    """How many of ``masks`` the fit takes where --sparsity auto's floor mask is one of
    them, measured and not fitted: "40 masks" stood beside the fit's "over 39
    measurements"."""
    if not run.unfitted or masks is None:
        return ""
    return (f"{masks - run.unfitted} of them fitted: the pilot's floor mask, half the "
            f"{UNITS[run.spec.components]} knocked out, only chooses the sparsity")


def _measured_all_alone(run: LocateRun) -> bool:
    """Whether a heads run measured every head alone after the fewest masks the fit takes:
    a default run's plan on a model of few heads (``budget.measures_all_alone``), or the
    same options given."""
    return (run.spec.components == "heads" and run.spec.masks == ALL_ALONE_MASKS
            and bool(run.rankings)
            and all(all_measured_alone(r) for r in run.rankings.values()))


def _all_alone_words(all_alone: bool) -> str:
    """The design line's note on such a run (``_measured_all_alone``): why it is so."""
    if not all_alone:
        return ""
    return (f"; the fewest masks the fit takes, then every head it ranks measured alone: a "
            "default run's plan on a model whose automatic cap, half its heads, would not "
            f"cover the default plan's {DEFAULT_BUDGET} measurement-equivalents; its top-k "
            "is the one-at-a-time top-k itself")


def _excluded_words(run: LocateRun) -> str:
    """--exclude as given, and the neuron groups left out with it: a group holding an
    excluded neuron would knock it out."""
    if not run.spec.exclude:
        return "none"
    first = next(iter(run.rankings.values()), None)
    left_out = set() if first is None else set(first.facts.excluded or ())
    groups = [] if first is None else [c for c in first.columns if
                                       isinstance(c, NeuronGroup) and str(c) in left_out]
    return run.spec.exclude + (
        f" (and the neuron groups holding one of them: "
        f"{', '.join(map(column_label, groups))})" if groups else "")


def write_results(folder: RunFolder, run: LocateRun,
                  before_report: Callable[[], Any] | None = None) -> None:
    """The run's ranking files and report (``write_ranking``, its ``before_report``), from
    ``run`` alone."""
    sparsity = run.spec.sparsity if run.pilot is None else run.pilot["sparsity"]
    # Every head measured alone: the confirmation's and those the group tests narrowed
    # down to (the heatmap boxes the same).
    alone = max((len(r.facts.confirmed or []) for r in run.rankings.values()), default=0)
    units = UNITS[run.spec.components]
    write_ranking(folder, run.rankings, run.spec.top_k,
                  title=(f"{run.spec.design} design, {_masks_words(run)}, p={sparsity}"
                         + (f"; {alone} {units} measured alone" if alone else ""))
                        .replace(" (", "\n("),
                  report=lambda: locate_report(run), knockout=recorded_knockout(run.spec),
                  before_report=before_report)
