"""Same-run A/B: a branching answer's loop queueing the next step before reading the one in
flight (``Branches.queue_ahead``) against reading each branching step first (the loop
before it), on SmolLM2-APAR's list prompts (or the other MT-Bench prompts), plain decoding
and the pinned speculative shape, branches on, greedy. Each prompt runs both loops back to
back in A B B A order, so drift falls on both; the tokens must be equal (far from the
limits the forks are the same).

    python -m scripts.experiments.branch_queue_ahead --num-prompts 6 --max-tokens 192
    python -m scripts.experiments.branch_queue_ahead --num-prompts 6 --max-tokens 192 --set rest
"""

from __future__ import annotations

import argparse

from redrafter_mlx.cli.common import load_engine
from redrafter_mlx.cli.paths import resolve_paths
from redrafter_mlx.engine.base.prompts import load_records
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.branch_rows import Branches
from redrafter_mlx.engine.loop.plan import default_plan
from scripts.bench_branches import LIST_CATEGORIES as LISTS
from scripts.bench_branches import answer

AHEAD = Branches.queue_ahead


def read_first(self, pending) -> bool:
    return not self.branching


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="smollm2-apar")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument(
        "--set",
        choices=("lists", "rest"),
        default="lists",
        help="list prompts, or MT-Bench's other categories (few or no forks)",
    )
    args = p.parse_args(argv)
    engine = load_engine(resolve_paths(args.model, None), None)
    model, drafter, tok = engine.model, engine.drafter, engine.tokenizer
    lists = [r.prompt for r in load_records("lists", 40)]
    half = args.num_prompts // 2
    prompts = lists[: args.num_prompts - half] + lists[20 : 20 + half]
    if args.set == "rest":  # as bench_branches picks them
        rest = [r.prompt for r in load_records("mt-bench", 80) if r.category not in LISTS]
        prompts = rest[:: max(60 // args.num_prompts, 1)][: args.num_prompts]
    spec = default_plan(drafter).shape
    sampler = SamplerConfig()
    for label, shape in (("plain", BeamShape.autoregressive()), (f"pinned {spec.label}", spec)):
        seconds = {"ahead": 0.0, "first": 0.0}
        tokens = steps = 0
        for prompt in prompts:
            got = {}
            for mode in ("ahead", "first", "first", "ahead"):
                Branches.queue_ahead = AHEAD if mode == "ahead" else read_first
                text, n, s, _, sec, _ = answer(
                    model, drafter, tok, prompt, shape, False, "on", args.max_tokens, sampler
                )
                seconds[mode] += sec
                if mode in got and got[mode] != text:
                    raise SystemExit("the same loop gave two answers")
                got[mode] = text
                tokens, steps = tokens + n, steps + s
            if got["ahead"] != got["first"]:
                print(f"  answers differ on {prompt[:40]!r} (a limit was reached)")
        Branches.queue_ahead = AHEAD
        rate = {m: tokens / 4 * 2 / s for m, s in seconds.items()}
        print(
            f"{label}: queue ahead {rate['ahead']:.1f} tok/s, read first {rate['first']:.1f} "
            f"tok/s, ratio {rate['ahead'] / rate['first']:.3f}x ({len(prompts)} prompts x 2 "
            "runs each)"
        )


if __name__ == "__main__":
    main()
