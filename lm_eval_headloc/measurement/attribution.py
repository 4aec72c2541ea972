"""Attribution patching (AtP): every head's (or MLP neuron's) knockout effect estimated
from one gradient.

Knocking head ``h`` out replaces its slice ``z_h`` of the attention output projection's
input by ``t_h`` (``hooks``: zero, its mean or a donor's output, per the ablation kind).
To first order that changes a differentiable score ``S`` by ``(t_h - z_h) · dS/dz_h``,
summed over positions: one forward and one backward pass give the estimate for every
head at once (Nanda 2022; Kramár et al. 2024, "AtP*"). A neuron is the same one feature
wide on the MLP output projection's input (``kind="neurons"``): the gradient there is the
knowledge-neuron attribution's (Dai et al. 2022), taken towards the model's own ablated
value. ``S`` here is the logprob signal (``signals``), written as a weighted sum of the
requests' log-likelihoods with weights ``dS/dll`` (``signals.signal_weights``), so the
backward pass needs only the scored tokens' log-probabilities.

A first-order estimate misses what saturates: a head whose removal matters only once
its attention pattern is gone, or whose job another head takes over, can look harmless
(AtP's known false negatives). Taking the gradient again part of the way to the ablated
run (``at``, as integrated gradients and EAP-IG do along that path) sees some of them.
Use the estimates to focus measurements, never to rule a head out.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lm_eval_headloc.intervention.hooks import KINDS
from lm_eval_headloc.intervention.multimask import (
    LoglikelihoodRequests,
    ScoredBatch,
    logits_only_at,
)
from lm_eval_headloc.measurement.sizing import is_out_of_memory

log = logging.getLogger(__name__)

__all__ = ["IG_STEPS", "PRIOR_POINTS", "attribution_effects", "ig_points",
           "measured_attribution", "path_point"]

#: Steps of the ``"ig"`` prior's midpoint rule (knowledge neurons and CNL take ~20 left
#: Riemann steps; the midpoint rule's error falls with the square of the step).
IG_STEPS = 8


def ig_points(steps: int = IG_STEPS) -> tuple[float, ...]:
    """The midpoints of ``steps`` equal steps of the path from the clean run to the
    ablated one: averaged there, the integrand is integrated gradients' midpoint rule."""
    return tuple((step + 0.5) / steps for step in range(steps))


#: --prior's attribution methods, one entry per ranking they give: a point of the path
#: from the clean run to the run with every unit ablated where the gradient is taken
#: (``attribution_effects``' ``at``), or a tuple of points whose estimates are averaged
#: into one ranking. Each point of atp-path ranks the heads on its own: averaged, a point
#: that sees a head is diluted by one that cannot (on the embedded model, the clean run
#: ranks induction's strongest head 257th of 270 and the half-ablated run 6th, while
#: arithmetic's second head goes the other way, 15th and 227th). ``"ig"`` is integrated
#: gradients (EAP-IG; knowledge neurons and CNL for MLP neurons): the integrand averaged
#: over ``IG_STEPS`` midpoints, whose sum over every unit is the effect of ablating them
#: all; it costs a forward pass and a forward and backward pass per point
#: (``budget.PRIOR_ALLOWANCE`` sets atp's allowance aside per point).
PRIOR_POINTS: dict[str, tuple[float | tuple[float, ...], ...]] = {
    "atp": (0.0,), "atp-path": (0.0, 0.5), "ig": (ig_points(),)}

Request = tuple[str, str]


def _site(knockout: Any, kind: str) -> tuple[dict[int, torch.nn.Module], int]:
    """The hooked projections of ``kind`` by layer (every layer that has the kind) and
    its units per layer."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: must be one of {', '.join(KINDS)}")
    units = knockout.heads_per_layer if kind == "heads" else knockout.neurons_per_layer
    return dict(zip(knockout.site_layers(kind), knockout.site_modules([kind]),
                    strict=True)), units


def _carrying(lm: Any, kind: str) -> contextlib.AbstractContextManager:
    """Inside, ``lm``'s passes carry ``kind``'s ablated values (mean ablation's means,
    resample's donors), which the path and the estimates need: an intervention carries
    only the kinds it knocks out (heads when none), so one that knocks out nothing is
    swapped for a per-row mask over the heads and ``kind`` that knocks out nothing."""
    knockout, intervention = lm.knockout, lm.intervention
    if kind in knockout.kinds_of(intervention) or getattr(lm, "ablation", "zero") == "zero":
        return contextlib.nullcontext()
    if intervention.any_knocked_out:
        raise ValueError(f"the attribution of {kind} under {lm.ablation} ablation around a "
                         "model that knocks out only other components: its passes carry no "
                         f"ablated values of {kind}; attribute the unablated model")
    return lm.knocking_out(row_masks=torch.zeros(
        1, knockout.flat_width(["heads", kind]), dtype=torch.bool))


def _scored_logprobs(lm: Any, requests: LoglikelihoodRequests, batch: ScoredBatch, at: float,
                     kind: str, captured: list[torch.Tensor] | None = None,
                     moves: list[torch.Tensor] | None = None) -> torch.Tensor:
    """The scored tokens' log-probabilities (at least float32) of ``batch`` with every
    unit of ``kind`` at path point ``at`` (``path_point``), under the model's
    intervention; resample's donors are computed whether or not it knocks anything out,
    as the point needs them. Differentiable when grad is enabled."""
    model = lm.model
    with path_point(lm, at, captured, moves, kind=kind), \
            lm.forward_pass(batch.input_ids, always_donors=True):
        for kept in (captured, moves):  # after the donors' own pass
            if kept is not None:
                kept.clear()
        if requests.narrow:
            with logits_only_at(model, batch.rows, batch.positions):
                logits = model(batch.input_ids).logits[0]
        else:
            logits = model(batch.input_ids).logits[batch.rows, batch.positions]
    # At least float32 (half-precision logits), float64 for a float64 model.
    logprobs = F.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)),
                             dim=-1)
    return logprobs.gather(1, batch.targets.to(logprobs.device)[:, None])[:, 0]


def attribution_effects(lm: Any, requests: LoglikelihoodRequests,
                        weights: Mapping[Request, float], batch_size: int = 32,
                        at: float = 0.0, kind: str = "heads") -> np.ndarray:
    """AtP estimate of how ``sum_r weights[r] * ll(r)`` changes when each head (``kind``
    ``"heads"``) or MLP neuron (``"neurons"``) is knocked out alone: a ``(layers *
    units_per_layer,)`` array in flat order (``layer * units_per_layer + unit``; 0 in a
    hybrid model's layers without heads).

    ``at``: where on the path from the clean run (0) to the run with every unit of
    ``kind`` ablated (1) the gradient is taken. At 0 this is AtP; at ``a`` > 0 every
    unit's slice ``z`` is first moved ``a`` of the way to its ablated value ``t``
    (``z + a (t − z)``) and each unit's estimate is ``(t − z) · dS/dz`` there: the
    integrand of integrated gradients (EAP-IG) at that point, which sees units whose
    effect the clean run's saturated gradient hides.

    ``weights`` are the signal's derivatives by each request's log-likelihood at that
    point (``signals.signal_weights`` of the answers at it, ``measured_attribution``).
    ``lm`` is an ``HFHeadAblateLM``; its current ``intervention`` (usually none) stays in
    place, so the estimate is taken around the model as it is measured.
    """
    knockout = lm.knockout
    modules, per_layer = _site(knockout, kind)
    effects = torch.zeros(knockout.num_layers, per_layer, dtype=torch.float64)
    # Per layer, in forward order: the slices the projection sees (the gradient's target)
    # and how far knocking each unit out would move them.
    captured: list[torch.Tensor] = []
    moves: list[torch.Tensor] = []

    def needs_grad(_module: Any, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        # Frozen weights (a PEFT base model) would leave no graph to differentiate.
        return output if output.requires_grad else output.detach().requires_grad_(True)

    handle = lm.model.get_input_embeddings().register_forward_hook(needs_grad)
    try:
        with _carrying(lm, kind):
            for batch in requests.batches(batch_size):
                key_weights = torch.tensor(
                    [float(weights.get(key, 0.0)) for key in batch.keys], dtype=torch.float64)
                if not key_weights.any():
                    continue
                with torch.enable_grad():
                    token_logprob = _scored_logprobs(lm, requests, batch, at, kind,
                                                     captured, moves)
                    per_token = key_weights.to(token_logprob)[
                        batch.owners.to(token_logprob.device)]
                    objective = (token_logprob * per_token).sum()
                    grads = torch.autograd.grad(objective, captured, allow_unused=True)
                for layer, moved, grad in zip(modules, moves, grads, strict=True):
                    if grad is None:
                        continue
                    change = moved.double() * grad.double().unflatten(-1, (per_layer, -1))
                    effects[layer] += change.sum(
                        dim=tuple(range(change.dim() - 2)) + (-1,)).cpu()
    finally:
        handle.remove()
        captured.clear()
        moves.clear()
    return effects.flatten().numpy()


@torch.no_grad()
def _answers_at(lm: Any, requests: LoglikelihoodRequests, at: float, kind: str,
                batch_size: int) -> dict[Request, tuple[float, bool]]:
    """Every request's log-likelihood with the units of ``kind`` at path point ``at`` > 0
    (greediness, which no signal weight depends on, is not computed: False): the passes
    ``attribution_effects`` differentiates, ablated values and donors included, which
    the answers of ``multimask`` (masks of components) cannot express."""
    answers: dict[Request, tuple[float, bool]] = {}
    with _carrying(lm, kind):
        for batch in requests.batches(batch_size):
            token_logprob = _scored_logprobs(lm, requests, batch, at, kind).double().cpu()
            summed = torch.zeros(len(batch.keys), dtype=torch.float64).index_add(
                0, batch.owners.cpu(), token_logprob)
            answers.update((key, (value, False))
                           for key, value in zip(batch.keys, summed.tolist(), strict=True))
    return answers


class BackwardBatch:
    """Rows per forward and backward pass of the attribution, halved on running out of
    GPU memory (as lm-eval's own batch-size detection does) and kept halved for the
    passes after: a backward pass keeps every layer's activations, so at 8B a batch the
    measurements run at can exceed the memory left beside the weights."""

    def __init__(self, rows: int) -> None:
        self.rows = max(1, int(rows))

    def run(self, attribute: Any) -> np.ndarray:
        """``attribute(rows)``, retried at half the rows after each out-of-memory error
        (raised again at one row)."""
        while True:
            try:
                return attribute(self.rows)
            except RuntimeError as error:
                if self.rows == 1 or not is_out_of_memory(error):
                    raise
                self.rows //= 2
                log.warning("the attribution prior ran out of GPU memory; retrying with "
                            "%d rows per backward pass", self.rows)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()


def measured_attribution(measure: Any, points: Sequence[float | Sequence[float]] = (0.0,),
                         kind: str = "heads") -> dict[str, np.ndarray]:
    """Attribution patching for a ``measure.HarnessMeasurement``: each task's estimated
    change of its logprob signal from knocking out each head (``kind="heads"``) or MLP
    neuron (``"neurons"``), a ``(len(points), units)`` array in flat order.

    Each entry of ``points`` is one row: a path point (``attribution_effects``' ``at``),
    or a sequence of them whose estimates are averaged (integrated gradients,
    ``ig_points``). Per path point: the answers there (at the clean run, the measured
    ones: a forward pass) and a forward and backward pass over the gold answers' requests
    (whatever signal the run measures). Decoder-only models (``scored_positions_apply``)
    only."""
    from lm_eval_headloc.intervention.multimask import (
        loglikelihoods_for_masks,
        scored_positions_apply,
    )
    from lm_eval_headloc.measurement.signals import signal_weights

    lm = measure.lm
    _site(lm.knockout, kind)  # a bad kind fails before any pass
    if not scored_positions_apply(lm):
        raise ValueError("the attribution prior needs a decoder-only model without a "
                         "prompt-learning adapter")
    golds = measure.gold_answers()
    requests = measure.requests() if measure.signal == "logprob" else LoglikelihoodRequests(
        lm, [key for gold in golds for key in gold.requests])
    batch_size = measure.resolved_batch_size()
    backward = BackwardBatch(batch_size)
    effects: dict[str, list[np.ndarray]] = {name: [] for name, _ in measure.tasks}
    # The prior is of the unablated model, whatever components the model was set to.
    with lm.knocking_out([]):
        for point in points:
            path = np.atleast_1d(np.asarray(point, dtype=np.float64)).tolist()
            along: dict[str, list[np.ndarray]] = {name: [] for name, _ in measure.tasks}
            for at in path:
                # The signal's weights are its derivatives at this point's own answers.
                answers = (loglikelihoods_for_masks(lm, requests, [[]], batch_size)[0]
                           if at == 0.0 else _answers_at(lm, requests, at, kind, batch_size))
                for name, _ in measure.tasks:
                    weights = signal_weights(golds, answers, measure.leaves_of[name])
                    along[name].append(backward.run(functools.partial(
                        attribution_effects, lm, requests, weights, at=at, kind=kind)))
            for name, rows in along.items():
                effects[name].append(np.mean(rows, axis=0))
    return {name: np.stack(rows) for name, rows in effects.items()}


@contextlib.contextmanager
def path_point(lm: Any, at: float, captured: list[torch.Tensor] | None = None,
               moves: list[torch.Tensor] | None = None, kind: str = "heads"
               ) -> Iterator[None]:
    """Inside, every forward pass run under ``lm.forward_pass`` sees each unit of
    ``kind`` (heads, or MLP neurons) with its slice ``z`` moved ``at`` of the way to its
    ablated value ``t`` (``z + at (t − z)``; 0: the clean run), and appends, per layer
    in forward order, the slices the projection sees to ``captured`` and ``t − z`` to
    ``moves`` when given. The pass's intervention must carry ``kind``'s ablated values
    (``attribution_effects`` sees to it)."""
    at = float(at)
    if not 0.0 <= at < 1.0:
        raise ValueError(f"at={at!r}: a point on the path from the clean run (0) towards "
                         "the ablated one, in [0, 1)")
    knockout = lm.knockout
    modules, per_layer = _site(knockout, kind)

    def hook_for(layer: int) -> Any:
        def to_path_point(_module: Any, args: tuple) -> tuple | None:
            active = knockout.active
            if active is None:  # outside a pass, or resample's clean pass for the donors
                return None
            hidden, flat = knockout.with_rows(args[0])  # OPT's MLP: its rows back
            z = hidden.unflatten(-1, (per_layer, -1))
            # What a knocked-out slice becomes is r + s·(z − r) (hooks.py): r = 0 for
            # zero ablation, the mean, or the donor's; knocking out moves it (1 − s)(r − z).
            replacement = knockout.replacement(layer, z.detach(), kind)
            # Live, so that gradients reaching earlier layers pass through the point.
            moved = (1.0 - active.scale) * (-z if replacement is None else replacement - z)
            point = (z + at * moved).flatten(-2) if at else hidden
            if captured is not None:
                captured.append(point)
            if moves is not None:
                moves.append(moved.detach())
            return (point.flatten(0, 1) if flat else point, *args[1:])
        return to_path_point

    handles = [module.register_forward_pre_hook(hook_for(layer))
               for layer, module in modules.items()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
