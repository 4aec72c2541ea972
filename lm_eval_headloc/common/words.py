"""Numbers in sentences: ``counted(1, "head")`` is "1 head", ``ordinal(3)`` is "3rd",
``signed(-0.0)`` is "+0.0000"."""

from __future__ import annotations

__all__ = ["counted", "ordinal", "signed"]


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun plural unless ``n`` is 1 (``plural``: where adding an
    s is wrong)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def ordinal(n: int) -> str:
    """``n`` as an English ordinal: 1st, 2nd, 3rd, 4th, 11th, 12th, 13th, 21st, ..."""
    suffix = "th" if n % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def signed(value: float, places: int = 4) -> str:
    """``value`` with its sign, to ``places`` decimals; what rounds to zero is ``+0.0000``,
    never ``-0.0000`` (a fit's signed zero, or a change of -1e-6, is no change)."""
    return f"{round(float(value), places) + 0.0:+.{places}f}"
