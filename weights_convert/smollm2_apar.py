"""SmolLM2-APAR: SmolLM2-135M-Instruct with the packaged APAR LoRA adapter fused in.

The package ships the adapter (``redrafter_mlx/smollm2_apar/``: ``adapters.safetensors``, the
LoRA matrices of the last blocks and the two new embedding rows, and ``adapter_config.json``;
built by ``make smollm2-apar``, see its BUILD.md), not a second copy of the model. This module
fuses it into the converted SmolLM2 folder's weights, once, into
``<home>/models/smollm2-apar`` (``--model smollm2-apar``)::

    python -m weights_convert.smollm2_apar      # make smollm2 runs it after SmolLM2

The fused folder: each adapted linear's weight plus ``scale * B^T A^T`` (mlx-lm's
``LoRALinear.fuse``; a quantized weight is dequantized, fused and quantized again with its own
group size and bits), the embedding (the tied head) grown by the adapter's rows, ``vocab_size``
and the ``branches`` block in ``config.json`` (a branching model; ``max_depth`` 1, as its
training trees), the tokenizer with both split
tokens as special tokens at the new ids. Written into a temp folder, renamed at the end; its
marker names the adapter's digest, so a newer packaged adapter is fused again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

from redrafter_mlx.engine.base.bundled import (
    SMOLLM2_APAR_ADAPTER,
    SMOLLM2_APAR_MARKER,
    smollm2_apar_path,
    smollm2_path,
)
from redrafter_mlx.engine.base.bundled import home as default_home
from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN
from weights_convert.errors import ConversionError

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
EMBEDDING = "model.embed_tokens"
EXTRA_ROWS = f"{EMBEDDING}.extra"  # the adapter's new embedding rows, (n, H)
SPLIT_TOKENS = (FORK_TOKEN, CHILD_TOKEN)  # in id order after the base vocabulary
MAX_DEPTH = 1  # its training trees are one level deep (train.apar_data): children never fork


def adapter_digest(adapter_dir: Path) -> str:
    """sha256 over the adapter's two files (what the fused folder's marker records)."""
    h = hashlib.sha256()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        h.update((adapter_dir / name).read_bytes())
    return h.hexdigest()


def _dequantized(weights: dict, name: str, quant: dict | None) -> tuple[mx.array, dict | None]:
    """``name``'s weight as floats, and its quantization (None when stored as floats)."""
    w = weights[f"{name}.weight"]
    if f"{name}.scales" not in weights:
        return w, None
    q = {**(quant or {}), **((quant or {}).get(name) or {})}
    group, bits = int(q.get("group_size", 64)), int(q.get("bits", 4))
    scales, biases = weights[f"{name}.scales"], weights[f"{name}.biases"]
    floats = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
    return floats.astype(scales.dtype), {"group_size": group, "bits": bits}


def _store(out: dict, name: str, w: mx.array, q: dict | None) -> None:
    """``name``'s weight into ``out``, quantized again when it was."""
    if q is None:
        out[f"{name}.weight"] = w
        return
    out[f"{name}.weight"], out[f"{name}.scales"], out[f"{name}.biases"] = mx.quantize(
        w, group_size=q["group_size"], bits=q["bits"]
    )


def fuse_adapter(weights: dict, adapter: dict, scale: float, quant: dict | None = None) -> dict:
    """The model's ``weights`` with the LoRA ``adapter`` fused in -> new weights dict.

    ``adapter``: ``<linear>.lora_a`` (in, r) and ``<linear>.lora_b`` (r, out) per adapted
    linear, and ``model.embed_tokens.extra`` (n, H), the rows appended to the embedding.
    ``quant``: config.json's ``quantization`` block when the weights are quantized."""
    out = dict(weights)
    linears = sorted(k[: -len(".lora_a")] for k in adapter if k.endswith(".lora_a"))
    for name in linears:
        if f"{name}.weight" not in weights or f"{name}.lora_b" not in adapter:
            raise ConversionError(
                f"the adapter adapts {name}, which the model lacks (or its lora_b is missing): "
                "it was trained for another model; rebuild it (make smollm2-apar)"
            )
        w, q = _dequantized(weights, name, quant)
        a, b = adapter[f"{name}.lora_a"], adapter[f"{name}.lora_b"]
        delta = ((scale * b.T).astype(w.dtype)) @ a.T.astype(w.dtype)
        _store(out, name, w + delta, q)
    if EXTRA_ROWS in adapter:
        table, q = _dequantized(weights, EMBEDDING, quant)
        grown = mx.concatenate([table, adapter[EXTRA_ROWS].astype(table.dtype)])
        _store(out, EMBEDDING, grown, q)
    return out


def add_split_tokens(folder: Path, first_id: int) -> None:
    """The split tokens as special added tokens at ``first_id``, ``first_id + 1`` in
    ``folder``'s ``tokenizer.json`` and ``tokenizer_config.json``."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    if tok.get_vocab_size(with_added_tokens=True) != first_id:
        raise ConversionError(
            f"{folder}'s tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, "
            f"not the model's {first_id}: the tokenizer and weights disagree"
        )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPLIT_TOKENS])
    tok.save(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    decoder = config.setdefault("added_tokens_decoder", {})
    for i, name in enumerate(SPLIT_TOKENS):
        decoder[str(first_id + i)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    extra = config.get("additional_special_tokens") or []
    config["additional_special_tokens"] = list(extra) + [t for t in SPLIT_TOKENS if t not in extra]
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def _marker(out: Path) -> dict | None:
    try:
        data = json.loads((out / SMOLLM2_APAR_MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def build(base: Path, adapter_dir: Path, out: Path) -> Path:
    """Fuse ``adapter_dir`` into the model folder ``base``, written as ``out`` (temp folder,
    renamed at the end; ``base`` is only read)."""
    settings = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    config = json.loads((base / "config.json").read_text())
    weights = {}
    for file in sorted(base.glob("*.safetensors")):
        weights.update(mx.load(str(file)))
    adapter = mx.load(str(adapter_dir / ADAPTER_WEIGHTS))
    quant = config.get("quantization")
    fused = fuse_adapter(weights, adapter, float(settings["scale"]), quant)
    vocab = int(config["vocab_size"])
    grown = int(fused[f"{EMBEDDING}.weight"].shape[0])
    if grown != vocab + len(SPLIT_TOKENS):
        raise ConversionError(
            f"the fused embedding has {grown} rows, not {vocab} + {len(SPLIT_TOKENS)}: the "
            "adapter's new rows do not match the split tokens; rebuild it (make smollm2-apar)"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users
    try:
        mx.save_safetensors(str(tmp / "model.safetensors"), fused, metadata={"format": "mlx"})
        branches = {"fork": FORK_TOKEN, "child": CHILD_TOKEN, "max_depth": MAX_DEPTH}
        (tmp / "config.json").write_text(
            json.dumps({**config, "vocab_size": grown, "branches": branches}, indent=4) + "\n"
        )
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (base / name).is_file():
                shutil.copyfile(base / name, tmp / name)
        add_split_tokens(tmp, vocab)
        marker = {"base": str(base), "adapter": adapter_digest(adapter_dir)}
        (tmp / SMOLLM2_APAR_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def ensure_smollm2_apar(home: Path | None = None) -> Path | None:
    """The fused SmolLM2-APAR folder, built when missing or older than the packaged adapter;
    None when the package has no adapter. Needs the converted SmolLM2 (``make smollm2``)."""
    if not (SMOLLM2_APAR_ADAPTER / ADAPTER_WEIGHTS).is_file():
        return None
    home = Path(home).expanduser() if home is not None else default_home()
    out, base = smollm2_apar_path(home), smollm2_path(home)
    marker = _marker(out)
    if marker is not None and marker.get("adapter") == adapter_digest(SMOLLM2_APAR_ADAPTER):
        return out
    if not (base / "config.json").is_file():
        raise ConversionError(f"no SmolLM2 at {base}: run `make smollm2` first")
    return build(base, SMOLLM2_APAR_ADAPTER, out)


def main() -> int:
    try:
        out = ensure_smollm2_apar()
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if out is None:
        print("no packaged APAR adapter (redrafter_mlx/smollm2_apar/): nothing to fuse")
    else:
        print(f"SmolLM2-APAR at {out} (--model smollm2-apar)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
