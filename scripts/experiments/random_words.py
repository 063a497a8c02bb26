"""Write the "random words" prompt set: prompts nothing in the context can predict.

Each prompt asks for a list of unrelated words after showing 24 words drawn at random from
the SmolLM2 tokenizer's whole-word pieces (seeded), the check that context lookup costs
nothing where the text does not repeat itself. Usage:

    python -m scripts.experiments.random_words [--out docs/bench/random_words.jsonl] [--n 16]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from redrafter_mlx.engine.base.bundled import smollm2_path
from redrafter_mlx.engine.base.tokenizer import load_tokenizer


def words(n_prompts: int, per_prompt: int, seed: int) -> list[list[str]]:
    tok = load_tokenizer(smollm2_path())
    vocab = sorted({tok.decode([i]).strip() for i in range(tok.vocab_size)})
    pool = [w for w in vocab if w.isalpha() and w.islower() and 4 <= len(w) <= 9]
    rng = random.Random(seed)
    return [rng.sample(pool, per_prompt) for _ in range(n_prompts)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/bench/random_words.jsonl")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lines = []
    for i, chosen in enumerate(words(args.n, 24, args.seed), 1):
        turn = (
            "Here are some unrelated words: "
            + ", ".join(chosen)
            + ". Write twenty new unrelated words that are not in this list, one per line."
        )
        lines.append(json.dumps({"question_id": i, "category": "random", "turns": [turn]}))
    Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} prompts to {args.out}")


if __name__ == "__main__":
    main()
