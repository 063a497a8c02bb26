"""The default beam shape for chat/generate/bench: tuned profile, else chip preset.

Call :func:`resolve_beam_shape` once per command; it never raises for a missing or
corrupt profile file (that is one warning line) and never runs the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from redrafter_mlx.engine.shape import AR, BeamShape
from tuning.chip import ChipInfo, detect_chip
from tuning.grid import max_length_for, read_predict_tokens
from tuning.presets import get_preset, preset_for
from tuning.profiles import Profile, ProfileKey, ProfileStore


@dataclass(frozen=True)
class ShapeChoice:
    """The beam shape to decode with and a human sentence saying where it came from.

    An autoregressive ``shape`` means plain decoding (the drafter is not loaded): tuning found
    that speculation does not pay here, or the user asked for it.
    """

    shape: BeamShape
    source: str
    lookup_tuned: bool = False  # from a profile whose search tried context lookup: the
    # shape's lookup fields (none included) were measured; do not add the default chain

    @property
    def speculative(self) -> bool:
        """False for plain decoding."""
        return not self.shape.is_autoregressive

    @property
    def width(self) -> int:
        return self.shape.width

    @property
    def length(self) -> int:
        return self.shape.length

    @property
    def capacity(self) -> int | None:
        return self.shape.capacity

    @property
    def label(self) -> str:
        return self.shape.label

    def to_dict(self) -> dict:
        """JSON-ready: the shape's fields, ``speculative``, ``source`` and ``label``."""
        return {
            **self.shape.to_dict(),
            "speculative": self.speculative,
            "source": self.source,
            "label": self.label,
        }


def _chip_target(chip: ChipInfo | str | None) -> tuple[str | None, str | None]:
    """(chip id for profile lookup, preset name) for a ChipInfo, preset/chip-id string, or None."""
    if chip is None:
        chip = detect_chip()
    if isinstance(chip, ChipInfo):
        return chip.chip_id, chip.preset
    preset = get_preset(chip)
    if preset is not None:
        return None, preset.name
    return chip, None


def _from_profile(profile: Profile) -> ShapeChoice:
    """A ShapeChoice from a saved profile."""
    source = f"tuned profile for {profile.key.chip_id} ({profile.date})"
    if not profile.speculative:
        return ShapeChoice(
            AR, source + ": speculation did not pay, plain decoding", profile.lookup_searched
        )
    return ShapeChoice(profile.shape, source, profile.lookup_searched)


def _stale_note(profiles: dict[str, Profile], key: ProfileKey) -> str:
    """A note when a profile exists for this setup but another package version."""
    for profile in profiles.values():
        if replace(profile.key, version=key.version) == key:
            return (
                f"; the tuned profile is from redrafter-mlx {profile.key.version}, "
                f"re-run 'redrafter-mlx tune'"
            )
    return ""


def _from_preset(preset_name: str | None) -> ShapeChoice:
    """A ShapeChoice from the chip's preset, or the default preset."""
    preset, matched = preset_for(preset_name)
    source = f"preset for {preset.name}" if matched else "default preset (no profile for this chip)"
    return ShapeChoice(preset.shape, source)


def cap_length(choice: ShapeChoice, predict_tokens: int | None) -> ShapeChoice:
    """Shorten ``choice``'s drafter beams to what the drafter was trained for (+1 for the init
    token); lookup chains are kept (they do not come from the drafter)."""
    limit = max_length_for(predict_tokens)
    if limit is None or not choice.shape.drafts or choice.length <= limit:
        return choice
    shape = replace(choice.shape, length=limit)
    capacity = shape.capacity
    if capacity is not None and not limit <= capacity <= shape.max_packed:
        shape = replace(shape, capacity=None)
    return replace(
        choice,
        shape=shape,
        source=f"{choice.source}; length capped at {limit} "
        f"(the drafter predicts {predict_tokens} tokens)",
    )


def preset_choice(drafter_path, chip: ChipInfo | str | None = None) -> ShapeChoice:
    """The chip's preset (else the default preset), capped by the drafter's trained length:
    what a drafter runs with when no usable profile says otherwise."""
    _, preset_name = _chip_target(chip)
    return cap_length(_from_preset(preset_name), read_predict_tokens(drafter_path))


def tuned_choice(
    model_path,
    drafter_path,
    dtype,
    chip: ChipInfo | str | None = None,
    store: ProfileStore | None = None,
) -> ShapeChoice | None:
    """The tuned profile's choice for exactly this setup (``drafter_path`` None: a model
    tuned without a drafter, lookup alone), or None; no preset, no length cap."""
    chip_id, _ = _chip_target(chip)
    if chip_id is None:
        return None
    key = ProfileKey.build(chip_id, model_path, drafter_path, dtype)
    profile = (store or ProfileStore()).load().get(key.text)
    return None if profile is None else _from_profile(profile)


def resolve_beam_shape(
    model_path,
    drafter_path,
    dtype,
    chip: ChipInfo | str | None = None,
    store: ProfileStore | None = None,
) -> ShapeChoice:
    """The beam shape chat/generate/bench should use when the user gives none.

    Order: a tuned profile for exactly this chip, model, drafter, dtype/quantization and
    package version; else the preset for the chip; else the default preset. The length is
    capped by the drafter's ``predict_tokens`` (config.json) when present.
    ``chip``: None detects this machine; a preset name (``"m2-max"``) or chip id also works.
    """
    chip_id, preset_name = _chip_target(chip)
    choice = None
    note = ""
    if chip_id is not None:
        store = store or ProfileStore()
        key = ProfileKey.build(chip_id, model_path, drafter_path, dtype)
        profiles = store.load()
        profile = profiles.get(key.text)
        if profile is not None:
            choice = _from_profile(profile)
        else:
            note = _stale_note(profiles, key)
    if choice is None:
        choice = _from_preset(preset_name)
        choice = replace(choice, source=choice.source + note)
    return cap_length(choice, read_predict_tokens(drafter_path))
