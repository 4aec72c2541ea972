"""A planted-sparse simulator of knockout measurements: the yardstick for recovery methods.

It stands in for "evaluate the model on ``n_examples`` documents with these heads knocked
out", so that a design or an estimator can be compared on how many
measurements it needs before it costs any model time. The package's own
:func:`~lm_eval_headloc.method.designs.design_matrix` and
:class:`~lm_eval_headloc.method.lasso.HeadLasso` do the work; this module supplies the world
and the bookkeeping, numpy in and out, ``np.random.default_rng`` randomness throughout
(the same seed gives the same world, design, scores and answer).

The world (:func:`planted_world`) is shaped after what the embedded SmolLM2-135M shows on
``headloc_induction`` (README: baseline 0.57; one head alone takes it to 0.12, two to
0.03, the top five to 0.00-0.04; at p = 0.1, 27 of 270 heads per mask, the accuracy
collapses and recovery gets worse, not better):

- **Planted heads**: ``k_true`` (5) heads whose single knockouts drop the accuracy by
  amounts drawn log-uniformly in ``planted_drops`` (0.08-0.45: from "well above one
  measurement's noise" up to the embedded model's strongest head). They are the world's
  exhaustive single-head top-5, the truth a run is scored against.
- **Diffuse tail**: every other head has a small effect with heavy-tailed (log-normal)
  magnitude, a share ``tail_helpful`` of them helpful (knocking them out raises the score,
  as some heads do for IOI and arithmetic), capped at ``tail_cap`` × the weakest planted
  drop so the planted heads stay the top-5. Its size is ``tail_mass``, the net summed
  ``-log(1 − d_j)`` over the tail (``d_j``: the share of the above-floor headroom head
  ``j`` costs alone), which is independent of ``N``: a mask knocking out a fraction ``p``
  of the heads costs the same on average whatever the model's size. A bigger model
  spreads "everything else" over more heads, each mattering less, and collapses at the
  same *fraction* of heads knocked out, not the same number (the paper's typical p = 0.02
  on Llama-8B knocks out 20 of 1,024 heads per mask; had each of those heads the weight
  of one of SmolLM2's, where 27 collapse the task, such masks would sit near the floor,
  and their fits would not work as they do). The tail is what makes the
  intercept sit below the baseline and what the planted heads must be told apart from.
- **Floor and saturation** (``saturation``): how several knockouts combine. Every model
  reproduces each head's single-knockout effect exactly and keeps the accuracy in
  [floor, 1]; they differ in what happens when many heads are out.

  ``"logistic"`` (default): effects add in the logit of the share of the range
  [floor, 1] reached, the item-response model of "each document is answered correctly
  with a probability that is a logistic function of the circuit's strength". Near the
  baseline it is close to additive (what the Lasso assumes); with many heads out it
  flattens smoothly onto the floor, so large sparsities lose information gradually, as
  observed. ``"multiplicative"``: each knockout keeps a share ``1 − d_j`` of the
  headroom (independent necessary components): sub-additive from the second knockout
  on, but it never quite reaches the floor, so high sparsities keep information.
  ``"clip"``: additive (the Lasso's own model) until the floor, no information below it:
  the best case at moderate sparsity, the worst at high. With the
  default tail the mean accuracy of masks at p = 0.02 / 0.05 / 0.1 is about
  0.47 / 0.32 / 0.16 at every N (logistic): the collapse towards the floor at p = 0.1
  that the embedded model shows.
- **Noise** (``noise``): ``"binomial"`` (default): the score is the mean of
  ``n_examples`` (100) Bernoulli documents at that accuracy, Binomial(n, acc)/n, variance
  acc(1−acc)/n, drawn afresh for every measurement. ``"documents"``: a real run reuses
  one fixed subset of documents, so measuring the same mask twice gives the same score
  and its "noise" is how the documents happen to depend on the heads. Each of the
  ``n_examples`` documents has a fixed latent logit (the logistic model's ``start`` plus a
  standard logistic draw), a fixed chance of being right by guessing (probability
  ``floor``) and its own copy of every head's logit step, multiplied by a log-normal
  factor of shape ``heterogeneity`` and mean 1 (a head matters more for some documents
  than for others). A document is right under a mask when it guesses or its logit plus
  the knocked-out heads' steps is above 0, so the expected score is the logistic world's
  accuracy and nothing is drawn per measurement. The exhaustive one-at-a-time search is
  then a deterministic function of the world, as on the embedded model, and a head
  measured alone measures exactly its ground truth (:func:`measured_alone`).

``benchmarks/simulate_recovery.py`` prints the masks needed per ``N`` and sparsity
(``SIMULATION.md``), and the measurement-equivalents the confirming defaults need
(:func:`confirmed_masks_needed`), today's and those before (:data:`METHODS`).
It lives outside the package's core (nothing there imports it) and needs no torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from lm_eval_headloc.method.designs import design_matrix, knockouts_per_mask
from lm_eval_headloc.method.lasso import HeadLasso

__all__ = ["DEFAULT_BUDGETS", "NOISES", "SATURATIONS", "Documents", "NeededMasks", "Ranker",
           "SeedTrial", "World", "coverage_prediction", "hits_by_budget", "masks_needed",
           "planted_world", "recovered_top", "seed_trial", "simulate_scores"]

#: How a world turns many knockouts into one accuracy (see the module docstring).
SATURATIONS: tuple[str, ...] = ("multiplicative", "logistic", "clip")

#: How a measurement's noise arises (see the module docstring).
NOISES: tuple[str, ...] = ("binomial", "documents")

#: Budgets (masks) scanned by :func:`masks_needed`: ~10-20 % steps from 10 to 1,000,
#: including the recovery benchmark's 25, 40, 54, 80, 100 and 150.
DEFAULT_BUDGETS: tuple[int, ...] = (
    10, 15, 20, 25, 30, 35, 40, 47, 54, 62, 70, 80, 90, 100, 110, 120, 135, 150, 175, 200,
    230, 270, 320, 380, 450, 540, 640, 800, 1000,
)


#: An estimator under test: ``(design, scores) -> head columns, most harmful first``.
Ranker = Callable[[np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Documents:
    """The fixed documents of a ``noise="documents"`` world.

    ``logits[d]``: document ``d``'s logit with nothing knocked out; ``guessed[d]``: right
    whatever is knocked out (the floor); ``steps[d, j]``: what knocking out head ``j``
    adds to document ``d``'s logit.
    """

    logits: np.ndarray
    guessed: np.ndarray
    steps: np.ndarray

    def outcomes(self, design: np.ndarray) -> np.ndarray:
        """Whether each document is right under each mask: ``(masks, documents)``."""
        right = (self.logits + np.asarray(design, dtype=np.float64) @ self.steps.T) > 0
        return right | self.guessed

    def scores(self, design: np.ndarray) -> np.ndarray:
        """Share of the documents right under each mask (row of ``design``)."""
        return self.outcomes(design).mean(axis=1)

    def single_scores(self) -> np.ndarray:
        """:meth:`scores` of every head knocked out alone, without an N × N design."""
        return (((self.logits + self.steps.T) > 0) | self.guessed).mean(axis=1)


@dataclass(frozen=True)
class World:
    """A simulated model + task: what each head's knockout does to a 0..1 accuracy.

    ``effects[j]`` is the change of the accuracy when head ``j`` alone is knocked out (the
    exhaustive one-shot greedy ground truth; negative = harmful). ``planted`` holds the
    ``k_true`` planted heads, most harmful first; they are the ``k_true`` most negative
    effects. :meth:`accuracy` combines several knockouts per ``saturation``.
    ``documents``: the fixed documents of a ``noise="documents"`` world (else None).
    """

    effects: np.ndarray
    planted: np.ndarray
    baseline: float
    floor: float
    n_examples: int
    saturation: str = "logistic"
    params: Mapping[str, object] = field(default_factory=dict)
    documents: Documents | None = None

    @property
    def n_heads(self) -> int:
        return int(self.effects.shape[0])

    def accuracy(self, design: np.ndarray) -> np.ndarray:
        """Noise-free accuracy of each mask (row of ``design``), in [floor, 1]."""
        knocked = np.asarray(design, dtype=np.float64)
        if knocked.ndim != 2 or knocked.shape[1] != self.n_heads:
            raise ValueError(
                f"design must be (masks, {self.n_heads}), got shape {knocked.shape}"
            )
        if self.saturation == "clip":
            score = self.baseline + knocked @ self.effects
        elif self.saturation == "logistic":
            start, steps = self.logistic_steps()
            score = self.floor + (1.0 - self.floor) * _expit(start + knocked @ steps)
        else:
            headroom = self.baseline - self.floor
            # log(1 - d_j) with d_j = -effect_j / headroom < 1 (a single knockout never
            # reaches the floor); helpful heads have d_j < 0 and raise the headroom.
            log_keep = np.log1p(self.effects / headroom)
            score = self.floor + headroom * np.exp(knocked @ log_keep)
        return np.clip(score, self.floor, 1.0)

    def logistic_steps(self) -> tuple[float, np.ndarray]:
        """(logit with nothing knocked out, each head's logit step) of the logistic model:
        additive in the logit of the share of the range [floor, 1] reached, each step
        reproducing its head's single-knockout effect exactly."""
        span = 1.0 - self.floor
        start = float(_logit((self.baseline - self.floor) / span))
        return start, _logit((self.baseline + self.effects - self.floor) / span) - start


def _logit(share: np.ndarray | float) -> np.ndarray:
    share = np.clip(share, 1e-12, 1 - 1e-12)  # a helpful head may reach the ceiling
    return np.log(share) - np.log1p(-share)


def _expit(logit: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * logit))  # 1/(1+exp(-x)) without overflow


def _capped_to_mass(magnitude: np.ndarray, sign: np.ndarray, cap: float,
                    mass: float) -> np.ndarray:
    """Cap the magnitudes at ``cap``, then rescale the harmful ones (water-filling) so the
    net ``sign @ magnitude`` is ``mass`` again; as close as the cap allows if it cannot be.

    Without this the cap would quietly change the tail's mass at small N (the per-head
    mass is ``tail_mass / N``), making a small model's tail lighter than a big one's.
    """
    capped = np.minimum(magnitude, cap)
    harmful = sign > 0
    wanted = mass + float(capped[~harmful].sum())  # what the harmful heads must carry
    weights = magnitude[harmful]
    if weights.size == 0 or mass <= 0:
        return capped

    def carried(scale: float) -> float:
        return float(np.minimum(scale * weights, cap).sum())

    low, high = 0.0, 1.0
    while carried(high) < wanted and high < 1e12:
        low, high = high, 2.0 * high
    for _ in range(100):  # bisection on the scale: carried() is monotone in it
        middle = 0.5 * (low + high)
        if carried(middle) < wanted:
            low = middle
        else:
            high = middle
    capped[harmful] = np.minimum(high * weights, cap)
    return capped


def planted_world(
    n_heads: int,
    rng: np.random.Generator,
    *,
    k_true: int = 5,
    baseline: float = 0.57,
    floor: float = 0.02,
    planted_drops: tuple[float, float] = (0.08, 0.45),
    tail_mass: float = 8.0,
    tail_sigma: float = 1.0,
    tail_helpful: float = 0.2,
    tail_cap: float = 0.5,
    n_examples: int = 100,
    saturation: str = "logistic",
    noise: str = "binomial",
    heterogeneity: float = 1.0,
) -> World:
    """Draw a world with ``k_true`` planted heads and a diffuse tail (module docstring).

    ``baseline`` 0.57 and ``floor`` 0.02: the embedded model's induction accuracy with
    nothing and with its top heads knocked out. ``planted_drops``: accuracy lost by each
    planted head alone, log-uniform in this range (below ``baseline − floor``).
    ``tail_mass``: net summed ``-log(1 − d_j)`` of the tail. 8 calibrates the world to
    what the Lasso found on the embedded model at N = 270 (stratified, alpha 0.01; 50
    seeds here): 0.7 of 5 at 54 masks of p = 0.02 (the model: 0-1), 3.4 at 150 with half
    the seeds >= 4 (the model: >= 4 at ~150 in a run), 1.8 at 54 masks of p = 0.1 with
    the accuracy down to ~0.17 (the model: 1-2, the accuracy collapsing); 4 is
    optimistic, 12 pessimistic (SIMULATION.md). Kept
    exact by rescaling the harmful heads when the cap binds (at N = 270 a few dozen tail
    heads sit at the cap, at 5,120 none). ``tail_sigma``: log-normal
    shape of the tail magnitudes (1: the largest of 270 is ~10× the mean).
    ``tail_helpful``: share of tail heads whose knockout helps (< 0.5). ``tail_cap``: no
    tail head's single drop exceeds this × the weakest planted drop. ``noise`` and
    ``heterogeneity``: see the module docstring; the documents are drawn after the
    effects, so a seed's effects are the same under either noise. With fixed documents
    the Lasso alone at N = 270, scored against the exhaustive top-5 (20 seeds), finds
    0.6 of 5 at 54 masks of p = 0.02 and 3.5 at 150, and at 54 masks of p = 0.1 finds 2.1
    with ``heterogeneity`` 0.5 and 1.4 with 1.0, against RECOVERY.md's 2.4 (induction)
    and 1.2 (IOI) on the embedded model; 1.0, the harder, is the default.
    """
    if saturation not in SATURATIONS:
        raise ValueError(f"saturation={saturation!r}: must be one of {', '.join(SATURATIONS)}")
    if noise not in NOISES:
        raise ValueError(f"noise={noise!r}: must be one of {', '.join(NOISES)}")
    if noise == "documents" and saturation != "logistic":
        raise ValueError(f"noise='documents' needs saturation='logistic' (the per-document "
                         f"logistic model), got {saturation!r}")
    if not heterogeneity >= 0:
        raise ValueError(f"heterogeneity={heterogeneity}: must be >= 0")
    if not 0.0 <= floor < baseline <= 1.0:
        raise ValueError(f"need 0 <= floor < baseline <= 1, got floor={floor}, "
                         f"baseline={baseline}")
    headroom = baseline - floor
    low, high = planted_drops
    if not 0.0 < low <= high < headroom:
        raise ValueError(f"planted_drops={planted_drops}: need 0 < low <= high < "
                         f"baseline - floor = {headroom:g}")
    if not 1 <= k_true < n_heads:
        raise ValueError(f"k_true={k_true}: need 1 <= k_true < n_heads={n_heads}")
    if not 0.0 <= tail_helpful <= 1.0 or tail_mass < 0 or tail_sigma < 0 or tail_cap < 0:
        raise ValueError("tail_mass, tail_sigma, tail_cap must be >= 0 and tail_helpful "
                         "in [0, 1]")
    if n_examples < 1:
        raise ValueError(f"n_examples={n_examples}: must be >= 1")

    planted = rng.choice(n_heads, k_true, replace=False)
    drops = np.exp(rng.uniform(math.log(low), math.log(high), k_true))
    order = np.argsort(-drops, kind="stable")  # most harmful first
    planted, drops = planted[order], drops[order]

    tail = np.setdiff1d(np.arange(n_heads), planted)
    magnitude = rng.lognormal(0.0, tail_sigma, tail.size)
    helpful = rng.random(tail.size) < tail_helpful
    sign = np.where(helpful, -1.0, 1.0)
    # Scale so the tail's net log-damage, sum of -log(1 - d_j), is tail_mass; then cap.
    net = float(sign @ magnitude)
    if tail_mass > 0 and net <= 0:
        raise ValueError(f"tail_helpful={tail_helpful}: the tail has no net harm to scale "
                         "to tail_mass (need tail_helpful < 0.5)")
    magnitude *= tail_mass / net if tail_mass > 0 else 0.0
    cap = -math.log1p(-tail_cap * drops.min() / headroom)
    magnitude = _capped_to_mass(magnitude, sign, cap, tail_mass)
    # Harmful: keep exp(-m) of the headroom; helpful: the mirror image, gain exp(+m).
    log_keep = -sign * magnitude

    effects = np.empty(n_heads)
    effects[tail] = headroom * np.expm1(log_keep)
    effects[planted] = -drops
    params = dict(n_heads=n_heads, k_true=k_true, baseline=baseline, floor=floor,
                  planted_drops=planted_drops, tail_mass=tail_mass, tail_sigma=tail_sigma,
                  tail_helpful=tail_helpful, tail_cap=tail_cap, n_examples=n_examples,
                  saturation=saturation, noise=noise)
    world = World(effects, planted, float(baseline), float(floor), int(n_examples),
                  saturation, params)
    if noise == "binomial":
        return world
    params["heterogeneity"] = heterogeneity
    start, steps = world.logistic_steps()
    # A standard logistic draw: P(start + g > 0) = expit(start), the baseline share.
    uniform = rng.uniform(size=n_examples)
    logits = start + np.log(uniform) - np.log1p(-uniform)
    factor = np.exp(heterogeneity * rng.standard_normal((n_examples, n_heads))
                    - heterogeneity ** 2 / 2)
    documents = Documents(logits, rng.random(n_examples) < floor, steps * factor)
    return World(effects, planted, float(baseline), float(floor), int(n_examples),
                 saturation, params, documents)


def simulate_scores(world: World, design: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Measured score of each mask: Binomial(n_examples, accuracy) / n_examples, or with
    fixed documents their share right (``rng`` then unused: nothing is drawn)."""
    if world.documents is not None:
        return world.documents.scores(design)
    accuracy = world.accuracy(design)
    return rng.binomial(world.n_examples, accuracy) / world.n_examples


def recovered_top(
    world: World, design: np.ndarray, scores: np.ndarray, top: int = 5, alpha: float = 0.01,
    rank: Ranker | None = None,
) -> int:
    """How many planted heads the fit's ``top`` most harmful heads hold.

    The fit is the package's: :class:`HeadLasso` with standardised scores and a fitted
    intercept (no baseline), ranked most negative first. ``rank`` replaces it with another
    estimator (then ``alpha`` is unused), so a new method is scored on the same worlds.
    """
    if rank is None:
        found = HeadLasso(alpha=alpha).fit(design, scores).ranking()[:top]
    else:
        found = np.asarray(rank(design, scores))[:top]
    return int(np.intersect1d(found, world.planted).size)


@dataclass(frozen=True)
class SeedTrial:
    """One seed's world, design (at the largest budget) and scores; prefixes are budgets."""

    world: World
    design: np.ndarray
    scores: np.ndarray


def seed_trial(
    n_heads: int, sparsity: float, seed: int, max_masks: int, *, kind: str = "stratified",
    world_options: Mapping[str, object] | None = None,
) -> SeedTrial:
    """World, design and scores of one seed.

    The seed's :class:`numpy.random.SeedSequence` is split three ways (world, design,
    noise), so the world depends only on ``(n_heads, seed, world_options)``: every
    sparsity and budget of a seed faces the same world (common random numbers, so
    comparisons between settings are not blurred by drawing new worlds). The first ``M``
    rows of the design are what ``design_matrix(kind, M, …)`` with the same seed gives
    (the package's designs are drawn row by row; benchmarks/tests/test_simulation.py checks
    it), so a budget ``M`` is the prefix: a user who measured ``M`` masks of this run.
    """
    world_seq, design_seq, noise_seq = np.random.SeedSequence(seed).spawn(3)
    world = planted_world(n_heads, np.random.default_rng(world_seq), **(world_options or {}))
    design_seed = int(design_seq.generate_state(1)[0])
    design = design_matrix(kind, max_masks, n_heads, sparsity, design_seed)
    scores = simulate_scores(world, design, np.random.default_rng(noise_seq))
    return SeedTrial(world, design, scores)


def hits_by_budget(
    n_heads: int, sparsity: float, budgets: Sequence[int], seeds: Sequence[int], *,
    kind: str = "stratified", alpha: float = 0.01, top: int = 5,
    world_options: Mapping[str, object] | None = None, rank: Ranker | None = None,
) -> np.ndarray:
    """``(len(seeds), len(budgets))`` planted heads found in the top ``top`` (every cell fit)."""
    budgets = [int(b) for b in budgets]
    hits = np.zeros((len(seeds), len(budgets)), dtype=np.int64)
    for row, seed in enumerate(seeds):
        trial = seed_trial(n_heads, sparsity, seed, max(budgets), kind=kind,
                           world_options=world_options)
        for col, masks in enumerate(budgets):
            hits[row, col] = recovered_top(trial.world, trial.design[:masks],
                                           trial.scores[:masks], top, alpha, rank)
    return hits


@dataclass(frozen=True)
class NeededMasks:
    """Result of :func:`masks_needed`.

    ``masks``: the smallest budget that met the target at the best sparsity, or ``None``
    if no budget on the grid did at any sparsity. ``sparsity``: the sparsity giving it
    (the smallest such if several tie; the first sparsity tried when ``masks`` is None).
    ``by_sparsity``: each sparsity's smallest budget (or None). ``success``: for each
    sparsity, ``{budget: share of seeds meeting the target}`` for the budgets scanned (a
    budget's share is over the seeds fitted before the outcome was certain).
    """

    masks: int | None
    sparsity: float
    by_sparsity: dict[float, int | None]
    success: dict[float, dict[int, float]]


def masks_needed(
    n_heads: int, *, sparsity: float | Sequence[float] = 0.02,
    budgets: Sequence[int] = DEFAULT_BUDGETS, seeds: Sequence[int] = range(50),
    target_hits: int = 4, share: float = 0.8, kind: str = "stratified", alpha: float = 0.01,
    top: int = 5, world_options: Mapping[str, object] | None = None,
    rank: Ranker | None = None,
) -> NeededMasks:
    """Smallest budget on ``budgets`` where ≥ ``target_hits`` planted heads are in the
    top ``top`` for ≥ ``share`` of ``seeds``: the "masks needed for ≥ 4/5 in 80 % of
    seeds" of the recovery goal.

    Budgets are scanned upwards and the scan stops at the first that meets the target
    (a later, larger budget is not looked at, so the answer is "first success", not a
    monotone fit). Within a budget, seeds stop being fitted as soon as the outcome is
    certain (too many failures, or enough successes), which makes budgets far from the
    threshold cheap. Several sparsities: each is scanned, the best (fewest masks) wins.
    ``rank``: another estimator than the package's Lasso (:func:`recovered_top`).
    ``None`` (no budget on the grid suffices) is the sentinel for "more than
    ``max(budgets)``".
    """
    sparsities = [float(sparsity)] if np.ndim(sparsity) == 0 else [float(s) for s in sparsity]
    budgets = sorted({int(b) for b in budgets})
    seeds = list(seeds)
    if not sparsities or not budgets or not seeds:
        raise ValueError("need at least one sparsity, one budget and one seed")
    if not 0.0 < share <= 1.0:
        raise ValueError(f"share={share}: must be in (0, 1]")
    required = math.ceil(share * len(seeds) - 1e-9)
    by_sparsity: dict[float, int | None] = {}
    success: dict[float, dict[int, float]] = {}
    for p in sparsities:
        # Built lazily and grown by doubling (budgets are prefixes, so a longer trial
        # extends a shorter one): a seed never fitted costs nothing, and memory stays
        # near what the scan reaches (50 seeds × 5,120 heads × 1,000 masks is 256 MB).
        trials: dict[int, SeedTrial] = {}
        by_sparsity[p], success[p] = None, {}
        for masks in budgets:
            met = failed = 0
            for seed in seeds:
                if seed not in trials or trials[seed].scores.shape[0] < masks:
                    length = min(budgets[-1], 2 * masks)
                    trials[seed] = seed_trial(n_heads, p, seed, length, kind=kind,
                                              world_options=world_options)
                trial = trials[seed]
                hits = recovered_top(trial.world, trial.design[:masks], trial.scores[:masks],
                                     top, alpha, rank)
                if hits >= target_hits:
                    met += 1
                else:
                    failed += 1
                if met >= required or failed > len(seeds) - required:
                    break
            success[p][masks] = met / (met + failed)
            if met >= required:
                by_sparsity[p] = masks
                break
    found = {p: m for p, m in by_sparsity.items() if m is not None}
    if not found:
        return NeededMasks(None, sparsities[0], by_sparsity, success)
    best = min(found, key=lambda p: (found[p], p))
    return NeededMasks(found[best], best, by_sparsity, success)


def coverage_prediction(n_heads: int, sparsity: float) -> float:
    """The coverage rule ``M ≈ (1 + 0.75·ln k)/p`` with ``k`` heads per mask: enough
    masks that each head is knocked out about ``1 + 0.75·ln k`` times.

    ``p`` is taken as ``k/N`` (the design's real rate after rounding ``k``).
    """
    k = knockouts_per_mask(sparsity, n_heads)
    return (1.0 + 0.75 * math.log(k)) * n_heads / k


# --- the defaults: an attribution prior, a screen of masks and confirmation ------------


