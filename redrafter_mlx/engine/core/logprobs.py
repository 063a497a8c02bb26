"""Each emitted token's log-probability, and the most likely tokens beside it, from the
distribution it was drawn from (OpenAI's ``logprobs`` / ``top_logprobs``).

A token is drawn from its node's processed logits (``sampling.process_text``: logit bias,
penalties, banned ends; then, for a sampling row, ``sampling.target_log_weights``:
temperature and the truncation filters). Its log-probability here is the log-softmax of
exactly that: a sampling row's tempered, filtered log-weights (a filtered-out token is
-inf); a greedy row's processed logits at temperature 1 (its draw is their argmax: the
model's own distribution after bias and penalties, as OpenAI and mlx-lm report it).
Under speculation every emitted token is the target's draw at its own tree node, so its
log-probability is that node's, the same as plain decoding's (docs/serving.md,
"Logprobs").

The step computes them only when its ``StepMode.logprobs`` is on (a compile key:
``LOGPROB_BUCKETS`` keep it rare), and only for the emitted path's nodes.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .sampling import RowSampler, target_log_weights

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on ``top_logprobs``
LOGPROB_BUCKETS = (1, 5, MAX_TOP_LOGPROBS)  # the top counts a step computes: few compiles


class TokenLogprobs(NamedTuple):
    """Per emitted token: ``logprob`` (B, L) float32, its log-probability; ``top_ids``
    (B, L, n) int32 and ``top_logprobs`` (B, L, n) float32, the n most likely tokens of its
    distribution, most likely first (-inf: tokens the filters dropped)."""

    logprob: mx.array
    top_ids: mx.array
    top_logprobs: mx.array


def logprob_bucket(top: int | None) -> int:
    """The step's top count for a row asking for ``top`` tokens (None: no logprobs -> 0; a
    row asking for the token's own only, 0 -> 1): the smallest ``LOGPROB_BUCKETS`` entry
    holding it."""
    if top is None:
        return 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return next(b for b in LOGPROB_BUCKETS if b >= top)


def drawn_log_probs(logits: mx.array, sampler: RowSampler) -> mx.array:
    """The log-probabilities each row draws from: processed logits (B, ..., V) -> (B, ..., V)
    float32 (a sampling row's ``target_log_weights``, a greedy row's logits, normalised)."""
    x = logits.astype(mx.float32)
    if sampler.mode.sample:
        sampling = sampler.settings.temperature.reshape((-1,) + (1,) * (x.ndim - 1)) > 0
        x = mx.where(sampling, target_log_weights(logits, sampler), x)
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def token_logprobs(logits: mx.array, tokens: mx.array, sampler: RowSampler) -> TokenLogprobs:
    """The logprobs of ``tokens`` (B, L) int32, each drawn from its position's processed
    logits (B, L, V), with the ``sampler.mode.logprobs`` most likely tokens of each."""
    lp = drawn_log_probs(logits, sampler)
    own = mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]
    n = sampler.mode.logprobs
    ids = mx.argpartition(-lp, n - 1, axis=-1)[..., :n] if n < lp.shape[-1] else None
    if ids is None:
        ids = mx.broadcast_to(mx.arange(lp.shape[-1]), lp.shape)
    top = mx.take_along_axis(lp, ids, axis=-1)
    order = mx.argsort(-top, axis=-1)
    ids = mx.take_along_axis(ids, order, axis=-1).astype(mx.int32)
    return TokenLogprobs(own, ids, mx.take_along_axis(top, order, axis=-1))


def on_slots(logits: mx.array, slots: mx.array, length: int) -> mx.array:
    """The processed logits (B, C, V) of the nodes ``slots`` (B, P) that drew the emitted
    tokens, as (B, length, V): slot k drew emitted token k; past P (a capacity below the
    beam length), the last slot again (those tokens are never emitted)."""
    P = slots.shape[1]
    if length > P:
        slots = mx.concatenate([slots, mx.repeat(slots[:, -1:], length - P, axis=1)], axis=1)
    return mx.take_along_axis(logits, slots[:, :length, None], axis=1)


def rows_of(out: TokenLogprobs, counts: list[int], tops: list[int | None]) -> list:
    """The host's per-row lists of a computed step's ``out``: per row r, None where
    ``tops[r]`` is None (it asked for none), else per emitted token (of ``counts[r]``)
    ``(logprob, ((id, logprob), ...))`` with its ``tops[r]`` most likely tokens."""
    if all(t is None for t in tops):
        return [None] * len(tops)
    # host reads of a step already computed: the loop's read of its tokens (``Stepping.read``)
    own, ids, top = out.logprob.tolist(), out.top_ids.tolist(), out.top_logprobs.tolist()
    rows = []
    for r, (count, n) in enumerate(zip(counts, tops)):
        if n is None:
            rows.append(None)
            continue
        rows.append([(own[r][k], tuple(zip(ids[r][k][:n], top[r][k][:n]))) for k in range(count)])
    return rows
