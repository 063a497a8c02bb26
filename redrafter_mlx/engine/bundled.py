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
SMOLLM2_DRAFTER = Path(__file__).resolve().parent.parent / "smollm2_drafter"
# Written by weights_convert.smollm2 into the SmolLM2-135M-Instruct folder it converts.
SMOLLM2_MARKER = ".redrafter-smollm2.json"


def demo_paths() -> tuple[Path, Path | None]:
    """Return ``(base_dir, drafter_dir)`` of the bundled demo model.

    ``base_dir`` is an mlx-lm model directory (config.json, model.safetensors, tokenizer files).
    ``drafter_dir`` is the ReDrafter drafter directory, or ``None`` until one has been distilled.
    """
    base = DEMO_ROOT / "base"
    drafter = DEMO_ROOT / "drafter"
    has_drafter = (drafter / "config.json").is_file() and any(drafter.glob("*.safetensors"))
    return base, (drafter if has_drafter else None)


def bundled_drafter_for(model_dir) -> Path | None:
    """The packaged drafter for ``model_dir`` when it is the SmolLM2-135M-Instruct folder that
    ``weights_convert.smollm2`` converted unquantized (the weights the drafter was trained on);
    else None. See ``redrafter_mlx/smollm2_drafter/BUILD.md``."""
    import json

    marker = Path(model_dir).expanduser() / SMOLLM2_MARKER
    if not marker.is_file() or not (SMOLLM2_DRAFTER / "config.json").is_file():
        return None
    try:
        info = json.loads(marker.read_text())
    except (OSError, ValueError):
        return None
    return SMOLLM2_DRAFTER if not info.get("quantization") else None


def heldout_prompts_path() -> Path:
    """JSONL of chat requests made from held-out stdlib files (``{"turns": [...]}`` per line)."""
    return DEMO_ROOT / "heldout_prompts.jsonl"


__all__ = [
    "DEMO_NOTE",
    "DEMO_ROOT",
    "SMOLLM2_DRAFTER",
    "bundled_drafter_for",
    "demo_paths",
    "heldout_prompts_path",
]
