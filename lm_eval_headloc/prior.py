"""Attribution patching (AtP): every head's knockout effect estimated from one gradient.

Knocking head ``h`` out sets its slice ``z_h`` of the attention output projection's
input to zero (``hooks``). To first order that changes a differentiable score ``S`` by
``(0 - z_h) · dS/dz_h``, summed over positions: one forward and one backward pass give
the estimate for every head at once (Nanda 2022; Kramár et al. 2024, "AtP*"). ``S``
here is the logprob signal (``signals``), written as a weighted sum of the requests'
log-likelihoods with weights ``dS/dll`` (``signals.signal_weights``), so the backward
pass needs only the scored tokens' log-probabilities.

A first-order estimate misses what saturates: a head whose removal matters only once
its attention pattern is gone, or whose job another head takes over, can look harmless
(AtP's known false negatives). Use it to focus measurements, never to rule a head out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .multimask import LoglikelihoodRequests, logits_only_at

__all__ = ["PRIOR_EASE", "attribution_effects", "prior_penalty_weights"]

#: How much the prior eases the Lasso penalty of the head it finds most harmful: its
#: penalty is divided by 1 + PRIOR_EASE (others by less; harmless-looking heads keep 1).
PRIOR_EASE = 1.0

Request = tuple[str, str]


def attribution_effects(lm: Any, requests: LoglikelihoodRequests,
                        weights: Mapping[Request, float], batch_size: int = 32) -> np.ndarray:
    """AtP estimate of how ``sum_r weights[r] * ll(r)`` changes when each head is knocked
    out alone: a ``(layers * heads_per_layer,)`` array in flat head order.

    ``lm`` is an ``HFHeadAblateLM``; its current knockout (usually none) stays in place,
    so the estimate is taken around the model as it is measured.
    """
    knockout = lm.knockout
    model = lm.model
    per_layer, head_dim = knockout.heads_per_layer, knockout.head_dim
    effects = torch.zeros(knockout.num_layers, per_layer, dtype=torch.float64)
    captured: list[torch.Tensor] = []

    def keep_input(_module: Any, args: tuple) -> None:
        captured.append(args[0])

    def needs_grad(_module: Any, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        # Frozen weights (a PEFT base model) would leave no graph to differentiate.
        return output if output.requires_grad else output.detach().requires_grad_(True)

    handles = [module.register_forward_pre_hook(keep_input) for module in knockout.modules]
    handles.append(model.get_input_embeddings().register_forward_hook(needs_grad))
    try:
        for batch in requests.batches(batch_size):
            row_weights = torch.tensor([float(weights.get(key, 0.0)) for key in batch.keys],
                                       dtype=torch.float64)
            if not row_weights.any():
                continue
            with torch.enable_grad(), lm.donors_for(batch.input_ids, always=True):
                captured.clear()  # after the donors' own pass, which these hooks also saw
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
                # What a knocked-out slice z becomes is r + s·(z − r) (hooks.py), a change
                # of (1 − s)·(r − z): r = 0 for zero ablation, the mean, or the donor's.
                replaced = [knockout.replacement(layer, z.detach().unflatten(
                    -1, (per_layer, head_dim))) for layer, z in enumerate(captured)]
            for layer, (z, grad) in enumerate(zip(captured, grads, strict=True)):
                if grad is None:
                    continue
                z = z.detach().double().unflatten(-1, (per_layer, head_dim))
                moved = -z if replaced[layer] is None else replaced[layer].double() - z
                change = (1.0 - knockout.scale) * moved * grad.double().unflatten(
                    -1, (per_layer, head_dim))
                effects[layer] += change.sum(dim=tuple(range(change.dim() - 2)) + (-1,)).cpu()
    finally:
        for handle in handles:
            handle.remove()
        captured.clear()
    return effects.flatten().numpy()


def prior_penalty_weights(harm_estimates: np.ndarray, ease: float = PRIOR_EASE) -> np.ndarray:
    """Per-head Lasso penalty factors from a prior's harm estimates (positive = the
    knockout hurts): ``1 / (1 + ease * share)``, ``share`` the head's harm over the
    largest. A mild adaptive Lasso: no head's penalty rises, so a head the prior misses
    (a false negative) is found as without a prior."""
    harm = np.clip(np.asarray(harm_estimates, dtype=np.float64), 0.0, None)
    top = harm.max() if harm.size else 0.0
    share = harm / top if top > 0 else np.zeros_like(harm)
    return 1.0 / (1.0 + ease * share)
