"""Errors the engine and the features raise for a bad argument.

:class:`ParamError` carries the name of the offending parameter (``param``), so the CLI can
name the flag (``--batch-size``, ``--temp``...) without parsing message text.
"""

from __future__ import annotations


class ParamError(ValueError):
    """A bad value for the parameter ``param``; the message says what is allowed."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message
