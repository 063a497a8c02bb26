"""Find a checkpoint's files (local folder or Hugging Face repo) and list its tensors lazily.

Weights are looked up in this order: ``model.safetensors.index.json`` (sharded safetensors),
``model.safetensors``, ``pytorch_model.bin.index.json`` (sharded ``.bin``),
``pytorch_model.bin``. A Hugging Face repo id is fetched with ``huggingface_hub`` and only the
files needed (config, tokenizer, one weight format) are downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from weights_convert.errors import ConversionError
from weights_convert.tensors import TensorRef

CONFIG_FILE = "config.json"
SIDE_FILES = (  # copied next to the converted weights when present
    "tokenizer.model",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
)
TOKENIZER_FILES = frozenset(SIDE_FILES) - {"generation_config.json"}
WEIGHT_LAYOUTS = (  # (index file or None, single file, shard glob)
    ("model.safetensors.index.json", "model.safetensors", "model-*.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin", "pytorch_model-*.bin"),
)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on local disk.

    Attributes:
        root: the folder holding config.json and the weights.
        config: the parsed config.json.
        weight_files: the files holding the tensors, in index order.
        index: the ``*.index.json`` that listed them (None for a single file).
    """

    root: Path
    config: dict
    weight_files: tuple[Path, ...]
    index: Path | None

    @property
    def nbytes(self) -> int:
        return sum(f.stat().st_size for f in self.weight_files)


def load_json(path: Path, what: str) -> dict:
    """Parse a JSON object file, with an error naming the file."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConversionError(f"{what} {path} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{what} {path} is not valid JSON ({e}); re-download it") from None
    if not isinstance(data, dict):
        raise ConversionError(f"{what} {path} is not a JSON object; re-download it")
    return data


def _index_shards(root: Path, index_name: str) -> tuple[Path, ...]:
    """The shard files an index lists, in order of first appearance; all must exist."""
    index = load_json(root / index_name, "weight index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConversionError(
            f"weight index {root / index_name} has no 'weight_map'; re-download it"
        )
    shards = list(dict.fromkeys(weight_map.values()))
    for shard in shards:
        if not isinstance(shard, str) or "/" in shard or "\\" in shard or shard.startswith("."):
            raise ConversionError(
                f"weight index {root / index_name} names an invalid shard {shard!r}"
            )
        _check_readable(root / shard)
        if not (root / shard).is_file():
            raise ConversionError(
                f"shard {shard} listed in {root / index_name} is missing from {root}; "
                "download all shards the index names (or re-download the model)"
            )
    return tuple(root / s for s in shards)


def _check_readable(path: Path) -> None:
    """ConversionError naming ``path`` when its name is there but it cannot be opened (a
    symbolic link in a loop or to nothing, a folder, no permission); nothing when absent."""
    from redrafter_mlx.engine.base.safetensors_check import unreadable

    if os.path.lexists(path) and (problem := unreadable(path)):
        raise ConversionError(problem)


def find_weight_files(root: Path) -> tuple[tuple[Path, ...], Path | None]:
    """Locate the weights in ``root`` -> (files, index path or None)."""
    for index_name, single, _ in WEIGHT_LAYOUTS:
        _check_readable(root / index_name)
        if (root / index_name).is_file():
            return _index_shards(root, index_name), root / index_name
        _check_readable(root / single)
        if (root / single).is_file():
            return (root / single,), None
    raise ConversionError(
        f"no weights found in {root}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


def open_checkpoint(root: Path, what: str) -> Checkpoint:
    """Read config.json and locate the weights of a local checkpoint folder."""
    from redrafter_mlx.engine.verifier.config import ConfigError, read_config

    try:
        config = read_config(root, what)
    except ConfigError as e:
        raise ConversionError(str(e)) from None
    files, index = find_weight_files(root)
    return Checkpoint(root, config, files, index)


def read_tensor_refs(checkpoint: Checkpoint) -> list[TensorRef]:
    """All tensors of a checkpoint (metadata only), in file order; names must be unique.

    When an index is present, every tensor it maps must be found in the shard it names.
    """
    from weights_convert.safetensors_io import read_safetensors
    from weights_convert.torch_bin import read_torch_bin

    refs: dict[str, TensorRef] = {}
    for path in checkpoint.weight_files:
        reader = read_safetensors if path.suffix == ".safetensors" else read_torch_bin
        for ref in reader(path):
            if ref.name in refs:
                raise ConversionError(
                    f"tensor {ref.name} appears in both {refs[ref.name].path.name} and "
                    f"{path.name}; "
                    "the checkpoint is inconsistent, re-download it"
                )
            refs[ref.name] = ref
    if checkpoint.index is not None:
        weight_map = load_json(checkpoint.index, "weight index")["weight_map"]
        for name, shard in weight_map.items():
            if name not in refs or refs[name].path.name != shard:
                raise ConversionError(
                    f"{checkpoint.index.name} maps {name} to {shard}, but that shard does not "
                    "hold it; "
                    "re-download the model"
                )
    return list(refs.values())


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy tokenizer files and generation_config.json that exist in ``src`` -> names copied."""
    copied = []
    for name in SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def _choose_repo_files(repo_id: str, files: list[str]) -> list[str]:
    """From a repo listing, pick config, tokenizer files and one weight format."""
    wanted = [f for f in files if f in SIDE_FILES or f == CONFIG_FILE]
    for index_name, single, pattern in WEIGHT_LAYOUTS:
        if index_name in files:
            return wanted + [index_name, pattern]
        if single in files:
            return wanted + [single]
    raise ConversionError(
        f"Hugging Face repo {repo_id} has no model.safetensors or pytorch_model.bin weights "
        "(for a GGUF-only repo, download the .gguf file and pass it with --model FILE.gguf)"
    )


def find_gguf(folder: Path) -> Path | None:
    """The one ``.gguf`` file of a folder without config.json, or None (a Hugging Face folder)."""
    if (folder / CONFIG_FILE).is_file():
        return None
    found = sorted(p for p in folder.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(found) > 1:
        names = ", ".join(p.name for p in found[:4]) + (" ..." if len(found) > 4 else "")
        raise ConversionError(
            f"{folder} holds {len(found)} .gguf files ({names}); pass the one to convert"
        )
    return found[0].resolve() if found else None


def resolve_source(spec: str, what: str) -> Path:
    """``--model``/``--drafter`` value -> local folder or ``.gguf`` file (downloading a Hugging
    Face repo if needed).

    Args:
        spec: a local folder, a ``.gguf`` file (or a folder holding exactly one), or a Hugging
            Face repo id ``owner/name`` (the engine's one rule,
            :mod:`redrafter_mlx.engine.base.hub`).
        what: "model" or "drafter", for messages.
    """
    from redrafter_mlx.engine.base.hub import ResolveError, resolve

    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path.resolve()
    try:
        path = resolve(
            spec,
            f"--{what}",
            patterns=("*.json", "*.safetensors", "tokenizer.model"),
            choose=lambda files: _choose_repo_files(spec, files),
        )
    except ResolveError as e:
        raise ConversionError(str(e)) from None
    return find_gguf(path) or path.resolve()
