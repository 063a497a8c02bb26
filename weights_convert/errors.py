"""The one error type the converter raises: a message naming the problem and the fix."""

from __future__ import annotations

from redrafter_mlx.engine.base.errors import RedrafterError


class ConversionError(RedrafterError):
    """A checkpoint cannot be converted. ``str(error)`` names the problem and how to fix it."""


class UnsafePickleError(ConversionError):
    """A pickle inside a PyTorch ``.bin`` asked for something outside the allow-list."""
