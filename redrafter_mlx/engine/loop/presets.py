"""Built-in beam-shape presets, used until the user runs ``redrafter-mlx tune``.

Three presets are measurements from the ReDrafter paper (Vicuna-7B fp16, greedy, MLX):
M1 Max W1 L5 (1.37x), M2 W2 L5 (1.68x), M2 Ultra W3 L4 (1.52x). The rest are defaults
reasoned from those, and documented here so they can be revisited:

* Speculation pays when the GPU has spare compute while it waits on memory. The ratio
  of GPU FLOP/s to memory bandwidth is about 26 FLOP/B for every M1 tier (the M1 Max
  measured best at W1 L5), and 34-41 FLOP/B on M2, M3 and M4 (the M2 measured W2 L5).
  So: the M1 family gets W1 L5, M2/M3/M4 base/Pro/Max get W2 L5, Ultras (two dies, more
  launch overhead per step, measured on the M2 Ultra) get W3 L4.
* Step time roughly doubles once W*L >= 16 on some chips, so every Apple preset stays
  below that knee and needs no packing capacity.
* Unknown chips (including future Apple families) get the conservative W2 L4.
* MLX on a Linux CPU is compute-bound already: extra verified tokens cost nearly their
  full price, so the preset is a single short beam, W1 L4.
* Server GPUs (MLX's CUDA backend) have compute to spare; the paper's server kernels want
  W >= 50, but our dense-mask verification does not scale that far, so W8 L5 with a
  packing cap of 32 is a starting point for ``tune``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.shape import BeamShape


@dataclass(frozen=True)
class Preset:
    """A named default shape and where it comes from."""

    name: str
    shape: BeamShape
    note: str


_MEASURED = "measured in the ReDrafter paper"
_M1_NOTE = "M1-family default (compute/bandwidth like the measured M1 Max)"
_M2_NOTE = "default for M2 and later (compute/bandwidth like the measured M2)"
_ULTRA_NOTE = "Ultra default (like the measured M2 Ultra)"


def _build_presets() -> dict[str, Preset]:
    """The preset table, keyed by name (``m1``, ``m1-pro``, ..., ``linux-cpu``)."""
    table: dict[str, Preset] = {}

    def add(name: str, width: int, length: int, note: str, capacity: int | None = None):
        table[name] = Preset(name, BeamShape(width, length, capacity), note)

    for tier in ("", "-pro", "-max"):
        add(f"m1{tier}", 1, 5, _M1_NOTE)
    add("m1-max", 1, 5, f"{_MEASURED}: 1.37x on M1 Max")
    add("m1-ultra", 1, 5, _M1_NOTE)
    for family in ("m2", "m3", "m4"):
        for tier in ("", "-pro", "-max"):
            add(f"{family}{tier}", 2, 5, _M2_NOTE)
        add(f"{family}-ultra", 3, 4, _ULTRA_NOTE)
    add("m2", 2, 5, f"{_MEASURED}: 1.68x on M2")
    add("m2-ultra", 3, 4, f"{_MEASURED}: 1.52x on M2 Ultra")
    add("linux-cpu", 1, 4, "CPU default (compute-bound: one short beam)")
    add("cuda", 8, 5, "server-GPU starting point (paper: W>=50 with fused kernels)", 32)
    add("default", 2, 4, "conservative default for chips without a preset")
    return table


PRESETS: dict[str, Preset] = _build_presets()
DEFAULT_PRESET = "default"


def preset_names() -> list[str]:
    """All preset names, Apple chips first in family/tier order."""
    return list(PRESETS)


def get_preset(name: str | None) -> Preset | None:
    """The preset called ``name`` (case-insensitive, ``"M2 Max"`` works too), or None."""
    if not name:
        return None
    key = "-".join(str(name).lower().replace("apple", "").split())
    return PRESETS.get(key)


def preset_for(name: str | None) -> tuple[Preset, bool]:
    """The preset for ``name``, falling back to the default; the flag says if it matched."""
    preset = get_preset(name)
    if preset is None:
        return PRESETS[DEFAULT_PRESET], False
    return preset, True
