"""The components a run's design matrix has columns for, in column order.

A heads run (the default) has one column per head in flat order, ``layer * H + head``,
as every run before neurons existed (a hybrid model's layers without heads have none). A
run with MLP neurons (``--components neurons`` or
``heads+neurons``) cannot give each of the model's tens of thousands of neurons a column:
its neuron columns are the attribution prior's likeliest candidates
(``neuron_candidates``), after the heads when both are located, and with
``--neuron-groups G`` the rest of each layer's neurons in G groups (``NeuronGroup``), one
column each: a mask that knocks out a group knocks out every neuron in it, so a neuron the
prior missed still moves the fit, through its group. Everything that turns a column index
into a name, or a knocked-out row into components, goes through ``Columns``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from lm_eval_headloc.common.options import COMPONENTS
from lm_eval_headloc.intervention.components import (
    Component,
    Head,
    Neuron,
    component_key,
    parse_components,
)

__all__ = ["UNIT", "UNITS", "Column", "Columns", "NeuronGroup", "certificate_unit", "column_key",
           "column_label", "components_of", "neuron_candidates", "neuron_groups"]


class NeuronGroup(NamedTuple):
    """Group ``group`` of layer ``layer``'s MLP neurons outside a run's candidates
    (``--neuron-groups``): one design column, knocking out all of ``neurons`` at once.
    Its name, ``L3G1``, means something only inside its run; files that leave the run
    list its neurons (``members``)."""

    layer: int
    group: int
    neurons: tuple[int, ...]

    def __str__(self) -> str:
        return f"L{self.layer}G{self.group}"

    @property
    def members(self) -> list[Neuron]:
        return [Neuron(self.layer, n) for n in self.neurons]


def column_label(column: Column) -> str:
    """A column's name for people: a group's with its size (``L3G1 (380 neurons)``)."""
    if isinstance(column, NeuronGroup):
        return f"{column} ({len(column.neurons):,} neurons)"
    return str(column)


#: What a design column stands for.
Column = Head | Neuron | NeuronGroup


def column_key(column: Column) -> tuple[int, int, int]:
    """``component_key`` with neuron groups after a layer's neurons (a group's index is
    not a neuron's, so the two must not compare equal)."""
    if isinstance(column, NeuronGroup):
        return (column.layer, 2, column.group)
    return component_key(column)


def neuron_groups(candidates: Iterable[Neuron], num_layers: int, neurons_per_layer: int,
                  per_layer: int, never: Iterable[Neuron] = ()) -> list[NeuronGroup]:
    """Each layer's MLP neurons that are neither ``candidates`` nor ``never`` knocked out
    (``--never-ablate``), cut in index order into ``per_layer`` groups of near-equal size
    (fewer where fewer neurons are left; none in a layer with none left)."""
    taken: dict[int, set[int]] = {}
    for neuron in (*candidates, *never):
        taken.setdefault(neuron.layer, set()).add(neuron.neuron)
    groups = []
    for layer in range(num_layers):
        rest = [n for n in range(neurons_per_layer) if n not in taken.get(layer, ())]
        parts = [part for part in np.array_split(np.asarray(rest, dtype=np.int64),
                                                 min(per_layer, len(rest)) or 1) if part.size]
        groups += [NeuronGroup(layer, i, tuple(int(n) for n in part))
                   for i, part in enumerate(parts)]
    return groups


@dataclass(frozen=True)
class Columns:
    """The component of each design column (a sequence: ``columns[i]``, ``len``)."""

    components: tuple[Column, ...]
    _index: dict[tuple[int, int, int], int] = field(init=False, repr=False, compare=False)
    _names: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {column_key(c): i for i, c in enumerate(self.components)}
        if len(index) != len(self.components):
            raise ValueError("a component has two columns")
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "_names", {str(c): i for i, c in enumerate(self.components)})

    @classmethod
    def heads(cls, num_layers: int, heads_per_layer: int,
              head_layers: Sequence[int] | None = None) -> Columns:
        """Every head, in flat order: a heads run's columns. ``head_layers``: the layers
        with heads where not every layer has them (a hybrid model's)."""
        layers = range(num_layers) if head_layers is None else head_layers
        return cls(tuple(Head(layer, head) for layer in layers
                         for head in range(heads_per_layer)))

    @classmethod
    def of(cls, components: str, num_layers: int, heads_per_layer: int,
           candidates: Sequence[str] = (), groups_per_layer: int = 0,
           neurons_per_layer: int | None = None, never: Sequence[str] = (),
           head_layers: Sequence[int] | None = None) -> Columns:
        """The columns of a run locating ``components`` (a ``COMPONENTS`` value): the
        heads when it locates heads (in ``head_layers`` when given), then its neuron
        ``candidates`` when it locates neurons, then (``groups_per_layer`` > 0, which
        needs ``neurons_per_layer``) the groups of the neurons outside the candidates and
        outside ``never`` (the neurons never knocked out; ``neuron_groups``)."""
        if components not in COMPONENTS:
            raise ValueError(f"components={components!r}: one of {', '.join(COMPONENTS)}")
        heads = cls.heads(num_layers, heads_per_layer, head_layers).components if "heads" \
            in components.split("+") else ()
        neurons = tuple(parse_components(list(candidates))) if "neurons" in components \
            else ()
        groups: list[NeuronGroup] = []
        if groups_per_layer and "neurons" in components:
            if neurons_per_layer is None:
                raise ValueError("neuron groups need the MLP's width (neurons_per_layer)")
            groups = neuron_groups(neurons, num_layers, neurons_per_layer,  # type: ignore[arg-type]
                                   groups_per_layer,
                                   parse_components(list(never)))  # type: ignore[arg-type]
        return cls((*heads, *sorted(neurons, key=component_key), *groups))

    def __len__(self) -> int:
        return len(self.components)

    def __getitem__(self, index: int) -> Component:
        return self.components[int(index)]

    def __iter__(self):
        return iter(self.components)

    def index(self, component: Column | str) -> int:
        """The column of ``component``, or of the column named so (``"L3H1"``); KeyError
        naming it when the run has none."""
        if isinstance(component, str):
            return self.named(component)
        try:
            return self._index[column_key(component)]
        except KeyError:
            raise KeyError(f"{component} is not one of the run's columns") from None

    def __contains__(self, component: Column | str) -> bool:
        """Whether ``component`` (or the column named so) is one of the run's columns."""
        try:
            self.index(component)
        except KeyError:
            return False
        return True

    def indices(self, components: Iterable[Column]) -> list[int]:
        return [self.index(c) for c in components]

    def named(self, name: str) -> int:
        """The column named ``name`` as the run's files write it (``L3N12``, ``L3G1``)."""
        try:
            return self._names[name]
        except KeyError:
            raise KeyError(f"{name} is not one of the run's columns") from None

    def names(self, indices: Iterable[int]) -> list[str]:
        return [str(self[i]) for i in indices]

    def holding(self, components: Iterable[Component]) -> list[int]:
        """The columns that knock out any of ``components``: a head's or neuron's own, and
        a neuron group holding one (--exclude'd neurons inside a group leave it out of the
        ranking, else its knockout would knock them out)."""
        keys = {component_key(c) for c in components}
        if not keys:  # the usual run excludes nothing: no group's members to walk
            return []
        return [i for i in range(len(self))
                if any(component_key(m) in keys for m in self.members(i))]

    def members(self, index: int) -> list[Component]:
        """What knocking out column ``index`` knocks out: its head or neuron, or every
        neuron of its group."""
        column = self[index]
        return column.members if isinstance(column, NeuronGroup) else [column]

    def knocked_out(self, row: np.ndarray) -> list[Component]:
        """The components a design row (booleans over the columns) knocks out."""
        if np.shape(row) != (len(self),):
            raise ValueError(f"a design row has one entry per column ({len(self)}), not "
                             f"shape {np.shape(row)}")
        row = np.asarray(row)
        # As the knockout hooks' row masks (hooks._checked_row_masks): all or nothing, so
        # 0.5 (a float design's row) is refused, not counted as knocked out.
        stray = (row != 0) & (row != 1)  # NaN too
        if stray.any():
            at = int(np.flatnonzero(stray)[0])
            raise ValueError(f"a design row holds {row[at].item()!r} at {at}: each entry is "
                             "True/False (or 1/0), knocked out or not")
        return [c for i in np.flatnonzero(row) for c in self.members(int(i))]

    @property
    def heads_grid(self) -> tuple[int, int] | None:
        """(layers, heads per layer) when the columns are every head of each layer they
        cover, in flat order (a layers x heads picture shows them; a hybrid model's
        layers without heads are rows without columns), else None."""
        if not self.components or self.has_neurons:
            return None
        layers = sorted({c.layer for c in self.components})
        per_layer = len(self.components) // len(layers)
        if len(self.components) != len(layers) * per_layer or \
                self.components != Columns.heads(0, per_layer, layers).components:
            return None
        return layers[-1] + 1, per_layer

    def grid_of(self, values: np.ndarray) -> np.ndarray:
        """``values`` (one per column) on the ``heads_grid`` (layers x heads), NaN where
        a layer has no columns."""
        grid = self.heads_grid
        if grid is None:
            raise ValueError("the columns are not a grid of heads")
        values = np.asarray(values, dtype=np.float64)
        if values.shape != (len(self),):
            raise ValueError(f"one value per column ({len(self)}), not shape {values.shape}")
        shown = np.full(grid, np.nan, dtype=np.float64)
        for column, value in zip(self.components, values, strict=True):
            shown[column.layer, column[1]] = value
        return shown

    @property
    def has_neurons(self) -> bool:
        return any(isinstance(c, (Neuron, NeuronGroup)) for c in self.components)

    @property
    def has_groups(self) -> bool:
        return any(isinstance(c, NeuronGroup) for c in self.components)


def neuron_candidates(estimates: Mapping[str, np.ndarray], neurons_per_layer: int,
                      count: int, skip: Iterable[Neuron] = ()) -> list[Neuron]:
    """The ``count`` neurons the attribution prior finds likeliest to matter: each task's
    and path point's ranking by estimated harm (most negative change of the logprob
    signal first) taken in turn (``confirm.alternated``), so every task and point gets
    its share. ``estimates``: task -> (points, layers x neurons) in flat neuron order."""
    from lm_eval_headloc.method.confirm import alternated, prior_rankings

    skipped = {component_key(n) for n in skip}
    sources = [ranking for task in estimates for ranking in prior_rankings(estimates[task])]
    picked = alternated(sources, count + len(skipped))
    neurons = [Neuron(*divmod(int(i), neurons_per_layer)) for i in picked]
    return [n for n in neurons if component_key(n) not in skipped][:count]


def components_of(columns: Columns) -> str:
    """The ``--components`` value whose columns these are."""
    heads = sum(isinstance(c, Head) for c in columns)
    return "heads" if heads == len(columns) else "neurons" if not heads else "heads+neurons"


def certificate_unit(columns: Columns) -> str:
    """What a certificate counts these columns as, one of them: ``UNIT``'s word, or
    "component" where neuron groups (each checked as one) stand beside neurons ("every one
    of the 10 neurons checked" counted 4 groups of 30 as neurons)."""
    if any(isinstance(c, NeuronGroup) for c in columns):
        return "component"
    return UNIT[components_of(columns)]


#: What a run locates, in words (``--components``): all of them, one of them, the title.
UNITS = {"heads": "heads", "neurons": "MLP neurons", "heads+neurons": "heads and MLP neurons"}


UNIT = {"heads": "head", "neurons": "neuron", "heads+neurons": "component"}
