"""Where a run's time goes: the seconds each phase of one process's run took.

A command runs under one ``PhaseClock`` (``run_clock``); the places that do the work say
which phase they are (``phase("model load")``), once, where the work happens: ``prepare``
checks the tasks, ``load_model`` loads, ``run_plan`` measures, whatever command calls
them. Time is charged to the innermost open phase only, so nested phases never count
twice (the confirmation's measurements are measurements, its refits its own). The
console script starts its clock at the process's start, so the interpreter's start and
the imports before the command are in "start-up and imports".

A run record keeps one ``snapshot`` per session (``runs.record.RunRecord``); the report and the
command line's last line say it (``timings_line``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["STARTUP", "PhaseClock", "current", "on_clock", "phase", "process_age", "run_clock",
           "timed", "timings_item", "timings_line"]

#: The phase a clock started at the process's start is in until its first named phase.
STARTUP = "start-up and imports"


#: Seconds a process may be older than the program it runs (the interpreter's start
#: before site reads the ``.pth`` files) before it counts as one a script ``exec``'d.
EXEC_SLACK = 1.0


def process_age() -> float | None:
    """Seconds since this program started, or None where not known: the process's age
    (Linux ``/proc``), unless the start-up hook noted a later start (``SITE_STARTED``,
    when site read its ``.pth`` file) — a script that ``exec``s ``headloc-harness``
    (``scripts/run_default.sh``: its pip install) is not this program's start-up."""
    age = _process_age()
    hook = sys.modules.get("_lm_eval_headloc_startup")
    started = getattr(hook, "SITE_STARTED", None)
    if started is None:
        return age
    program = max(0.0, os.times().elapsed - started)
    return program if age is None or age - program > EXEC_SLACK else age


def _process_age() -> float | None:
    try:
        with open("/proc/self/stat") as stat:
            # Field 22, after the command name in parentheses (which may hold spaces).
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return max(0.0, up - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class PhaseClock:
    """Seconds per phase since ``started`` (a ``time.perf_counter`` value; None: now),
    ``first`` the phase open from then until the first ``phase``."""

    def __init__(self, started: float | None = None, first: str | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}
        # Open phases, innermost last; None holds a nested clock's time (``absorb``).
        self._open: list[str | None] = [first] if first else []
        self._first_open = bool(first)  # until the first ``phase`` begins
        self._since = self.started

    def _charge(self) -> None:
        now = time.perf_counter()
        if self._open and self._open[-1] is not None:
            name = self._open[-1]
            self.seconds[name] = self.seconds.get(name, 0.0) + now - self._since
        self._since = now

    @contextlib.contextmanager
    def phase(self, name: str | None) -> Iterator[None]:
        """Charge the time inside to ``name`` (and not to the phase around it)."""
        self._charge()
        if self._first_open:  # e.g. start-up ends where the command's first phase begins
            self._open.clear()
            self._first_open = False
        self._open.append(name)
        try:
            yield
        finally:
            self._charge()
            self._open.pop()

    def absorb(self, other: PhaseClock) -> None:
        """Add a nested clock's phases (its time was held out of this clock's)."""
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def whole(self) -> float:
        return time.perf_counter() - self.started

    def snapshot(self) -> dict[str, Any]:
        """What a run records: the whole time so far, each phase's seconds (in the order
        first entered) and the rest, the time in no phase."""
        self._charge()
        whole = self.whole()
        phases = {name: round(seconds, 2) for name, seconds in self.seconds.items()}
        return {"whole": round(whole, 2), "phases": phases,
                "other": round(max(0.0, whole - sum(self.seconds.values())), 2)}


_current: PhaseClock | None = None


def current() -> PhaseClock | None:
    """The clock of the command running now, if any."""
    return _current


@contextlib.contextmanager
def run_clock(started: float | None = None, first: str | None = None
              ) -> Iterator[PhaseClock]:
    """The clock a command runs under: a new one (``started``, ``first``: ``PhaseClock``'s),
    or, inside another command's (a sweep's cells), one of its own whose phases are added
    to the outer clock's when it ends."""
    global _current
    outer = _current
    clock = PhaseClock(started, first)
    _current = clock
    try:
        if outer is None:
            yield clock
        else:
            with outer.phase(None):
                yield clock
    finally:
        _current = outer
        if outer is not None:
            outer.absorb(clock)


def on_clock(function: Any) -> Any:
    """Decorator for a command's Python API: it runs under the running command's clock
    (the command line's), else one of its own for the call."""
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _current is not None:
            return function(*args, **kwargs)
        with run_clock():
            return function(*args, **kwargs)
    return wrapper


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """``name``'s phase on the running command's clock (nothing where none runs)."""
    if _current is None:
        yield
        return
    with _current.phase(name):
        yield


def _seconds(value: float) -> str:
    if value >= 90:
        return f"{value / 60:.1f} min"
    return f"{value:.1f} s" if value < 10 else f"{value:.0f} s"


def timings_item(sessions: Sequence[Mapping[str, Any]]) -> str:
    """A report's time line: ``timings_line`` as a list item naming where it is kept."""
    return f"- time: {timings_line(sessions)} (config.json's timings)"


def timings_line(sessions: Sequence[Mapping[str, Any]]) -> str:
    """One line: the whole time and each phase's (the largest first), of the last session;
    a run resumed over several sessions says how many and their sum."""
    last = sessions[-1]
    phases = sorted(last.get("phases", {}).items(), key=lambda item: -item[1])
    parts = [f"{name} {_seconds(seconds)}" for name, seconds in phases if seconds >= 0.05]
    if last.get("other", 0) >= 0.05:
        parts.append(f"other {_seconds(last['other'])}")
    line = f"{_seconds(last['whole'])} whole" + (f": {', '.join(parts)}" if parts else "")
    if len(sessions) > 1:
        total = sum(float(s.get("whole", 0.0)) for s in sessions)
        line += (f" (this session; the run took {len(sessions)} sessions, "
                 f"{_seconds(total)} in all)")
    return line


def timed(name: str) -> Any:
    """Decorator: every call of the function is ``name``'s phase."""
    def decorate(function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with phase(name):
                return function(*args, **kwargs)
        return wrapper
    return decorate
