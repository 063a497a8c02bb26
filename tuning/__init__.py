"""Beam-shape tuning for redrafter-mlx: chip detection, presets, the budgeted grid search,
saved profiles, and :func:`resolve_beam_shape` for the chat/generate/bench commands.

Only the standard library is imported here, so importing ``tuning`` stays cheap.
"""

from tuning.defaults import ShapeChoice, resolve_beam_shape

__all__ = ["ShapeChoice", "resolve_beam_shape"]
