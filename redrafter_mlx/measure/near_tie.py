"""Is a greedy mismatch a near-tie that float rounding decided, or an engine bug?

Greedy speculative decoding gives plain decoding's tokens when both compute the same logits.
They compute them in forwards of different shapes: plain decoding one token per step, the
verify a tree of T tokens at once. Kernels round differently for different shapes, by ~1e-6
of a logit in float32 and by ~1e-2 in float16, so where the top two tokens are that close the
two paths can pick different ones, and the texts part there (mlx-lm's own plain and
speculative generators part from each other the same way in half precision).

The check, at the first position where a run differs from plain decoding: the logits after
the common prefix, computed twice, as a one-token step after the rest of the prefix (plain
decoding's shape) and in one forward over the whole prefix (a many-token shape, as a
verify). ``noise``: the largest difference between the two over the vocabulary, and at
least the logits' own resolution (the head runs in the model's dtype: one unit in the last
place of the two logits, 0.016 at a logit of 20 in float16, 0.125 in bfloat16; a backend
whose two shapes happen to round alike, as MLX's CPU backend in half precision, still
differs from another by that much). ``lead``: how far the plain path's token leads the
other run's token in the one-token logits. A lead within ``TIE_FACTOR`` times the noise is a
near-tie; a larger one cannot come from rounding, so the engine accepted a token the model
does not choose: a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

TIE_FACTOR = 2.0


@dataclass(frozen=True)
class TieCheck:
    """``lead``: plain decoding's token over the other's, one-token step logits; ``noise``:
    max |step - whole-prefix forward| logits; ``near_tie``: ``|lead| <= TIE_FACTOR * noise``."""

    lead: float
    noise: float

    @property
    def near_tie(self) -> bool:
        return abs(self.lead) <= TIE_FACTOR * self.noise

    def to_dict(self) -> dict:
        return dict(lead=self.lead, noise=self.noise, near_tie=self.near_tie)


def last_logits(model, tokens: list[int], start: int, keys, values) -> tuple[mx.array, list, list]:
    """Tokens at positions ``start..`` against a cache holding the ``start`` before them;
    returns (last position's float32 logits (V,), keys, values)."""
    n = len(tokens)
    positions = mx.arange(start, start + n, dtype=mx.int32)[None]
    # (1, 1, n, start + n): each new token sees the cache and the new tokens up to itself.
    mask = (mx.arange(start + n)[None] <= positions[0][:, None])[None, None]
    hidden, keys, values = model(
        mx.array([tokens], mx.int32), positions, mask, keys, values, positions
    )
    return model.logits(hidden[0, -1]), keys, values


def check(model, prefix: list[int], token: int, other: int) -> TieCheck:
    """``prefix``: the prompt and the tokens both runs share, (P,) with P >= 2; ``token``:
    plain decoding's next token; ``other``: the other run's. One forward over P tokens and
    one over P - 1 then a one-token step (``model``: the engine's ``Model``)."""
    if len(prefix) < 2:
        raise ValueError("a near-tie check needs a prefix of at least 2 tokens")
    whole, _, _ = last_logits(model, prefix, 0, *model.make_cache(1, len(prefix)))
    _, keys, values = last_logits(model, prefix[:-1], 0, *model.make_cache(1, len(prefix)))
    step, _, _ = last_logits(model, prefix[-1:], len(prefix) - 1, keys, values)
    lead = step[token] - step[other]
    noise = mx.max(mx.abs(step - whole))
    biggest = mx.maximum(mx.abs(step[token]), mx.abs(step[other]))
    mx.eval(lead, noise, biggest)
    return TieCheck(lead=lead.item(), noise=max(noise.item(), ulp(biggest.item(), model)))


def ulp(value: float, model) -> float:
    """One unit in the last place of ``value`` in the model's dtype (its head's output)."""
    eps = mx.finfo(model.model.norm.weight.dtype).eps
    return eps * 2.0 ** math.floor(math.log2(value)) if value > 0 else 0.0
