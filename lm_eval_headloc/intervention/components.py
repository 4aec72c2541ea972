"""Component notation: heads ``L{layer}H{head}`` and MLP neurons ``L{layer}N{neuron}``,
zero-based; several joined with ``+``.

``L0H29+L1H31`` names two heads, ``L3H*`` every head of layer 3; ``L3N1234`` is neuron 1234
of layer 3's MLP (its slice of the MLP output projection's input) and ``L3N*`` the whole
MLP. Heads and neurons mix: ``L0H29+L3N1234``. Commas are taken by lm-eval's
``model_args``, hence ``+``. Parsing sorts (layer, then heads before neurons, then index)
and de-duplicates, so formatting a parsed list round-trips and the order a user wrote
components in does not matter. ``parse_heads`` takes heads only; ``parse_components`` both.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from lm_eval_headloc.common.errors import UserError
from lm_eval_headloc.common.words import counted
from lm_eval_headloc.intervention.arg_string import as_written

__all__ = [
    "Component",
    "Head",
    "ComponentSpecError",
    "Neuron",
    "check_component_names",
    "check_head_names",
    "check_top",
    "component_key",
    "describe_layers",
    "format_heads",
    "names_a_file",
    "names_neurons",
    "parse_components",
    "parse_heads",
    "ranked_task",
    "read_heads_file",
    "recorded_harmless",
    "validate_heads",
]

_TOKEN = re.compile(r"^L(\d+)([HN])(\d+|\*)$", re.ASCII)


class ComponentSpecError(UserError):
    """A head list that cannot be parsed or does not fit the model (a user mistake)."""


class Head(NamedTuple):
    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    def flat_index(self, heads_per_layer: int) -> int:
        """Flat index ``layer * heads_per_layer + head`` (the column of a design matrix)."""
        per_layer = _whole(heads_per_layer, "heads_per_layer", 1)
        # Out of range, the sum lands on another head's column (Head(1, 5) of 4 is L2H1).
        if self.layer < 0 or not 0 <= self.head < per_layer:
            raise ComponentSpecError(
                f"head {self} has no flat index with heads_per_layer={per_layer}: the layer "
                f"must be >= 0 and the head in 0..{per_layer - 1}")
        return self.layer * per_layer + self.head

    @classmethod
    def from_flat_index(cls, index: int, heads_per_layer: int) -> Head:
        """The head at column ``index`` of a design with ``heads_per_layer`` heads a layer."""
        per_layer = _whole(heads_per_layer, "heads_per_layer", 1)
        return cls(*divmod(_whole(index, "index", 0), per_layer))


class Neuron(NamedTuple):
    """Neuron ``neuron`` of layer ``layer``'s MLP: one input feature of its output
    projection (``down_proj``, ``fc2``, ``c_proj`` …)."""

    layer: int
    neuron: int

    def __str__(self) -> str:
        return f"L{self.layer}N{self.neuron}"


Component = Head | Neuron


def _whole(value: object, name: str, min_val: int) -> int:
    """``value`` as an int >= ``min_val``, else ComponentSpecError naming it."""
    if type(value) is int and value >= min_val:  # the usual case, without sklearn
        return value
    from lm_eval_headloc.common.checks import (  # sklearn: only imported when needed
        UsageError,
        check_number,
    )

    try:
        return int(check_number(value, name, whole=True, min_val=min_val))
    except UsageError as err:
        raise ComponentSpecError(str(err)) from None


def component_key(component: Component) -> tuple[int, int, int]:
    """Sort key: layer, then heads before neurons, then index (a Head and a Neuron with the
    same numbers are equal as tuples, so they never sort by themselves)."""
    return (component.layer, isinstance(component, Neuron), component[1])


#: A head where only MLP neurons are taken (``heads=False``).
_ONLY_NEURONS = ("{token} is an attention head; only MLP neurons are accepted here "
                 "(L{{layer}}N{{neuron}}, e.g. L3N1234)")

_NAMES = {
    False: "L{layer}H{head} with zero-based non-negative integers (e.g. L0H29) or "
           "L{layer}H* for a whole layer",
    True: "a head L{layer}H{head} (e.g. L0H29, L3H* for a whole layer) or an MLP neuron "
          "L{layer}N{neuron} (e.g. L3N1234, L3N* for a whole MLP), zero-based",
}


def _parse_token(token: str, heads_per_layer: int | None, neurons_per_layer: int | None,
                 neurons: bool, head_layers: Collection[int] | None = None,
                 heads: bool = True) -> list[Component]:
    token = token.strip()
    if not token:
        what = "component" if neurons else "head"
        raise ComponentSpecError(
            f"empty {what} name in the {what} list (two '+' in a row, or a '+' at an end); "
            "write heads as L{layer}H{head} joined by '+', e.g. L0H29+L1H31"
        )
    match = _TOKEN.match(token)
    if match is None:
        raise ComponentSpecError(f"bad {'component' if neurons else 'head'} name {token!r}: "
                            f"expected {_NAMES[neurons]}")
    layer, kind, index = int(match.group(1)), match.group(2), match.group(3)
    if kind == "N" and not neurons:
        raise ComponentSpecError(f"{token!r} is an MLP neuron; only attention heads are accepted "
                            "here (L{layer}H{head}, e.g. L0H29)")
    if kind == "H" and not heads:
        raise ComponentSpecError(_ONLY_NEURONS.format(token=repr(token)))
    unit, count, what = ((Head, heads_per_layer, "head") if kind == "H"
                         else (Neuron, neurons_per_layer, "MLP neuron"))
    if index == "*":
        if count is None:
            raise ComponentSpecError(
                f"{token!r} names a whole layer, which needs the model's {what} count")
        if unit is Head and head_layers is not None and layer not in head_layers:
            raise ComponentSpecError(_no_heads_in(token, layer, head_layers))
        return [unit(layer, i) for i in range(count)]
    return [unit(layer, int(index))]


def validate_heads(heads: Iterable[Component], num_layers: int | None,
                   heads_per_layer: int | None, neurons_per_layer: int | None = None, *,
                   head_layers: Collection[int] | None = None) -> None:
    """Raise ComponentSpecError naming the first component outside a model of ``num_layers``
    layers of ``heads_per_layer`` heads (and MLPs ``neurons_per_layer`` wide): layer or
    index out of range, or a head in a layer without heads (a hybrid model's:
    ``head_layers`` lists those with heads, None for every layer). Each bound is checked
    where given (None: unknown); layers and indices are always zero-based."""
    for component in heads:
        is_neuron = isinstance(component, Neuron)
        what, count, per = (("neuron", neurons_per_layer, "MLP neuron") if is_neuron
                            else ("head", heads_per_layer, "head"))
        if num_layers is not None and not 0 <= component.layer < num_layers:
            raise ComponentSpecError(
                f"{what} {component} is outside the model: layer {component.layer} not in "
                f"0..{num_layers - 1} ({counted(num_layers, 'layer')})"
            )
        if count is not None and not 0 <= component[1] < count:
            raise ComponentSpecError(
                f"{what} {component} is outside the model: {what} {component[1]} not in "
                f"0..{count - 1} ({counted(count, per)} per layer)"
            )
        if component.layer < 0 or component[1] < 0:
            raise ComponentSpecError(f"bad {what} {component}: layer {component.layer} and {what} "
                                f"{component[1]} must be >= 0 (zero-based)")
        if not is_neuron and head_layers is not None and component.layer not in head_layers:
            raise ComponentSpecError(_no_heads_in(f"head {component}", component.layer,
                                             head_layers))


def _no_heads_in(what: str, layer: int, head_layers: Collection[int]) -> str:
    return (f"{what} is outside the model: layer {layer} has no attention heads (it is not "
            f"a self-attention layer); the layers with heads are "
            f"{describe_layers(head_layers)}")


def describe_layers(layers: Collection[int]) -> str:
    """``3, 7, 11, ... 31 (8 layers)``: a list of layer numbers, in one short phrase."""
    ordered = sorted(layers)
    shown = ", ".join(map(str, ordered if len(ordered) <= 8 else ordered[:6]))
    if len(ordered) > 8:
        shown += f", ... {ordered[-1]}"
    return f"{shown} ({len(ordered)} layer{'s' if len(ordered) != 1 else ''})"


def component_tokens(spec: str | Iterable[Any]) -> list[Any]:
    """The names (or components) ``spec`` lists: a '+'-joined string, or a list whose
    names may themselves be '+'-joined (a neuron group's entry in heads.json)."""
    items = [spec] if isinstance(spec, str) else spec
    return [part for item in items
            for part in (item.split("+") if isinstance(item, str) else [item])]


def parse_components(
    spec: str | Iterable[str | Component | tuple[int, int]],
    num_layers: int | None = None,
    heads_per_layer: int | None = None,
    neurons_per_layer: int | None = None,
    *,
    neurons: bool = True,
    head_layers: Collection[int] | None = None,
    heads: bool = True,
) -> list[Component]:
    """Parse ``"L0H29+L3N1234"`` (or a list of names, Heads, Neurons or (layer, head)
    pairs) into sorted, unique components.

    Every component is checked against each of ``num_layers``/``heads_per_layer`` given
    (neurons against ``neurons_per_layer`` when given) and ``L{l}H*``/``L{l}N*`` expand
    to the whole layer/MLP. ``neurons=False`` refuses neurons (``parse_heads``),
    ``heads=False`` heads (a run that locates MLP neurons only).
    ``head_layers``: a hybrid model's layers with heads (``Geometry.head_layers``); a
    head elsewhere is refused.
    """
    return _parse(spec, num_layers, heads_per_layer, neurons_per_layer, neurons=neurons,
                  head_layers=head_layers, heads=heads)


def _parse(spec: str | Iterable[str | Component | tuple[int, int]],
           num_layers: int | None, heads_per_layer: int | None,
           neurons_per_layer: int | None, *, neurons: bool,
           head_layers: Collection[int] | None = None, ranges: bool = True,
           heads: bool = True) -> list[Component]:
    # ranges=False: the counts only expand L{l}H*/L{l}N* (names checked without a model).
    if not isinstance(spec, (str, Iterable)):  # None, 5: not a list of names at all
        raise ComponentSpecError(f"components {spec!r}: give names such as 'L0H29+L1H31' (or a "
                            "list of names, Heads or (layer, head) pairs)")
    if isinstance(spec, str) and not spec.strip():
        raise ComponentSpecError(
            "the head list is empty; write heads as L{layer}H{head} joined by '+', "
            "e.g. L0H29+L1H31"
        )
    tokens = component_tokens(spec)
    if isinstance(spec, str) and any(isinstance(t, str) and not t.strip() for t in tokens):
        what = "component" if neurons else "head"
        raise ComponentSpecError(  # named: 'empty name' alone did not say where
            f"{spec!r}: an empty {what} name (two '+' in a row, or a '+' at an end); write "
            "heads as L{layer}H{head} joined by '+', e.g. L0H29+L1H31")
    found: dict[tuple[int, int, int], Component] = {}  # by component_key: Head(0, 1) and
    for token in tokens:                                 # Neuron(0, 1) are equal tuples
        if isinstance(token, str):
            parsed = _parse_token(token, heads_per_layer, neurons_per_layer, neurons,
                                  head_layers, heads)
        elif isinstance(token, Neuron):
            if not neurons:
                raise ComponentSpecError(f"{token} is an MLP neuron; only attention heads are "
                                    "accepted here (L{layer}H{head}, e.g. L0H29)")
            parsed = [token]
        else:
            parsed = [_head_from_pair(token)]
            if not heads:
                raise ComponentSpecError(_ONLY_NEURONS.format(token=parsed[0]))
        found.update((component_key(c), c) for c in parsed)
    components = list(found.values())
    if ranges:
        validate_heads(components, num_layers, heads_per_layer, neurons_per_layer,
                       head_layers=head_layers)
    else:
        validate_heads(components, None, None)  # zero-based, whatever the model
    return sorted(components, key=component_key)


def parse_heads(
    spec: str | Iterable[str | Head | tuple[int, int]],
    num_layers: int | None = None,
    heads_per_layer: int | None = None,
    *,
    head_layers: Collection[int] | None = None,
) -> list[Head]:
    """Parse ``"L0H29+L1H31"`` (or a list of names or Heads) into sorted, unique Heads
    (a neuron is refused, naming it).

    With ``num_layers``/``heads_per_layer`` given, every head is checked against them (each
    one given) and ``L{l}H*`` expands to the whole layer.
    """
    return parse_components(spec, num_layers, heads_per_layer,  # type: ignore[return-value]
                            neurons=False, head_layers=head_layers)


def check_head_names(spec: str | Iterable[str | Head | tuple[int, int]]) -> None:
    """Raise ComponentSpecError if ``spec`` is malformed whatever the model (``L3H*`` passes).

    For checks before a model is loaded; the layer/head ranges need the model.
    """
    # Any head count: L{l}H* only has to parse here; nothing is checked against it.
    _parse(spec, None, 1, None, neurons=False, ranges=False)


def names_neurons(spec: str | Iterable[str | Component | tuple[int, int]]) -> bool:
    """Whether ``spec`` names any MLP neuron (so the MLP's width is needed to check it)."""
    tokens = component_tokens(spec)
    return any(isinstance(t, Neuron) or (isinstance(t, str) and (m := _TOKEN.match(t.strip()))
                                         is not None and m.group(2) == "N") for t in tokens)


def check_component_names(spec: str | Iterable[str | Component | tuple[int, int]], *,
                          heads: bool = True) -> None:
    """``check_head_names`` for heads and neurons (``L3N*`` passes); ``heads=False``: MLP
    neurons only (a head is refused, naming it)."""
    _parse(spec, None, 1, 1, neurons=True, ranges=False, heads=heads)


def names_a_file(spec: str) -> bool:
    """Whether ``spec`` (an --exclude or --never-ablate) names a head file rather than
    heads: an existing path, a .json or .txt name, or one with a folder in it."""
    path = Path(spec)
    try:
        exists = path.exists()
    except OSError:  # a list of hundreds of heads is too long to be a file's name
        exists = False
    return exists or path.suffix.lower() in (".json", ".txt") or "/" in spec


def _head_from_pair(token: object) -> Head:
    # A Head or a (layer, head) pair given from Python.
    try:
        layer, head = token  # type: ignore[misc]
    except (TypeError, ValueError):
        raise ComponentSpecError(f"bad head {token!r}: expected a name like 'L0H29', a Head or a "
                            "(layer, head) pair") from None
    if type(layer) is not int or type(head) is not int:  # plain ints (the usual) skip this
        from lm_eval_headloc.common.checks import (  # sklearn: only imported when needed
            UsageError,
            check_number,
        )

        try:
            layer = check_number(layer, "layer", whole=True)
            head = check_number(head, "head", whole=True)
        except UsageError as err:
            raise ComponentSpecError(f"bad head {token!r}: {err}") from None
    return Head(layer, head)


def format_heads(heads: str | Iterable[str | Component | tuple[int, int]]) -> str:
    """``[Head(1, 31), Neuron(0, 7), Head(0, 29)]`` -> ``"L0H29+L0N7+L1H31"`` (sorted,
    unique; a plain pair is a head). Names (``"L0H1"``, ``["L1H2+L0H1"]``, as
    ``read_heads_file`` gives them) are accepted too; nothing formats to ``""``. A
    component ``parse_components`` refuses (``(-1, 2)``) raises ComponentSpecError."""
    if isinstance(heads, str) and not heads.strip():
        return ""
    return "+".join(map(str, parse_components(heads)))


def _json_object(path: str | Path) -> dict[str, Any] | None:
    """A ``.json`` head file's object (a ranking), or None for a list, another kind of
    file, or one that cannot be read (``read_heads_file`` says why)."""
    path = Path(path)
    if path.suffix.lower() != ".json":
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def ranked_task(path: str | Path) -> str | None:
    """The task a ranking file was ranked for (``headloc-harness``'s heads.json says it),
    or None for a plain list of heads or a file that does not say."""
    task = (_json_object(path) or {}).get("task")
    return task if isinstance(task, str) else None


def recorded_harmless(path: str | Path) -> set[str]:
    """The components a ranking file (heads-<task>.json) records as not hurting the task:
    a measured or estimated ``effect`` that leaves the score as it was or improves it. A
    top-k lists such components when fewer hurt; their places say nothing of the task.
    (An entry with no effect recorded is not among them.)"""
    from lm_eval_headloc.common.files import read_json

    data = read_json(path, ComponentSpecError)
    higher = bool(data.get("higher_is_better", True)) if isinstance(data, dict) else True
    entries = data.get("heads", []) if isinstance(data, dict) else []
    return {str(entry.get("head") or entry.get("neuron") or entry.get("group"))
            for entry in entries
            if isinstance(entry, dict) and isinstance(entry.get("effect"), (int, float))
            and not (-entry["effect"] if higher else entry["effect"]) > 0}


def ranking_top_k(path: str | Path) -> int | None:
    """How many entries a run's ranking file names as its located set (its ``top_k``
    list: the first K of its ``heads``), or None for a file that is no run's ranking (a
    list of heads, a text file, ``universal.json``). A ``top_k`` list that is not the
    start of the ``heads`` list is refused: which heads were meant cannot be told."""
    data = _json_object(path)
    top = None if data is None else data.get("top_k")
    if not isinstance(top, list):
        return None
    items = data.get("heads")
    named = [(item.get("head") or item.get("neuron") or item.get("group"))
             if isinstance(item, dict) else item
             for item in (items if isinstance(items, list) else [])[:len(top)]]
    if not top or named != top:
        raise ComponentSpecError(f"{path}: its top_k list is not the start of its heads list; "
                            "give ablate_top=K for its first K heads")
    return len(top)


def _heads_in_json(data: object, path: Path) -> list[str]:
    # Accepted: ["L0H1", ...], {"heads": [...]}, where items are names or
    # {"head": "L0H1", ...}, {"neuron": "L3N12", ...} or {"group": "L3G1", "neurons":
    # "L3N0+L3N2+..."} records (the ranked list headloc-harness writes; a neuron group is
    # one entry of the ranking, its neurons '+'-joined).
    items = data.get("heads") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ComponentSpecError(
            f"{path}: expected a JSON list of heads or an object with a 'heads' list"
        )
    names = []
    for number, item in enumerate(items, start=1):
        name = (item.get("neurons" if "group" in item else "head", item.get("neuron"))
                if isinstance(item, dict) else item)
        if not isinstance(name, str):
            raise ComponentSpecError(f"{path}: entry {number} is not a head; expected "
                                     "'L0H29' or {\"head\": \"L0H29\", ...}")
        names.append(_checked_entry(name, path, f"entry {number}"))
    return names


#: What a head file's entry must look like to be echoed in an error: a name that may be
#: misspelt (L0H99, L3h1, L2H1 + L0H3), not arbitrary text.
_NAME_ATTEMPT = re.compile(r"L[0-9][0-9A-Za-z*+ ]*", re.ASCII)


def _checked_entry(entry: str, path: Path, where: str) -> str:
    """``entry`` (one line or item of a head file, maybe '+'-joined) if its names parse,
    else ComponentSpecError naming the file, where in it, and the entry."""
    # Checked here, not only when the heads are used: a file of junk must not read as a
    # list of heads (format_heads, overlap and verify take the names as they are).
    if entry.strip() and not _NAME_ATTEMPT.fullmatch(entry.strip()):
        # Not even a misspelt head: the file may be anything (--exclude /etc/shadow), and
        # its text is not ours to print.
        raise ComponentSpecError(f"{path}, {where}: not a head name (e.g. L0H29, L3N12 or "
                                 "L0H29+L1H31; its text is not shown)")
    if not entry.strip() or any(len(part.split()) > 1 for part in entry.split("+")):
        problem = "is empty" if not entry.strip() else "holds names separated by spaces"
        unit = where.split()[0]  # "line" or "entry"
        raise ComponentSpecError(f"{path}, {where}: {entry!r} {problem}; write one head per "
                            f"{unit}, or several joined by '+' (e.g. L0H29+L1H31)")
    try:
        check_component_names(entry)
    except ComponentSpecError as err:
        raise ComponentSpecError(f"{path}, {where}: {err}") from None
    return entry


def shown_name(name: str) -> str:
    """An entry of a ranking file for a table: a neuron group's (its neurons '+'-joined)
    as its first and last neuron and its size, so a 400-neuron group takes one cell."""
    parts = name.split("+")
    return name if len(parts) <= 3 else f"{parts[0]}…{parts[-1]} ({len(parts)} neurons)"


def check_top(top: object) -> int:
    """``ablate_top`` as an int >= 1, else ComponentSpecError (True, 0, 2.5 and "3" are refused).

    A whole float is the whole number (``arg_string.as_written``: lm-eval's command line
    types a signed ``-3`` or ``+3`` as a float)."""
    from lm_eval_headloc.common.checks import (  # sklearn: only imported when needed
        UsageError,
        check_number,
    )

    try:
        return check_number(as_written(top), "ablate_top", whole=True, min_val=1)
    except UsageError as err:
        raise ComponentSpecError(str(err)) from None


def read_heads_file(path: str | Path, top: int | None = None) -> list[str]:
    """Head names from a file, in file order (ranked files: best first).

    A ``.json`` file holds a list of heads or an object with a ``heads`` list (as
    ``headloc-harness`` writes); any other file holds one head per line (``#`` comments
    and blank lines ignored; ``+``-joined lines allowed). ``top=K`` keeps the first K.
    Every entry must be a head or neuron name (``L3H*`` passes: the model is not known
    here), else ComponentSpecError naming the file, the line or entry, and the name.
    """
    if top is not None:
        top = check_top(top)
    if not isinstance(path, (str, os.PathLike)):
        raise ComponentSpecError(f"head file {path!r}: give a path")
    path = Path(path)
    if path.is_dir():
        # A run folder (a sweep's: its cells'): name a ranking in it.
        ranked = [found for pattern in ("heads.json", "heads-*.json", "*/heads.json")
                  for found in sorted(path.glob(pattern))]
        raise ComponentSpecError(f"{path} is a folder, not a head file" + (
            f"; give a ranking file in it, e.g. {ranked[0]}" if ranked else ""))
    if not path.is_file():
        raise ComponentSpecError(f"head file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a Windows editor's BOM is no text
    except UnicodeDecodeError:
        raise ComponentSpecError(f"{path} is not a head file: not UTF-8 text (expected JSON or "
                            "one head per line)") from None
    except OSError as err:
        raise ComponentSpecError(f"{path} cannot be read: {err.strerror or err}") from None
    if path.suffix.lower() == ".json":
        from lm_eval_headloc.common.files import parse_json

        data = parse_json(text, path, ComponentSpecError)
        names = _heads_in_json(data, path)  # a group's "+"-joined neurons: one entry
    else:
        names = []
        for number, line in enumerate(text.splitlines(), start=1):
            line = line.split("#", 1)[0].strip()
            if line:
                _checked_entry(line, path, f"line {number}")
                names.extend(part.strip() for part in line.split("+"))
    first: dict[str, int] = {}
    for place, entry in enumerate(names, start=1):
        for name in (part.strip() for part in entry.split("+")):  # inside a pair too
            if name in first:  # overlap counted it twice (a rate of 1.0 where it was 0.8)
                raise ComponentSpecError(f"{path} names {name} twice (its entries "
                                         f"{first[name]} and {place}); a list of heads names "
                                         "each once")
            first[name] = place
    if top is not None:
        if top > len(names):
            raise ComponentSpecError(
                f"ablate_top={top} but {path} lists only {counted(len(names), 'entry', 'entries')}"
            )
        names = names[:top]
    if not names:
        raise ComponentSpecError(f"{path} lists no heads")
    return names
