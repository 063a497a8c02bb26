"""The default beam shape for chat/generate/bench: tuned profile, else chip preset.

Call :func:`resolve_beam_shape` once per command; it never raises for a missing or
corrupt profile file (that is one warning line) and never runs the engine. The plan's
precedence and the presets are the engine's (``redrafter_mlx.engine.loop.plan``);
``ProfileSources`` gives it the tuned profiles.
"""

from __future__ import annotations

from dataclasses import replace

from redrafter_mlx.engine.base.chip import ChipInfo
from redrafter_mlx.engine.core.shape import AR
from redrafter_mlx.engine.loop.plan import (
    PlanSources,
    ShapeChoice,
    cap_length,
    chip_target,
    from_preset,
    preset_choice,
    read_predict_tokens,
)
from tuning.profiles import Profile, ProfileKey, ProfileStore

__all__ = [
    "ProfileSources",
    "ShapeChoice",
    "cap_length",
    "preset_choice",
    "resolve_beam_shape",
    "tuned_choice",
]


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


def tuned_choice(
    model_path,
    drafter_path,
    dtype,
    chip: ChipInfo | str | None = None,
    store: ProfileStore | None = None,
    draft_model=None,
) -> ShapeChoice | None:
    """The tuned profile's choice for exactly this setup (``drafter_path`` None: a model
    tuned without a drafter, lookup alone; ``draft_model``: tuned with that draft model,
    ``tune --draft-model``), or None; no preset, no length cap."""
    chip_id, _ = chip_target(chip)
    if chip_id is None:
        return None
    key = ProfileKey.build(chip_id, model_path, drafter_path, dtype, draft_model_path=draft_model)
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
    chip_id, preset_name = chip_target(chip)
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
        choice = from_preset(preset_name)
        choice = replace(choice, source=choice.source + note)
    return cap_length(choice, read_predict_tokens(drafter_path))


class ProfileSources(PlanSources):
    """The engine's plan sources plus the tuned profiles of this chip (``resolve_plan``)."""

    def __init__(self, chip: ChipInfo | str | None = None, store: ProfileStore | None = None):
        self.chip, self.store = chip, store

    def tuned(self, model, drafter, dtype, draft_model=None) -> ShapeChoice | None:
        return tuned_choice(model, drafter, dtype, self.chip, self.store, draft_model)

    def beam(self, model, drafter, dtype) -> ShapeChoice:
        return resolve_beam_shape(model, drafter, dtype, self.chip, self.store)

    def preset(self, drafter) -> ShapeChoice:
        return preset_choice(drafter, self.chip)
