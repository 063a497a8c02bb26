"""Checkpoint conversion: Hugging Face / PyTorch / GGUF base models and ReDrafter drafters -> MLX.

Public API::

    from weights_convert import convert, ConversionError
    summary = convert("lmsys/vicuna-7b-v1.3", "~/models/vicuna-7b", quantize=True)

Importing this package is cheap: MLX is imported only when a conversion runs.
"""

from __future__ import annotations

from weights_convert.errors import ConversionError, UnsafePickleError

__all__ = ["ConversionError", "UnsafePickleError", "convert"]


def convert(*args, **kwargs):
    """Convert a checkpoint; see :func:`weights_convert.conversion.convert` for the arguments."""
    from weights_convert.conversion import convert as _convert

    return _convert(*args, **kwargs)
