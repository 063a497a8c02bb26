"""Build a smaller SmolLM2-tokenizer draft model by keeping the first k decoder layers.

    python -m scripts.build_smollm2_draft --layers 8
    python -m scripts.build_smollm2_draft --layers 8 --model DIR --out DIR --force

No smaller SmolLM2 can be downloaded here, so the draft model is cut from the target
itself: SmolLM2-135M-Instruct (``--model``, default the installed ``smollm2``) with its
decoder layers ``[0, k)``, its final norm and its (tied) head kept, every later layer
dropped. The result is a normal Llama folder (``config.json`` with ``num_hidden_layers =
k``, ``model.safetensors``, the tokenizer files) that our loader and mlx-lm load as is, for
``--draft-model`` (``bench --draft-model DIR --configs D1xL4``). Its forward equals the
source model's first k layers followed by the final norm and the head
(``tests/scripts/test_build_draft.py``).

The folder is written beside ``--out`` under a hidden name and renamed into place at the
end (``engine.base.output_dir.staging_dir``): an interrupted build leaves nothing half written.
Default ``--out``: HOME/models/smollm2-draft-L{k} (HOME: ``engine.base.bundled.home()``).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a decoder layer's tensor (model.layers.N.)
SKIP = ("config.json", "model.safetensors.index.json")  # rewritten, not copied
PER_LAYER = ("layer_types",)  # config lists with one entry per decoder layer


def default_out(layers: int) -> Path:
    """HOME/models/smollm2-draft-L{k}."""
    from redrafter_mlx.engine.base.bundled import home

    return home() / "models" / f"smollm2-draft-L{layers}"


def truncated_config(config: dict, layers: int) -> dict:
    """``config`` with ``layers`` decoder layers (a per-layer list such as ``layer_types``
    keeps its first ``layers`` entries). ValueError unless 1 <= layers < the model's
    layer count."""
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers < total:
        raise ValueError(
            f"--layers {layers}: pass a count from 1 to {total - 1} (the model has {total} "
            "layers; a draft model keeps fewer)"
        )
    out = dict(config, num_hidden_layers=layers)
    for key in PER_LAYER:
        if isinstance(out.get(key), list):
            out[key] = out[key][:layers]
    return out


def kept(name: str, layers: int) -> bool:
    """Whether tensor ``name`` belongs to the draft model: everything but layers >= k."""
    m = LAYER.search(name)
    return m is None or int(m.group(1)) < layers


def copied(file: Path) -> bool:
    """Whether a source file goes into the draft folder as is: the tokenizer and generation
    files, not the weights, the rewritten config or hidden files (an install marker would
    make the folder pass for the full model)."""
    rewritten = file.suffix == ".safetensors" or file.name in SKIP
    return file.is_file() and not rewritten and not file.name.startswith(".")


def weight_files(folder: Path) -> list[Path]:
    """The folder's safetensors files (sharded or one file); ValueError when none."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} holds no .safetensors weights: pass an MLX model folder")
    return files


def build(model: Path, out: Path, layers: int) -> Path:
    """Write the first ``layers`` layers of the model in ``model`` as a folder at ``out``."""
    import mlx.core as mx

    from redrafter_mlx.engine.base.output_dir import staging_dir

    config = truncated_config(json.loads((model / "config.json").read_text()), layers)
    weights = {}
    for file in weight_files(model):
        weights.update({k: v for k, v in mx.load(str(file)).items() if kept(k, layers)})
    with staging_dir(out, "building") as tmp:
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        for f in model.iterdir():
            if copied(f):
                shutil.copy(f, tmp / f.name)
        (tmp / "BUILD.md").write_text(
            f"The first {layers} decoder layers of {model} (with its final norm and head), "
            f"written by `python -m scripts.build_smollm2_draft --layers {layers}`.\n"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, required=True, help="decoder layers kept (k)")
    parser.add_argument("--model", help="source MLX model folder (default: installed smollm2)")
    parser.add_argument("--out", help="output folder (default HOME/models/smollm2-draft-L{k})")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out")
    args = parser.parse_args(argv)
    from redrafter_mlx.engine.base.bundled import smollm2_path
    from redrafter_mlx.engine.base.output_dir import refusal

    model = Path(args.model).expanduser() if args.model else smollm2_path()
    out = Path(args.out).expanduser() if args.out else default_out(args.layers)
    if not (model / "config.json").is_file():
        print(f"error: {model} has no config.json; install SmolLM2 (make smollm2) or pass "
              "--model", file=sys.stderr)  # fmt: skip
        return 2
    problem = refusal(out, args.force, [model], "--force")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        build(model, out, args.layers)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
