"""What a run leaves for people: ranked head files, the heatmap, the markdown report."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .heads import Head

__all__ = ["HeadRanking", "heads_table", "plot_heatmap", "ranked_heads_json"]


@dataclass
class HeadRanking:
    """One task's result: every head's estimated effect, most harmful first."""

    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    effects: np.ndarray  # (num_layers * num_heads,), score change from knocking out a head
    order: list[int]  # flat head indices, most harmful first (excluded heads left out)
    num_heads: int
    extra: dict[str, Any] = field(default_factory=dict)  # r2, alpha, excluded, ...

    def top(self, k: int) -> list[Head]:
        return [Head.from_index(i, self.num_heads) for i in self.order[:k]]


def ranked_heads_json(ranking: HeadRanking, top_k: int) -> dict[str, Any]:
    """heads.json: read by ``hf-headablate ablate_file=…,ablate_top=K`` (the 'heads' list)."""
    return {
        "task": ranking.task, "metric": ranking.metric,
        "higher_is_better": ranking.higher_is_better, "baseline": ranking.baseline,
        "top_k": [str(h) for h in ranking.top(top_k)], **ranking.extra,
        "heads": [
            {"rank": rank, "head": str(Head.from_index(i, ranking.num_heads)),
             "layer": i // ranking.num_heads, "index": i % ranking.num_heads,
             "effect": float(ranking.effects[i])}
            for rank, i in enumerate(ranking.order, start=1)
        ],
    }


def heads_table(ranking: HeadRanking) -> str:
    """heads.csv text: rank, head, layer, index, effect."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["rank", "head", "layer", "index", "effect"])
    for rank, i in enumerate(ranking.order, start=1):
        writer.writerow([rank, str(Head.from_index(i, ranking.num_heads)),
                         i // ranking.num_heads, i % ranking.num_heads,
                         f"{ranking.effects[i]:.6g}"])
    return out.getvalue()


def plot_heatmap(rankings: Sequence[HeadRanking], top_k: int, path: Path, title: str = "") -> None:
    """Layers × heads image of each task's effects, its top-k heads circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rankings), figsize=(4 + 2.5 * len(rankings), 6),
                             squeeze=False)
    for ax, ranking in zip(axes[0], rankings, strict=True):
        grid = ranking.effects.reshape(-1, ranking.num_heads)
        # Harmful is red whichever way the metric points.
        shown = grid if ranking.higher_is_better else -grid
        limit = float(np.abs(shown).max()) or 1.0
        image = ax.imshow(shown, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto",
                          interpolation="nearest")
        for head in ranking.top(top_k):
            ax.scatter(head.head, head.layer, s=80, facecolors="none", edgecolors="black",
                       linewidths=1.5)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{ranking.task} ({ranking.metric})", fontsize=9)
        fig.colorbar(image, ax=ax, shrink=0.8,
                     label="score change on knockout" + ("" if ranking.higher_is_better
                                                         else " (sign flipped)"))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
