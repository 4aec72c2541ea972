"""A locate run's report.md and its ranking files (``write_results``), and the sentences
the report and the terminal share (the fit, the certificate, the prior)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from lm_eval_headloc.common import timing
from lm_eval_headloc.method.columns import (
    UNIT,
    UNITS,
    NeuronGroup,
    components_of,
)
from lm_eval_headloc.method.ranking import Ranking, RankingFacts, all_measured_alone
from lm_eval_headloc.report.pages import (
    equal_change_words,
    floor_words,
    harmless_words,
    ranking_table,
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


_SIGNAL_WORDS = {"metric": "each task's metric, as lm-eval reports it",
                 "logprob": "the gold answers' mean log-likelihood (logprob)"}


def locate_report(run: LocateRun) -> str:
    """report.md of a fitted locate run (``run.rankings``), from its record alone."""
    spec, top_k = run.spec, run.spec.top_k
    units = UNITS[spec.components]
    lines = [
        f"# {_TITLES[spec.components]} by compressed sensing", "",
        f"- model: `{spec.model_args}`",
        *([f"- components: {units}; the design's neuron columns are the attribution "
           f"prior's {len(run.candidates or ())} likeliest of the model's "
           f"{run.layers * run.neurons_per_layer:,} MLP neurons (--candidates)"
           + _group_words(run)]
          if "neurons" in spec.components and run.neurons_per_layer else []),
        f"- signal: {_SIGNAL_WORDS[spec.signal]}",
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
           if spec.design_seed is not None else ""),
        f"- examples per task: {spec.num_samples} asked, used "
        + ", ".join(f"{t} {n}" for t, n in (run.examples_used or {}).items())
        + " (the same subset in every measurement)",
        f"- attribution prior: {_prior_words(run)}"
        + (f" (--prior {spec.prior}" + (f": {run.prior_skipped})" if run.prior_skipped
                                        else ")") if spec.prior == "auto" else ""),
        f"- confirmation: {_confirm_words(run)}",
        f"- Lasso alpha: {spec.alpha}",
        f"- never knocked out: {spec.never_ablate or 'none'}"
        + (" (not ranked: no measurement knocked them out)" if spec.never_ablate else ""),
        f"- excluded from the ranking: {spec.exclude or 'none'}",
        *([f"- time: {timing.timings_line(run.timings)} (config.json's timings)"]
          if run.timings else []), "",
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
            *tie_words(ranking, top_k, "the fit found no effect that tells them apart"),
            *harmless_words(ranking, top_k, UNIT[spec.components]),
            *spread_words(ranking, top_k, UNIT[spec.components]),
            *equal_change_words(ranking, top_k),
            *same_masks_words(ranking.facts, UNIT[spec.components], run.uses_prior),
            *_unconfirmed_words(ranking.facts, UNIT[spec.components]),
            *certificate_words(ranking, UNIT[spec.components]),
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
        return (f"; the top {len(top)} measured alone: their order is measured, not "
                "fitted (the masks' fit: report.md)")
    words = f", fit R² {r2:.3f} in-sample"
    if held_out is not None:
        words += f", {held_out:.2f} held out" + (f" ({BELOW_ZERO})" if held_out < 0 else "")
    return words


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


def _confirm_words(run: LocateRun) -> str:
    confirmed = run.confirm
    if not confirmed:
        return f"none (every {UNIT[run.spec.components]} ranked by the Lasso's estimate)"
    rounds = (f" in {len(confirmed['rounds'])} rounds of {confirmed['round_size']}"
              if "rounds" in confirmed else "")
    units = UNITS[run.spec.components]
    return (f"{len(confirmed['heads'])} {units} knocked out one at a "
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


def certificate_words(ranking: Ranking, unit: str = "head") -> list[str]:
    """report.md's completeness certificate (``facts.certificate``): what the run
    measured alone, what a measured set ruled out and by how much at most, what the
    group tests measured, and what nothing checked, with the flag that would check it."""
    cert = ranking.facts.certificate
    if not cert:
        return []
    k, bar = cert.top_k, cert.entry_bar
    entry = (f"stays under the top-{k}'s entry bar, a harm of {bar:.4g} (the {k}th "
             "largest measured alone)," if bar > 0 else
             f"does not hurt the task at all (fewer than {k} {unit}s measured alone hurt "
             f"it, so any harm would enter the top-{k})")
    lines = [f"### What was checked ({cert.measured_alone + cert.ruled_out} of "
             f"{cert.measured_alone + cert.ruled_out + len(cert.unchecked)} "
             f"{unit}s)", "",
             f"Under the rule that {cert.rule} — an assumption: a {unit} whose knockout "
             f"helps can hide one that hurts in the same set — a measured set whose harm "
             f"{entry} rules out each of its members.", "",
             f"- measured alone: {cert.measured_alone} {unit}s (the table's measured "
             "changes)"]
    if cert.ruled_out:
        lines.append(f"- ruled out by a mask or group test: {cert.ruled_out} {unit}s; "
                     + (f"none of them alone harms the task by more than {cert.bound:.4g} "
                        "(the harm of the set that ruled it out)" if cert.bound > 0 else
                        "none of them alone hurts the task (each set that ruled one out "
                        "left the score as good or better)"))
    else:
        lines.append(f"- ruled out by a mask or group test: none (every measured set with "
                     f"an unmeasured {unit} in it reached the bar)")
    groups = cert.group_tests
    if groups:
        shown = "; ".join(f"{'+'.join(g.components[:4])}"
                          + (f"+{len(g.components) - 4} more" if len(g.components) > 4
                             else "") + f" {g.change:+.4f}" for g in groups[:8])
        lines.append(f"- group tests ({len(groups)} sets of up to {cert.group_size} "
                     f"{unit}s, halved where they reached the bar): {shown}"
                     + (f"; and {len(groups) - 8} more (heads.json)" if len(groups) > 8
                        else ""))
    unchecked = cert.unchecked
    if not unchecked:
        lines += ["", f"Every {unit} the run ranks was measured alone or ruled out: under "
                  f"the rule, no {unit} outside the table's measured ones would enter the "
                  f"top-{k}.", ""]
        return lines
    beside = cert.unchecked_beside_measured
    lines += [f"- **not checked: {len(unchecked)} {unit}s** "
              f"({cert.unchecked_never_in_a_mask} never knocked out by a mask, "
              f"{cert.unchecked_in_one_mask} in one mask only"
              + (f", {len(beside)} only in masks beside a {unit} measured to reach the bar"
                 if beside else "") + f"): {_listed(unchecked)}. Any of them could enter "
              f"the top-{k}; the masks' estimate is all the run has for them.", "",
              _group_tests_advice(ranking, cert.group_tests_run + cert.group_tests_to_cover)
              + f" would knock each of them out in at least one group of "
              f"{cert.group_size} (more tests where a group reaches the bar and is "
              "halved); a larger `--confirm` measures the likeliest alone.", ""]
    return lines


def _group_tests_advice(ranking: Ranking, tests: int) -> str:
    """The flags that would run ``tests`` group tests: group tests follow a confirmation
    (a ``--confirm 0`` run is refused them), so a run that confirmed nothing needs both."""
    if ranking.facts.confirmed is None:
        return f"`--confirm` above 0 with `--group-tests {tests}`"
    return f"`--group-tests {tests}`"


def certificate_line(ranking: Ranking) -> str | None:
    """The terminal's one line on the certificate, or None without one."""
    cert = ranking.facts.certificate
    if not cert:
        return None
    unit = UNIT[components_of(ranking.columns)]
    unchecked = len(cert.unchecked)
    ruled = (f", {cert.ruled_out} ruled out by sets under the top-{cert.top_k}'s bar "
             + (f"(each ≤ {cert.bound:.4g} alone)" if cert.bound > 0 else
                "(none of them hurts alone)") if cert.ruled_out else "")
    rest = (f", {unchecked} not checked (report.md: what would check them)" if unchecked
            else f"; every {unit} checked")
    return f"  checked: {cert.measured_alone} measured alone{ruled}{rest}"


def _sparsity_words(run: LocateRun) -> str:
    if run.spec.sparsity != "auto" or run.pilot is None:
        return f"{run.spec.sparsity}"
    pilot = run.pilot
    return (f"auto: {pilot['sparsity']:g}, the largest whose pilot masks kept ≥ "
            f"{pilot['keep_at_least']:.0%} of the score's distance to a mask of half the "
            "heads (" + "; ".join(f"p={level}: " + ", ".join(
                f"{share:.0%}" for share in shares.values())
                for level, shares in pilot["kept"].items()) + ")")


def _masks_words(run: LocateRun) -> str:
    if run.spec.masks != "auto":
        return f"{run.spec.masks} masks"
    return (f"{run.masks_used} masks (--masks auto: measured until every top-k "
            f"head was stable, at most {run.spec.max_masks})")


def write_results(folder: RunFolder, run: LocateRun) -> None:
    """The run's ranking files and report (``write_ranking``), from ``run`` alone."""
    sparsity = run.spec.sparsity if run.pilot is None else run.pilot["sparsity"]
    write_ranking(folder, run.rankings, run.spec.top_k,
                  title=f"{run.spec.design} design, {_masks_words(run)}, p={sparsity}"
                        .replace(" (", "\n("),
                  report=lambda: locate_report(run))
