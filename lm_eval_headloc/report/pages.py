"""What a run leaves for people: ranked head files, the heatmap, the markdown report.

``write_ranking`` is the one writer of a ranking's files (heads.json/csv per task, the
heatmap, report.md), used by locate, refit and greedy.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lm_eval_headloc.common import timing, words
from lm_eval_headloc.common.files import write_atomically
from lm_eval_headloc.intervention.components import Head, Neuron
from lm_eval_headloc.method.columns import (
    UNIT,
    UNITS,
    Column,
    NeuronGroup,
    column_label,
    components_of,
)
from lm_eval_headloc.method.head_types import HEAD_TYPES
from lm_eval_headloc.method.lasso import STABLE, harm
from lm_eval_headloc.method.ranking import (
    Ranking,
    ranked_heads_json,
    type_fields,
)
from lm_eval_headloc.runs.folder import RunFolder

__all__ = ["beyond_spread", "examples_words", "harmless_words", "heads_table", "knockout_words",
           "none_hurts_words", "plot_heatmap", "recorded_knockout", "signal_words",
           "tie_words", "within_spread", "write_ranking"]


def type_words(ranking: Ranking, head: Column) -> str:
    """A head's dominant type and its score for a table ("induction (0.81)"), where the
    probe cannot tell the type it is nearest to "induction? (0.30)", "-" for a head no type
    stands out in, "" where the run has no types."""
    fields = type_fields(ranking, head)
    if not fields:
        return ""
    label = fields["type"]
    if label is None and fields.get("type_borderline"):
        near = fields["type_borderline"][0]
        return f"{near.replace('_', '-')}? ({fields['types'][near]:.2f})"
    return "-" if label is None else f"{label.replace('_', '-')} ({fields['types'][label]:.2f})"


def _decimal(value: float) -> str:
    """A number of heads.csv: 6 significant digits, always with a decimal point or an
    exponent (1.0, not 1: a column a reader parses as floats on every run) and no
    negative zero."""
    return repr(float(f"{float(value):.6g}") + 0.0)


def heads_table(ranking: Ranking) -> str:
    """heads.csv text: rank, head, layer, head_in_layer, effect (empty where unknown); with
    a bootstrap also selected, effect_low, effect_high. A run with neurons has
    ``component, kind, layer, index_in_layer`` instead of ``head, layer, head_in_layer``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    boot = ranking.stability is not None
    confirmed = ranking.facts.confirmed is not None
    neurons = ranking.columns.has_neurons
    names = ["component", "kind", "layer", "index_in_layer"] if neurons else [
        "head", "layer", "head_in_layer"]
    typed = ranking.head_types is not None
    writer.writerow(["rank", *names, "effect",
                     *(["measured_alone"] if confirmed else []),
                     *(["selected", "effect_low", "effect_high"] if boot else []),
                     *([*HEAD_TYPES, "type"] if typed else [])])
    for rank, head in enumerate(ranking.top(len(ranking.order)), start=1):
        effect = ranking.effect(head)
        kind = [_KIND[type(head)]] if neurons else []
        row = [rank, str(head), *kind, head.layer, head[1],
               _decimal(effect) if np.isfinite(effect) else ""]
        if confirmed:
            row.append(int(bool(ranking.measured_alone(head))))
        if boot:
            confidence = ranking.confidence(head)
            interval = confidence["effect_interval"]  # None: measured alone
            row += [_decimal(confidence["selected"]),
                    *((_decimal(v) for v in interval) if interval else ("", ""))]
        if typed:
            fields = type_fields(ranking, head)
            row += ([_decimal(fields["types"][t]) for t in HEAD_TYPES] + [fields["type"] or ""]
                    if fields else [""] * (len(HEAD_TYPES) + 1))
        writer.writerow(row)
    return out.getvalue()


#: The heatmap's letter for each head type.
_TYPE_LETTER = {"previous_token": "P", "duplicate_token": "D", "induction": "I",
                "attention_sink": "S"}

#: The most layers (heads) the heatmap gives a tick each.
MAX_TICKS = 40

#: heads.csv's kind column.
_KIND = {Head: "head", Neuron: "neuron", NeuronGroup: "neuron group"}


def plot_heatmap(rankings: Sequence[Ranking], top_k: int, path: Path, title: str = ""
                 ) -> Any:
    """Layers × heads image of each task's harm, its top-k heads circled (hatched when
    fewer than ``STABLE`` of the bootstrap refits agree); heads with no estimate are grey,
    as are a hybrid model's layers without heads (white is "no change"). What the marks
    mean is said once, under the panels (each line once however many panels use it): a
    panel's title holds only its task, so several tasks' titles never run into each other.
    Uses a bare ``Figure`` (returned): the caller's pyplot state and backend are not
    touched."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle
    from matplotlib.ticker import MaxNLocator, MultipleLocator

    fig = Figure(figsize=(4 + 2.5 * len(rankings), 6))
    axes = fig.subplots(1, len(rankings), squeeze=False)[0]
    notes: dict[str, None] = {}  # the legend's lines, each once, in the order first met
    for ax, ranking in zip(axes, rankings, strict=True):
        if ranking.columns.heads_grid is None:  # neurons: no grid would be readable
            notes.update(dict.fromkeys(_plot_top_list(ax, ranking, top_k)))
            continue
        # Harmful is red whichever way the metric points: show -harm on a red-blue map.
        shown = ranking.columns.grid_of(-harm(ranking.effects, ranking.higher_is_better))
        finite = np.abs(shown[np.isfinite(shown)])
        limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        image = ax.imshow(np.ma.masked_invalid(shown), cmap="RdBu", vmin=-limit, vmax=limit,
                          aspect="auto", interpolation="nearest")
        measured = [c for c in ranking.columns if ranking.measured_alone(c)]
        if measured:  # a measured cell is a measurement, the others the Lasso's estimate
            for head in measured:
                ax.add_patch(Rectangle((head.head - 0.42, head.layer - 0.42), 0.84, 0.84,
                                       fill=False, edgecolor="0.35", linewidth=0.6,
                                       gid="measured"))
            notes["boxed: measured alone (the other cells: the masks' fit's estimate)"] = None
        # A top-k place filled by a head that does not hurt is no find (harmless_words):
        # dashed and grey, not circled as one (it is never hatched either).
        harmless = ranking.harmless(top_k)
        for head in ranking.top(top_k):
            filler = head in harmless
            ax.scatter(head.head, head.layer, s=80, facecolors="none",
                       edgecolors="0.45" if filler else "black", linewidths=1.5,
                       linestyles=(0, (2, 1.5)) if filler else "solid",
                       gid="harmless" if filler else "top")
        typed = ranking.head_types is not None
        if typed:  # each head a type stands out in, by its letter
            for layer, row in enumerate(ranking.head_types.labels):
                for head_index, label in enumerate(row):
                    if label is not None:
                        # Light on a dark cell (a strong head's, often circled), else grey.
                        value = shown[layer, head_index]
                        dark = np.isfinite(value) and abs(value) > 0.5 * limit
                        ax.text(head_index, layer, _TYPE_LETTER[label], ha="center",
                                va="center", fontsize=6, fontweight="bold" if dark else None,
                                color="white" if dark else "dimgray")
        unstable = ranking.unstable(top_k)
        for head in unstable:
            ax.add_patch(Rectangle((head.head - 0.5, head.layer - 0.5), 1, 1, fill=False,
                                   hatch="////", edgecolor="black", linewidth=0))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        for axis, count in ((ax.xaxis, shown.shape[1]), (ax.yaxis, shown.shape[0])):
            # A tick per layer (per head) while they fit: every third left L10 and L11
            # hard to tell apart. Whole numbers either way.
            axis.set_major_locator(MultipleLocator(1) if count <= MAX_TICKS
                                   else MaxNLocator(integer=True))
            axis.set_tick_params(labelsize=7 if count > 16 else 9)
        notes[f"circled: top-{top_k}"] = None
        if harmless:
            notes[f"dashed circle: a top-{top_k} place filled by a head that does not hurt "
                  "the task"] = None
        if unstable:
            notes[f"hatched: top-{top_k} in < {STABLE:.0%} of "
                  f"{words.counted(ranking.stability.resamples, 'bootstrap refit')}"] = None
        hybrid = len({c.layer for c in ranking.columns}) < shown.shape[0]
        unknown = not np.isfinite(ranking.effects).all()
        if hybrid or unknown:
            ax.set_facecolor("0.8")  # not white: white is "no change" on this map
        if hybrid:
            notes["grey rows: layers without attention heads"] = None
        if unknown:
            notes["grey: no estimate (excluded, never knocked out or not measured)"] = None
        shown_types = {label for row in ranking.head_types.labels for label in row} if typed \
            else set()
        if shown_types - {None}:
            notes["letters: head types (" + ", ".join(
                f"{letter} {name.replace('_', '-')}" for name, letter in _TYPE_LETTER.items()
                if name in shown_types) + ")"] = None
        ax.set_title(f"{ranking.task} ({ranking.metric})", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8,
                     label="score change on knockout" + ("" if ranking.higher_is_better
                                                         else " (sign flipped)"))
    if title:
        fig.suptitle(title, fontsize=10)
    # The legend under the panels, the panels laid out above it (a line is ~0.17 in).
    below = (0.1 + 0.17 * len(notes)) / fig.get_figheight() if notes else 0.0
    if notes:
        fig.text(0.5, 0.1 / fig.get_figheight(), "\n".join(notes), ha="center",
                 va="bottom", fontsize=8, gid="legend")
    fig.tight_layout(rect=(0, below, 1, 1))
    # Atomically: a kill mid-write never leaves a truncated figure.
    write_atomically(path, lambda partial: fig.savefig(partial, dpi=120, format="png"))
    return fig


#: Each kind's bar colour (matplotlib's name) and the legend's words for it, in the
#: legend's order.
_BARS = {Neuron: ("tab:red", "red, MLP neurons"), Head: ("tab:blue", "blue, heads"),
         NeuronGroup: ("tab:orange", "orange, neuron groups")}

#: Components a top list shows (a run with neurons has no layers x heads picture).
TOP_LIST = 30


def _plot_top_list(ax: Any, ranking: Ranking, top_k: int) -> list[str]:
    """The ranking's first ``TOP_LIST`` components as horizontal bars of their harm, the
    top-k darker, hatched where unstable; heads and neurons in two colours. Returns the
    legend's lines for it."""
    shown = ranking.top(TOP_LIST)
    effects = np.array([ranking.effect(c) for c in shown], dtype=np.float64)
    harms = np.nan_to_num(harm(effects, ranking.higher_is_better))
    unstable = {str(c) for c in ranking.unstable(top_k)}
    # Where the run measured some alone, the others' bars are the fit's estimates: drawn
    # outlined, so an estimate longer than a measurement does not read as one.
    estimated = set() if ranking.facts.confirmed is None else {
        str(c) for c in shown if not ranking.measured_alone(c)}
    positions = np.arange(len(shown))[::-1]
    for position, component, value, rank in zip(positions, shown, harms, range(len(shown)),
                                                 strict=True):
        colour = _BARS[type(component)][0]
        outlined = str(component) in estimated
        ax.barh(position, value, color="white" if outlined else colour,
                alpha=1.0 if rank < top_k else 0.45,
                hatch="////" if str(component) in unstable else None,
                edgecolor=colour if outlined else "black",
                linewidth=1.0 if outlined else 0.3)
    ax.set_yticks(positions, [column_label(c) for c in shown], fontsize=7)
    ax.axvline(0, color="black", linewidth=0.5)
    ax.set_xlabel("harm on knockout (how much worse the score gets)")
    ax.set_title(f"{ranking.task} ({ranking.metric}): top {len(shown)}", fontsize=9)
    # Only the kinds the bars show: a neuron run's legend named blue heads it has not.
    kinds = {type(c) for c in shown}
    colours = "".join(f"; {said}" for kind, (_, said) in _BARS.items() if kind in kinds)
    return [f"bars: dark, top-{top_k}{colours}"
            + ("; hatched, unstable" if unstable else "")
            + ("; outlined, the fit's estimate (not measured alone)" if estimated else "")]


def recorded_knockout(spec: Any) -> dict[str, Any]:
    """What a knockout did in the run, as its ranking files record it (``knockout``)."""
    return {"ablation": spec.ablation, "scale": float(spec.scale)}


_SIGNAL_WORDS = {"metric": "each task's metric, as lm-eval reports it",
                 "logprob": "the gold answers' mean log-likelihood (logprob)"}


def signal_words(spec: Any) -> str:
    """report.md's line on what each measurement scored (locate's and greedy's)."""
    return f"- signal: {_SIGNAL_WORDS[spec.signal]}"


def examples_words(spec: Any, examples_used: Mapping[str, int] | None) -> str:
    """report.md's line on the examples each measurement scored (locate's and greedy's)."""
    return (f"- examples per task: {spec.num_samples} asked"
            + (", used " + ", ".join(f"{t} {n}" for t, n in examples_used.items())
               if examples_used else "")
            + " (the same subset in every measurement)")


def knockout_words(spec: Any, unit: str) -> str:
    """What knocking a ``unit`` out did in the run (``--ablation``, ``--scale``): the report
    said nothing of it, so a run by mean ablation at scale 2 read as zeroed heads."""
    kind, scale = spec.ablation, float(spec.scale)
    flags = f"(--ablation {kind}, --scale {scale:g})"
    if kind == "zero":
        done = ("zeroed" if scale == 0 else "left as it is" if scale == 1 else
                f"multiplied by {scale:g}")
        return f"- knockout: a knocked-out {unit}'s output is {done} {flags}"
    source = (f"`{spec.ablation_data}`" + (f"'s field {spec.ablation_field}"
                                            if spec.ablation_field else "")
              if spec.ablation_data else "the run's tasks on its example subset")
    reference = {"mean": f"its mean over the reference set, {source}",
                 "resample": f"its output on another example of the reference set, {source}"
                 }.get(kind, f"its {kind} value")
    if scale == 0:
        return (f"- knockout: {kind} ablation: a knocked-out {unit}'s output is replaced by "
                f"{reference} {flags}")
    return (f"- knockout: {kind} ablation: a knocked-out {unit}'s output z becomes "
            f"r + {scale:g}·(z − r), r {reference} {flags}")


@timing.timed("report")
def write_ranking(folder: RunFolder, rankings: Mapping[str, Ranking], top_k: int,
                  title: str, report: Callable[[], str],
                  knockout: Mapping[str, Any] | None = None,
                  before_report: Callable[[], Any] | None = None) -> None:
    """heads-<task>.json/.csv for every task, heads.json/.csv (the first task's, for
    ``ablate_file=runs/x/heads.json``), heatmap.png and report.md (``report()``'s text);
    with the folder's head types (types.json) each head's scores and type, in every one
    of them; ``knockout``: the run's ``{"ablation", "scale"}``, recorded in each ranking
    file (``hf-headablate`` says so where it knocks the heads out otherwise).
    ``before_report``: called just before report.md is written (a run saving its record,
    so that the timings report.md says hold this phase's own)."""
    from lm_eval_headloc.runs.types_file import read_types

    head_types = read_types(folder)
    for ranking in rankings.values():
        ranking.head_types = head_types
        if knockout is not None:
            ranking.facts.knockout = dict(knockout)
    for task, ranking in rankings.items():
        folder.write_json(folder.ranking_file(task).name, ranked_heads_json(ranking, top_k))
        folder.write_text(folder.ranking_file(task, ".csv").name, heads_table(ranking))
    first = next(iter(rankings.values()))
    folder.write_json("heads.json", ranked_heads_json(first, top_k))
    folder.write_text("heads.csv", heads_table(first))
    with folder.writing("heatmap.png") as path:
        plot_heatmap(list(rankings.values()), top_k, path, title=title)
    if before_report is not None:
        before_report()
    folder.write_text("report.md", report())


def ranking_table(ranking: Ranking, top_k: int, effect_label: str) -> list[str]:
    """Markdown rows of a ranking's top-k: rank, head, effect (and, with a bootstrap, how
    often refits put the head in the top-k and the effect's 95 % interval)."""
    unit = "component" if ranking.columns.has_neurons else "head"
    typed = ranking.head_types is not None
    type_head, type_rule = (" type (score) |", " --- |") if typed else ("", "")

    def type_cell(head: Column) -> str:
        return f" {type_words(ranking, head)} |" if typed else ""

    if ranking.stability is None:
        lines = [f"| rank | {unit} | {effect_label} |{type_head}",
                 f"| --- | --- | --- |{type_rule}"]
        return lines + [f"| {rank} | {column_label(head)} | {words.signed(ranking.effect(head))} |"
                        f"{type_cell(head)}"
                        for rank, head in enumerate(ranking.top(top_k), start=1)
                        ] + _near_type_words(ranking, top_k)
    lines = [f"| rank | {unit} | {effect_label} | 95 % interval | in top-{top_k}, hurting, "
             f"in {words.counted(ranking.stability.resamples, 'bootstrap refit')} |{type_head}",
             f"| --- | --- | --- | --- | --- |{type_rule}"]
    harmless = set(ranking.harmless(top_k))
    unstable = set(ranking.unstable(top_k))
    for rank, head in enumerate(ranking.top(top_k), start=1):
        confidence = ranking.confidence(head)
        interval = confidence["effect_interval"]
        shown = "measured alone" if interval is None else (
            f"[{words.signed(interval[0])}, {words.signed(interval[1])}]")
        selected = ("— (does not hurt)" if head in harmless else
                    _share(confidence["selected"], head in unstable)
                    + (" (unstable)" if head in unstable else ""))
        lines.append(f"| {rank} | {column_label(head)} | {words.signed(ranking.effect(head))} | "
                     f"{shown} | {selected} |{type_cell(head)}")
    return lines + _near_type_words(ranking, top_k)


def _share(selected: float, unstable: bool) -> str:
    """How often the refits put a head in the top-k, in whole percent; an unstable head's
    never rounded up to the bar it missed (179 of 200 refits read "90% (unstable)" beside
    a bar of 90 %): then in tenths, rounded down."""
    shown = f"{selected:.0%}"
    if unstable and float(shown[:-1]) / 100 >= STABLE:
        shown = f"{math.floor(selected * 1000 + 1e-9) / 10:.1f}%"
    return shown


def _near_type_words(ranking: Ranking, top_k: int) -> list[str]:
    """What a type with "?" in the table means, where one is shown."""
    if not any(type_words(ranking, head).split(" ")[0].endswith("?")
               for head in ranking.top(top_k)):
        return []
    return ["", "A type with ?: the head's probe score is within three of its standard "
                "errors of that type's threshold (types.json's borderline), so another "
                "probe may put it on either side; it is not labelled."]


def harmless_words(ranking: Ranking, top_k: int, unit: str = "head",
                   all_measured: bool = False) -> list[str]:
    """The top-k places filled by components that do not hurt the task, said as such (a
    top-k is not a claim that k were found). ``all_measured``: every effect is a
    measurement (greedy); otherwise those measured alone (``--confirm``) are told from
    the fit's estimates."""
    harmless = ranking.harmless(top_k)
    top = ranking.top(top_k)
    if not harmless or _all_tied(ranking, top_k):  # tie_words says it then
        return []
    measured = [str(c) for c in harmless if all_measured or ranking.measured_alone(c)]
    estimated = [str(c) for c in harmless if str(c) not in measured]
    how = "; ".join(
        [f"{', '.join(measured)}: measured {'' if all_measured else 'alone '}to do no harm"]
        * bool(measured) + [f"{', '.join(estimated)}: no harm in the fit's estimate"]
        * bool(estimated))
    hurting = [c for c in top if c not in harmless]
    hurt = len(hurting)
    if not hurt:
        return [f"Nothing found: {none_hurts_words(len(top), unit, f' ({how})')}.", ""]
    return [f"Only {hurt} of the top-{len(top)} {unit}s hurt{'s' if hurt == 1 else ''} "
            f"the task; the other places are filled by {unit}s that do not ({how}). "
            f"{_only_what_hurts(top, hurting)}", ""]


def _only_what_hurts(top: Sequence[Column], hurting: Sequence[Column]) -> str:
    """How to knock out only the top-k's ``hurting`` components: ``ablate_top=K`` where
    they are its first K; else (iterative greedy ranks heads in the order they won its
    rounds, so one that does not hurt may come before one that does) by name, ``ablate=``
    joined by ``+`` as hf-headablate reads it."""
    if list(top[:len(hurting)]) == list(hurting):
        return f"`ablate_top={len(hurting)}` knocks out only what hurts."
    first = [str(c) for c in top[:len(hurting)] if c not in hurting]
    not_first = (f"not `ablate_top={len(hurting)}`, whose first {len(hurting)} include "
                 f"{', '.join(first)}")
    if any(isinstance(c, NeuronGroup) for c in hurting):  # a group's name is its run's own
        return (f"Knock out only what hurts by name ({', '.join(map(column_label, hurting))}, "
                f"a group as the neurons heads.json lists for it) with `ablate=`; "
                f"{not_first}.")
    return (f"`ablate={'+'.join(map(str, hurting))}` knocks out only what hurts "
            f"({not_first}).")


def none_hurts_words(k: int, unit: str, how: str = "") -> str:
    """What a top-k of which no component hurts the task is (report.md and the terminal):
    ``how``, said after "hurts the task", is why each is known not to."""
    return (f"none of the top-{k} {unit}s hurts the task{how}; their order is no evidence "
            "of a role in it")


def beyond_spread(change: float, largest_help: Mapping[str, Any], higher_is_better: bool
                  ) -> bool:
    """Whether a knockout's ``change`` hurts the task by more than ``largest_help``
    (``largest_single_help``) helps it — by more than round-off: one example of 24 lost
    and one gained differ in their last bits, not in what was measured."""
    hurts = float(harm(change, higher_is_better))
    helps = -float(harm(largest_help["change"], higher_is_better))
    return hurts > helps and not math.isclose(hurts, helps, rel_tol=1e-9, abs_tol=1e-12)


def within_spread(ranking: Ranking, top_k: int) -> list[Column]:
    """The top-k components that hurt the task by no more than the run's largest single
    help (``facts.largest_single_help``): no evidence that the task needs them.
    [] where none is recorded, or where the top-k has no order at all (all tied)."""
    recorded = ranking.facts.largest_single_help
    if recorded is None or _all_tied(ranking, top_k):
        return []
    higher = ranking.higher_is_better
    return [c for c in ranking.top(top_k) if np.isfinite(ranking.effect(c))
            and harm(ranking.effect(c), higher) > 0
            and not beyond_spread(ranking.effect(c), recorded, higher)]


def spread_words(ranking: Ranking, top_k: int, unit: str = "head") -> list[str]:
    """Harms no larger than the run's own spread (``within_spread``), said as such: a
    harm no larger than the largest help measured alone (a task at chance, say) is not
    evidence that the task needs the component."""
    within = within_spread(ranking, top_k)
    if not within:
        return []
    recorded = ranking.facts.largest_single_help
    beyond = [column_label(c) for c in ranking.top(top_k) if np.isfinite(ranking.effect(c))
              and harm(ranking.effect(c), ranking.higher_is_better) > 0 and c not in within]
    against = (f"knocking out one {unit} alone helps it ({recorded['head']}: "
               f"{words.signed(recorded['change'])})")
    if not beyond:
        return [f"Nothing beyond the spread of single knockouts: no top-{top_k} {unit} hurts "
                f"the task by more than {against}; their order may reflect which examples "
                f"happened to flip, not {unit}s the task needs.", ""]
    return [f"Only {', '.join(beyond)} hurt{'s' if len(beyond) == 1 else ''} the task by "
            f"more than {against}; the other top-{top_k} {unit}s that hurt do so by no "
            "more, within the spread of single knockouts.", ""]


def equal_change_words(ranking: Ranking, top_k: int, all_measured: bool = False
                       ) -> list[str]:
    """Top-k neighbours measured alike by the task's score but not tied, said as such:
    ``rank.rank_measured`` orders them by the gold answers' log-likelihood, which the
    table does not show. Where the k-th is measured alike with those ranked after it, the
    log-likelihood decided which of them is in the top-k: said too. ``all_measured``:
    every effect is a measurement (greedy)."""
    tied = set(ranking.facts.tied_with_above or [])

    def alike(above: Column, below: Column) -> bool:
        return (str(below) not in tied and ranking.effect(above) == ranking.effect(below)
                and all(all_measured or ranking.measured_alone(c) for c in (above, below)))

    groups: list[list[Column]] = []
    top = ranking.top(top_k)
    for above, below in zip(top, top[1:], strict=False):
        if alike(above, below):
            if groups and groups[-1][-1] == above:
                groups[-1].append(below)
            else:
                groups.append([above, below])
    left_out: list[Column] = []  # measured as the k-th is, ranked after it
    # Only where the k-th hurts: places filled by harmless ones are harmless_words' to say.
    if top and harm(ranking.effect(top[-1]), ranking.higher_is_better) > 0:
        for below in ranking.top(len(ranking.columns))[len(top):]:
            if not alike(left_out[-1] if left_out else top[-1], below):
                break
            left_out.append(below)
    if left_out and not (groups and groups[-1][-1] == top[-1]):
        groups.append([top[-1]])
    if not groups:
        return []
    shown = [f"{', '.join(map(column_label, group))} ({words.signed(ranking.effect(group[0]))})"
             for group in groups]
    if left_out:
        names = ", ".join(map(column_label, left_out[:5])) + (
            f" and {len(left_out) - 5} more" if len(left_out) > 5 else "")
        shown[-1] += (f", and after the top-{len(top)} {names}, measured the same: the "
                      f"log-likelihood decided which of them are in the top-{len(top)}")
    return [f"The same measured change, ordered by the gold answers' log-likelihood change "
            f"(the larger drop first): {'; '.join(shown)}.", ""]


def _all_tied(ranking: Ranking, top_k: int) -> bool:
    tied = set(ranking.facts.tied_with_above or [])
    top = [str(h) for h in ranking.top(top_k)]
    return len(top) > 1 and all(h in tied for h in top[1:])


def at_floor(ranking: Ranking) -> bool:
    """Whether the task scores 0 by a higher-is-better metric with nothing knocked out
    (accuracy 0): no knockout can lower it, so a ranking by the metric finds nothing."""
    return scores_at_floor(ranking.baseline, ranking.higher_is_better, ranking.metric)


def scores_at_floor(baseline: float, higher_is_better: bool | None,
                    metric: str | None = None) -> bool:
    """``at_floor`` for a bare baseline (a sweep's): 0 by a higher-is-better metric, not
    the log-likelihood nor one that goes below 0 (``signed_metric``)."""
    return bool(higher_is_better) and baseline == 0.0 and metric != "logprob" \
        and not signed_metric(metric)


def signed_metric(metric: str | None) -> bool:
    """Whether lm-eval's metric ``metric`` (``name,filter``) can be negative, so that 0 is
    no floor: a correlation (mcc: 0 is a model that answers one class every time) or a
    difference of two scores (truthfulqa_gen's bleu_diff, rouge1_diff ...)."""
    name = (metric or "").split(",")[0]
    return name == "mcc" or name.endswith("_diff")


FLOOR_HINT = ("--signal logprob (the gold answers' log-likelihood, where the task has "
              "them) can move")


def floor_words(ranking: Ranking) -> list[str]:
    """The report's line for a task at its floor (``at_floor``)."""
    if not at_floor(ranking):
        return []
    return [f"The task scores 0 with nothing knocked out, so no knockout can lower it; "
            f"{FLOOR_HINT}.", ""]


def why_nothing_stands_out(ranking: Ranking) -> str:
    """Why every top component has the same evidence, in words: a greedy ranking measured
    each head alone; a locate ranking's fit found no effect."""
    if "greedy" in (ranking.facts.method or ""):
        return "every head measured alone changed the score and log-likelihood alike"
    return (f"the fit found no effect that tells the "
            f"{UNITS[components_of(ranking.columns)]} apart")


def tie_words(ranking: Ranking, top_k: int) -> list[str]:
    """Ties in the top-k (``ranking.facts.tied_with_above``) said as such: equal
    evidence is no order."""
    tied = set(ranking.facts.tied_with_above or [])
    top = [str(h) for h in ranking.top(top_k)]
    components = components_of(ranking.columns)
    if _all_tied(ranking, top_k):
        return [f"No {UNIT[components]} stands out: all {len(top)} listed {UNITS[components]} "
                f"have the same evidence ({why_nothing_stands_out(ranking)}); their order is "
                "the index.", ""]
    groups: list[list[str]] = []
    for head in top:
        if head in tied and groups:
            groups[-1].append(head)
        else:
            groups.append([head])
    ties = [" = ".join(group) for group in groups if len(group) > 1]
    below = ranking.top(top_k + 1)
    if len(below) > top_k and str(below[top_k]) in tied:
        ties.append(f"{top[-1]} = {below[top_k]} (the last place is shared with "
                    f"{UNITS[components]} below it)")
    return [f"Tied (the same evidence; listed in {UNIT[components]} order): "
            f"{'; '.join(ties)}.", ""] \
        if ties else []
