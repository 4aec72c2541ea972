"""The one equality by contents of the package's results that hold numpy arrays (a
dataclass's own ``==`` compares its fields as a tuple, which raises on arrays: "the truth
value of an array is ambiguous")."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields, is_dataclass
from typing import Any

import numpy as np

__all__ = ["same_values"]


def same_values(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` hold the same values: arrays by shape and values, NaN equal
    to NaN (an unknown effect is the same unknown); dataclasses, mappings and sequences
    item by item; an object without an equality of its own (the run's ``HeadTypes``) by its
    attributes."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        try:
            return a.shape == b.shape and bool(np.array_equal(a, b, equal_nan=True))
        except TypeError:  # not numbers: no NaN to match
            return a.shape == b.shape and bool(np.array_equal(a, b))
    if type(a) is not type(b) and not (isinstance(a, float) and isinstance(b, float)):
        return bool(a == b) if isinstance(a, (int, float)) else False
    if is_dataclass(a):
        return all(same_values(getattr(a, f.name), getattr(b, f.name)) for f in fields(a)
                   if f.compare)
    if isinstance(a, Mapping):
        return a.keys() == b.keys() and all(same_values(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(same_values, a, b))
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):
        return same_values(vars(a), vars(b))
    return bool(a == b)
