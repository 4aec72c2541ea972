"""What a run leaves for people: ranked head files, the heatmap, the markdown report.

``write_ranking`` is the one writer of a ranking's files (heads.json/csv per task, the
heatmap, report.md), used by locate, refit and greedy.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..heads import Head
from ..recovery import STABLE, Stability, harm
from .runfolder import RunFolder

__all__ = ["HeadRanking", "heads_table", "plot_heatmap", "ranked_heads_json", "relative_drop",
           "tie_words", "write_ranking"]


@dataclass
class HeadRanking:
    """One task's result: every head's estimated effect, most harmful first."""

    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    effects: np.ndarray  # (total_heads,), score change from knocking out a head; NaN unknown
    order: list[int]  # flat head indices, most harmful first (excluded heads left out)
    heads_per_layer: int
    extra: dict[str, Any] = field(default_factory=dict)  # r2, alpha, excluded, ...
    stability: Stability | None = None  # bootstrap over the measurements (locate, refit)

    def top(self, k: int) -> list[Head]:
        return [Head.from_flat_index(i, self.heads_per_layer) for i in self.order[:k]]

    def effect(self, head: Head) -> float:
        return float(self.effects[head.flat_index(self.heads_per_layer)])

    def confidence(self, head: Head) -> dict[str, Any]:
        """``selected`` (fraction of bootstrap refits with the head in the top-k) and
        ``effect_interval`` (95 %); empty when the ranking has no bootstrap."""
        if self.stability is None:
            return {}
        i = head.flat_index(self.heads_per_layer)
        low, high = float(self.stability.low[i]), float(self.stability.high[i])
        # None for a head measured alone (--confirm): one measurement has no spread.
        return {"selected": float(self.stability.selected[i]),
                "effect_interval": [low, high] if np.isfinite(low) else None}

    def measured_alone(self, head: Head) -> bool | None:
        """Whether ``head``'s effect was measured alone (``--confirm``), rather than
        estimated; None when the run confirmed nothing."""
        confirmed = self.extra.get("confirmed")
        return None if confirmed is None else str(head) in confirmed

    def unstable(self, k: int) -> list[Head]:
        """The top-k heads fewer than ``STABLE`` of the bootstrap refits put in the top-k."""
        if self.stability is None:
            return []
        return [h for h in self.top(k)
                if self.stability.selected[h.flat_index(self.heads_per_layer)] < STABLE]


def relative_drop(baseline: float, score: float, higher_is_better: bool) -> float:
    """How much of the baseline a knockout removed (positive = worse); NaN at a zero
    baseline, where a relative drop is undefined."""
    change = float(harm(score - baseline, higher_is_better))
    return change / abs(baseline) if baseline else float("nan")


def ranked_heads_json(ranking: HeadRanking, top_k: int) -> dict[str, Any]:
    """heads.json: read by ``hf-headablate ablate_file=…,ablate_top=K`` (the 'heads' list).

    Each entry: ``head`` (its name, L{layer}H{head}), ``layer``, ``head_in_layer`` and
    ``effect`` (null where no effect was estimated); with a bootstrap also ``selected``
    (fraction of refits with the head in the top-k) and ``effect_interval`` (95 %; null
    for a head measured alone); after a confirmation (``--confirm``) ``measured_alone``;
    from locate ``tied_with_above``: the head's evidence equals the head ranked above it
    (their order is then the head index, which says nothing).
    """
    stability = {} if ranking.stability is None else {
        "bootstrap": {"resamples": ranking.stability.resamples, "stable_at": STABLE,
                      "unstable_in_top_k": [str(h) for h in ranking.unstable(top_k)]}}
    return {
        "task": ranking.task, "metric": ranking.metric,
        "higher_is_better": ranking.higher_is_better, "baseline": ranking.baseline,
        "heads_per_layer": ranking.heads_per_layer,
        "top_k": [str(h) for h in ranking.top(top_k)], **ranking.extra, **stability,
        "heads": [
            {"rank": rank, "head": str(head), "layer": head.layer, "head_in_layer": head.head,
             "effect": ranking.effect(head), **ranking.confidence(head),
             **_alone_field(ranking, head),
             **({"tied_with_above": str(head) in ranking.extra["tied_with_above"]}
                if "tied_with_above" in ranking.extra else {})}
            for rank, head in enumerate(ranking.top(len(ranking.order)), start=1)
        ],
    }


def _alone_field(ranking: HeadRanking, head: Head) -> dict[str, bool]:
    alone = ranking.measured_alone(head)
    return {} if alone is None else {"measured_alone": alone}


def heads_table(ranking: HeadRanking) -> str:
    """heads.csv text: rank, head, layer, head_in_layer, effect (empty where unknown); with
    a bootstrap also selected, effect_low, effect_high."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    boot = ranking.stability is not None
    confirmed = "confirmed" in ranking.extra
    writer.writerow(["rank", "head", "layer", "head_in_layer", "effect",
                     *(["measured_alone"] if confirmed else []),
                     *(["selected", "effect_low", "effect_high"] if boot else [])])
    for rank, head in enumerate(ranking.top(len(ranking.order)), start=1):
        effect = ranking.effect(head)
        row = [rank, str(head), head.layer, head.head,
               f"{effect:.6g}" if np.isfinite(effect) else ""]
        if confirmed:
            row.append(int(bool(ranking.measured_alone(head))))
        if boot:
            confidence = ranking.confidence(head)
            interval = confidence["effect_interval"]  # None: measured alone
            row += [f"{confidence['selected']:.6g}",
                    *((f"{v:.6g}" for v in interval) if interval else ("", ""))]
        writer.writerow(row)
    return out.getvalue()


def plot_heatmap(rankings: Sequence[HeadRanking], top_k: int, path: Path, title: str = ""
                 ) -> Any:
    """Layers × heads image of each task's harm, its top-k heads circled (hatched when
    fewer than ``STABLE`` of the bootstrap refits agree); heads with no estimate are left
    blank. Uses a bare ``Figure`` (returned): the caller's pyplot state and backend are
    not touched."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    fig = Figure(figsize=(4 + 2.5 * len(rankings), 6))
    axes = fig.subplots(1, len(rankings), squeeze=False)[0]
    for ax, ranking in zip(axes, rankings, strict=True):
        # Harmful is red whichever way the metric points: show -harm on a red-blue map.
        shown = -harm(ranking.effects, ranking.higher_is_better).reshape(
            -1, ranking.heads_per_layer)
        finite = np.abs(shown[np.isfinite(shown)])
        limit = float(finite.max()) if finite.size and finite.max() > 0 else 1.0
        image = ax.imshow(np.ma.masked_invalid(shown), cmap="RdBu", vmin=-limit, vmax=limit,
                          aspect="auto", interpolation="nearest")
        for head in ranking.top(top_k):
            ax.scatter(head.head, head.layer, s=80, facecolors="none", edgecolors="black",
                       linewidths=1.5)
        unstable = ranking.unstable(top_k)
        for head in unstable:
            ax.add_patch(Rectangle((head.head - 0.5, head.layer - 0.5), 1, 1, fill=False,
                                   hatch="////", edgecolor="black", linewidth=0))
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        note = (f"\nhatched: top-{top_k} in < {STABLE:.0%} of "
                f"{ranking.stability.resamples} bootstrap refits") if unstable else ""
        ax.set_title(f"{ranking.task} ({ranking.metric}){note}", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8,
                     label="score change on knockout" + ("" if ranking.higher_is_better
                                                         else " (sign flipped)"))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return fig


def write_ranking(folder: RunFolder, rankings: Mapping[str, HeadRanking], top_k: int,
                  title: str, report: str) -> None:
    """heads-<task>.json/.csv for every task, heads.json/.csv (the first task's, for
    ``ablate_file=runs/x/heads.json``), heatmap.png and report.md."""
    for task, ranking in rankings.items():
        folder.write_json(f"heads-{task}.json", ranked_heads_json(ranking, top_k))
        folder.write_text(f"heads-{task}.csv", heads_table(ranking))
    first = next(iter(rankings.values()))
    folder.write_json("heads.json", ranked_heads_json(first, top_k))
    folder.write_text("heads.csv", heads_table(first))
    plot_heatmap(list(rankings.values()), top_k, folder.file("heatmap.png"), title=title)
    folder.write_text("report.md", report)


def ranking_table(ranking: HeadRanking, top_k: int, effect_label: str) -> list[str]:
    """Markdown rows of a ranking's top-k: rank, head, effect (and, with a bootstrap, how
    often refits put the head in the top-k and the effect's 95 % interval)."""
    if ranking.stability is None:
        lines = [f"| rank | head | {effect_label} |", "| --- | --- | --- |"]
        return lines + [f"| {rank} | {head} | {ranking.effect(head):+.4f} |"
                        for rank, head in enumerate(ranking.top(top_k), start=1)]
    lines = [f"| rank | head | {effect_label} | 95 % interval | in top-{top_k} of "
             f"{ranking.stability.resamples} bootstrap refits |",
             "| --- | --- | --- | --- | --- |"]
    for rank, head in enumerate(ranking.top(top_k), start=1):
        confidence = ranking.confidence(head)
        interval = confidence["effect_interval"]
        shown = "measured alone" if interval is None else (
            f"[{interval[0]:+.4f}, {interval[1]:+.4f}]")
        flag = "" if confidence["selected"] >= STABLE else " (unstable)"
        lines.append(f"| {rank} | {head} | {ranking.effect(head):+.4f} | {shown} | "
                     f"{confidence['selected']:.0%}{flag} |")
    return lines


def tie_words(ranking: HeadRanking, top_k: int, why_none: str) -> list[str]:
    """Ties in the top-k (``ranking.extra["tied_with_above"]``) said as such: equal
    evidence is no order. ``why_none``: why no head would stand out, in words."""
    tied = set(ranking.extra.get("tied_with_above", []))
    top = [str(h) for h in ranking.top(top_k)]
    if len(top) > 1 and all(h in tied for h in top[1:]):
        return [f"No head stands out: all {len(top)} listed heads have the same evidence "
                f"({why_none}); their order is the head index.", ""]
    groups: list[list[str]] = []
    for head in top:
        if head in tied and groups:
            groups[-1].append(head)
        else:
            groups.append([head])
    ties = [" = ".join(group) for group in groups if len(group) > 1]
    below = ranking.top(top_k + 1)
    if len(below) > top_k and str(below[top_k]) in tied:
        ties.append(f"{top[-1]} = {below[top_k]} (the last place is shared with heads "
                    "below it)")
    return [f"Tied (the same evidence; listed in head order): {'; '.join(ties)}.", ""] \
        if ties else []
