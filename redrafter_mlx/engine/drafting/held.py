"""The sources a loop holds: the drafter slot and the draft slot as one ordered tuple.

A run names its draft sources in two slots: the drafter (``drafter=``, ``--drafter``: a
recurrent drafter, or an early-exit adapter drafting the shape's W1×L) and the draft slot
(``draft_model=``, in the API: any number of sources, draft models, an
early-exit adapter or any ``sources.Source``, each proposing one chain of the shape's
``D1×L``; ``--draft-model``, given twice at most, loads a draft model and an adapter).
``held_sources`` turns them into the loop's sources, in the one order every step, state and
statistic follows: the drafter slot's, the context lookup (always held: it reads the text),
then the draft slot's by ``Source.order`` (an early-exit adapter before a draft model; the
given order on ties). Nothing else in the engine asks what kind a source is.

``held_sources`` is called once, where a run is set up from the two slots (the API's
``Run.of``, the CLI's memory check and profile, the loader's pairing check); everything
below takes the tuple (``sources: tuple[Source, ...]``): the loop, the step and its compile
cache (keyed by ``sources_key``), the memory check and the profile.
"""

from __future__ import annotations

import os

from .draft_model import DraftModelSource
from .drafter import DrafterSource
from .head_sources import MtpSource
from .heads.mtp import MtpHead
from .lookup import LookupSource
from .sources import Source


def slot_items(draft_model) -> list:
    """What the draft slot holds, as a list: None -> [], a list or tuple -> its items."""
    if draft_model is None:
        return []
    return list(draft_model) if isinstance(draft_model, list | tuple) else [draft_model]


def as_source(thing, part: str) -> Source:
    """``thing`` as a source of the shape's ``part`` (``"beams"``: the drafter slot,
    ``"chain"``: the draft slot): a ``Source`` as it is, a module that knows its source
    (``as_source``: a recurrent drafter, an early-exit adapter), else a drafter's beams in
    the drafter slot and a draft model's chain in the draft slot."""
    if isinstance(thing, Source):
        return thing
    if isinstance(thing, MtpHead):
        return MtpSource(thing)
    if hasattr(thing, "as_source"):
        return thing.as_source(part)
    if part == "beams":
        return DrafterSource(thing)
    check_loaded(thing)
    return DraftModelSource(thing)


def held_sources(drafter=None, draft_model=None) -> tuple[Source, ...]:
    """The sources a loop with this drafter slot and draft slot holds, in order (the module
    docstring). ValueError when a source that a run holds once (``Source.one_per_run``:
    an early-exit adapter's state) is given twice."""
    beams = [as_source(drafter, "beams")] if drafter is not None else []
    chains = [as_source(item, "chain") for item in slot_items(draft_model)]
    chains.sort(key=lambda source: source.order)  # stable: the given order on ties
    held = (*beams, LookupSource(), *chains)
    for source in held:
        if source.one_per_run and sum(type(s) is type(source) for s in held) > 1:
            raise ValueError(source.once_message())
    return held


def runnable_sources(sources: tuple[Source, ...], shape) -> tuple[Source, ...]:
    """The ``sources`` a run of ``shape`` holds: the drafter slot's (``part`` "beams") only
    when the shape drafts, the draft slot's (``"chain"``) only with its ``D1×L`` chain; the
    rest (the lookup) always. ``shape`` None: plain decoding, which holds none."""
    if shape is None:
        return ()
    dropped = {"beams": not shape.drafts, "chain": not shape.model_length}
    return tuple(s for s in sources if not dropped.get(s.part, False))


def sources_key(sources: tuple[Source, ...]) -> tuple:
    """A hashable identity of ``sources`` for what is kept across runs (the compiled steps,
    the learnt shape choices): per source its class and attributes, numbers and strings by
    value, anything else (a module, an array) by identity, so that the same modules resolved
    again (the next chat turn, the next request batch) find what the last run kept."""
    check_sources(sources)

    def value(v):
        return v if v is None or isinstance(v, bool | int | float | str) else ("id", id(v))

    return tuple(
        (type(s), tuple(sorted((k, value(v)) for k, v in vars(s).items()))) for s in sources
    )


def check_sources(sources) -> None:
    """TypeError unless ``sources`` is a tuple of ``Source`` (what ``held_sources`` gives)."""
    if not isinstance(sources, tuple) or not all(isinstance(s, Source) for s in sources):
        raise TypeError(
            f"sources takes a tuple of draft sources, got {type(sources).__name__}: resolve "
            "the drafter and draft slot once with held.held_sources(drafter, draft_model)"
        )


def check_draft_slot(model, draft_model, sources: tuple[Source, ...]) -> None:
    """What the draft slot holds, checked against the target before anything runs: each
    item loaded (``check_loaded``: TypeError naming how to load a path), then each of the
    run's ``sources`` (``held_sources``) by its own check (``Source.check``: ValueError
    naming the fix)."""
    if draft_model is None:
        return
    for source in sources:
        source.check(model)


def check_loaded(draft_model) -> None:
    """TypeError unless every item of the draft slot is something loaded (a model, an
    early-exit adapter or a ``Source``): a path names how to load it."""
    for item in slot_items(draft_model):
        _check_item(item)


def _check_item(draft) -> None:
    if isinstance(draft, str | os.PathLike):
        raise TypeError(
            f"draft_model takes a loaded draft model, early-exit adapter or draft source, got "
            f"the path {str(draft)!r}; load it first: model, drafter, tokenizer, draft = "
            f"redrafter_mlx.load(model_path, drafter_path, draft_model={str(draft)!r}), then "
            "pass draft_model=draft"
        )
    if isinstance(draft, Source | MtpHead) or hasattr(draft, "as_source"):
        return
    if not hasattr(draft, "vocab_size") or not callable(draft):
        raise TypeError(
            f"draft_model takes a loaded draft model, early-exit adapter or draft source, got "
            f"{type(draft).__name__}; load one with redrafter_mlx.load(model_path, "
            "drafter_path, draft_model=path) (its fourth item)"
        )


def held_modules(held) -> tuple:
    """Every module the held sources read (compile inputs; what a server materializes)."""
    return tuple(m for source in held for m in source.modules)


def slot_modules(draft_model) -> tuple:
    """Every module the draft slot's sources read."""
    return held_modules(as_source(item, "chain") for item in slot_items(draft_model))
