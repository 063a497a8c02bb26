"""Rebuild the SmolLM2-135M-Instruct drafter that ships in the package (make smollm2-drafter).

    python -m scripts.build_smollm2_drafter            # distill (resumable), then ship
    python -m scripts.build_smollm2_drafter --print    # only print the distill command

The build is one ``redrafter-mlx distill`` run without ``--data`` (the model's own answers to
the built-in prompts, with the hidden states kept from decoding, soft targets, a shortlist
head, held-out checkpoint selection) with the settings below, into HOME/build/smollm2-drafter
(seeded; rerun to continue: ``--resume``), followed by ``ship``: the selected drafter in
float16 into redrafter_mlx/smollm2_drafter/. BUILD.md there records the shipped build.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIP = ROOT / "redrafter_mlx" / "smollm2_drafter"

# The shipped drafter's settings (BUILD.md): 1.7M answer positions (12,864 answers), 160-token
# greedy answers in batches of 48, T=5, 2 layers, exit_dim 576, 8192-id shortlist, soft
# targets, 10,800 steps of 256 (1.62 epochs), AdamW lr 1e-3 with weight decay 0.1, a held-out
# score every 300 steps; multi-layer features (layers 2, 15, 27: the ablation's winner).
SETTINGS = (
    "--budget 1700k --answer-tokens 160 --gen-batch 48 --predict-tokens 5 --layers 2 "
    "--exit-dim 576 --draft-vocab 8192 --soft-targets --steps 10800 --batch-size 256 "
    "--lr 1e-3 --weight-decay 0.1 --select-every 300 --seed 0 --feature-layers auto"
)


def default_work() -> Path:
    """The build's work folder in the one home folder (``engine.base.bundled.home()``)."""
    from redrafter_mlx.engine.base.bundled import home

    return home() / "build" / "smollm2-drafter"


def command(model: Path, out: Path, resume: bool) -> list[str]:
    return [
        "redrafter-mlx",
        "distill",
        "--model",
        str(model),
        "--out",
        str(out),
        *shlex.split(SETTINGS),
        *(["--resume"] if resume else []),
    ]


def ship(drafter: Path) -> None:
    """The drafter in float16 (config.json + model.safetensors) and the run's eval.json into
    the package."""
    import mlx.core as mx

    from redrafter_mlx.train.selfdata import write_json_atomic

    weights = mx.load(str(drafter / "model.safetensors"))
    weights = {
        k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in weights.items()
    }
    tmp = SHIP / f".model.safetensors.tmp-{os.getpid()}.safetensors"
    mx.save_safetensors(str(tmp), weights)
    os.replace(tmp, SHIP / "model.safetensors")
    config = json.loads((drafter / "config.json").read_text())
    write_json_atomic(SHIP / "config.json", dict(config, torch_dtype="float16"))
    if (drafter / "eval.json").exists():
        write_json_atomic(SHIP / "eval.json", json.loads((drafter / "eval.json").read_text()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default=None, help="default: HOME/build/smollm2-drafter")
    p.add_argument("--print", action="store_true", help="print the distill command and stop")
    p.add_argument("--no-ship", action="store_true", help="leave the packaged drafter alone")
    a = p.parse_args(argv)
    from weights_convert.smollm2 import smollm2_path

    out = (Path(a.work).expanduser() if a.work else default_work()) / "drafter"
    cmd = command(smollm2_path(), out, resume=out.exists())
    if a.print:
        print(shlex.join(cmd))
        return 0
    subprocess.run(cmd, check=True)
    if not a.no_ship:
        ship(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
