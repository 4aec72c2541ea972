"""The defaults simulated: an attribution prior, a screen of masks, confirmation and the
group tests, run on ``simulation``'s planted worlds (what ``benchmarks/budget_split.py`` and
``benchmarks/simulate_recovery.py`` compare budgets and methods with)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from headloc_bench.simulation import DEFAULT_BUDGETS, SeedTrial, World, seed_trial
from lm_eval_headloc.method.budget import PRIOR_ALLOWANCE, budget_split
from lm_eval_headloc.method.confirm import (
    ROUND,
    Screen,
    alternated,
    confirmation,
    prior_rankings,
    prior_weights,
    screen,
)
from lm_eval_headloc.method.group_tests import group_testing
from lm_eval_headloc.method.locate_loop import plan_groups
from lm_eval_headloc.method.rank import confirmed_order

__all__ = ["METHODS", "METHOD_PRIOR", "PRIOR_POINTS", "confirmed_masks_needed", "confirmed_split",
           "confirming_run", "confirming_run_top", "exhaustive_top", "grouped_run_top",
           "measured_alone", "simulated_prior"]


#: The confirming methods the simulator runs. ``"defaults"``: today's (``--prior auto``,
#: which is atp-path: two rankings, the clean run's and the half-ablated run's; then the
#: budget split as ``budget.budget_split`` splits it, 12 masks at p = 0.1 and 34 heads
#: confirmed at M = 54, picked in rounds of ``confirm.ROUND``, the screen refitted after
#: each round with the measured heads held fixed). ``"before"``: the defaults until then
#: (``--prior atp``, one ranking; the rest of the budget halved, 25 + 25 at M = 54, every
#: head to confirm picked up front, the prior's and the plain fit's in turn).
METHODS: tuple[str, ...] = ("defaults", "before")


#: Each method's ``--prior``: its allowance is ``budget.PRIOR_ALLOWANCE``'s.
METHOD_PRIOR: dict[str, str] = {"defaults": "atp-path", "before": "atp"}


#: Rankings (path points) each method's prior gives (``prior.PRIOR_POINTS``; a test
#: checks, as the prior module needs torch and this one does not).
PRIOR_POINTS: dict[str, int] = {"defaults": 2, "before": 1}


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: must be one of {', '.join(METHODS)}")


def simulated_prior(world: World, rng: np.random.Generator, *, noise: float = 0.7,
                    miss: float = 0.2, additive: float = 0.0, points: int = 1,
                    shared_misses: bool = False) -> np.ndarray:
    """An attribution-patching-like estimate of every head's single-knockout effect at
    each of ``points`` path points: a ``(points, N)`` array.

    At each point, each head's effect times ``exp(noise · z)`` (a linear approximation is
    off by a factor, not by a fixed amount); each planted head independently, with
    probability ``miss``, a false negative (its estimate shrunk to 2 %: attention that
    saturates hides the head from the gradient, as L16H0 of the embedded model's induction
    task, ranked 257th of 270); plus ``additive`` × the weakest planted drop × a standard
    normal, an error that does not shrink with the tail's heads (0: none). On the embedded
    model the exhaustive top-5 of two tasks stood at ranks 1, 2, 3, 10, 257 and 1, 2, 4,
    5, 43 (the clean run's ranking).

    Assumption: every point draws its own noise and its own false negatives,
    independently of the others, so a head is missed by all points with probability
    ``miss ** points``. The embedded model suggests it (the clean run ranks induction's
    strongest head 257th and the half-ablated run 6th; arithmetic's second head 15th
    and 227th), but two tasks are no proof: where real misses correlate between points,
    the second point finds less than simulated here, and these numbers are optimistic.
    ``shared_misses``: the opposite extreme, every point misses point 0's heads (its
    noise stays its own), to bound what the assumption is worth. The points are drawn
    one after the other from ``rng`` (the same draws either way), so point 0 is what a
    one-point prior from the same ``rng`` gives.
    """
    if points < 1:
        raise ValueError(f"points={points}: must be >= 1")
    weakest = float(-world.effects[world.planted].max())
    estimates = np.empty((points, world.n_heads))
    first_missed = None
    for point in range(points):
        estimate = world.effects * np.exp(noise * rng.standard_normal(world.n_heads))
        missed = world.planted[rng.random(world.planted.size) < miss]
        if shared_misses:
            first_missed = missed if first_missed is None else first_missed
            missed = first_missed
        estimate[missed] *= 0.02
        estimates[point] = estimate + additive * weakest * rng.standard_normal(world.n_heads)
    return estimates


def measured_alone(world: World, noise_seed: int) -> tuple[float, np.ndarray]:
    """(baseline score, every head's score change) with each head knocked out alone:
    the exhaustive one-at-a-time search on one fixed set of documents, whose top-5 (most
    negative changes) is the ground truth of RECOVERY.md. Drawn once per seed: a run that
    confirms a head measures what the exhaustive search measured (same documents, same
    mask), so both use these values."""
    if world.documents is not None:  # the same documents: nothing to draw
        base = float(world.documents.scores(np.zeros((1, world.n_heads)))[0])
        return base, world.documents.single_scores() - base
    rng = np.random.default_rng(noise_seed)
    base = rng.binomial(world.n_examples, world.baseline) / world.n_examples
    single = np.clip(world.baseline + world.effects, world.floor, 1.0)
    return base, rng.binomial(world.n_examples, single) / world.n_examples - base


def exhaustive_top(changes: np.ndarray, top: int = 5) -> np.ndarray:
    """The exhaustive search's ``top`` heads: most negative measured change first."""
    return np.argsort(changes, kind="stable")[:top]


def confirming_run_top(world: World, design: np.ndarray, scores: np.ndarray,
                       prior: np.ndarray | None, confirm: int, changes: np.ndarray, *,
                       method: str = "defaults", top: int = 5, alpha: float = 0.01,
                       logprob_changes: np.ndarray | None = None) -> np.ndarray:
    """A confirming run's top ``top`` (``method.locate_loop``'s ``_confirm`` and
    ``fit_rankings`` on one task): ``confirm`` heads measured alone (``changes``, from
    :func:`measured_alone`), picked by ``confirm.confirmation`` from the prior's rankings
    (``prior``: ``(points, N)`` estimates as :func:`simulated_prior` gives, or None;
    ``confirm.prior_rankings``) and the masks' screen (``confirm.screen``, its Lasso's
    penalty eased by the first point, ``confirm.prior_weights``), then ranked by measured
    change ahead of the screen's order (``rank.confirmed_order``).

    ``method="defaults"``: rounds of ``confirm.ROUND``, the screen refitted before each
    with the heads measured so far held fixed, and the final order's screen too.
    ``"before"``: the old up-front pick, the prior's rankings and the plain fit (nothing
    held fixed) in turn (``confirm.alternated``), and the final order's screen the same
    plain fit. ``world`` is not used (kept for the callers). ``logprob_changes``: each
    head's measured change of the gold log-likelihood, which breaks ties of ``changes``
    as a run's ranking does (``rank.rank_measured``; None: no tie-break but the index).
    """
    return confirming_run(design, scores, prior, confirm, changes, method=method, top=top,
                          alpha=alpha, logprob_changes=logprob_changes)[1]


def confirming_run(design: np.ndarray, scores: np.ndarray, prior: np.ndarray | None,
                   confirm: int, changes: np.ndarray, *, method: str = "defaults",
                   top: int = 5, alpha: float = 0.01,
                   logprob_changes: np.ndarray | None = None) -> tuple[list[int], np.ndarray]:
    """:func:`confirming_run_top`'s run: the heads it measures alone, in the order picked,
    and its top ``top``."""
    _check_method(method)
    weights = prior_weights(prior)

    def fitted(known: Mapping[int, tuple[float, float]]) -> Screen:
        return screen(design, scores, True, alpha=alpha, penalty_weights=weights,
                      fixed={h: change for h, (change, _) in known.items()})

    def measure(heads: list[int]) -> dict[int, tuple[float, float]]:
        return {h: (float(changes[h]),
                    0.0 if logprob_changes is None else float(logprob_changes[h]))
                for h in heads}

    sources = prior_rankings(prior)
    if method == "defaults":
        refit = fitted
        picked = confirmation({"task": sources}, {"task": lambda known: refit(known).order},
                              lambda heads: {"task": measure(heads)}, confirm,
                              round_size=ROUND).heads
    else:
        # With nothing held fixed the screen IS the old plain fit. Its order among the
        # Lasso's zero coefficients now follows the marginal contrast, where the old
        # HeadLasso.ranking() kept index order: only which zero-coefficient heads fill
        # the screen's late turns can differ, an accepted departure from the old code.
        plain = fitted({})

        def refit(_known: Mapping[int, tuple[float, float]]) -> Screen:
            return plain

        picked = alternated([*sources, plain.order], confirm)
    alone = measure(picked)
    # The screen matters only when fewer than ``top`` measured heads hurt.
    if sum(change < 0 for change, _ in alone.values()) >= top:
        return picked, np.asarray(confirmed_order(alone, (), higher_is_better=True)[:top])
    final = refit(alone)
    return picked, np.asarray(confirmed_order(alone, final.order, True, (), final.effects)[:top])


def grouped_run_top(world: World, design: np.ndarray, scores: np.ndarray,
                    prior: np.ndarray | None, confirm: int, group_tests: int,
                    changes: np.ndarray, *, top: int = 5, alpha: float = 0.01
                    ) -> np.ndarray:
    """A confirming run's top ``top`` with ``group_tests`` measurements more spent on the
    heads not measured alone (``method.locate_loop``'s group stage on one task):
    ``confirm`` heads measured alone as :func:`confirming_run` picks them, then
    ``group_tests.group_testing`` over the screen's implicated heads and the least covered
    (``group_tests.group_order``), groups sized by ``group_tests.group_size``, every set
    that is not ruled out halved (no predicted helper is taken apart: ``peeled``); a group is
    measured on ``world``'s documents (``noise="documents"`` only: a set's score is then a
    function of the set, as on a real model), a head it narrows down to reads ``changes``.
    The ranking: every head measured alone by its change, then the screen's."""
    if world.documents is None:
        raise ValueError("grouped_run_top needs a noise='documents' world")
    base = float(world.documents.scores(np.zeros((1, world.n_heads)))[0])
    picked, _ = confirming_run(design, scores, prior, confirm, changes, top=top, alpha=alpha)
    weights = prior_weights(prior)
    plan = plan_groups(design, scores, base, True, {int(h): float(changes[h]) for h in picked},
                       alpha=alpha, penalty_weights=weights, top_k=top)
    alone = {int(h): float(-changes[h]) for h in picked}  # harms
    known = {members: {"task": value} for members, value in plan.known.items()}

    def measure(sets: list[tuple[int, ...]]) -> dict[tuple[int, ...], dict[str, float]]:
        rows = np.zeros((len(sets), world.n_heads))
        for row, members in zip(rows, sets, strict=True):
            row[list(members)] = 1
        return {members: {"task": float(-changes[members[0]]) if len(members) == 1
                          else float(base - value)}
                for members, value in zip(sets, world.documents.scores(rows), strict=True)}

    tested = group_testing(plan.order, known, measure, group_tests, size=plan.size,
                           top_k=top)
    alone.update({s[0]: h["task"].value for s, h in tested.harms.items() if len(s) == 1})
    measured = {h: (-v, 0.0) for h, v in alone.items()}
    if sum(v > 0 for v in alone.values()) >= top:
        return np.asarray(confirmed_order(measured, (), True)[:top])
    final = screen(design, scores, True, alpha=alpha, penalty_weights=weights,
                   fixed={h: c for h, (c, _) in measured.items()})
    return np.asarray(confirmed_order(measured, final.order, True, (), final.effects)[:top])


def confirmed_split(budget: int, method: str = "defaults", use_prior: bool = True
                    ) -> tuple[int, int]:
    """(masks, heads confirmed) of a budget in measurement-equivalents, after the
    method's prior's allowance (``budget.PRIOR_ALLOWANCE``; none without a prior):
    ``"defaults"``, ``budget.budget_split`` (12 + 34 at 54); ``"before"``, the rest
    halved, masks rounded down (25 + 25 at 54)."""
    _check_method(method)
    prior = METHOD_PRIOR[method] if use_prior else "none"
    if method == "defaults":
        return budget_split(budget, prior)
    rest = budget - PRIOR_ALLOWANCE[prior]
    return rest // 2, rest - rest // 2


def confirmed_masks_needed(
    n_heads: int, *, sparsity: float = 0.1, budgets: Sequence[int] = DEFAULT_BUDGETS,
    seeds: Sequence[int] = range(50), target_hits: int = 4, share: float = 0.8,
    use_prior: bool = True, prior_options: Mapping[str, object] | None = None,
    world_options: Mapping[str, object] | None = None, top: int = 5,
    against: str = "exhaustive", method: str = "defaults",
) -> tuple[int | None, dict[int, float]]:
    """:func:`masks_needed` for a confirming ``method`` (:data:`METHODS`): the smallest
    budget (in measurement-equivalents, the prior's allowance included when it is used)
    whose run (:func:`confirmed_split`, :func:`confirming_run_top`) holds >= ``target_hits``
    of the truth's top ``top`` for >= ``share`` of ``seeds``, and each scanned budget's
    share of successful seeds. The prior has the method's ``PRIOR_POINTS``. The truth
    (``against``): ``"exhaustive"``, the one-at-a-time search on the same documents
    (:func:`measured_alone`, RECOVERY.md's ground truth), or ``"planted"``. A seed's
    world and masks are :func:`seed_trial`'s; its prior and its documents' draws for
    single knockouts come from further streams of the seed (the same for both methods:
    their first prior point is the same draw)."""
    if against not in ("exhaustive", "planted"):
        raise ValueError(f"against={against!r}: must be exhaustive or planted")
    _check_method(method)
    budgets = sorted({int(b) for b in budgets})
    required = math.ceil(share * len(seeds) - 1e-9)
    trials: dict[int, SeedTrial] = {}
    priors, changes, truths, success = {}, {}, {}, {}
    for budget in budgets:
        masks, confirm = confirmed_split(budget, method, use_prior)
        if min(masks, confirm) < 2:
            continue
        met = failed = 0
        for seed in seeds:
            if seed not in trials or trials[seed].scores.shape[0] < masks:
                trials[seed] = seed_trial(n_heads, sparsity, seed, 2 * masks,
                                          world_options=world_options)
                world = trials[seed].world
                prior_seq, alone_seq = np.random.SeedSequence(seed).spawn(5)[3:]
                priors[seed] = simulated_prior(world, np.random.default_rng(prior_seq),
                                               points=PRIOR_POINTS[method],
                                               **(prior_options or {}))
                changes[seed] = measured_alone(world, int(alone_seq.generate_state(1)[0]))[1]
                truths[seed] = (exhaustive_top(changes[seed], top) if against == "exhaustive"
                                else world.planted)
            trial = trials[seed]
            found = confirming_run_top(trial.world, trial.design[:masks],
                                       trial.scores[:masks],
                                       priors[seed] if use_prior else None, confirm,
                                       changes[seed], method=method, top=top)
            hits = np.intersect1d(found, truths[seed]).size
            met, failed = met + (hits >= target_hits), failed + (hits < target_hits)
            if met >= required or failed > len(seeds) - required:
                break
        success[budget] = met / (met + failed)
        if met >= required:
            return budget, success
    return None, success
