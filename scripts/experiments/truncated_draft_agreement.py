"""Teacher-forced top-1 agreement of layer-subset draft models with their target.

    python -m scripts.experiments.truncated_draft_agreement            # installed SmolLM2
    python -m scripts.experiments.truncated_draft_agreement --model DIR --tokens 96

The target (mlx-lm's loader) answers three prompts greedily; then, at every answer position,
a draft made of a subset of the target's decoder layers (the first k, as
``scripts/build_smollm2_draft.py`` builds; or the first a and the last b) with the target's
final norm and head predicts the next token, fed the true text. The share of positions where
its argmax equals the target's bounds what a greedy draft chain can get accepted: a chain of
n drafts accepts about p + p^2 + ... + p^n tokens a step at agreement p
(``docs/bench/draft_model_small.txt``).
"""

from __future__ import annotations

import argparse

PROMPTS = (
    "Write a short story about a robot who learns to paint.",
    "Explain how photosynthesis works in simple terms.",
    "Give me three tips for learning Python.",
)


def subsets(layers: int) -> list[tuple[str, list[int]]]:
    """The layer subsets compared: the first k for several k, then first a + last b."""
    out = [(f"first {k}", list(range(k))) for k in (4, 8, 12, 16, 24, 28) if k < layers]
    for a, b in ((4, 4), (6, 6), (8, 8), (4, 8)):
        if a + b < layers:
            out.append((f"first {a} + last {b}", [*range(a), *range(layers - b, layers)]))
    return out


def main(argv=None) -> None:
    import mlx.core as mx
    from mlx_lm.generate import generate
    from mlx_lm.utils import load

    from redrafter_mlx.engine.bundled import smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(smollm2_path()), help="target model folder")
    ap.add_argument("--tokens", type=int, default=96, help="answer tokens per prompt")
    args = ap.parse_args(argv)
    model, tokenizer = load(args.model)
    texts = []
    for prompt in PROMPTS:
        chat = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        answer = generate(model, tokenizer, text, max_tokens=args.tokens, verbose=False)
        texts.append((tokenizer.encode(text + answer), len(tokenizer.encode(text))))
    layers = list(model.model.layers)

    def argmax(subset, ids):
        model.model.layers = [layers[i] for i in subset]
        try:
            return mx.argmax(model(mx.array([ids]))[0], axis=-1)
        finally:
            model.model.layers = layers

    every = list(range(len(layers)))
    targets = [(argmax(every, ids), start) for ids, start in texts]
    positions = sum(len(ids) - start for ids, start in texts)
    print(f"{'draft layers':<20} {'layers':>6} {'agreement':>9}  ({positions} answer positions)")
    for name, subset in subsets(len(layers)):
        agree = total = 0
        for (ids, start), (want, _) in zip(texts, targets):
            got = argmax(subset, ids)
            agree += int((got[start - 1 : -1] == want[start - 1 : -1]).sum())
            total += len(ids) - start
        print(f"{name:<20} {len(subset):>6} {agree / total:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
