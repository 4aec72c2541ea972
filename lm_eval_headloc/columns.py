"""The components a run's design matrix has columns for, in column order.

A heads run (the default) has one column per head in flat order, ``layer * H + head``,
as every run before neurons existed. A run with MLP neurons (``--components neurons`` or
``heads+neurons``) cannot give each of the model's tens of thousands of neurons a column:
its neuron columns are the attribution prior's likeliest candidates
(``neuron_candidates``), after the heads when both are located. Everything that turns a
column index into a name, or a knocked-out row into components, goes through ``Columns``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .heads import Component, Head, Neuron, component_key, parse_components

__all__ = ["COMPONENTS", "Columns", "neuron_candidates"]

#: ``--components``' values: what a run locates.
COMPONENTS: tuple[str, ...] = ("heads", "neurons", "heads+neurons")


@dataclass(frozen=True)
class Columns:
    """The component of each design column (a sequence: ``columns[i]``, ``len``)."""

    components: tuple[Component, ...]
    _index: dict[tuple[int, int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {component_key(c): i for i, c in enumerate(self.components)}
        if len(index) != len(self.components):
            raise ValueError("a component has two columns")
        object.__setattr__(self, "_index", index)

    @classmethod
    def heads(cls, num_layers: int, heads_per_layer: int) -> Columns:
        """Every head, in flat order: a heads run's columns."""
        return cls(tuple(Head(layer, head) for layer in range(num_layers)
                         for head in range(heads_per_layer)))

    @classmethod
    def of(cls, components: str, num_layers: int, heads_per_layer: int,
           candidates: Sequence[str] = ()) -> Columns:
        """The columns of a run locating ``components`` (a ``COMPONENTS`` value): the
        heads when it locates heads, then its neuron ``candidates`` when it locates
        neurons."""
        if components not in COMPONENTS:
            raise ValueError(f"components={components!r}: one of {', '.join(COMPONENTS)}")
        heads = cls.heads(num_layers, heads_per_layer).components if "heads" in \
            components.split("+") else ()
        neurons = tuple(parse_components(list(candidates))) if "neurons" in components \
            else ()
        return cls((*heads, *sorted(neurons, key=component_key)))

    def __len__(self) -> int:
        return len(self.components)

    def __getitem__(self, index: int) -> Component:
        return self.components[int(index)]

    def __iter__(self):
        return iter(self.components)

    def index(self, component: Component) -> int:
        """The column of ``component`` (KeyError naming it when the run has none)."""
        try:
            return self._index[component_key(component)]
        except KeyError:
            raise KeyError(f"{component} is not one of the run's columns") from None

    def indices(self, components: Iterable[Component]) -> list[int]:
        return [self.index(c) for c in components]

    def names(self, indices: Iterable[int]) -> list[str]:
        return [str(self[i]) for i in indices]

    def knocked_out(self, row: np.ndarray) -> list[Component]:
        """The components a design row (booleans over the columns) knocks out."""
        return [self.components[i] for i in np.flatnonzero(row)]

    @property
    def heads_grid(self) -> tuple[int, int] | None:
        """(layers, heads per layer) when the columns are every head in flat order (a
        layers x heads picture shows them), else None."""
        if not self.components or any(isinstance(c, Neuron) for c in self.components):
            return None
        layers = self.components[-1].layer + 1
        per_layer = len(self.components) // layers
        if len(self.components) != layers * per_layer or \
                self.components != Columns.heads(layers, per_layer).components:
            return None
        return layers, per_layer

    @property
    def has_neurons(self) -> bool:
        return any(isinstance(c, Neuron) for c in self.components)


def neuron_candidates(estimates: Mapping[str, np.ndarray], neurons_per_layer: int,
                      count: int, skip: Iterable[Neuron] = ()) -> list[Neuron]:
    """The ``count`` neurons the attribution prior finds likeliest to matter: each task's
    and path point's ranking by estimated harm (most negative change of the logprob
    signal first) taken in turn (``confirm.alternated``), so every task and point gets
    its share. ``estimates``: task -> (points, layers x neurons) in flat neuron order."""
    from .confirm import alternated, prior_rankings

    skipped = {component_key(n) for n in skip}
    sources = [ranking for task in estimates for ranking in prior_rankings(estimates[task])]
    picked = alternated(sources, count + len(skipped))
    neurons = [Neuron(*divmod(int(i), neurons_per_layer)) for i in picked]
    return [n for n in neurons if component_key(n) not in skipped][:count]
