"""The kinds of draft source a folder can hold, one registry for the command line and Python.

A folder's ``config.json`` names its kind (``"kind": "<name>"``). ``"early-exit"`` is the
built-in adapter (``early_exit.py``); any other kind is a third-party source, found through
the Python entry point group ``redrafter_mlx.sources``: a package declares

    [project.entry-points."redrafter_mlx.sources"]
    mykind = "mypackage.drafts:load"

and ``load(folder, model, tokenizer=None, dtype=None)`` returns a ``sources.Source``. Such a
folder passed as ``--draft-model`` (or ``load``'s ``draft_model``) joins the draft slot as
that source, beside a draft model or an adapter (docs/design/adding-a-source.md).

A draft head people download (``HEADS``: DFlash ``block``, ``eagle3``, ``mtp``) has no
``kind`` key: its published config names it (``heads/formats.py``), and ``kind_of`` reads
that too.
"""

from __future__ import annotations

import json
from pathlib import Path

from .sources import Source

ENTRY_POINTS = "redrafter_mlx.sources"
BUILT_IN = ("early-exit",)  # ``EARLY_EXIT``  # kinds the loader knows itself (``loading.load``)
HEADS = ("block", "eagle3", "mtp")  # recognised by their published config (heads/formats.py)


def kind_of(folder) -> str | None:
    """The ``kind`` a folder's config.json names (a string), else the head kind its
    published config describes (one of ``HEADS``), else None."""
    return _kind(_config(folder))


def _config(folder) -> dict | None:
    """A folder's config.json, read (None: none, unreadable, or not an object)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def _kind(config: dict | None) -> str | None:
    if config is None:
        return None
    kind = config.get("kind")
    if isinstance(kind, str):
        return kind
    from .heads.formats import head_kind

    return head_kind(config)


def registered() -> dict:
    """Third-party kinds: name -> its entry point (loaded only when used)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINTS)}


EARLY_EXIT = "early-exit"


def slot_kind(folder) -> str | None:
    """What a folder given to the draft slot (``--draft-model``) holds, by its config.json's
    kind, the one dispatch of the loader (``loading.draft_slot_paths``, ``loading.load``):
    ``EARLY_EXIT`` (built in: an early-exit adapter), a registered third-party kind (a
    source, ``load_source``), None: no kind (a draft model). ValueError naming the kind and
    the fix when no installed package registers it."""
    config = _config(folder)
    kind = _kind(config)
    if kind in HEADS:  # a published head; a whole checkpoint with MTP layers is a model
        return kind if _is_head(config, kind) else None
    if kind is None or kind in BUILT_IN:
        return kind
    if kind not in registered():
        raise ValueError(_unregistered(folder, kind))
    return kind


def _is_head(config: dict, kind: str) -> bool:
    """Whether a config of a head kind (``HEADS``) is a published draft head's: an EAGLE-3
    or DFlash head, or an MTP sidecar (``model_type: qwen3_5_mtp``). A whole checkpoint
    whose config declares MTP layers is a model in the draft slot (a draft model), not its
    MTP head."""
    from .heads.mtp import SIDECAR_MODEL_TYPE

    return kind != "mtp" or config.get("model_type") == SIDECAR_MODEL_TYPE


def _unregistered(folder, kind: str) -> str:
    known = ", ".join(sorted(registered())) or "none installed"
    return (
        f"{folder}/config.json names the draft source kind {kind!r}, which no installed "
        f"package registers (entry point group {ENTRY_POINTS!r}; registered: {known}): "
        "install the package that provides it"
    )


def is_source_folder(folder) -> bool:
    """Whether ``folder`` holds a registered third-party source (its config.json's kind)."""
    kind = kind_of(folder)
    return kind is not None and kind not in BUILT_IN and kind in registered()


def load_source(folder, model, tokenizer=None, dtype=None) -> Source:
    """The source in ``folder``, by its kind's registered loader; ValueError naming the
    kind and the package when the loader fails or gives something else than a Source."""
    kind = kind_of(folder)
    entry = registered().get(kind)
    if entry is None:
        raise ValueError(_unregistered(folder, kind))
    where = entry.value
    try:
        loader = entry.load()
        source = loader(Path(folder), model=model, tokenizer=tokenizer, dtype=dtype)
    except ValueError as e:
        raise ValueError(f"{folder}: the {kind!r} source ({where}) cannot load it: {e}") from None
    if not isinstance(source, Source):
        raise ValueError(
            f"{folder}: the {kind!r} source's loader ({where}) returned a "
            f"{type(source).__name__}, not a draft source (redrafter_mlx.DraftSource)"
        )
    return source
