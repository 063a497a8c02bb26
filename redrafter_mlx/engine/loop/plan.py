"""What the engine runs: the plan (a beam shape with its lookup chains, and whence it came).

``resolve_plan`` holds the precedence every entry point shares: explicit arguments (the CLI's
flags) over a tuned profile over the chip's preset; context-lookup chains join the drafter's
beams unless asked otherwise or the tuner measured them; a capacity grows by the chains' own
slots; no drafter means lookup alone, or plain decoding. Where the defaults come from is a
``PlanSources``: the engine alone knows the chip's preset (``presets.py``, ``chip.py``); the
tuner adds its saved profiles (``tuning.defaults.ProfileSources``), which the CLI passes.

``default_plan`` is what the Python API runs when given no shape: the same resolution with no
arguments and no profile, so ``stream_generate(model, drafter, tok, prompt)`` runs what
``chat`` runs on an untuned machine (the chip's preset with a lookup chain, adaptive).
Only the standard library is imported at module level (the CLI's ``--help`` stays fast).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from ..base.chip import ChipInfo, detect_chip
from ..base.errors import ParamError
from ..core.shape import AR, BeamShape
from .presets import get_preset, preset_for

DEFAULT_SHAPE = BeamShape(4, 4)  # the base of a shape given only in part (no preset beams)


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
    draft_tuned: bool = False  # from a profile tuned with this draft model (``tune
    # --draft-model``): its chain, or its absence (it did not pay), was measured

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


# --------------------------------------------------------------------------- the drafter's reach


def read_predict_tokens(drafter_dir: str | Path | None) -> int | None:
    """``predict_tokens`` from the drafter's config.json (written by our trainer), or None.

    ``None`` means no limit is known: no drafter, no config, or the key is absent.
    """
    if not drafter_dir:
        return None
    config = Path(drafter_dir) / "config.json"
    try:
        value = json.loads(config.read_text(encoding="utf-8")).get("predict_tokens")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def max_length_for(predict_tokens: int | None) -> int | None:
    """Longest useful beam: the drafter's trained tokens plus the init token."""
    return None if predict_tokens is None else predict_tokens + 1


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


# --------------------------------------------------------------------------- presets


def chip_target(chip: ChipInfo | str | None) -> tuple[str | None, str | None]:
    """(chip id for profile lookup, preset name) for a ChipInfo, preset/chip-id string, or None
    (this machine)."""
    if chip is None:
        chip = detect_chip()
    if isinstance(chip, ChipInfo):
        return chip.chip_id, chip.preset
    preset = get_preset(chip)
    if preset is not None:
        return None, preset.name
    return chip, None


def from_preset(preset_name: str | None) -> ShapeChoice:
    """A ShapeChoice from the chip's preset, or the default preset."""
    preset, matched = preset_for(preset_name)
    source = f"preset for {preset.name}" if matched else "default preset (no profile for this chip)"
    return ShapeChoice(preset.shape, source)


def preset_choice(drafter_path, chip: ChipInfo | str | None = None) -> ShapeChoice:
    """The chip's preset (else the default preset), capped by the drafter's trained length:
    what a drafter runs with when no usable profile says otherwise."""
    _, preset_name = chip_target(chip)
    return cap_length(from_preset(preset_name), read_predict_tokens(drafter_path))


class PlanSources:
    """Where a plan's defaults come from. The engine's own: no profile, the chip's preset
    (``tuning.defaults.ProfileSources`` adds the tuned profiles)."""

    def tuned(self, model, drafter, dtype, draft_model=None) -> ShapeChoice | None:
        """The tuned choice for exactly this setup (``drafter`` None: lookup alone;
        ``draft_model``: tuned with that draft model), or None."""
        return None

    def beam(self, model, drafter, dtype) -> ShapeChoice:
        """The drafter's default shape: a profile, else the preset (capped)."""
        return preset_choice(drafter)

    def preset(self, drafter) -> ShapeChoice:
        """The chip's preset, capped by the drafter's trained length."""
        return preset_choice(drafter)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class PlanArgs:
    """What a caller asks of the plan (the CLI's ``--beam-width``, ``--beam-length``,
    ``--capacity``, ``--no-draft``, ``--lookup``, ``--lookup-length``, ``--no-lookup``);
    None: not asked (the defaults decide)."""

    width: int | None = None
    length: int | None = None
    capacity: int | None = None
    no_draft: bool = False
    lookup: int | None = None
    lookup_length: int | None = None
    no_lookup: bool = False

    def lookup_chains(self) -> tuple[int, int]:
        """(chains, chain length) asked for, defaults filled in; ParamError when invalid."""
        from ..drafting.lookup import (  # imports MLX: not at start-up
            DEFAULT_CHAIN_LENGTH,
            DEFAULT_CHAINS,
        )

        if self.no_lookup and self.lookup:
            raise ParamError("lookup", f"no_lookup contradicts lookup={self.lookup}; ask one")
        chains = 0 if self.no_lookup else (DEFAULT_CHAINS if self.lookup is None else self.lookup)
        if chains < 0:
            raise ParamError("lookup", f"lookup must be >= 0 (0 = off), got {chains}")
        length = DEFAULT_CHAIN_LENGTH if self.lookup_length is None else self.lookup_length
        if length < 2:
            raise ParamError(
                "lookup_length",
                f"lookup_length must be >= 2 (it counts the init token), got {length}",
            )
        return chains, length

    @property
    def asks_lookup(self) -> bool:
        """Whether the lookup chains were asked for (on, off or their length)."""
        return self.no_lookup or self.lookup is not None or self.lookup_length is not None

    @property
    def asks_beam(self) -> bool:
        return any(v is not None for v in (self.width, self.length, self.capacity))


def asked_shape(args: PlanArgs, base: BeamShape) -> BeamShape:
    """The drafter shape the arguments ask for, the rest from ``base``; validated."""
    shape = BeamShape(
        args.width if args.width is not None else base.width,
        args.length if args.length is not None else base.length,
        args.capacity,
    )
    if shape.length < 2:
        raise ParamError(
            "length",
            f"the beam length must be >= 2 (it counts the init token), got {shape.length}; "
            "ask for no drafting (--no-draft) for plain decoding",
        )
    return shape.validate()  # a ShapeError names its field


def resolve_plan(
    model,
    drafter,
    dtype=None,
    args: PlanArgs = PlanArgs(),
    sources: PlanSources | None = None,
    *,
    demo: bool = False,
    draft_model=None,
) -> ShapeChoice:
    """The plan for ``model`` with ``drafter`` (folders; ``drafter`` None: none): the asked
    shape over the tuned profile / chip preset; context-lookup chains join it unless asked
    otherwise or the tuner measured them (its profile's chains, or their absence, stand unless
    ``args`` say otherwise); no drafter -> the tuned lookup-only profile, else lookup alone,
    or AR. ``draft_model`` (a folder, or the (draft model, early-exit adapter) pair of
    ``--draft-model`` given twice): a profile tuned with it (``tune --draft-model``)
    decides the whole shape, its chain included or left out (``ShapeChoice.draft_tuned``),
    unless ``args`` ask for a shape or for lookup; without one, the plan is made as without
    a draft model (the caller adds its chain)."""
    sources = sources or PlanSources()
    chains, chain_length = args.lookup_chains()
    if args.no_draft:
        return ShapeChoice(AR, "--no-draft: plain decoding")
    if draft_model is not None and not (args.asks_beam or args.asks_lookup):
        tuned = sources.tuned(model, drafter, dtype, draft_model)
        if tuned is not None:
            return replace(tuned, source=f"{tuned.source}, with this draft model", draft_tuned=True)
    if drafter is None:
        why = "the demo model has no drafter yet" if demo else "no --drafter given"
        tuned = None if args.asks_lookup else sources.tuned(model, None, dtype)
        if tuned is not None and tuned.lookup_tuned:
            return tuned  # tune measured lookup alone here: its chains, or plain decoding
        if chains:
            lookup = BeamShape.lookup_only(chains, chain_length)
            return ShapeChoice(lookup, f"{why}: context lookup alone (--no-lookup: plain)")
        return ShapeChoice(AR, f"{why}: plain decoding")
    choice = sources.beam(model, drafter, dtype)
    if args.asks_beam:
        base = choice.shape if choice.shape.drafts else DEFAULT_SHAPE
        choice = ShapeChoice(asked_shape(args, base), "beam shape from flags")
    if choice.lookup_tuned and not args.asks_lookup:
        return choice  # tune measured the chains: keep them (or their absence) as tuned
    if not choice.speculative:
        return choice
    drafted = choice.shape
    if drafted.lookup:  # the tuned chains give way to the asked ones: the drafter's part alone
        capacity = drafted.capacity
        if capacity is not None:
            capacity -= drafted.lookup * (drafted.chain_length - 1)
        drafted = replace(drafted, capacity=capacity, lookup=0, lookup_length=0)
        source = choice.source if chains else f"{choice.source}, without lookup chains"
        if not drafted.drafts and not chains:  # --no-lookup, lookup alone tuned: the preset
            preset = sources.preset(drafter)
            drafted, source = preset.shape, f"{source}; drafter shape from the {preset.source}"
        choice = ShapeChoice(drafted, source)
    if not chains:
        return choice
    shape = replace(drafted, lookup=chains, lookup_length=chain_length)
    if drafted.capacity is not None:  # the drafter's slots, plus the chains' own
        shape = replace(shape, capacity=drafted.capacity + chains * (chain_length - 1))
    return ShapeChoice(shape.validate(), f"{choice.source}, with context lookup")


def default_plan(drafter) -> ShapeChoice:
    """What the Python API runs when given no shape (``drafter``: a loaded Drafter or None):
    ``resolve_plan`` with no arguments and the engine's sources, as ``chat`` resolves it on a
    machine with no tuned profile."""
    folder = getattr(drafter, "folder", None) or "" if drafter is not None else None
    return resolve_plan(None, folder, sources=PlanSources())
