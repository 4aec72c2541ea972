"""Group tests: the components no one measured alone, knocked out together in small groups,
and the certificate that says what every measurement rules out.

A run measures a few components alone (``confirm``) and estimates the rest from random
masks. What no one measured alone is the method's blind spot: a strong head the prior did
not rank, knocked out once in a mask beside 26 others, is credited to no one. Group tests
look there. The unmeasured components are knocked out together in groups (those the masks'
fit implicates first, then those the masks covered least); a group that stays clearly
under the *entry bar* — the harm of the k-th strongest component measured alone, what a
hidden one needs to enter the top-k — rules out its members; one that does not is halved
and each half measured (binary splitting, Hwang 1972; the likelier half first), down to
components measured alone, which then rank by their measurement like the confirmation's.
One that helps the task is split into its likeliest helper alone and the rest
(``peeled``): the help is often one member's.
A run is *certified* when every component it ranks was measured alone or ruled out.

The rule behind "rules out": **knocking out more components never lessens the harm** (a
component's harm alone is at most that of any set it is in). It is an assumption, and the
measurements are checked against it: a set whose change is a help larger than its noise
(a helpful member can hide a harmful one), or whose harm is clearly below that of a
measured part of it (a violation of the rule, observed), rules out nothing, and the
certificate counts them. A member measured alone to help beyond its noise breaks the rule
inside any set it is in (its knockout lessened the harm of knocking out nothing), so its
help may hide as much harm of the others: the set's harm is read with that help added back
(``unmasked``: a knockout lessens the harm by at most its help alone).

A measurement is a sample of n examples, so each set's harm comes with the paired standard
error of its change (``Harm.se``: per-example differences against the baseline, on the same
examples). A set *rules out* its members only when its harm is under the bar by more than
``Z`` standard errors (one-sided, ``CONFIDENCE``); one within the noise of the bar is
split, not ruled out. Each ruled-out member's harm alone is then at most the set's harm
plus that margin (``Certificate.ruled_out``'s bound), at that confidence. Where a run
recorded no per-example scores the error is 0: the rule is then applied to the numbers as
measured.

Everything works on flat column indices and plain numbers (harm: positive = the task gets
worse); the procedure (``group_testing``) is a pure function of what each round measured,
and a round's sets do not depend on the budget, so a larger budget measures only what is
new and a killed run resumes to the same tests.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

__all__ = ["CONFIDENCE", "HELPS", "MAX_GROUP", "OVER", "ROUND", "UNCLEAR", "UNDER", "VIOLATES",
           "Certificate", "GroupTesting", "Harm", "Reading", "Z", "background_harm",
           "certificate", "entry_bar", "group_key", "group_order", "group_size",
           "group_testing", "halves", "peeled", "read_sets", "status", "tied_at_k",
           "unmasked"]

#: Sets measured per round: halves of the last round's sets that did not rule out their
#: members first, then new groups. Small, so that a round's results steer the next.
ROUND = 5

#: The largest group: a group's harm is the sum of many small ones, and past a few dozen
#: components it passes the bar whatever the members (a mask of 27 does on the embedded
#: model), so a larger group only costs more halvings.
MAX_GROUP = 16

#: The largest a group grows to where every new group of a round rules its members out
#: (``next_size``).
LARGEST_GROUP = 64

#: The one-sided confidence at which a set rules out its members, and its normal quantile:
#: a set rules them out when its harm plus Z standard errors stays under the bar.
CONFIDENCE = 0.95
Z = NormalDist().inv_cdf(CONFIDENCE)

#: Round-off: harms are differences of means of a hundred-odd values.
_TOL = 1e-12

#: A set of columns knocked out together (sorted).
Members = tuple[int, ...]


class Harm(NamedTuple):
    """What a measured set did to one task: ``value``, its harm (the score's change, signed
    so that positive = worse), and ``se``, the paired standard error of that change (0: not
    estimated, the run recorded no per-example scores)."""

    value: float
    se: float = 0.0


def _harm(value: Harm | float) -> Harm:
    return value if isinstance(value, Harm) else Harm(float(value), 0.0)


#: What a measured set says of its members under the rule (``status``).
UNDER = "under"  # clearly under the bar: rules its members out
OVER = "over"  # clearly at or over the bar: one of its members may enter the top-k
UNCLEAR = "unclear"  # within the noise of the bar: split, never ruled out
HELPS = "helps"  # a help larger than the noise: a helpful member may hide a harmful one
VIOLATES = "violates"  # clearly less harm than a measured part of it: the rule fails here


def group_key(names: Sequence[str]) -> str:
    """The run folder's key of a group test knocking out ``names`` (components' names):
    by content, so a resumed run or a larger budget finds the same set under the same key
    whatever order the tests came in."""
    digest = hashlib.sha1("+".join(names).encode()).hexdigest()[:12]
    return f"group-{digest}"


def entry_bar(alone: Mapping[int, Harm | float], top_k: int) -> float:
    """The harm a component alone needs to enter the top-k: the k-th largest harm of those
    measured alone (``alone``: column -> harm); 0 where fewer than k were measured to hurt
    (then any harm would enter it)."""
    harms = sorted((_harm(h).value for h in alone.values()), reverse=True)
    if len(harms) < top_k or harms[top_k - 1] <= 0:
        return 0.0
    return harms[top_k - 1]


def unmasked(harm: Harm | float, alone: Iterable[Harm | float] = (), z: float = Z) -> Harm:
    """A set's ``harm`` with the help of its members measured ``alone`` to help beyond
    ``z`` standard errors added back (their errors combined with its own): what its other
    members may harm together, a helper's help hiding it (a strong head beside a helper
    measures 0.2 - 0.15 = 0.05)."""
    harm = _harm(harm)
    helpers = [part for part in map(_harm, alone) if part.value < -z * part.se - _TOL]
    if not helpers:
        return harm
    return Harm(harm.value - sum(part.value for part in helpers),
                math.hypot(harm.se, *(part.se for part in helpers)))


def status(harm: Harm | float, bar: float, inside: Iterable[Harm | float] = (),
           z: float = Z, alone: Iterable[Harm | float] = ()) -> str:
    """What a measured set with this ``harm`` says of its members, given the top-k's entry
    ``bar``, the harms of its parts measured too (``inside``: its members alone, smaller
    sets of them) and those of its members measured alone (``alone``): ``HELPS`` where its
    change is a help larger than ``z`` standard errors; ``VIOLATES`` where a part's harm
    exceeds its own by more than ``z`` standard errors of the difference; else, its harm
    read with its helpers' help added back (``unmasked``), ``UNDER`` where that harm plus
    ``z`` standard errors stays under the bar (or at 0: it hurts nothing, and fewer than k
    hurt), ``OVER`` where that harm less them reaches the bar, ``UNCLEAR`` in between. Only
    ``UNDER`` rules its members out."""
    harm = _harm(harm)
    margin = z * harm.se
    if harm.value < -margin - _TOL:
        return HELPS
    for part in map(_harm, inside):
        if part.value - harm.value > z * math.hypot(part.se, harm.se) + _TOL:
            return VIOLATES
    harm = unmasked(harm, alone, z)
    margin = z * harm.se
    if harm.value + margin < bar - _TOL or harm.value + margin <= _TOL:
        return UNDER
    if harm.value - margin >= bar - _TOL:
        return OVER
    return UNCLEAR


@dataclass(frozen=True)
class Reading:
    """One task's reading of every measured set (``read_sets``): the ``bar``, each set of
    two or more members' ``status``, and the columns ruled out with the largest harm each
    could have alone (the least of its ruling sets' harm plus their margin)."""

    bar: float
    statuses: dict[Members, str]
    ruled_out: dict[int, float]


def read_sets(measured: Mapping[Members, Harm | float], top_k: int, z: float = Z,
              alone: Mapping[int, Harm | float] | None = None) -> Reading:
    """One task's ``Reading`` of ``measured`` (members -> harm). ``alone``: the components
    measured alone, which set the bar and are never ruled out (they are measured); None:
    the 1-sets of ``measured`` are. A set's parts (``status``'s ``inside``) are its members
    measured alone and the smaller measured sets inside it; a set's harm is read with the
    help of its members measured alone added back (``unmasked``: those of ``alone`` and
    those whose 1-set is among ``measured``), and a ruled-out column's bound is that harm
    plus the margin."""
    sets = {tuple(members): _harm(value) for members, value in measured.items()}
    if alone is None:
        singles = {members[0]: value for members, value in sets.items() if len(members) == 1}
    else:
        singles = {int(h): _harm(value) for h, value in alone.items()}
    bar = entry_bar(singles, top_k)
    larger = [members for members in sets if alone is not None or len(members) > 1]
    containing: dict[int, list[Members]] = {}  # column -> the sets it is in
    for members in larger:
        for h in members:
            containing.setdefault(h, []).append(members)
    statuses: dict[Members, str] = {}
    ruled_out: dict[int, float] = {}
    for members in larger:
        harm, inner = sets[members], set(members)
        singly = [singles[h] for h in members if h in singles and (h,) != members]
        smaller = {other for h in members for other in containing[h]
                   if len(other) < len(members)}
        parts = singly + [sets[other] for other in smaller if inner.issuperset(other)]
        # Every member measured alone gives its help back, a component left out of the
        # ranking (its 1-set among the sets: --exclude'd once measured) too.
        helpers = singly + [sets[(h,)] for h in members
                            if h not in singles and (h,) in sets and (h,) != members]
        statuses[members] = verdict = status(harm, bar, parts, z, helpers)
        if verdict != UNDER:
            continue
        shown = unmasked(harm, helpers, z)
        bound = shown.value + z * shown.se
        for h in members:
            if h not in singles:
                ruled_out[h] = min(ruled_out.get(h, bound), bound)
    return Reading(bar, statuses, ruled_out)


def tied_at_k(alone: Mapping[int, Harm | float], top_k: int, z: float = Z,
              se_between: Callable[[int, int], float | None] | None = None) -> list[int]:
    """The columns measured alone whose harm the noise cannot tell from the k-th largest's
    (within ``z`` standard errors of the difference), strongest first, where they straddle
    the top-k's edge (some inside, some outside); [] where the edge is clear, or where the
    k-th does not hurt (fewer than k hurt: the places past them are filled by components
    that do not, which no noise makes a finding, and the ranking may fill them with the
    fit's estimates first).
    ``se_between(a, b)``: the paired standard error of two columns' difference (their
    measurements' per-example scores; None: not known), else the two errors combined as
    if independent."""
    ranked = sorted(((_harm(v), h) for h, v in alone.items()), key=lambda x: -x[0].value)
    if len(ranked) <= top_k:
        return []
    kth, kth_column = ranked[top_k - 1]
    if kth.value <= 0:
        return []

    def error(harm: Harm, column: int) -> float:
        paired = None if se_between is None else se_between(column, kth_column)
        return math.hypot(harm.se, kth.se) if paired is None else paired

    tied = [i for i, (harm, column) in enumerate(ranked)
            if abs(harm.value - kth.value) <= z * error(harm, column) + _TOL]
    if not any(i < top_k for i in tied) or not any(i >= top_k for i in tied):
        return []
    return [ranked[i][1] for i in tied]


def background_harm(design: np.ndarray, harms: np.ndarray, alone: Mapping[int, Harm | float]
                    ) -> float:
    """The typical harm of one component nobody measured alone, from the masks: each
    mask's harm less its members' measured harms (additivity, only for this estimate),
    over its unmeasured members; the median over masks, at least 0. It sizes the groups."""
    knocked_out = np.asarray(design, dtype=bool)
    measured = np.zeros(knocked_out.shape[1], dtype=bool)
    measured[list(alone)] = True
    known = np.zeros(knocked_out.shape[1])
    known[list(alone)] = [_harm(alone[h]).value for h in alone]
    per_member = []
    for row, harm in zip(knocked_out, np.asarray(harms, dtype=np.float64), strict=True):
        others = int((row & ~measured).sum())
        if others:
            per_member.append((harm - known[row].sum()) / others)
    return max(0.0, float(np.median(per_member))) if per_member else 0.0


def group_size(bar: float, background: float, margin: float = 0.0,
               largest: int = MAX_GROUP) -> int:
    """The group size: the largest power of two (2 to ``largest``) whose groups' typical
    harm (``background`` per member) stays under half of what the bar leaves above a
    measurement's noise (``margin``: ``Z`` typical standard errors), so that a group that
    is not ruled out owes it to a member rather than to the sum of small ones."""
    room = bar - margin
    if room <= 0:
        return 2
    if background <= 0:
        return largest
    fits = room / (2 * background)
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


def next_size(size: int, ruled_out: Sequence[bool], smallest: int = 2,
              largest: int = LARGEST_GROUP) -> int:
    """The next round's new groups' size, from whether each of this round's new groups
    (``size`` members) ruled its members out: twice as large (up to ``largest``) where all
    did, half as large (down to ``smallest``) where fewer than half did, else the same."""
    if not ruled_out:
        return size
    if all(ruled_out):
        return max(size, min(largest, 2 * size))
    if 2 * sum(ruled_out) < len(ruled_out):
        return max(smallest, size // 2)
    return size


def halves(members: Members, position: Mapping[int, int]) -> tuple[Members, Members]:
    """A set's two halves: its likelier half (by ``position``, the group order: the masks'
    fit's implicated first, then the least covered; columns not in it last, by index) and
    the rest, each sorted. The likelier half holds the members the fit points at, so the
    other half, without them, is the one likely to rule its members out at once."""
    ranked = sorted(members, key=lambda h: (position.get(h, len(position)), h))
    middle = len(ranked) // 2
    return tuple(sorted(ranked[:middle])), tuple(sorted(ranked[middle:]))


def peeled(members: Members, helpers: Mapping[int, float], skip: Iterable[int] = ()
           ) -> tuple[Members, Members] | None:
    """A helping set's two parts: its likeliest helper alone (the member with the largest
    predicted help in ``helpers``, column -> predicted help > 0; ``skip``: members settled
    already) and the rest; None where no member is predicted to help. A set that helps
    the task owes it to its helpful members, often one: the rest without it is then
    likely to rule its members out at once, where halving would narrow down to the helper
    at two measurements a level."""
    settled = {int(h) for h in skip}
    likely = [h for h in members if helpers.get(h, 0.0) > 0 and h not in settled]
    if len(members) < 3 or not likely:
        return None
    helper = max(likely, key=lambda h: (helpers[h], -h))
    return (helper,), tuple(h for h in members if h != helper)


@dataclass(frozen=True)
class GroupTesting:
    """What ``group_testing`` did: the sets measured in each round, in order, the group
    size, and each set's harm per task (``harms``, also the sets it was given)."""

    rounds: list[list[Members]]
    size: int
    harms: dict[Members, dict[str, Harm]] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)  # each round's new groups' size

    @property
    def sets(self) -> list[Members]:
        return [s for batch in self.rounds for s in batch]


Measured = Mapping[Members, Mapping[str, Harm | float]]


def group_testing(order: Sequence[int], known: Measured,
                  measure: Callable[[list[Members]], Measured], budget: int | float,
                  *, size: int, top_k: int, round_size: int = ROUND, z: float = Z,
                  largest: int = LARGEST_GROUP,
                  helpers: Mapping[int, float] | None = None) -> GroupTesting:
    """Spend up to ``budget`` measurements (``math.inf``: until every column of ``order``
    is measured alone or ruled out) on group tests of ``order``'s columns (the likeliest
    first), ``round_size`` sets per round.

    ``known``: sets measured before (the masks, the components measured alone as 1-sets),
    with their harm per task; a task's bar is ``entry_bar`` of every 1-set known or
    measured so far, so it rises as splitting finds strong components. ``measure(sets)``:
    the harm per task of those sets (each a sorted tuple of columns). A column is *done*
    when every task has it measured alone or ruled out (``read_sets``). A round: first
    the halves (``halves``) of sets that did not rule out their members for every task,
    deepest first, then new groups of ``size`` columns not done and in no group yet; a
    1-set is a component measured alone, and is not split. Halves with no column left to
    settle (the risen bar ruled their parent out, or their members were settled
    otherwise) are dropped; a half measured before is read, not measured again.
    ``helpers``: column -> predicted help (> 0: its knockout is predicted to improve a
    task, e.g. by the prior); a set that helps some task is split into its likeliest
    helper alone and the rest (``peeled``) rather than halved."""
    order = [int(h) for h in order]
    position = {h: i for i, h in enumerate(order)}
    tested: dict[Members, dict[str, Harm]] = {}
    known_sets = {tuple(m): {t: _harm(v) for t, v in harms.items()} for m, harms in
                  known.items()}
    tasks = sorted({t for harms in known_sets.values() for t in harms})
    rounds: list[list[Members]] = []
    pending: list[Members] = []  # halves to measure next, deepest first
    grouped: set[int] = set()
    queue = list(order)
    spent = 0

    def readings() -> dict[str, Reading]:
        seen = {**known_sets, **tested}
        return {t: read_sets({m: h[t] for m, h in seen.items() if t in h}, top_k, z)
                for t in tasks}

    def settled(read: Mapping[str, Reading]) -> set[int]:
        seen = {**known_sets, **tested}
        alone = {m[0] for m in seen if len(m) == 1}
        return {h for h in order if h in alone
                or (read and all(h in r.ruled_out for r in read.values()))}

    def to_split(members: Members, read: Mapping[str, Reading], done: set[int]) -> bool:
        return (len(members) > 1 and any(h not in done for h in members)
                and any(r.statuses.get(members) != UNDER for r in read.values()))

    def parts(members: Members, read: Mapping[str, Reading], done: set[int]
              ) -> tuple[Members, Members]:
        helping = any(r.statuses.get(members) == HELPS for r in read.values())
        peel = peeled(members, helpers, done) if helping and helpers else None
        return peel or halves(members, position)

    read = readings()
    done = settled(read)
    sizes: list[int] = []
    current = size
    while spent < budget:
        seen = {**known_sets, **tested}
        batch: list[Members] = []
        room = int(min(round_size, budget - spent))
        while pending and len(batch) < room:
            half = pending.pop(0)
            if not any(h not in done for h in half):
                continue  # nothing left in it to settle
            if half in seen:  # measured before (a mask, a component alone): read it
                if to_split(half, read, done):
                    pending[:0] = list(parts(half, read, done))
                continue
            batch.append(half)
        queue = [h for h in queue if h not in done and h not in grouped]
        fresh: list[Members] = []  # this round's new groups, which steer the next size
        while queue and len(batch) < room:
            group = tuple(sorted(queue[:current]))
            queue = queue[current:]
            grouped.update(group)
            if group in seen:
                if to_split(group, read, done):
                    pending[:0] = list(parts(group, read, done))
                continue
            batch.append(group)
            fresh.append(group)
        if not batch:
            break  # every column measured alone, ruled out or in a group being split
        measured = measure(batch)
        for members in batch:
            tested[members] = {t: _harm(v) for t, v in measured[members].items()}
        tasks = sorted({*tasks, *(t for m in batch for t in tested[m])})
        spent += len(batch)
        rounds.append(batch)
        sizes.append(current if fresh else 0)
        read = readings()  # also the next round's
        done = settled(read)
        current = next_size(current, [all(r.statuses.get(g) == UNDER for r in read.values())
                                      for g in fresh], smallest=size, largest=largest)
        # Each unsettled set's halves go first, the round's first set's first.
        pending = [half for members in batch if to_split(members, read, done)
                   for half in parts(members, read, done)] + pending
    return GroupTesting(rounds, size, tested, sizes)


@dataclass(frozen=True)
class Certificate:
    """What one task's measurements rule out (``certificate``).

    ``bar``: the top-k's entry bar. ``alone``: the columns measured alone. ``ruled_out``:
    column -> the largest harm it could have alone (its least ruling set's harm plus ``z``
    standard errors). ``unchecked``: the columns nothing ruled out, each with how many
    masks knocked it out (``coverage``) and whether every such mask also knocked out a
    component measured alone to reach the bar (``shadowed``: the masks' drop has an owner
    already). ``groups``: the group tests, (members, harm), in order. ``helps`` and
    ``violations``: the measured sets of two or more members that ruled nothing out
    because they helped the task beyond the noise, or harmed it clearly less than a
    measured part of them. ``tied``: the components measured alone that the noise cannot
    tell from the k-th (``tied_at_k``). ``noise``: whether the harms came with standard
    errors (per-example scores recorded) or were taken as exact."""

    bar: float
    alone: list[int]
    ruled_out: dict[int, float]
    unchecked: list[int]
    coverage: dict[int, int]
    shadowed: list[int]
    groups: list[tuple[Members, Harm]]
    helps: list[Members] = field(default_factory=list)
    violations: list[Members] = field(default_factory=list)
    tied: list[int] = field(default_factory=list)
    noise: bool = False
    z: float = Z

    @property
    def bound(self) -> float | None:
        """The largest harm a ruled-out column could have alone (None: none ruled out)."""
        return max(self.ruled_out.values()) if self.ruled_out else None

    @property
    def complete(self) -> bool:
        return not self.unchecked


def certificate(candidates: Iterable[int], design: np.ndarray,
                mask_harms: Sequence[Harm | float], alone: Mapping[int, Harm | float],
                groups: Sequence[tuple[Members, Harm | float]], top_k: int, z: float = Z,
                se_between: Callable[[int, int], float | None] | None = None,
                left_out: Mapping[int, Harm | float] | None = None) -> Certificate:
    """One task's certificate over its ranked ``candidates`` (columns): ``design``'s rows
    with their harms, the columns measured alone (``alone``: column -> harm) and the group
    tests (members, harm), read by ``read_sets``; ``se_between``: ``tied_at_k``'s.
    ``left_out``: columns measured alone but left out of the ranking (``--exclude``d
    since): they set no bar, and their help is still given back to the sets they are in."""
    knocked_out = np.asarray(design, dtype=bool)
    masks = [tuple(int(h) for h in np.flatnonzero(row)) for row in knocked_out]
    measured: dict[Members, Harm] = {}
    for members, value in [*zip(masks, mask_harms, strict=True),
                           *((tuple(m), v) for m, v in groups),
                           *(((int(h),), v) for h, v in (left_out or {}).items())]:
        if members and not (len(members) == 1 and members[0] in alone):
            measured.setdefault(members, _harm(value))
    reading = read_sets(measured, top_k, z, alone=alone)
    alone_sets = {(int(h),) for h in left_out or {}}  # measurements alone, not sets tested
    pool = [int(h) for h in candidates]
    ranked = set(pool)
    ruled_out = {h: bound for h, bound in reading.ruled_out.items() if h in ranked}
    unchecked = [h for h in pool if h not in alone and h not in ruled_out]
    owners = {h for h, value in alone.items()
              if status(value, reading.bar, (), z) in (OVER, UNCLEAR)
              and _harm(value).value > _TOL}
    coverage, shadowed = {}, []
    for h in unchecked:
        rows = knocked_out[:, h] if knocked_out.size else np.zeros(0, dtype=bool)
        coverage[h] = int(rows.sum())
        if rows.any() and all(owners & set(np.flatnonzero(r)) for r in knocked_out[rows]):
            shadowed.append(h)
    noise = any(_harm(v).se > 0 for v in [*mask_harms, *alone.values(),
                                          *(v for _, v in groups)])
    return Certificate(
        reading.bar, sorted(h for h in pool if h in alone), ruled_out, unchecked, coverage,
        shadowed, [(tuple(m), _harm(v)) for m, v in groups],
        helps=[m for m, s in reading.statuses.items() if s == HELPS and m not in alone_sets],
        violations=[m for m, s in reading.statuses.items() if s == VIOLATES],
        tied=tied_at_k(alone, top_k, z, se_between), noise=noise, z=z)
