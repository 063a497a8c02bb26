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

Both are read from the distribution the run decoded from: the raw logits after the run's
text processors (``sampling.process_text``: its logit bias, and its repetition, presence and
frequency penalties over the last ``repetition_context_size`` tokens of the prefix, the
window plain decoding reads there), applied alike to the one-token step and the whole-prefix
logits. Where a run drew a token its settings ban (a bias of -100 on it) or a penalty
pushed down, plain decoding's token leads it by what the settings moved it, however close
their raw logits are. The
resolution floor is the raw logits' unit in the last place carried through the same
processing (a repetition penalty scales it; a bias or the other penalties shift it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from redrafter_mlx.engine.core.penalties import node_text
from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig, process_text

TIE_FACTOR = 2.0


@dataclass(frozen=True)
class TieCheck:
    """``lead``: plain decoding's token over the other's, one-token step logits; ``noise``:
    max |step - whole-prefix forward| logits (both processed as the run decoded them);
    ``near_tie``: ``|lead| <= TIE_FACTOR * noise``."""

    lead: float
    noise: float

    @property
    def near_tie(self) -> bool:
        return abs(self.lead) <= TIE_FACTOR * self.noise

    def to_dict(self) -> dict:
        return dict(lead=self.lead, noise=self.noise, near_tie=self.near_tie)


def last_logits(model, tokens: list[int], start: int, cache: tuple) -> tuple[mx.array, tuple]:
    """Tokens at positions ``start..`` against a cache holding the ``start`` before them;
    returns (last position's float32 logits (V,), the cache)."""
    n = len(tokens)
    positions = mx.arange(start, start + n, dtype=mx.int32)[None]
    # (1, 1, n, start + n): each new token sees the cache and the new tokens up to itself.
    mask = (mx.arange(start + n)[None] <= positions[0][:, None])[None, None]
    hidden, cache = model(mx.array([tokens], mx.int32), positions, mask, cache, positions)
    return model.logits(hidden[0, -1]), cache


def check(
    model, prefix: list[int], token: int, other: int, sampling: SamplerConfig | None = None
) -> TieCheck:
    """``prefix``: the prompt and the tokens both runs share, (P,) with P >= 2; ``token``:
    plain decoding's next token; ``other``: the other run's; ``sampling``: the runs' settings
    (their bias and penalties are applied; None: raw logits). One forward over P tokens and
    one over P - 1 then a one-token step (``model``: the engine's ``Model``)."""
    if len(prefix) < 2:
        raise ValueError("a near-tie check needs a prefix of at least 2 tokens")
    whole, _ = last_logits(model, prefix, 0, model.make_cache(1, len(prefix)))
    _, cache = last_logits(model, prefix[:-1], 0, model.make_cache(1, len(prefix)))
    step, _ = last_logits(model, prefix[-1:], len(prefix) - 1, cache)
    process = processor(prefix, sampling, step.shape[-1])
    floor = resolution(step, (token, other), prefix, sampling, model)
    step, whole = process(step), process(whole)
    lead = step[token] - step[other]
    noise = mx.max(mx.abs(step - whole))
    mx.eval(lead, noise)
    return TieCheck(lead=lead.item(), noise=max(noise.item(), floor))


def processor(prefix: list[int], sampling: SamplerConfig | None, vocab_size: int):
    """The run's text processing of the logits after ``prefix``: (V,) -> (V,) float32
    (``sampling.process_text``, its penalty window the last ``repetition_context_size``
    tokens of ``prefix``, as plain decoding reads them); the identity without settings."""
    if sampling is None or not (sampling.logit_bias or sampling.reads_text):
        return lambda logits: logits.astype(mx.float32)
    sampler = RowSampler.from_config(sampling, vocab_size, mx.random.key(0))
    text = None
    if sampler.reads_text:
        span, context = sampler.penalty_window()
        text = node_text(mx.array([prefix], mx.int32), mx.array([len(prefix)]), span, context)
    return lambda logits: process_text(logits[None, None], sampler, text)[0, 0].astype(mx.float32)


def resolution(
    raw: mx.array, tokens: tuple[int, ...], prefix: list[int], sampling: SamplerConfig | None, model
) -> float:
    """The logits' resolution at ``tokens``: each one's raw logit (V,) unit in the last place
    in the model's dtype (``ulp``), scaled as the run's repetition penalty scales a token seen
    in its window (``penalties.penalize``: divided by the penalty if positive, else multiplied;
    a bias or the other penalties shift a logit, keeping its unit); the largest."""
    window = set(prefix[-sampling.repetition_context_size :]) if sampling else set()
    penalty = sampling.repetition_penalty if sampling else 1.0
    units = []
    for t in tokens:
        value = raw[t].item()
        unit = ulp(abs(value), model)
        if t in window:
            unit *= 1 / penalty if value > 0 else penalty
        units.append(unit)
    return max(units)


def ulp(value: float, model) -> float:
    """One unit in the last place of ``value`` in the model's dtype (its head's output)."""
    eps = mx.finfo(model.dtype).eps
    return eps * 2.0 ** math.floor(math.log2(value)) if value > 0 else 0.0
