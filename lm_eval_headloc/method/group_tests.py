"""Group tests: the components no one measured alone, knocked out together in small groups,
and the completeness certificate that says what every measurement rules out.

A run measures a few components alone (``confirm``) and estimates the rest from random
masks. What no one measured alone is the method's blind spot: a strong head the prior did
not rank, knocked out once in a mask beside 26 others, is credited to no one. Group tests
look there. The unmeasured components are knocked out together in groups (those the masks'
fit implicates first, then those the masks covered least); a group that does not drop the
task by the *entry bar* — the harm of the k-th strongest component measured alone, what a
hidden one needs to enter the top-k — clears its members; one that does is halved and each
half measured (binary splitting, Hwang 1972), down to components measured alone, which then
rank by their measurement like the confirmation's.

The rule behind "clears": **knocking out more components never lessens the harm** (a
component's harm alone is at most that of any set it is in). It is an assumption, named as
such wherever the certificate is shown: components whose knockout helps the task can hide a
harmful one in the same set. Under it, every measured set with a harm below the bar — a
group, a random mask, a component alone — rules out each of its members, and
``certificate`` says which components were measured alone, which a set ruled out (and the
largest harm any of them could still have alone), and which nothing ruled out (with how
often the masks covered them and beside what).

Everything works on flat column indices and plain numbers (harm: positive = the task gets
worse); the procedure (``group_testing``) is a pure function of what each round measured,
and a round's sets do not depend on the budget, so a larger ``--group-tests`` measures
only what is new and a killed run resumes to the same tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

__all__ = ["MAX_GROUP", "ROUND", "Certificate", "GroupTesting", "background_harm",
           "certificate", "entry_bar", "group_key", "group_size", "group_testing",
           "positive", "group_order"]

#: Sets measured per round: halves of the last round's positive groups first, then new
#: groups. Small, so that a round's results steer the next (as the confirmation's rounds).
ROUND = 5

#: The largest group: a group's harm is the sum of many small ones, and past a few dozen
#: components it passes the bar whatever the members (a mask of 27 does on the embedded
#: model), so a larger group only costs more halvings.
MAX_GROUP = 16

#: A set of columns knocked out together (sorted), and its harm per task.
Members = tuple[int, ...]
Harms = Mapping[str, float]


def group_key(names: Sequence[str]) -> str:
    """The run folder's key of a group test knocking out ``names`` (components' names):
    by content, so a resumed run or a larger budget finds the same set under the same key
    whatever order the tests came in."""
    digest = hashlib.sha1("+".join(names).encode()).hexdigest()[:12]
    return f"group-{digest}"


def entry_bar(alone: Mapping[int, float], top_k: int) -> float:
    """The harm a component alone needs to enter the top-k: the k-th largest harm of those
    measured alone (``alone``: column -> harm); 0 where fewer than k were measured to hurt
    (then any harm would enter it)."""
    harms = sorted((float(h) for h in alone.values()), reverse=True)
    if len(harms) < top_k or harms[top_k - 1] <= 0:
        return 0.0
    return harms[top_k - 1]


def positive(harm: float, bar: float) -> bool:
    """Whether a set with this harm could hide a component that enters the top-k (its harm
    reaches the bar, and it hurts at all): such a set rules out none of its members."""
    return harm > 1e-12 and harm >= bar


def background_harm(design: np.ndarray, harms: np.ndarray, alone: Mapping[int, float]
                    ) -> float:
    """The typical harm of one component nobody measured alone, from the masks: each
    mask's harm less its members' measured harms (additivity, only for this estimate),
    over its unmeasured members; the median over masks, at least 0. It sizes the groups."""
    knocked_out = np.asarray(design, dtype=bool)
    measured = np.zeros(knocked_out.shape[1], dtype=bool)
    measured[list(alone)] = True
    known = np.zeros(knocked_out.shape[1])
    known[list(alone)] = [alone[h] for h in alone]
    per_member = []
    for row, harm in zip(knocked_out, np.asarray(harms, dtype=np.float64), strict=True):
        others = int((row & ~measured).sum())
        if others:
            per_member.append((harm - known[row].sum()) / others)
    return max(0.0, float(np.median(per_member))) if per_member else 0.0


def group_size(bar: float, background: float, largest: int = MAX_GROUP) -> int:
    """The group size: the largest power of two (2 to ``largest``) whose groups' typical
    harm (``background`` per member) stays under half the bar, so that a group passes the
    bar for a member's sake rather than for the sum of small ones."""
    if bar <= 0:
        return 2
    if background <= 0:
        return largest
    fits = bar / (2 * background)
    return int(min(largest, max(2, 2 ** math.floor(math.log2(max(fits, 1.0))))))


def group_order(screen_order: Sequence[int], implicated: Iterable[int], design: np.ndarray,
               skip: Iterable[int] = ()) -> list[int]:
    """The order a task's group tests take its unmeasured columns in: those the masks'
    fit implicates (in ``screen_order``), then the rest by how few masks knocked them
    out (never, once, …), equal counts in ``screen_order``. ``skip``: measured alone,
    excluded or never knocked out."""
    left_out = {int(h) for h in skip}
    shown = [int(h) for h in screen_order if int(h) not in left_out]
    first = [h for h in shown if h in {int(i) for i in implicated}]
    taken = set(first)
    coverage = np.asarray(design, dtype=bool).sum(axis=0)
    position = {h: i for i, h in enumerate(shown)}
    rest = sorted((h for h in shown if h not in taken), key=lambda h: (coverage[h], position[h]))
    return first + rest


@dataclass(frozen=True)
class GroupTesting:
    """What ``group_testing`` did: the sets measured in each round, in order, the group
    size, and each set's harm per task (``harms``, also the sets it was given)."""

    rounds: list[list[Members]]
    size: int
    harms: dict[Members, dict[str, float]] = field(default_factory=dict)

    @property
    def sets(self) -> list[Members]:
        return [s for batch in self.rounds for s in batch]


def group_testing(order: Sequence[int], known: Mapping[Members, Harms],
                  measure: Callable[[list[Members]], Mapping[Members, Harms]], budget: int,
                  *, size: int, top_k: int, round_size: int = ROUND) -> GroupTesting:
    """Spend up to ``budget`` measurements on group tests of ``order``'s columns (the
    likeliest first), ``round_size`` sets per round.

    ``known``: sets measured before (the masks, the components measured alone as 1-sets),
    with their harm per task; a task's bar is ``entry_bar`` of every 1-set known or
    measured so far, so it rises as splitting finds strong components. ``measure(sets)``:
    the harm per task of those sets (each a sorted tuple of columns). A round: first the
    halves of positive sets (``positive`` for some task), deepest first, then new groups of
    ``size`` columns that no set rules out yet and no group has taken; a positive 1-set is
    a component measured alone, and is not split. Halves whose parent the risen bar now
    rules out are dropped (the parent's members are ruled out with it)."""
    tested: dict[Members, dict[str, float]] = {}
    rounds: list[list[Members]] = []
    pending: list[tuple[Members, Members]] = []  # (half, its parent), the next to measure
    grouped: set[int] = set()
    queue = [int(h) for h in order]
    spent = 0
    while spent < budget:
        seen = {**known, **tested}
        bars = _bars(seen, top_k)
        ruled_out = _ruled_out(seen, bars)
        pending = [(s, parent) for s, parent in pending if _any_positive(seen[parent], bars)]
        batch: list[Members] = []
        room = min(round_size, budget - spent)
        while pending and len(batch) < room:
            batch.append(pending.pop(0)[0])
        queue = [h for h in queue if h not in ruled_out and h not in grouped
                 and (h,) not in seen]
        while queue and len(batch) < room:
            group = tuple(sorted(queue[:size]))
            queue = queue[size:]
            grouped.update(group)
            batch.append(group)
        if not batch:
            break  # every column ruled out, measured or tested
        measured = measure(batch)
        for members in batch:
            tested[members] = dict(measured[members])
        spent += len(batch)
        rounds.append(batch)
        seen = {**known, **tested}
        bars = _bars(seen, top_k)
        # Each positive set's halves go first, the round's first set's first.
        halves = [(half, members) for members in batch
                  if len(members) > 1 and _any_positive(tested[members], bars)
                  for half in (members[:len(members) // 2], members[len(members) // 2:])]
        pending = halves + pending
    return GroupTesting(rounds, size, tested)


def _singles(seen: Mapping[Members, Harms]) -> dict[str, dict[int, float]]:
    singles: dict[str, dict[int, float]] = {}
    for members, harms in seen.items():
        if len(members) == 1:
            for task, value in harms.items():
                singles.setdefault(task, {})[members[0]] = float(value)
    return singles


def _bars(seen: Mapping[Members, Harms], top_k: int) -> dict[str, float]:
    tasks = {task for harms in seen.values() for task in harms}
    singles = _singles(seen)
    return {task: entry_bar(singles.get(task, {}), top_k) for task in tasks}


def _any_positive(harms: Harms, bars: Mapping[str, float]) -> bool:
    return any(positive(value, bars.get(task, 0.0)) for task, value in harms.items())


def _ruled_out(seen: Mapping[Members, Harms], bars: Mapping[str, float]) -> set[int]:
    """Columns in a set positive for no task (of those not measured alone)."""
    out: set[int] = set()
    for members, harms in seen.items():
        if len(members) > 1 and not _any_positive(harms, bars):
            out.update(members)
    return out


@dataclass(frozen=True)
class Certificate:
    """What one task's measurements rule out (``certificate``).

    ``bar``: the top-k's entry bar. ``alone``: the columns measured alone. ``ruled_out``:
    column -> the harm of the least harmful measured set that ruled it out (its harm alone
    is at most that, under the rule). ``unchecked``: the columns nothing ruled out, each
    with how many masks knocked it out (``coverage``) and whether every such mask also
    knocked out a component measured alone to reach the bar (``shadowed``: the masks' drop
    has an owner already). ``groups``: the group tests, (members, harm), in order."""

    bar: float
    alone: list[int]
    ruled_out: dict[int, float]
    unchecked: list[int]
    coverage: dict[int, int]
    shadowed: list[int]
    groups: list[tuple[Members, float]]

    @property
    def bound(self) -> float | None:
        """The largest harm a ruled-out column could have alone (None: none ruled out)."""
        return max(self.ruled_out.values()) if self.ruled_out else None

    @property
    def complete(self) -> bool:
        return not self.unchecked


def certificate(candidates: Iterable[int], design: np.ndarray, mask_harms: np.ndarray,
                alone: Mapping[int, float], groups: Sequence[tuple[Members, float]],
                top_k: int) -> Certificate:
    """One task's certificate over its ranked ``candidates`` (columns): ``design``'s rows
    with their harms, the columns measured alone (``alone``: column -> harm) and the group
    tests (members, harm). A column not measured alone is ruled out by the least harmful
    set containing it whose harm is under the bar (``positive`` is False)."""
    bar = entry_bar(alone, top_k)
    knocked_out = np.asarray(design, dtype=bool)
    sets: list[tuple[Members, float]] = [
        (tuple(int(h) for h in np.flatnonzero(row)), float(value))
        for row, value in zip(knocked_out, np.asarray(mask_harms, dtype=np.float64),
                              strict=True)]
    sets += [(tuple(members), float(value)) for members, value in groups]
    pool = [int(h) for h in candidates]
    ranked = set(pool)
    ruled_out: dict[int, float] = {}
    for members, value in sets:
        if positive(value, bar):
            continue
        for h in members:
            if h in ranked and h not in alone:
                ruled_out[h] = min(ruled_out.get(h, value), value)
    unchecked = [h for h in pool if h not in alone and h not in ruled_out]
    owners = {h for h, value in alone.items() if positive(value, bar)}
    coverage, shadowed = {}, []
    for h in unchecked:
        rows = knocked_out[:, h] if knocked_out.size else np.zeros(0, dtype=bool)
        coverage[h] = int(rows.sum())
        if rows.any() and all(owners & set(np.flatnonzero(r)) for r in knocked_out[rows]):
            shadowed.append(h)
    return Certificate(bar, sorted(h for h in pool if h in alone), ruled_out, unchecked,
                       coverage, shadowed, [(tuple(m), float(v)) for m, v in groups])
