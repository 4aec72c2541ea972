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

__all__ = [
    "Head",
    "HeadSpecError",
    "format_heads",
    "parse_heads",
    "read_heads_file",
    "validate_heads",
]

_TOKEN = re.compile(r"^L(\d+)H(\d+|\*)$")


class HeadSpecError(ValueError):
    """A head list that cannot be parsed or does not fit the model (a user mistake)."""


class Head(NamedTuple):
    layer: int
    head: int

    def __str__(self) -> str:
        return f"L{self.layer}H{self.head}"

    def index(self, num_heads: int) -> int:
        """Flat index ``layer * num_heads + head`` (the column of a design matrix)."""
        return self.layer * num_heads + self.head

    @classmethod
    def from_index(cls, index: int, num_heads: int) -> Head:
        return cls(*divmod(int(index), num_heads))


def _parse_token(token: str, num_heads: int | None) -> list[Head]:
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
        if num_heads is None:
            raise HeadSpecError(
                f"{token!r} names a whole layer, which needs the model's head count"
            )
        return [Head(layer, h) for h in range(num_heads)]
    return [Head(layer, int(match.group(2)))]


def validate_heads(heads: Iterable[Head], num_layers: int, num_heads: int) -> None:
    """Raise HeadSpecError naming the first head outside a ``num_layers × num_heads`` model."""
    for head in heads:
        if not 0 <= head.layer < num_layers:
            raise HeadSpecError(
                f"head {head} is outside the model: layer {head.layer} not in "
                f"0..{num_layers - 1} ({num_layers} layers)"
            )
        if not 0 <= head.head < num_heads:
            raise HeadSpecError(
                f"head {head} is outside the model: head {head.head} not in "
                f"0..{num_heads - 1} ({num_heads} heads per layer)"
            )


def parse_heads(
    spec: str | Iterable[str | Head | tuple[int, int]],
    num_layers: int | None = None,
    num_heads: int | None = None,
) -> list[Head]:
    """Parse ``"L0H29+L1H31"`` (or a list of names or Heads) into sorted, unique Heads.

    With ``num_layers``/``num_heads`` given, every head is checked against the model and
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
            heads.update(_parse_token(token, num_heads))
        else:
            layer, head = token
            if isinstance(layer, bool) or isinstance(head, bool):
                raise HeadSpecError(f"bad head {token!r}: layer and head must be integers")
            heads.add(Head(int(layer), int(head)))
    if num_layers is not None and num_heads is not None:
        validate_heads(heads, num_layers, num_heads)
    else:
        for head in heads:
            if head.layer < 0 or head.head < 0:
                raise HeadSpecError(f"bad head {head}: layer and head are zero-based")
    return sorted(heads)


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


def read_heads_file(path: str | Path, top: int | None = None) -> list[str]:
    """Head names from a file, in file order (ranked files: best first).

    A ``.json`` file holds a list of heads or an object with a ``heads`` list (as
    ``headloc-harness`` writes); any other file holds one head per line (``#`` comments
    and blank lines ignored; ``+``-joined lines allowed). ``top=K`` keeps the first K.
    """
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
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise HeadSpecError(f"ablate_top={top!r}: must be a whole number >= 1")
        if top > len(names):
            raise HeadSpecError(
                f"ablate_top={top} but {path} lists only {len(names)} head(s)"
            )
        names = names[:top]
    if not names:
        raise HeadSpecError(f"{path} lists no heads")
    return names
