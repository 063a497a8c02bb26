"""Prompts that repeat themselves and step costs by phase, for context lookup's tests."""

from __future__ import annotations


def repetitive_prompts(rng, vocab, B):
    """Prompts that repeat a phrase, so lookup finds matches (and sometimes wrong ones)."""
    rows = []
    for _ in range(B):
        phrase = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        noise = [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        rows.append([1] + phrase * rng.randint(1, 3) + noise + phrase[: rng.randint(0, 3)])
    return rows


def phased_costs(shapes, period: int):
    """Step costs under which each of ``shapes`` in turn is cheapest, for ``period`` steps."""
    ticks = {"n": 0}

    def cost(shape):
        ticks["n"] += 1
        return 1.0 if shapes[(ticks["n"] // period) % len(shapes)] == shape else 3.0

    return cost
