"""The package's exceptions: one root, with the user's mistakes told apart from bugs.

Every exception ``lm_eval_headloc`` raises on purpose is a :class:`HeadlocError`, so a
caller can catch the package's failures in one ``except`` clause. Beneath it:

- :class:`UserError`: something the user gave is wrong or missing (an argument, a file
  they named, a task, a run folder, a Ray address). Its message is one line that names
  the value and says what would work; the ``headloc-harness`` command prints exactly that
  line and exits with status 2, and the stock ``lm_eval`` command prints it without a
  traceback. It is also a ``ValueError``, which is what these errors were before they
  had a root, so existing ``except ValueError`` clauses keep catching them.
- :class:`InternalError`: the package broke a promise of its own (say an install that
  lacks the package's own task YAMLs). No change to the user's command fixes that, so it
  keeps its traceback, which is what a bug report needs.

Anything else (a ``FileNotFoundError`` from deep inside a library, a ``KeyError``) is not
a ``UserError`` either and also keeps its traceback: only an error that was raised as the
user's mistake, with a message written for them, is reported as one.

The classes users catch by name (``ComponentSpecError``, ``AblationError``, ``UsageError``,
``MetricError``, ``UnknownTaskError``, ``StoreError``, ``RunFolderError``, ``WorkerError``,
``AttentionOutputNotFound``) stay in their modules and derive from ``UserError``.
"""

from __future__ import annotations

__all__ = ["HeadlocError", "InternalError", "UserError", "one_line"]


class HeadlocError(Exception):
    """The root of every exception ``lm_eval_headloc`` raises on purpose."""


class UserError(HeadlocError, ValueError):
    """A mistake in what the user gave: reported in one line (exit status 2), no
    traceback."""


class InternalError(HeadlocError, RuntimeError):
    """A failure of the package itself, not of the user's input: keeps its traceback."""


def one_line(error: BaseException) -> str:
    """The line a user error is reported with: its message's first line, or the class
    name when it has no message (a bare ``raise UserError()`` must still say something)."""
    text = str(error)
    return text.splitlines()[0] if text.strip() else type(error).__name__

