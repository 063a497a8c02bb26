"""A model folder's weight files: the safetensors files (an index's shards), read with
their headers checked first (``safetensors_check``), so damage gets a clear ``LoadError``
naming the file and the fix."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import mlx.core as mx

from ..base.errors import RedrafterError
from ..base.safetensors_check import CorruptFileError, check_file
from .config import head_pairs


class LoadError(RedrafterError):
    """A model or drafter that cannot be loaded; the message names the problem and the fix."""


def read_weights(path: Path) -> dict[str, mx.array]:
    """All tensors of ``model*.safetensors`` in ``path`` (index-listed shards must exist)."""
    weights: dict[str, mx.array] = {}
    for f in weight_files_of(path):
        weights.update(load_checked(f))
    return weights


def non_finite(weights: dict[str, mx.array]) -> list[str]:
    """The names of the floating-point tensors in ``weights`` that hold a NaN or an infinity
    (what a diverged training run leaves; such weights are never saved or loaded)."""
    names = [k for k, v in weights.items() if mx.issubdtype(v.dtype, mx.floating)]
    flags = [mx.all(mx.isfinite(weights[k])) for k in names]
    mx.eval(flags)
    return [k for k, flag in zip(names, flags) if not flag.item()]


def tensor_names(files: list[Path]) -> set[str]:
    """The names of the tensors in ``files`` (headers only; each file checked whole)."""
    return {name for f in files for name in check_weight_file(f) if name != "__metadata__"}


def head_copies(files: list[Path]) -> bool:
    """Whether the checkpoint's head is a copy of its embedding (only those tensors are read:
    ``mx.load`` is lazy)."""
    weights = {k: v for f in files for k, v in mx.load(str(f)).items()}
    return copies_embedding(weights)


def copies_embedding(weights: dict) -> bool:
    """Whether every ``lm_head.*`` tensor of ``weights`` equals its ``model.embed_tokens.*``
    counterpart (reads both; ``weights`` may be lazily loaded)."""
    return all(
        embedding in weights and bool(mx.array_equal(weights[head], weights[embedding]))
        for head, embedding in head_pairs(weights)
    )


def weight_files_of(path: Path) -> list[Path]:
    """The model's safetensors files (index-listed shards must exist), or LoadError."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not os.path.lexists(path / s)]
        if missing:
            raise LoadError(f"{path}: shards listed in the index are missing: {missing}")
        files = [str(path / s) for s in shards]
    else:
        files = sorted(glob.glob(str(path / "model*.safetensors")))
    if not files:
        raise LoadError(f"{path} has no model*.safetensors; {_weights_fix(path)}")
    return [Path(f) for f in files]


def _weights_fix(path: Path) -> str:
    """What to do with a folder whose weights are under other names: what was found there
    and the command that makes it load."""
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin"))
    safetensors = [n for n in found if n.endswith(".safetensors")]
    if len(safetensors) == 1:
        return (
            f"it holds {safetensors[0]}: give it the name the loader reads, "
            f"mv {path / safetensors[0]} {path / 'model.safetensors'}"
        )
    if safetensors:
        return f"it holds {', '.join(safetensors)}: name them model-00001-of-N.safetensors ..."
    bins = [n for n in found if n.endswith(".bin")]
    if bins and not any(n.startswith("pytorch_model") for n in bins):
        return (
            f"it holds {', '.join(bins)}, a PyTorch checkpoint under another name: name it "
            f"pytorch_model.bin (mv {path / bins[0]} {path / 'pytorch_model.bin'}), then "
            f"convert it: redrafter-mlx convert --model {path} --out <dir>"
        )
    return (
        f"PyTorch checkpoints must be converted first: redrafter-mlx convert --model {path} "
        "--out <dir>"
    )


def check_weight_file(file: Path) -> dict:
    """The file's header, or LoadError naming the damage unless the safetensors file opens and
    is whole (a symbolic link in a loop, say)."""
    try:
        return check_file(file)
    except CorruptFileError as e:
        raise LoadError(str(e)) from None


def load_checked(file: Path) -> dict[str, mx.array]:
    """``mx.load`` of a safetensors file checked first, so damage gets a clear LoadError."""
    check_weight_file(file)
    return mx.load(str(file))
