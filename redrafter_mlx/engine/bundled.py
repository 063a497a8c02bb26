"""The bundled demo model: a small Llama trained on Python's standard library.

Weights cannot be downloaded on a fresh machine, so the package ships a small *trained* base
model (and, once distilled, a ReDrafter drafter for it) under ``redrafter_mlx/demo_model/``.
Rebuild it with ``python -m scripts.build_demo`` (``make demo-model``); see ``demo_model/BUILD.md``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_NOTE = (
    "Using the bundled demo model (a small Llama trained on Python's standard library); "
    "pass --model for a real one."
)

DEMO_ROOT = Path(__file__).resolve().parent.parent / "demo_model"


def demo_paths() -> tuple[Path, Path | None]:
    """Return ``(base_dir, drafter_dir)`` of the bundled demo model.

    ``base_dir`` is an mlx-lm model directory (config.json, model.safetensors, tokenizer files).
    ``drafter_dir`` is the ReDrafter drafter directory, or ``None`` until one has been distilled.
    """
    base = DEMO_ROOT / "base"
    drafter = DEMO_ROOT / "drafter"
    has_drafter = (drafter / "config.json").is_file() and any(drafter.glob("*.safetensors"))
    return base, (drafter if has_drafter else None)


def heldout_prompts_path() -> Path:
    """JSONL of chat requests made from held-out stdlib files (``{"turns": [...]}`` per line)."""
    return DEMO_ROOT / "heldout_prompts.jsonl"


__all__ = ["DEMO_NOTE", "DEMO_ROOT", "demo_paths", "heldout_prompts_path"]
