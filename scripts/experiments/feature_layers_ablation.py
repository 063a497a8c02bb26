"""Score drafters on held-out MT-Bench turns: greedy ReDrafter tokens/step per beam shape
(no lookup chains; all prompts in one batch) and each drafter's recorded held-out selection.

    python -m scripts.experiments.feature_layers_ablation --model ~/.cache/redrafter-mlx/models/\
smollm2-135m-instruct --drafter last=/tmp/abl/last --drafter auto=/tmp/abl/auto

Used for the feature-layer ablation in redrafter_mlx/smollm2_drafter/BUILD.md.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from redrafter_mlx.engine.base.prompts import load_prompts
from redrafter_mlx.engine.loop.loading import attach, load, load_drafter
from redrafter_mlx.train.evaluation import evaluate


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--drafter", action="append", required=True, help="NAME=PATH")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--shapes", default="1x4,4x5")
    ap.add_argument("--out", help="write the rows as JSON here too")
    args = ap.parse_args(argv)
    model, _, tok = load(Path(args.model).expanduser(), None, "float32")
    prompts = [
        list(tok.chat_prompt([{"role": "user", "content": text}]))
        for text in load_prompts("mt-bench", args.prompts)
    ]
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = []
    for spec in args.drafter:
        name, path = spec.split("=", 1)
        drafter = load_drafter(Path(path), model.dtype)
        attach(model, drafter)
        config = json.loads((Path(path) / "config.json").read_text())
        sel = config.get("selected") or {}
        for r in evaluate(model, drafter, prompts, shapes, args.max_tokens, tok.eos_token_ids):
            row = dict(drafter=name, feature_layers=config.get("feature_layers"), **r)
            row.update(selected_step=sel.get("step"), heldout=sel)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
