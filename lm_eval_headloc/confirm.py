"""Confirmation: the likeliest heads knocked out one at a time, ranked by what they measured.

A random design (the *screen*) and the attribution prior each name likely heads, and each
misses some: the Lasso on a few dozen masks is noisy, and attribution patching misses
heads whose knockout saturates attention (a false negative it cannot see). Confirmation
spends the rest of a budget on knocking out their candidates alone, alternately the
prior's next and the screen's next, so that one source's miss can be the other's find.
A head measured alone has its effect measured, not estimated: the same quantity as an
exhaustive one-head-at-a-time search, on the same examples. The ranking lists the
confirmed heads first (most harmful first), then the rest in the screen's order.

Everything here is a pure function of rankings and measured changes (flat head indices).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from .recovery import harm

__all__ = ["candidates", "confirm_selector", "confirmed_order", "confirmed_top",
           "task_candidates"]


def task_candidates(orders: Sequence[Sequence[int]], count: int,
                    skip: Iterable[int] = ()) -> list[int]:
    """The first ``count`` distinct heads taken alternately from ``orders`` (each a
    ranking, likeliest first: the prior's, the screen's), leaving out ``skip``."""
    left_out, picked = set(skip), []
    queues = [iter(order) for order in orders]
    while len(picked) < count and queues:
        for queue in list(queues):
            head = next((h for h in queue if h not in left_out and h not in picked), None)
            if head is None:
                queues.remove(queue)
            else:
                picked.append(int(head))
                if len(picked) == count:
                    break
    return picked


def candidates(per_task: Mapping[str, Sequence[int]], count: int
               ) -> tuple[list[int], dict[str, int]]:
    """(heads to confirm, how many of each task's candidate list they consumed): at most
    ``count`` distinct heads, taken from the tasks' lists in turn, so every task gets its
    share of a multi-task run."""
    picked: list[int] = []
    used = dict.fromkeys(per_task, 0)
    while len(picked) < count and any(used[t] < len(per_task[t]) for t in per_task):
        for task, heads in per_task.items():
            while used[task] < len(heads) and heads[used[task]] in picked:
                used[task] += 1  # already picked for another task: costs nothing
            if used[task] < len(heads) and len(picked) < count:
                picked.append(int(heads[used[task]]))
                used[task] += 1
    return picked, used


def confirmed_order(alone: Mapping[int, tuple[float, float]], screen_order: Sequence[int],
                    higher_is_better: bool, exclude: Iterable[int] = ()) -> list[int]:
    """The ranking: heads measured alone first, most harmful first by their measured
    change (``alone[head] = (score change, logprob change)``; equal score changes by the
    logprob's, then by index), then every other head in ``screen_order``."""
    excluded = set(exclude)
    confirmed = sorted((h for h in alone if h not in excluded), key=lambda h: (
        -float(harm(alone[h][0], higher_is_better)), -float(harm(alone[h][1], True)), h))
    return confirmed + [int(h) for h in screen_order if h not in alone and h not in excluded]


def confirmed_top(alone: Mapping[int, tuple[float, float]], pool: Iterable[int], top_k: int,
                  higher_is_better: bool) -> list[int]:
    """The ``top_k`` heads of ``pool`` (all measured alone) with a harmful measured change,
    most harmful first: what a confirmation that had measured only ``pool`` would report."""
    order = confirmed_order({h: alone[h] for h in pool}, (), higher_is_better)
    return [h for h in order[:top_k] if harm(alone[h][0], higher_is_better) > 0]


def confirm_selector(alone: Mapping[int, tuple[float, float]],
                     prior_order: Sequence[int] | None, own_count: int, others: Iterable[int],
                     higher_is_better: bool, top_k: int, skip: Iterable[int] = ()
                     ) -> Callable[[np.ndarray], np.ndarray]:
    """For ``bootstrap_stability(select=…)``: the top-k a bootstrap refit of the screen
    would have led to. The refit's screen ranking, alternated with the prior's, names the
    task's ``own_count`` candidates; ``others`` (heads measured alone for other tasks'
    candidates) stay in the pool. A candidate the run did not measure cannot be ranked,
    so it is left out: a head only the screen found is as stable as the screen is."""
    skip, others = list(skip), {int(h) for h in others}

    def select(screen_ranking: np.ndarray) -> np.ndarray:
        orders = [screen_ranking] if prior_order is None else [prior_order, screen_ranking]
        own = task_candidates(orders, own_count, skip)
        pool = {h for h in own if h in alone} | others
        return np.array(confirmed_top(alone, pool, top_k, higher_is_better), dtype=np.int64)

    return select
