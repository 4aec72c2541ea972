"""Head notation: ``L{layer}H{head}``, zero-based; several heads joined with ``+``.

``L0H29+L1H31`` names two heads, ``L3H*`` every head of layer 3. Commas are taken by
lm-eval's ``model_args``, hence ``+``. Parsing sorts and de-duplicates, so formatting a
parsed list round-trips and the order a user wrote heads in does not matter.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from .errors import UserError

__all__ = [
    "Head",
    "HeadSpecError",
    "check_head_names",
    "check_top",
    "format_heads",
    "parse_heads",
    "read_heads_file",
    "validate_heads",
]

_TOKEN = re.compile(r"^L(\d+)H(\d+|\*)$")


class HeadSpecError(UserError):
    """A head list that cannot be parsed or does not fit the model (a user mistake)."""


class Head(NamedTuple):
    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    def flat_index(self, heads_per_layer: int) -> int:
        """Flat index ``layer * heads_per_layer + head`` (the column of a design matrix)."""
        return self.layer * heads_per_layer + self.head

    @classmethod
    def from_flat_index(cls, index: int, heads_per_layer: int) -> Head:
        return cls(*divmod(int(index), heads_per_layer))


def _parse_token(token: str, heads_per_layer: int | None) -> list[Head]:
    token = token.strip()
    if not token:
        raise HeadSpecError(
            "empty head name in the head list (two '+' in a row, or a '+' at an end); "
            "write heads as L{layer}H{head} joined by '+', e.g. L0H29+L1H31"
        )
    match = _TOKEN.match(token)
    if match is None:
        raise HeadSpecError(
            f"bad head name {token!r}: expected L{{layer}}H{{head}} with zero-based "
            "non-negative integers (e.g. L0H29) or L{layer}H* for a whole layer"
        )
    layer = int(match.group(1))
    if match.group(2) == "*":
        if heads_per_layer is None:
            raise HeadSpecError(
                f"{token!r} names a whole layer, which needs the model's head count"
            )
        return [Head(layer, h) for h in range(heads_per_layer)]
    return [Head(layer, int(match.group(2)))]


def validate_heads(heads: Iterable[Head], num_layers: int, heads_per_layer: int) -> None:
    """Raise HeadSpecError naming the first head outside a ``num_layers × heads_per_layer``
    model (layer or head out of range)."""
    for head in heads:
        if not 0 <= head.layer < num_layers:
            raise HeadSpecError(
                f"head {head} is outside the model: layer {head.layer} not in "
                f"0..{num_layers - 1} ({num_layers} layers)"
            )
        if not 0 <= head.head < heads_per_layer:
            raise HeadSpecError(
                f"head {head} is outside the model: head {head.head} not in "
                f"0..{heads_per_layer - 1} ({heads_per_layer} heads per layer)"
            )


def parse_heads(
    spec: str | Iterable[str | Head | tuple[int, int]],
    num_layers: int | None = None,
    heads_per_layer: int | None = None,
) -> list[Head]:
    """Parse ``"L0H29+L1H31"`` (or a list of names or Heads) into sorted, unique Heads.

    With ``num_layers``/``heads_per_layer`` given, every head is checked against the model and
    ``L{l}H*`` expands to the whole layer.
    """
    if isinstance(spec, str):
        if not spec.strip():
            raise HeadSpecError(
                "the head list is empty; write heads as L{layer}H{head} joined by '+', "
                "e.g. L0H29+L1H31"
            )
        tokens: list[str | Head | tuple[int, int]] = list(spec.split("+"))
    else:
        tokens = list(spec)
    heads: set[Head] = set()
    for token in tokens:
        if isinstance(token, str):
            heads.update(_parse_token(token, heads_per_layer))
        else:
            heads.add(_head_from_pair(token))
    if num_layers is not None and heads_per_layer is not None:
        validate_heads(heads, num_layers, heads_per_layer)
    else:
        for head in heads:
            if head.layer < 0 or head.head < 0:
                raise HeadSpecError(f"bad head {head}: layer and head are zero-based")
    return sorted(heads)


def check_head_names(spec: str | Iterable[str | Head | tuple[int, int]]) -> None:
    """Raise HeadSpecError if ``spec`` is malformed whatever the model (``L3H*`` passes).

    For checks before a model is loaded; the layer/head ranges need the model.
    """
    parse_heads(spec, heads_per_layer=1)  # any head count: L{l}H* only has to parse here


def _head_from_pair(token: object) -> Head:
    # A Head or a (layer, head) pair given from Python.
    try:
        layer, head = token  # type: ignore[misc]
    except (TypeError, ValueError):
        raise HeadSpecError(f"bad head {token!r}: expected a name like 'L0H29', a Head or a "
                            "(layer, head) pair") from None
    if type(layer) is not int or type(head) is not int:  # plain ints (the usual) skip this
        from .checks import UsageError, check_number  # sklearn: only imported when needed

        try:
            layer = check_number(layer, "layer", whole=True)
            head = check_number(head, "head", whole=True)
        except UsageError as err:
            raise HeadSpecError(f"bad head {token!r}: {err}") from None
    return Head(layer, head)


def format_heads(heads: Iterable[Head | tuple[int, int]]) -> str:
    """``[Head(1, 31), Head(0, 29)]`` -> ``"L0H29+L1H31"`` (sorted, unique)."""
    return "+".join(str(Head(*h)) for h in sorted({Head(*h) for h in heads}))


def _heads_in_json(data: object, path: Path) -> list[str]:
    # Accepted: ["L0H1", ...], {"heads": [...]}, where items are names or
    # {"head": "L0H1", ...} records (the ranked list headloc-harness writes).
    items = data.get("heads") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise HeadSpecError(
            f"{path}: expected a JSON list of heads or an object with a 'heads' list"
        )
    names = []
    for item in items:
        name = item.get("head") if isinstance(item, dict) else item
        if not isinstance(name, str):
            raise HeadSpecError(f"{path}: bad head entry {item!r}; expected 'L0H29' or "
                                "{\"head\": \"L0H29\", ...}")
        names.append(name)
    return names


def check_top(top: object) -> int:
    """``ablate_top`` as an int >= 1, else HeadSpecError (True, 0, 2.5 and "3" are refused)."""
    from .checks import UsageError, check_number  # sklearn: only imported when needed

    try:
        return check_number(top, "ablate_top", whole=True, min_val=1)
    except UsageError as err:
        raise HeadSpecError(str(err)) from None


def read_heads_file(path: str | Path, top: int | None = None) -> list[str]:
    """Head names from a file, in file order (ranked files: best first).

    A ``.json`` file holds a list of heads or an object with a ``heads`` list (as
    ``headloc-harness`` writes); any other file holds one head per line (``#`` comments
    and blank lines ignored; ``+``-joined lines allowed). ``top=K`` keeps the first K.
    """
    if top is not None:
        top = check_top(top)
    path = Path(path)
    if not path.is_file():
        raise HeadSpecError(f"head file not found: {path}")
    text = path.read_text()
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise HeadSpecError(f"{path} is not valid JSON: {err}") from None
        names = _heads_in_json(data, path)
    else:
        names = []
        for line in text.splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                names.extend(part.strip() for part in line.split("+"))
    if top is not None:
        if top > len(names):
            raise HeadSpecError(
                f"ablate_top={top} but {path} lists only {len(names)} head(s)"
            )
        names = names[:top]
    if not names:
        raise HeadSpecError(f"{path} lists no heads")
    return names
