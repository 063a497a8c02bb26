"""The package's error base, and the error for a bad argument.

:class:`RedrafterError` is the base of every error the package raises for a problem its user
can fix (a bad flag or argument, a model that cannot load, a file that cannot be read, a
conversion or a tuning run that cannot go on); the message names the problem and the fix.
Each such class also keeps the standard base it always had (``ValueError``, ``OSError``,
``RuntimeError``), so ``except ValueError`` and the like still catch what they caught. The
CLI reports any of them as one ``error:`` line (``cli/errors.py``'s ``user_errors``).

:class:`ParamError` carries the name of the offending parameter (``param``), so the CLI can
name the flag (``--batch-size``, ``--temp``...) without parsing message text.
"""

from __future__ import annotations


class RedrafterError(Exception):
    """A problem the user can fix; ``str(error)`` names it and the fix."""


class ParamError(RedrafterError, ValueError):
    """A bad value for the parameter ``param``; the message says what is allowed."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
