"""Families refused by name, before mlx-lm builds them: their class does something at
construction or in every forward that the engine cannot run around, found by the family
sweep (``scripts/experiments/family_sweep.py``). Every other refusal is found by a check
of the built model (``lm_checks``, ``LmModel.check_commit`` / ``check_steps``).
"""

from __future__ import annotations

import importlib.util

BY_NAME = {
    "phi3small": (
        "its block-sparse attention layers add the attention mask to the scores as numbers "
        "(mlx-lm 0.32's phi3small.py), so a boolean mask masks nothing and every slot of the "
        "engine's cache is attended, and its head writes -inf at token ids 100256-100351, "
        "past a smaller vocabulary"
    ),
}

# Families whose mlx-lm module ends the process (sys.exit) when a package is missing, as it
# is imported: model_type -> (the module it probes, the package that holds it).
NEEDS = {"olmo": ("hf_olmo", "ai2-olmo")}


def missing_package(model_type: str) -> str | None:
    """The package ``model_type``'s mlx-lm module needs and this environment lacks, or None."""
    module, package = NEEDS.get(model_type, (None, None))
    if module is None or importlib.util.find_spec(module) is not None:
        return None
    return package


def check_family(model_type: str) -> None:
    """ValueError naming ``model_type`` and why, if it is refused by name or its mlx-lm
    module needs a package this environment lacks (checked before mlx-lm imports it)."""
    package = missing_package(model_type)
    if package is not None:
        raise ValueError(
            f"model_type {model_type!r} needs the package {package}, which mlx-lm's "
            f"{model_type}.py imports and this environment lacks (pip install {package})"
        )
    if model_type in BY_NAME:
        raise ValueError(
            f"model_type {model_type!r} cannot be sped up yet: {BY_NAME[model_type]} "
            "(mlx_lm.generate runs it)"
        )
