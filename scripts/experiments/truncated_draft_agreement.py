"""Teacher-forced top-1 agreement of layer-subset draft models with their target.

    python -m scripts.experiments.truncated_draft_agreement            # installed SmolLM2
    python -m scripts.experiments.truncated_draft_agreement --model DIR --tokens 96

The target (mlx-lm's loader) answers three prompts greedily; then, at every answer position,
a draft made of a subset of the target's decoder layers (the first k, as
``scripts/build_smollm2_draft.py`` builds; or the first a and the last b) with the target's
final norm and head predicts the next token, fed the true text. The share of positions where
its argmax equals the target's bounds what a greedy draft chain can get accepted: a chain of
n drafts accepts about p + p^2 + ... + p^n tokens a step at agreement p
(``docs/bench/draft_model_small.txt``). ``--top K`` also prints the share where the target's
token is among the draft's K best (what a tree of the draft's top tokens could get accepted).
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

    from redrafter_mlx.engine.base.bundled import smollm2_path

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(smollm2_path()), help="target model folder")
    ap.add_argument("--tokens", type=int, default=96, help="answer tokens per prompt")
    ap.add_argument("--top", type=int, default=1, help="also the share within the K best")
    args = ap.parse_args(argv)
    model, tokenizer = load(args.model)
    texts = []
    for prompt in PROMPTS:
        chat = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        answer = generate(model, tokenizer, text, max_tokens=args.tokens, verbose=False)
        texts.append((tokenizer.encode(text + answer), len(tokenizer.encode(text))))
    layers = list(model.model.layers)

    def ranked(subset, ids, k):  # (T, k) the k best ids at each position, best first
        model.model.layers = [layers[i] for i in subset]
        try:
            return mx.argsort(-model(mx.array([ids]))[0], axis=-1)[:, :k]
        finally:
            model.model.layers = layers

    every = list(range(len(layers)))
    targets = [(ranked(every, ids, 1)[:, 0], start) for ids, start in texts]
    positions = sum(len(ids) - start for ids, start in texts)
    tops = "".join(f" {'top-' + str(j):>7}" for j in range(2, args.top + 1))
    print(
        f"{'draft layers':<20} {'layers':>6} {'agreement':>9}{tops}  ({positions} answer positions)"
    )
    for name, subset in subsets(len(layers)):
        within, total = [0] * args.top, 0
        for (ids, start), (want, _) in zip(texts, targets):
            got = ranked(subset, ids, args.top)[start - 1 : -1]
            hit = got == want[start - 1 : -1, None]  # (T, k)
            for j in range(args.top):
                within[j] += int(hit[:, : j + 1].any(axis=1).sum())
            total += len(ids) - start
        shares = "".join(f" {w / total:>7.3f}" for w in within[1:])
        print(f"{name:<20} {len(subset):>6} {within[0] / total:>9.3f}{shares}", flush=True)


if __name__ == "__main__":
    main()
