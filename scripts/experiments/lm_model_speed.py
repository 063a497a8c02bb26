"""SmolLM2 through our own forward (``engine/verifier/model.py``) and through mlx-lm's model
(``engine/verifier/lm_model.py``), side by side in one process: tokens/s of plain decoding and
of the default plan (the shipped drafter and lookup, adaptive), on MT-Bench first turns.

    python -m scripts.experiments.lm_model_speed --num-prompts 8 --max-tokens 128

Rounds alternate the two paths, so machine noise falls on both; each path's outputs must
equal the other's (greedy).
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from redrafter_mlx.engine.base import bundled
from redrafter_mlx.engine.base.prompts import load_records
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.loading import attach, load_drafter, load_lm_model, load_model
from redrafter_mlx.engine.loop.plan import default_plan
from redrafter_mlx.engine.verifier.config import read_config


def run(model, drafter, prompt, shape, adapt, max_tokens):
    tokens, start = [], time.perf_counter()
    for event in generate_steps(
        model, drafter, [prompt], max_tokens=max_tokens, shape=shape, adapt=adapt
    ):
        tokens += event.tokens[0]
    return tokens, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    path = bundled.smollm2_path()
    own, _ = load_model(path)
    lm = load_lm_model(path, read_config(path), own.dtype)
    drafter = load_drafter(bundled.SMOLLM2_DRAFTER, own.dtype)
    tokenizer = load_tokenizer(path)
    records = load_records("mt-bench", args.num_prompts, spread_categories=True)
    prompts = [tokenizer.chat_prompt([{"role": "user", "content": r.turns[0]}]) for r in records]
    plan = default_plan(drafter).shape
    rows = {}
    for label, shape, adapt, d in (
        ("AR", BeamShape.autoregressive(), False, None),
        (f"default ({plan.label}, adaptive)", plan, True, drafter),
    ):
        totals = {"own": [0, 0.0], "mlx-lm": [0, 0.0]}
        for i, prompt in enumerate(prompts):
            order = (("own", own), ("mlx-lm", lm))
            outs = {}
            for name, model in order if i % 2 == 0 else order[::-1]:
                attach(model, d)
                run(model, d, prompt[:8], shape, adapt, 4)  # compile outside the timing
                out, seconds = run(model, d, prompt, shape, adapt, args.max_tokens)
                outs[name] = out
                totals[name][0] += len(out)
                totals[name][1] += seconds
            assert outs["own"] == outs["mlx-lm"], f"prompt {i}: the two paths differ"
        rows[label] = {k: n / s for k, (n, s) in totals.items()}
    print(
        f"| SmolLM2, {args.num_prompts} MT-Bench prompts x {args.max_tokens} | own tok/s |"
        " mlx-lm tok/s | mlx-lm / own |"
    )
    print("| --- | --- | --- | --- |")
    for label, r in rows.items():
        print(f"| {label} | {r['own']:.2f} | {r['mlx-lm']:.2f} | {r['mlx-lm'] / r['own']:.3f} |")
    mx.clear_cache()


if __name__ == "__main__":
    main()
