"""Chip detection lives in the engine (``redrafter_mlx.engine.base.chip``): the engine's default
plan needs the chip's preset too; this name stays for the tuner and its callers."""

from redrafter_mlx.engine.base.chip import (
    APPLE_TIERS,
    ChipInfo,
    apple_chip_id,
    apple_preset_name,
    chip_from_facts,
    detect_chip,
    gather_facts,
    normalise_cpu_model,
    parse_apple_brand,
    parse_apple_gpu_arch,
    parse_cpuinfo_model,
    parse_gpu_core_count,
    parse_int,
    slugify,
)

__all__ = [
    "APPLE_TIERS",
    "ChipInfo",
    "apple_chip_id",
    "apple_preset_name",
    "chip_from_facts",
    "detect_chip",
    "gather_facts",
    "normalise_cpu_model",
    "parse_apple_brand",
    "parse_apple_gpu_arch",
    "parse_cpuinfo_model",
    "parse_gpu_core_count",
    "parse_int",
    "slugify",
]
