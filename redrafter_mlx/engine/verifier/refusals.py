"""Families refused by name, before mlx-lm builds them: their class does something at
construction or in every forward that the engine cannot run around, found by the family
sweep (``scripts/experiments/family_sweep.py``). Every other refusal is found by a check
of the built model (``lm_checks``, ``LmModel.check_commit`` / ``check_steps``).
"""

from __future__ import annotations

BY_NAME = {
    "phi3small": (
        "its block-sparse attention layers add the attention mask to the scores as numbers "
        "(mlx-lm 0.32's phi3small.py), so a boolean mask masks nothing and every slot of the "
        "engine's cache is attended, and its head writes -inf at token ids 100256-100351, "
        "past a smaller vocabulary"
    ),
}


def check_family(model_type: str) -> None:
    """ValueError naming ``model_type`` and why, if it is refused by name."""
    if model_type in BY_NAME:
        raise ValueError(
            f"model_type {model_type!r} cannot be sped up yet: {BY_NAME[model_type]} "
            "(mlx_lm.generate runs it)"
        )
