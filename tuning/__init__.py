"""Beam-shape tuning for redrafter-mlx: chip detection, presets, the budgeted grid search,
saved profiles, and :func:`resolve_beam_shape` for the chat/generate/bench commands.

Only the standard library is imported here, so importing ``tuning`` stays cheap.
"""

from tuning.defaults import ShapeChoice, preset_choice, resolve_beam_shape, tuned_choice

__all__ = ["ShapeChoice", "preset_choice", "resolve_beam_shape", "tuned_choice"]
