"""Attribution patching (AtP): every head's knockout effect estimated from one gradient.

Knocking head ``h`` out replaces its slice ``z_h`` of the attention output projection's
input by ``t_h`` (``hooks``: zero, its mean or a donor's output, per the ablation kind).
To first order that changes a differentiable score ``S`` by ``(t_h - z_h) · dS/dz_h``,
summed over positions: one forward and one backward pass give the estimate for every
head at once (Nanda 2022; Kramár et al. 2024, "AtP*"). ``S`` here is the logprob signal
(``signals``), written as a weighted sum of the requests' log-likelihoods with weights
``dS/dll`` (``signals.signal_weights``), so the backward pass needs only the scored
tokens' log-probabilities.

A first-order estimate misses what saturates: a head whose removal matters only once
its attention pattern is gone, or whose job another head takes over, can look harmless
(AtP's known false negatives). Taking the gradient again part of the way to the ablated
run (``at``, as integrated gradients and EAP-IG do along that path) sees some of them.
Use the estimates to focus measurements, never to rule a head out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .confirm import PRIOR_EASE, prior_penalty_weights  # re-exported; numpy-only there
from .multimask import LoglikelihoodRequests, logits_only_at

__all__ = ["PRIOR_EASE", "PRIOR_POINTS", "attribution_effects", "measured_attribution",
           "path_point", "prior_penalty_weights"]

#: --prior's attribution methods: the points of the path from the clean run to the run
#: with every head ablated where each takes a gradient (``attribution_effects``' ``at``).
#: Each point ranks the heads on its own: averaged, a point that sees a head is diluted
#: by one that cannot (on the embedded model, the clean run ranks induction's strongest
#: head 257th of 270 and the half-ablated run 6th, while arithmetic's second head goes the
#: other way, 15th and 227th).
PRIOR_POINTS: dict[str, tuple[float, ...]] = {"atp": (0.0,), "atp-path": (0.0, 0.5)}

Request = tuple[str, str]


def attribution_effects(lm: Any, requests: LoglikelihoodRequests,
                        weights: Mapping[Request, float], batch_size: int = 32,
                        at: float = 0.0) -> np.ndarray:
    """AtP estimate of how ``sum_r weights[r] * ll(r)`` changes when each head is knocked
    out alone: a ``(layers * heads_per_layer,)`` array in flat head order.

    ``at``: where on the path from the clean run (0) to the run with every head ablated
    (1) the gradient is taken. At 0 this is AtP; at ``a`` > 0 every head's slice ``z``
    is first moved ``a`` of the way to its ablated value ``t`` (``z + a (t − z)``) and
    each head's estimate is ``(t − z) · dS/dz`` there: the integrand of integrated
    gradients (EAP-IG) at that point, which sees heads whose effect the clean run's
    saturated gradient hides.

    ``weights`` are the signal's derivatives by each request's log-likelihood at that
    point (``signals.signal_weights`` of the answers measured inside ``path_point``).
    ``lm`` is an ``HFHeadAblateLM``; its current ``intervention`` (usually none) stays in
    place, so the estimate is taken around the model as it is measured.
    """
    knockout = lm.knockout
    model = lm.model
    per_layer = knockout.heads_per_layer
    effects = torch.zeros(knockout.num_layers, per_layer, dtype=torch.float64)
    # Per layer, in forward order: the slices the projection sees (the gradient's target)
    # and how far knocking each head out would move them.
    captured: list[torch.Tensor] = []
    moves: list[torch.Tensor] = []

    def needs_grad(_module: Any, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        # Frozen weights (a PEFT base model) would leave no graph to differentiate.
        return output if output.requires_grad else output.detach().requires_grad_(True)

    handle = model.get_input_embeddings().register_forward_hook(needs_grad)
    try:
        for batch in requests.batches(batch_size):
            row_weights = torch.tensor([float(weights.get(key, 0.0)) for key in batch.keys],
                                       dtype=torch.float64)
            if not row_weights.any():
                continue
            with torch.enable_grad(), path_point(lm, at, captured, moves), \
                    lm.forward_pass(batch.input_ids, always_donors=True):
                # After the donors' own pass, which these hooks also saw.
                captured.clear()
                moves.clear()
                if requests.narrow:
                    with logits_only_at(model, batch.rows, batch.positions):
                        logits = model(batch.input_ids).logits[0]
                else:
                    logits = model(batch.input_ids).logits[batch.rows, batch.positions]
                # At least float32 (half-precision logits), float64 for a float64 model.
                logprobs = F.log_softmax(
                    logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
                token_logprob = logprobs.gather(
                    1, batch.targets.to(logprobs.device)[:, None])[:, 0]
                per_token = row_weights.to(logprobs)[batch.rows.to(logprobs.device)]
                objective = (token_logprob * per_token).sum()
                grads = torch.autograd.grad(objective, captured, allow_unused=True)
            for layer, (moved, grad) in enumerate(zip(moves, grads, strict=True)):
                if grad is None:
                    continue
                change = moved.double() * grad.double().unflatten(-1, (per_layer, -1))
                effects[layer] += change.sum(dim=tuple(range(change.dim() - 2)) + (-1,)).cpu()
    finally:
        handle.remove()
        captured.clear()
        moves.clear()
    return effects.flatten().numpy()


def measured_attribution(measure: Any, points: Sequence[float] = (0.0,)
                         ) -> dict[str, np.ndarray]:
    """Attribution patching for a ``measure.HarnessMeasurement``: each task's estimated
    change of its logprob signal from knocking out each head, a ``(len(points), heads)``
    array: per path point (``attribution_effects``' ``at``) a forward pass for the
    answers there and a forward and backward pass over the gold answers' requests
    (whatever signal the run measures). Decoder-only models (``scored_positions_apply``)
    only."""
    from .multimask import loglikelihoods_for_masks, scored_positions_apply
    from .signals import signal_weights

    lm = measure.lm
    if not scored_positions_apply(lm):
        raise ValueError("the attribution prior needs a decoder-only model without a "
                         "prompt-learning adapter")
    golds = measure.gold_answers()
    requests = measure.requests() if measure.signal == "logprob" else LoglikelihoodRequests(
        lm, [key for gold in golds for key in gold.requests])
    batch_size = measure.resolved_batch_size()
    effects: dict[str, list[np.ndarray]] = {name: [] for name, _ in measure.tasks}
    # The prior is of the unablated model, whatever heads the model was set to.
    with lm.knocking_out([]):
        for at in points:
            # The signal's weights are its derivatives at this point's own answers.
            with path_point(lm, at):
                answers = loglikelihoods_for_masks(lm, requests, [[]], batch_size)[0]
            for name, _ in measure.tasks:
                weights = signal_weights(golds, answers, measure.leaves_of[name])
                effects[name].append(attribution_effects(lm, requests, weights,
                                                         batch_size, at=at))
    return {name: np.stack(rows) for name, rows in effects.items()}


@contextlib.contextmanager
def path_point(lm: Any, at: float, captured: list[torch.Tensor] | None = None,
               moves: list[torch.Tensor] | None = None) -> Iterator[None]:
    """Inside, every forward pass run under ``lm.forward_pass`` sees each head's slice
    ``z`` moved ``at`` of the way to its ablated value ``t`` (``z + at (t − z)``; 0: the
    clean run), and appends, per layer
    in forward order, the slices the projection sees to ``captured`` and ``t − z`` to
    ``moves`` when given."""
    at = float(at)
    if not 0.0 <= at < 1.0:
        raise ValueError(f"at={at!r}: a point on the path from the clean run (0) towards "
                         "the ablated one, in [0, 1)")
    knockout = lm.knockout
    per_layer = knockout.heads_per_layer

    def hook_for(layer: int) -> Any:
        def to_path_point(_module: Any, args: tuple) -> tuple | None:
            active = knockout.active
            if active is None:  # outside a pass, or resample's clean pass for the donors
                return None
            z = args[0].unflatten(-1, (per_layer, -1))
            # What a knocked-out slice becomes is r + s·(z − r) (hooks.py): r = 0 for
            # zero ablation, the mean, or the donor's; knocking out moves it (1 − s)(r − z).
            replacement = knockout.replacement(layer, z.detach())
            # Live, so that gradients reaching earlier layers pass through the point.
            moved = (1.0 - active.scale) * (-z if replacement is None else replacement - z)
            point = (z + at * moved).flatten(-2) if at else args[0]
            if captured is not None:
                captured.append(point)
            if moves is not None:
                moves.append(moved.detach())
            return (point, *args[1:])
        return to_path_point

    handles = [module.register_forward_pre_hook(hook_for(layer))
               for layer, module in enumerate(knockout.modules)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
