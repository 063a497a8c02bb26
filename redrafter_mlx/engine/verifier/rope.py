"""Rotary position embeddings for every supported family: default, linear and llama3 scaling.

Our own small module (instead of mlx-lm's) so that importing the engine does not import
mlx-lm and transformers (seconds of start-up for every command). Parity with mlx-lm's rope
is tested. ``freqs`` are the rotation periods per pair of dimensions: angle = pos / freq.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn


def rope_periods(dims: int, base: float, scaling: dict | None) -> mx.array:
    """(dims/2,) float32 periods for a HF ``rope_scaling`` config (None = no scaling)."""
    periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    kind = (scaling or {}).get("type") or (scaling or {}).get("rope_type") or "default"
    if kind == "default":
        return periods
    if kind == "linear":
        return periods * scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_context = scaling.get("original_max_position_embeddings", 8192)
        wavelens = 2 * math.pi * periods
        scaled = mx.where(wavelens > old_context / low, periods * factor, periods)
        medium = (wavelens > old_context / high) & (wavelens < old_context / low)
        smooth = (old_context / wavelens - low) / (high - low)
        return mx.where(medium, scaled / ((1 - smooth) / factor + smooth), scaled)
    raise ValueError(
        f"rope_scaling type {kind!r} is not supported (supported: linear, llama3); "
        f"this model is not a configuration we can run"
    )


class RoPE(nn.Module):
    def __init__(self, dims: int, base: float, traditional: bool, scaling: dict | None):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        self._freqs = rope_periods(dims, base, scaling)

    def __call__(self, x: mx.array, offset) -> mx.array:
        """Fused kernel: x (N, ..., T, D), offset an int or (N,) array of start positions."""
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )

    def tables(self, positions: mx.array):
        """cos/sin at ``positions`` (B, T): two (B, T, 1, dims/2) float32 arrays."""
        angles = positions.astype(mx.float32)[..., None] / self._freqs
        return mx.cos(angles)[:, :, None, :], mx.sin(angles)[:, :, None, :]
