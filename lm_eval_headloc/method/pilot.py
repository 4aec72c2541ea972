"""``--sparsity auto``: how many heads a mask should knock out, from a few pilot masks.

More heads per mask means more information per measurement, until the score sits at its
floor and stops telling masks apart (on the embedded model the copying task's accuracy
collapses with 27 of 270 heads out). The pilot measures ``PILOT_MASKS`` masks at each
sparsity of ``PILOT_SPARSITIES`` and one *floor* mask that knocks out half the heads,
then picks the largest sparsity whose masks keep, on average, at least ``KEEP`` of the
score's distance to that floor, for every task. The pilot masks (not the floor mask)
join the fit: they are knockouts like any other.

Pure functions of the seed and the scores, so a resumed run picks the same sparsity.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from lm_eval_headloc.common.checks import UsageError
from lm_eval_headloc.method.designs import design_matrix, knockouts_per_mask
from lm_eval_headloc.method.lasso import harm

__all__ = ["FLOOR_KEY", "FLOOR_SPARSITY", "KEEP", "PILOT_MASKS", "PILOT_SPARSITIES", "UNFITTED",
           "check_pilot_fits", "choose_sparsity", "levels_kept", "pilot_design"]

PILOT_SPARSITIES: tuple[float, ...] = (0.02, 0.05, 0.1, 0.2)
PILOT_MASKS = 2  # per sparsity
FLOOR_SPARSITY = 0.5
FLOOR_KEY = "pilot-floor"
#: A sparsity is informative when its masks keep this share of the distance to the floor.
KEEP = 0.5
#: Pilot measurements that are not design rows (the floor mask, last in the pilot).
UNFITTED = 1


def pilot_design(total_heads: int, seed: int, never_ablate: Sequence[int] = ()
                 ) -> tuple[list[str], list[float], np.ndarray]:
    """The pilot's masks: ``(keys, sparsity of each, matrix)``; the floor mask last.

    Sparsities giving the same number of heads per mask (small models) are measured once.
    """
    eligible = total_heads - len(set(never_ablate))
    keys, levels, rows, seen = [], [], [], set()
    for level in PILOT_SPARSITIES:
        per_mask = knockouts_per_mask(level, eligible)
        if per_mask in seen:
            continue
        seen.add(per_mask)
        own_seed = zlib.crc32(f"pilot-{seed}-{level}".encode())
        matrix = design_matrix("stratified", PILOT_MASKS, total_heads, level, own_seed,
                               never_ablate)
        for i, row in enumerate(matrix):
            keys.append(f"pilot-p{level:g}-{i}")
            levels.append(level)
            rows.append(row)
    floor = design_matrix("stratified", 1, total_heads, FLOOR_SPARSITY,
                          zlib.crc32(f"pilot-{seed}-floor".encode()), never_ablate)
    keys.append(FLOOR_KEY)
    levels.append(FLOOR_SPARSITY)
    rows.append(floor[0])
    return keys, levels, np.array(rows, dtype=bool)


def check_pilot_fits(design_rows: int, pilot: int, masks: int | str) -> None:
    """Refuse a design of ``design_rows`` masks (``masks``: the --masks asked, a count or
    auto, whose cap --max-masks is then) that the ``pilot`` measurements alone would fill:
    before they are measured, not once the design is left none."""
    if design_rows <= pilot:
        flag = "--max-masks" if masks == "auto" else "--masks"
        raise UsageError(f"{flag} {design_rows}: --sparsity auto's pilot alone takes "
                         f"{pilot} measurements; give more")


def choose_sparsity(levels: Sequence[float], keys: Sequence[str],
                    records: Mapping[str, Mapping[str, object]], tasks: Sequence[str]
                    ) -> tuple[float, dict[str, dict[str, float]]]:
    """The largest pilot sparsity whose masks keep ``KEEP`` of every task's distance to
    the floor mask's score (the smallest when none does), and each level's share kept."""
    baseline = records["baseline"]
    kept: dict[str, dict[str, float]] = {}
    for task in tasks:
        higher = bool(baseline["higher_is_better"][task])  # type: ignore[index]
        base = float(baseline["scores"][task])  # type: ignore[index]
        floor_harm = float(harm(float(records[FLOOR_KEY]["scores"][task]) - base, higher))
        for level in sorted({lv for lv in levels if lv != FLOOR_SPARSITY}):
            level_keys = [k for k, lv in zip(keys, levels, strict=True) if lv == level]
            mean_harm = float(np.mean([harm(float(records[k]["scores"][task]) - base, higher)
                                       for k in level_keys]))
            # No drop at the floor mask: nothing saturates, every level keeps it all.
            share = 1.0 if floor_harm <= 0 else 1.0 - mean_harm / floor_harm
            kept.setdefault(f"{level:g}", {})[task] = share
    informative = levels_kept(kept, KEEP)
    chosen = max(informative) if informative else min(float(level) for level in kept)
    return chosen, kept


def levels_kept(kept: Mapping[str, Mapping[str, float]], keep: float) -> list[float]:
    """The pilot levels whose masks kept ``keep`` of every task's distance (``kept``: per
    level, per task, the share kept): those ``choose_sparsity`` picks the largest of."""
    return [float(level) for level, shares in kept.items()
            if all(share >= keep for share in shares.values())]
