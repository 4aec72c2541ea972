"""The package's own locate loop run on a simulated world: ``method.locate_loop`` over a
``SimulatedMeasurement`` of a ``simulation`` world with fixed documents, in a
``MemoryStore``.

The simulator's other yardsticks (``defaults``) re-enact parts of the method on
simulated numbers; this runs the method itself — the design, the confirmation, the group
tests, the fit and the certificate, with every default of ``RunSpec`` — and only the
measurement is simulated. A mask's score is the share of the world's documents right with
its heads knocked out, and each document's outcome is the per-example value a real
measurement records, so the certificate's noise rule sees the same kind of numbers as on
a model. What a run spends and whether it ends certified with the exhaustive top-k is
then a question the simulator answers for any number of heads (``simulate_certified``'s
table in SIMULATION.md) and the tests can ask of a planted world.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from headloc_bench.simulation import World
from lm_eval_headloc.intervention.components import Head
from lm_eval_headloc.measurement.metrics import TaskScore
from lm_eval_headloc.measurement.store import MemoryStore
from lm_eval_headloc.method.budget import PRIOR_ALLOWANCE
from lm_eval_headloc.method.columns import Columns
from lm_eval_headloc.method.locate_loop import locate_loop
from lm_eval_headloc.method.ranking import CertificateRecord, Ranking

__all__ = ["TASK", "SimulatedMeasurement", "SimulatedRun", "head_grid", "simulated_locate"]

#: The one task a simulated world has.
TASK = "simulated"


def head_grid(n_heads: int) -> tuple[int, int]:
    """(layers, heads per layer) of a model with ``n_heads`` heads: the embedded SmolLM2's
    30 × 9 for 270, Llama-3.1-8B's 32 × 32 for 1,024, else 64 heads a layer where they
    divide, else one head a layer."""
    known = {270: (30, 9), 1024: (32, 32)}
    if n_heads in known:
        return known[n_heads]
    return (n_heads // 64, 64) if n_heads % 64 == 0 else (n_heads, 1)


class SimulatedMeasurement:
    """A measurement (``measurement.store.run_plan``'s way in: ``measure_chunks``) of
    ``world``'s one task: a mask's score is the share of its fixed documents right
    (``Documents.outcomes``), recorded with each document's 0/1 outcome as the score's
    per-example values. ``measured`` counts the masks measured."""

    def __init__(self, world: World, columns: Columns) -> None:
        if world.documents is None:
            raise ValueError("a simulated measurement needs a noise='documents' world")
        self.world, self.columns = world, columns
        self.tasks = [(TASK, "acc,none")]
        self.measured = 0

    def auto_masks_per_pass(self) -> int:
        return 1

    def measure_chunks(self, chunks: Sequence[Sequence[Sequence[Head]]],
                       masks_per_pass: int | None = None, scale: float | None = None
                       ) -> Iterator[tuple[int, list[dict[str, TaskScore]], float]]:
        if scale is not None:
            raise ValueError("a simulated world knocks heads out at one scale")
        assert self.world.documents is not None
        for index, chunk in enumerate(chunks):
            rows = np.zeros((len(chunk), self.world.n_heads))
            for row, heads in zip(rows, chunk, strict=True):
                row[[self.columns.index(h) for h in heads]] = 1.0
            outcomes = self.world.documents.outcomes(rows).astype(np.float64)
            self.measured += len(chunk)
            yield index, [{TASK: TaskScore(TASK, "acc,none", float(right.mean()), True,
                                           examples=(tuple(right.tolist()),))}
                          for right in outcomes], 0.0


@dataclass(frozen=True)
class SimulatedRun:
    """What ``simulated_locate`` found: the ranking, its certificate, the measurement-
    equivalents the run spent (the prior's allowance, masks, heads alone, group tests) and
    the exhaustive top-k of the world's documents (every head alone, ranked by its
    measured change, equal changes by index)."""

    ranking: Ranking
    spent: int
    exhaustive: list[int]

    @property
    def certificate(self) -> CertificateRecord:
        assert self.ranking.facts.certificate is not None
        return self.ranking.facts.certificate

    def top(self, k: int) -> list[int]:
        return [self.ranking.columns.index(h) for h in self.ranking.top(k)]

    def exact(self, k: int) -> bool:
        """Whether the run's top-k is the exhaustive top-k as a set (equal measured
        changes at the k-th place: either of them)."""
        return _same_top(self.top(k), self.exhaustive, self.changes, k)

    @property
    def changes(self) -> np.ndarray:
        return self._changes  # type: ignore[attr-defined]


def _same_top(found: Sequence[int], truth: Sequence[int], changes: np.ndarray, k: int
              ) -> bool:
    if set(found) == set(truth[:k]):
        return True
    # Equal measured changes at the k-th place: the run's order among them is as good.
    edge = changes[truth[k - 1]]
    sure = {h for h in truth[:k] if changes[h] < edge}
    return sure <= set(found) and all(changes[h] == edge for h in set(found) - sure)


def simulated_locate(world: World, settings: Any, *, prior: np.ndarray | None = None,
                     prior_kind: str = "atp-path") -> SimulatedRun:
    """``method.locate_loop`` on ``world`` with ``settings`` (a ``RunSpec`` with its budget
    decided, e.g. ``RunSpec(bootstrap=1).budgeted("atp-path")``), in a ``MemoryStore``.
    ``prior``: ``(points, N)`` estimates of each head's change (``defaults.
    simulated_prior``), charged ``PRIOR_ALLOWANCE[prior_kind]`` against the run's cap."""
    columns = Columns.heads(*head_grid(world.n_heads))
    measure = SimulatedMeasurement(world, columns)
    allowance = PRIOR_ALLOWANCE[prior_kind] if prior is not None else 0
    state = locate_loop(measure, MemoryStore(), columns, [TASK], settings,
                        priors=None if prior is None else {TASK: np.atleast_2d(prior)},
                        heads_per_layer=columns.heads_grid[1] if columns.heads_grid else 1,
                        allowance=allowance)
    assert world.documents is not None
    base = float(world.documents.scores(np.zeros((1, world.n_heads)))[0])
    changes = world.documents.single_scores() - base
    run = SimulatedRun(state.rankings[TASK], allowance + measure.measured - 1,
                       [int(h) for h in np.argsort(changes, kind="stable")])
    object.__setattr__(run, "_changes", changes)
    return run
