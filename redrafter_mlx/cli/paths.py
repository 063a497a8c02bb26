"""Which model and drafter a command loads: ``--model`` (a folder, a Hub id or a bundled
name), else the bundled model; ``--drafter``, else the model's own or the packaged one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelPaths:
    """Where the model and drafter come from, and notes to show when they are loaded.

    ``demo`` when the bundled model is used.
    """

    model: str
    drafter: str | None
    demo: bool = False
    notes: tuple[str, ...] = ()
    # --draft-model, resolved (``resolve_draft_model``): one path (a draft model or an
    # early-exit adapter's folder), or (draft model, adapter) when it was given twice
    draft_model: str | tuple[str, str] | None = None


def installed_bundled(model: str | None):
    """The bundled model ``--model`` names (``bundled.NAMES``; no ``--model``: the default
    one), checked to be installed; None when ``model`` names something else (a folder, a Hub
    id). Raises ``LoadError`` with the command that installs it."""
    from redrafter_mlx.engine.base.bundled import bundled, default_model

    named = default_model() if model is None else bundled(model)
    if named is not None and not named.installed:
        from redrafter_mlx.engine.loop.loading import LoadError

        raise LoadError(
            f"the {named.name} model is not installed ({named.base} has no config.json); "
            f"run {named.install}, or pass --model DIR"
        )
    return named


def resolve_paths(model: str | None, drafter: str | None) -> ModelPaths:
    """``--model``/``--drafter`` as given; ``demo``/``smollm2`` name the bundled models; no
    ``--model`` is SmolLM2 when installed with its drafter, else the demo model.

    A converted model directory's own drafter (``MODEL/drafter``, written by ``convert
    --drafter``) is used when no ``--drafter`` is given. Nothing is printed here: the notes
    are shown by :func:`load_engine`, after every flag has been checked.
    """
    named = installed_bundled(model)
    if named is not None:
        chosen = drafter if drafter is not None else (str(named.drafter) if named.drafter else None)
        note = named.note if model is None else asked_note(named.note)
        return ModelPaths(str(named.base), chosen, demo=named.name == "demo", notes=(note,))
    _check_model_name(model)
    own = Path(model).expanduser() / "drafter"
    if drafter is None and (own / "config.json").is_file():
        note = f"using the drafter converted with the model: {own} (--drafter to choose another)"
        return ModelPaths(model, str(own), notes=(note,))
    from redrafter_mlx.engine.base.bundled import bundled_drafter_for

    packaged = bundled_drafter_for(model) if drafter is None else None
    if packaged is not None:
        note = f"using the packaged SmolLM2 drafter: {packaged} (--drafter to choose another)"
        return ModelPaths(model, str(packaged), notes=(note,))
    return ModelPaths(model, drafter)


def asked_note(note: str) -> str:
    """A bundled model's note when ``--model`` named it: without the advice to pass
    ``--model`` for a real model, which is for the demo chosen by default."""
    head, advice, _ = note.partition("; pass --model")
    return head + "." if advice else note


def resolve_draft_model(name: str | Sequence[str] | None) -> str | tuple[str, str] | None:
    """``--draft-model`` (repeatable) as a path or Hub id: a bundled model's name
    (``smollm2``, ``demo``) is its installed folder; anything else is passed on as given
    (None: no draft model; an empty value, or a local path that is no folder: an error
    naming ``--draft-model``). Given twice: (the draft model, the early-exit
    adapter's folder), in that order whatever the flags' (``loading.draft_slot_paths``:
    a LoadError naming the fix for two models, two adapters or more than two values)."""
    if name is None or isinstance(name, str):
        return _resolve_one(name)
    names = [_resolve_one(n) for n in name]
    if len(names) <= 1:
        return names[0] if names else None
    from redrafter_mlx.engine.loop.loading import draft_slot_paths

    return draft_slot_paths(names)  # two of a kind or more than two: a LoadError


def _resolve_one(name: str | None) -> str | None:
    if name is None:
        return None
    if not name.strip():
        from redrafter_mlx.cli.errors import FlagError

        raise FlagError(
            f"--draft-model {name!r} is an empty path (it would name the current folder): "
            "pass a draft model's folder or Hub id, or an early-exit adapter's folder, or "
            "drop --draft-model"
        )
    from redrafter_mlx.engine.loop.loading import SELF_MTP

    if name == SELF_MTP:  # the model's own MTP layers (``loading.self_mtp``)
        return name
    named = installed_bundled(name)
    if named is not None:
        return str(named.base)
    _check_model_name(name)
    _check_local(name)
    return name


def _check_local(name: str) -> None:
    """A LoadError naming ``--draft-model`` when ``name`` reads as a local path (not a Hub
    id: ``hub.is_path``) and is no folder, before anything is loaded."""
    from redrafter_mlx.engine.base.hub import is_path

    path = Path(name).expanduser()
    if not is_path(name) or path.is_dir():
        return
    from redrafter_mlx.engine.loop.loading import LoadError

    if path.exists():
        raise LoadError(f"--draft-model {name}: a file; pass the folder that holds config.json")
    raise LoadError(
        f"--draft-model {name}: no such folder; pass a draft model's folder or Hugging Face "
        "repo id (or smollm2, demo), or an early-exit adapter's folder"
    )


def _check_model_name(model: str) -> None:
    """A LoadError listing the bundled models for a ``--model`` word that names nothing."""
    from redrafter_mlx.engine.base.bundled import unknown_name_error

    message = unknown_name_error(model)
    if message is not None:
        from redrafter_mlx.engine.loop.loading import LoadError

        raise LoadError(message)
