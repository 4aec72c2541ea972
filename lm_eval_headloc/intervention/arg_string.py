"""lm-eval's ``--model_args`` string (``pretrained=…,dtype=…``), parsed in this one place.

``ModelArgs.parse`` splits the text once and keeps both readings a run needs: the parts as
given, so that a rewrite of one argument (the embedded model's folder, a worker's device)
leaves every other part exactly as the user wrote it, and ``args``, each value typed as
lm-eval types it (``lm_eval.utils.simple_parse_args_string``: what the model receives),
read on first use (lm-eval is imported then, not for a check of the names).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["ModelArgs", "as_written"]


@dataclass(frozen=True)
class ModelArgs:
    """One ``--model_args`` text: ``parts`` (its comma-separated parts as written) and
    ``args`` (name -> typed value, lm-eval's reading)."""

    text: str
    parts: tuple[str, ...]

    @staticmethod
    def parse(text: str | None) -> ModelArgs:
        """The arguments of ``text`` (None or "" has none); parsed once per distinct text."""
        return _parsed(text or "")

    @functools.cached_property
    def args(self) -> Mapping[str, Any]:
        from lm_eval.utils import simple_parse_args_string

        return MappingProxyType(simple_parse_args_string(self.text))

    @property
    def names(self) -> frozenset[str]:
        """The arguments given, by name (spaces around a name ignored, as our checks
        compare them)."""
        return frozenset(part.split("=", 1)[0].strip() for part in self.parts if part.strip())

    def given_twice(self) -> str | None:
        """The first argument the text gives more than once (lm-eval keeps the last, so
        ``ablate=L0H1,ablate=L1H2`` would drop L0H1 without a word), or None."""
        seen: set[str] = set()
        for part in self.parts:
            name = part.split("=", 1)[0].strip()
            if name and name in seen:
                return name
            seen.add(name)
        return None

    def get(self, name: str, default: Any = None) -> Any:
        return self.args.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def without(self, *names: str) -> str:
        """The text less the parts that give ``names`` (and less empty parts)."""
        return ",".join(part for part in self.parts if part.strip()
                        and part.split("=", 1)[0].strip() not in names)


def as_written(value: Any) -> Any:
    """A whole-number argument as the user wrote it: lm-eval's parser types a signed
    ``-3`` or ``+3`` as a float (``-3.0``, ``3.0``), so a whole float is the int it was
    written as (and an error message names ``-3``, not ``-3.0``); anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@functools.lru_cache(maxsize=256)
def _parsed(text: str) -> ModelArgs:
    return ModelArgs(text, tuple(text.split(",")))
