"""The beam-shape presets live in the engine (``redrafter_mlx.engine.loop.presets``): the engine's
default plan starts from them; this name stays for the tuner and its callers."""

from redrafter_mlx.engine.loop.presets import (
    DEFAULT_PRESET,
    PRESETS,
    Preset,
    get_preset,
    preset_for,
    preset_names,
)

__all__ = ["DEFAULT_PRESET", "PRESETS", "Preset", "get_preset", "preset_for", "preset_names"]
