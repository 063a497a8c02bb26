"""Models that come with redrafter-mlx, by name: ``demo`` and ``smollm2``.

* ``demo``: a 4.3M-parameter Llama trained on Python's standard library, with its distilled
  drafter, shipped inside the package (``redrafter_mlx/demo_model/``; rebuilt by
  ``make demo-model``, see its BUILD.md). It runs anywhere, fast: tests use it.
* ``smollm2``: SmolLM2-135M-Instruct, converted by ``make install`` (``make smollm2``) into
  ``home()/models`` (``$REDRAFTER_MLX_HOME``, else ``$XDG_CACHE_HOME/redrafter-mlx``, else
  ``~/.cache/redrafter-mlx``; float32 on the CPU backend, the GGUF's own Q4_1/Q8_0 kept as
  MLX 4/8-bit on Metal), with the drafter shipped in ``redrafter_mlx/smollm2_drafter/``,
  which serves both.

* ``smollm2-apar``: SmolLM2 post-trained for APAR parallel branches (a LoRA adapter shipped in
  ``redrafter_mlx/smollm2_apar/``, fused into ``home()/models/smollm2-apar`` by ``make install``
  through ``weights_convert.smollm2_apar``); it forks list answers into branches.

With no ``--model`` the CLI uses ``smollm2`` when it is installed with a drafter, else ``demo``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # redrafter_mlx/
DEMO_ROOT = PACKAGE_ROOT / "demo_model"
SMOLLM2_NAME = "smollm2-135m-instruct"
SMOLLM2_DRAFTER = PACKAGE_ROOT / "smollm2_drafter"
# Written by weights_convert.smollm2 into the SmolLM2-135M-Instruct folder it converts.
SMOLLM2_MARKER = ".redrafter-smollm2.json"
SMOLLM2_APAR_NAME = "smollm2-apar"
SMOLLM2_APAR_ADAPTER = PACKAGE_ROOT / "smollm2_apar"  # the LoRA adapter (make smollm2-apar)
SMOLLM2_APAR_MARKER = ".redrafter-smollm2-apar.json"  # weights_convert.smollm2_apar's, last

DEMO_NOTE = (
    "Using the bundled demo model (a small Llama trained on Python's standard library); "
    "pass --model for a real one (--model smollm2 after make install)."
)
SMOLLM2_NOTE = "Using SmolLM2-135M-Instruct (installed by make install); --model demo for the toy."
SMOLLM2_APAR_NOTE = (
    "Using SmolLM2-APAR (SmolLM2-135M-Instruct post-trained to decode list items as parallel "
    "branches; --branches off for one sequence)."
)


@dataclass(frozen=True)
class BundledModel:
    """A named model: its directory, its drafter directory (None without one), a note, and
    the command that installs it."""

    name: str
    base: Path
    drafter: Path | None
    note: str
    install: str = "'make install'"

    @property
    def installed(self) -> bool:
        return (self.base / "config.json").is_file()


def home() -> Path:
    """The one home folder (tuned profiles, converted models, caches, build work):
    ``$REDRAFTER_MLX_HOME``, else ``$XDG_CACHE_HOME/redrafter-mlx``, else
    ``~/.cache/redrafter-mlx``."""
    explicit = os.environ.get("REDRAFTER_MLX_HOME")
    if explicit:
        return Path(explicit).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "redrafter-mlx"


def smollm2_path(root: Path | None = None) -> Path:
    """Where ``make smollm2`` converts SmolLM2-135M-Instruct (whether or not it exists yet)."""
    return (root or home()) / "models" / SMOLLM2_NAME


def smollm2_apar_path(root: Path | None = None) -> Path:
    """Where ``weights_convert.smollm2_apar`` fuses SmolLM2-APAR (whether or not it exists)."""
    return (root or home()) / "models" / SMOLLM2_APAR_NAME


def _drafter_dir(path: Path) -> Path | None:
    has = (path / "config.json").is_file() and any(path.glob("*.safetensors"))
    return path if has else None


def demo_paths() -> tuple[Path, Path | None]:
    """``(base_dir, drafter_dir)`` of the bundled demo model (drafter None if not distilled)."""
    return DEMO_ROOT / "base", _drafter_dir(DEMO_ROOT / "drafter")


def heldout_prompts_path() -> Path:
    """JSONL of chat requests made from held-out stdlib files (``{"turns": [...]}`` per line)."""
    return DEMO_ROOT / "heldout_prompts.jsonl"


# The quantization Metal's conversion keeps from the GGUF (``weights_convert.gguf``: Q4_1 is
# MLX's affine 4-bit and Q8_0 its 8-bit, both in groups of 32, exactly): the same weights the
# drafter was trained on, so the packaged drafter serves it too (docs/bench/quantized_drafter.txt).
SMOLLM2_GGUF_QUANTIZATION = {
    "group_size": 32,
    "bits": 4,
    "mode": "affine",
    "model.embed_tokens": {"group_size": 32, "bits": 8},
}


def _read_json(file: Path) -> dict | None:
    """A JSON object file's contents; None when absent, unreadable or not an object."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_weights_as_the_gguf(config: dict) -> bool:
    """Whether ``config.json`` describes the GGUF's weights as stored: unquantized (float32,
    the Q4_1 values dequantized) or the GGUF's own Q4_1/Q8_0 kept as MLX's affine triples;
    any other quantization (re-quantized weights) is not what the drafter was trained on."""
    quant = config.get("quantization") or config.get("quantization_config")
    if not quant:
        return True
    return isinstance(quant, dict) and {"mode": "affine", **quant} == SMOLLM2_GGUF_QUANTIZATION


def bundled_drafter_for(model_dir) -> Path | None:
    """The packaged drafter for ``model_dir`` when it is the SmolLM2-135M-Instruct folder that
    ``weights_convert.smollm2`` converted (its marker file), holding the GGUF's weights as
    stored: float32 on the CPU backend or the GGUF's own 4/8-bit quantization on Metal
    (:data:`SMOLLM2_GGUF_QUANTIZATION`); else None. See
    ``redrafter_mlx/smollm2_drafter/BUILD.md``."""
    folder = Path(model_dir).expanduser()
    if _drafter_dir(SMOLLM2_DRAFTER) is None or _read_json(folder / SMOLLM2_MARKER) is None:
        return None
    config = _read_json(folder / "config.json")
    return SMOLLM2_DRAFTER if config is not None and _same_weights_as_the_gguf(config) else None


NAMES = ("smollm2", "smollm2-apar", "demo")


def unknown_name_error(spec: str) -> str | None:
    """The message for a model value that names nothing: a bare word (no path separator, not
    shaped ``owner/name``) that is neither a folder nor a bundled model; None otherwise."""
    if spec in NAMES or Path(spec).expanduser().exists() or spec.startswith((".", "~")):
        return None
    if "/" in spec or os.sep in spec:
        return None
    return (
        f"model {spec!r} is not a folder here, a Hugging Face repo id (owner/name) or a "
        f"bundled model; the bundled models are {', '.join(NAMES)} (e.g. --model demo)"
    )


def bundled(name: str) -> BundledModel | None:
    """The bundled model called ``name`` (``demo``, ``smollm2``, ``smollm2-apar``), or None
    for other names."""
    if name == "demo":
        base, drafter = demo_paths()
        return BundledModel("demo", base, drafter, DEMO_NOTE, "'make demo-model'")
    if name == "smollm2":
        path = smollm2_path()
        drafter = bundled_drafter_for(path)
        return BundledModel(
            "smollm2", path, drafter, SMOLLM2_NOTE, "'make smollm2' (part of make install)"
        )
    if name == SMOLLM2_APAR_NAME:
        path = smollm2_apar_path()
        fuse = "'make smollm2' (part of make install; it fuses the packaged APAR adapter)"
        # SmolLM2's drafter serves it (a drafter of the vocabulary before the split tokens:
        # loading.check_pair): 1.57 against 1.03 tokens/step with lookup alone on a list
        drafter = bundled_drafter_for(smollm2_path())
        return BundledModel(SMOLLM2_APAR_NAME, path, drafter, SMOLLM2_APAR_NOTE, fuse)
    return None


def default_model() -> BundledModel:
    """SmolLM2 when it is installed and has a drafter, else the demo model."""
    smollm2 = bundled("smollm2")
    if smollm2.installed and smollm2.drafter is not None:
        return smollm2
    return bundled("demo")
