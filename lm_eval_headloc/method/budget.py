"""The measurement budget: ``--masks`` and ``--confirm`` from a total, the prior's allowance
set aside (plain Python: ``RunSpec`` reads its defaults from here without loading the
method's numerics)."""

from __future__ import annotations

import math

from lm_eval_headloc.common import words

__all__ = ["ALL_ALONE_MASKS", "ALL_ALONE_UP_TO", "AUTO_CAP_SHARE", "DEFAULT_ALONE",
           "DEFAULT_BUDGET", "DEFAULT_MASKS", "MASK_SHARE", "PRIOR_ALLOWANCE", "budget_split",
           "cap_refusal", "default_split", "measurement_cap", "measures_all_alone"]


#: Measurement-equivalents (one measurement: a forward pass over the example subset) set
#: aside for the attribution prior, by ``--prior`` method. On the embedded model atp's
#: forward and backward pass cost 3.2-3.6 measurements; atp-path's two passes and a
#: forward for the answers at its second point 6.3-7.1 (RECOVERY.md times them).
#: ig (integrated gradients over ``attribution.IG_STEPS`` = 8 points, averaged) is allowed
#: atp's per point (not timed yet; a test keeps the 8 in step with IG_STEPS).
PRIOR_ALLOWANCE: dict[str, int] = {"none": 0, "atp": 4, "atp-path": 8, "ig": 4 * 8}


#: The defaults' budget in measurement-equivalents: atp-path's allowance, then masks and
#: heads measured alone.
DEFAULT_BUDGET = 54


#: The share of a budget, after the prior's allowance, spent on masks; the rest is heads
#: measured alone. With a prior, 12 of the default budget's 46: the prior's rankings name
#: most candidates, the masks' screen is one source in turn. Without one the screen names
#: every candidate, and a screen of 12 masks is too weak to name them: half the budget on
#: masks finds more of the exhaustive top-5 at the default budget than the prior's share,
#: on the embedded model's stored measurements and in the simulator at 1,024 heads
#: (docs/budget_split.md, ``python benchmarks/budget_split.py``).
MASK_SHARE: dict[bool, float] = {True: 12 / 46, False: 1 / 2}


def budget_split(total: int, prior: str = "atp-path", share: float | None = None
                 ) -> tuple[int, int]:
    """(masks, heads measured alone) of a budget of ``total`` measurement-equivalents:
    ``prior``'s allowance (``PRIOR_ALLOWANCE``) set aside, ``share`` of the rest in masks
    (default ``MASK_SHARE``'s, with a prior or without one for ``"none"``; rounded to the
    nearest, halves to even), the remainder measured alone."""
    if prior not in PRIOR_ALLOWANCE:
        raise ValueError(f"prior={prior!r}: must be one of {', '.join(PRIOR_ALLOWANCE)}")
    rest = int(total) - PRIOR_ALLOWANCE[prior]
    masks = round(rest * (MASK_SHARE[prior != "none"] if share is None else share))
    return masks, rest - masks


def default_split(prior: str | None) -> tuple[int, int]:
    """``--masks`` and ``--confirm`` where the user gives neither, for the prior the run
    computes (``attribution.PRIOR_POINTS``' key; None or ``"none"`` for none): without a prior
    the whole default budget split for none (27 + 27); with one, the split measured for
    atp-path (12 + 34), whichever it is (atp's and ig's allowances are estimates, not
    timings)."""
    return budget_split(DEFAULT_BUDGET, "none" if prior in (None, "none") else "atp-path")


#: The defaults' split with a prior: 12 masks, 34 heads measured alone.
DEFAULT_MASKS, DEFAULT_ALONE = default_split("atp-path")


#: --max-measurements auto: this share of the columns a run ranks (one-shot greedy's cost).
AUTO_CAP_SHARE = 0.5


def measurement_cap(max_measurements: int | str | None, columns: int) -> int:
    """``--max-measurements`` as a number for a run ranking ``columns`` components: auto
    (or None, left out) is ``AUTO_CAP_SHARE`` of them, rounded up."""
    if max_measurements in (None, "auto"):
        return max(1, math.ceil(columns * AUTO_CAP_SHARE))
    return int(max_measurements)


#: The masks of a default run that measures every head alone: the fewest the fit takes.
ALL_ALONE_MASKS = 2


def measures_all_alone(heads: int) -> bool:
    """Whether a default run ranking ``heads`` heads measures each one alone: where the
    automatic cap (``AUTO_CAP_SHARE`` of them) does not exceed the default plan's
    ``DEFAULT_BUDGET`` (up to 108 heads), that plan ends with no group test and not
    certified — simulated with the cap raised to the heads' count, none of 10 default runs
    was certified at 96 or 108 heads, at 48 each needed at least 55, and 4-8 of 10 had the
    exhaustive top-5 (SIMULATION.md, "certified") — while measuring every head alone costs
    the heads' count and ``ALL_ALONE_MASKS``: certified, and the exhaustive top-5 itself."""
    return measurement_cap(None, heads) <= DEFAULT_BUDGET


#: The most heads on which a default run measures every head alone (108).
ALL_ALONE_UP_TO = max(n for n in range(1, 4 * DEFAULT_BUDGET) if measures_all_alone(n))


def fixed_part(masks: int | str | None, confirm: int, allowance: int) -> int:
    """What a run measures whatever it finds: the prior's ``allowance``, its ``masks``
    (not counted with ``auto``) and the ``confirm`` heads it measures alone."""
    return allowance + (0 if masks in (None, "auto") else int(masks)) + int(confirm)


def cap_refusal(cap: int, masks: int | str | None, confirm: int, allowance: int,
                prior_known: bool = True) -> str | None:
    """Why ``--max-measurements cap`` is too small for a run's fixed part — the prior's
    ``allowance``, its ``masks`` (not counted with ``auto``) and the ``confirm`` heads it
    measures alone — or None where it is not. ``prior_known`` False: the prior is not
    decided yet (``--prior auto``), its allowance comes on top."""
    counted = 0 if masks in (None, "auto") else int(masks)
    fixed = fixed_part(masks, confirm, allowance)
    if cap >= fixed:
        return None
    parts = (f"{words.counted(counted, 'mask')} and {words.counted(int(confirm), 'head')} "
             "measured alone"
             + (f" with the prior's {allowance}" if allowance else "")
             + ("" if prior_known else " (and the prior's allowance, if it has one)"))
    return (f"--max-measurements {cap}: the run's {parts} take {fixed}; give at least "
            f"{fixed}, or fewer --masks or --confirm")
