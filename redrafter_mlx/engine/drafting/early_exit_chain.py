"""The early-exit chain: the target's first ``exit_layer`` layers, then the adapter and the
target's head, drafting one greedy chain per row (Kangaroo, arXiv 2404.18911; DESIGN.md
section 3c; the adapter and its source: ``early_exit.py``).

The shallow layers write the drafted tokens' K/V into the target's cache at the slots the
verify overwrites; the adapter keeps a K/V cache of its own (same slot count as the
target's, committed positions at slots ``[0, len)``). ``adapter_write`` fills it from
exit-layer hidden states (the prompt's after prefill, or an accepted path that another draft
source proposed); ``draft_chain`` writes the slots of the init token and of every drafted
token, so after a step that accepted this chain's first n drafts, ``[len, len + n + 1)`` is
already right.

Shapes: B rows, S cache slots, A attended slots (the window), H hidden, V vocabulary,
G = gamma drafted tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import mlx.core as mx

from ..core.tree import arange, cache_mask, chain_mask
from ..verifier.entries import cache_slots
from ..verifier.protocol import Verifier
from .sources import ABSENT, padded_chunks

GAMMA = 6  # the paper's most drafted tokens per step
ETA = 0.6  # the paper's confidence exit: stop after a draft whose top-1 prob is below this
Adapter = Any  # an ``early_exit.EarlyExitAdapter`` (that module imports this one)


def draft_top1(model: Verifier, adapter: Adapter, h: mx.array):
    """The greedy draft from adapter states h (B, H): (token (B,) int32, its probability
    (B,)). With a shortlist, over its K rows only (the probability is the shortlist's
    softmax: the confidence exit reads it); the rows bound to ``model`` (``bind_head``),
    else gathered here (correct, slower: a step would gather them each time). A model whose
    logits are more than its head's rows (``Verifier.head_rows`` is None) reads them whole."""
    ids = adapter._draft_ids
    if ids is None:
        return top1(model.logits(h))
    bound = adapter._head_of() if adapter._head_of is not None else None
    rows = adapter._head if bound is model else model.head_rows(ids)
    logits = model.head_logits(h, ids) if rows is None else (h @ rows.T).astype(mx.float32)
    token, prob = top1(logits)
    return ids[token], prob


def adapter_write(adapter: Adapter, states, lengths, own: tuple, window: int):
    """Write the adapter K/V of T tokens at positions/slots ``[len, len+T)``.

    states: (B, T, H) their exit-layer hidden states (the prompt's after prefill, read with
    ``Verifier.capture_features([exit_layer])``, or an accepted path's); lengths: (B,);
    ``own``: the adapter's cache. Returns (adapter outputs (B, T, H), its cache); the last
    output is the adapter's state for the token after those T.
    """
    T = states.shape[1]
    idx = lengths[:, None] + arange(T)[None, :]
    mask = cache_mask(lengths, chain_mask(T), window)
    return adapter(states, idx, mask, own, idx)


def adapter_prefill(model: Verifier, adapter, tokens, lengths, cache, own, window: int):
    """The adapter K/V of a prompt chunk already run by the target at ``[len, len+T)``.

    tokens: (B, T) (right-padded rows: what lands past a row's real tokens is junk above
    its length, as in ``decode.prefill_chunk``); lengths: (B,) before the chunk; cache:
    the target's; own: the adapter's. Re-runs layers [:exit_layer] on the chunk
    (``Verifier.run_to``: they rewrite the same K/V at the same slots) for the exit states,
    then ``adapter_write``. Returns (cache, own). A caller whose prefill
    captures the exit layer (``Verifier.capture_features``) can call ``adapter_write`` alone.
    """
    T = tokens.shape[1]
    idx = lengths[:, None] + arange(T)[None, :]
    mask = cache_mask(lengths, chain_mask(T), window)
    x, cache = model.run_to(tokens, idx, mask, cache, idx, adapter.args.exit_layer)
    _, own = adapter_write(adapter, x, lengths, own, window)
    return cache, own


def top1(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy draft and its probability: logits (B, V) -> (token (B,) int32, prob (B,))."""
    token = mx.argmax(logits, axis=-1).astype(mx.int32)
    best = mx.max(logits, axis=-1)
    return token, mx.exp(best - mx.logsumexp(logits, axis=-1))


def confident_prefix(probs: mx.array) -> mx.array:
    """The confidence cut: probs (B, G) top-1 probabilities of drafts 1..G -> present
    (B, G + 1) bool over the init token and the drafts. The init token and the first draft
    are always present; draft k > 1 only while drafts 1..k-1 all reached eta (compared by
    the caller: ``probs`` here is already ``prob >= eta``)."""
    B, G = probs.shape
    head = mx.ones((B, 2), dtype=mx.bool_)
    if G == 1:
        return head
    kept = mx.cumprod(probs[:, : G - 1].astype(mx.int32), axis=1).astype(mx.bool_)
    return mx.concatenate([head, kept], axis=1)


class Chain(NamedTuple):
    """``draft_chain``'s result."""

    tokens: mx.array  # (B, G+1) int32, init first, ABSENT past the confidence cut
    present: mx.array  # (B, G+1) bool
    probs: mx.array  # (B, G) each draft's top-1 probability
    cache: tuple  # the target's cache, layers [:exit_layer] written at [len, len+G]
    own: tuple  # the adapter's cache, written at [len, len+G]


def refresh_committed(
    model: Verifier, adapter, history, lengths, cache, own, window: int, count: int,
    start: mx.array | None = None,
):  # fmt: skip
    """Rewrite the adapter K/V of each row's last ``count`` committed tokens.

    history: (B, S) committed token ids; lengths: (B,); cache: the target's (only layers
    [:exit_layer] run); own: the adapter's. The tokens at positions
    ``[len - count, len)`` (from 0 in a row shorter than ``count``) run through layers
    [:exit_layer], attending to the committed K/V (slots up to their own position), then the
    adapter writes their K/V at their slots. The target's own slots below ``len`` are not
    written: the shallow layers' K/V of these tokens go to slots ``[len, len + count)``,
    above every row's length (junk that drafting overwrites). Positions past a short row's
    length compute junk that lands above its length too. Returns (cache, own).

    ``start`` (B,): run positions ``[start, start + count)`` instead (a catch-up chunk,
    ``EarlyExitSource.catch_up``); the slots above the length are then clamped to the cache.
    """
    j = arange(count)[None, :]  # (1, P)
    above = lengths[:, None] + j  # (B, P) slots at or above the length
    if start is None:
        start = mx.maximum(lengths - count, 0)  # (B,)
    else:
        above = mx.minimum(above, cache_slots(cache) - 1)
    pos = start[:, None] + j  # (B, P)
    committed = pos < lengths[:, None]
    tokens = mx.take_along_axis(history, mx.minimum(pos, history.shape[1] - 1), axis=1)
    slots = arange(window)[None, None, :]
    mask = (slots <= pos[:, :, None])[:, None]  # (B, 1, P, A): keys up to its own position
    x, cache = model.run_to(tokens, pos, mask, cache, above, adapter.args.exit_layer)
    write = mx.where(committed, pos, above)
    _, own = adapter(x, pos, mask, own, write)
    return cache, own


def draft_chain(
    model: Verifier,
    adapter: Adapter,
    init_token: mx.array,
    lengths: mx.array,
    cache: tuple,
    own: tuple,
    window: int,
    gamma: int = GAMMA,
    eta: float = ETA,
    history: mx.array | None = None,
    refresh: int = 0,
) -> Chain:
    """Draft a greedy chain of ``gamma`` tokens per row with the target's first layers.

    init_token (B,) int: the token the target produced last (not yet in the cache) at
    position ``len``; lengths (B,): committed tokens per row; cache: the target's entries;
    own: the adapter's cache. ``window`` (A) must
    cover ``len + gamma + 1`` slots of every row. Token k (init = 0) runs at position and
    slot ``len + k`` through layers [:exit_layer] (their cache slots above ``len`` are the
    verify's to overwrite; slots below ``len`` are never written), then the adapter and the
    target's head. All gamma + 1 tokens are run (the last one's logits unused) so that the
    adapter cache holds every drafted token, whatever the verify accepts. Static shapes, no
    host read: the confidence exit is ``present`` (``confident_prefix``), not a stop.

    ``refresh`` > 0 with ``history`` (B, S), the committed token ids slot by slot: first
    rewrite the adapter K/V of the last ``refresh`` committed tokens (``refresh_committed``),
    so the chain is right whichever source's candidate the last step accepted, as long as
    it committed at most ``refresh`` tokens. The cache needs ``len + max(refresh, gamma+1)``
    slots.
    """
    exit_layer = adapter.args.exit_layer
    if refresh:
        cache, own = refresh_committed(
            model, adapter, history, lengths, cache, own, window, refresh
        )
    tokens, probs = [init_token.astype(mx.int32)], []
    one = chain_mask(1)
    for k in range(gamma + 1):
        pos = (lengths + k)[:, None]  # (B, 1)
        mask = cache_mask(lengths + k, one, window)
        x, cache = model.run_to(tokens[-1][:, None], pos, mask, cache, pos, exit_layer)
        if k == gamma:  # the last draft's K/V only: no token after it is drafted
            _, own = adapter(x, pos, mask, own, pos)
            break
        h, own = adapter(x, pos, mask, own, pos)
        token, prob = draft_top1(model, adapter, h[:, 0])
        tokens.append(token)
        probs.append(prob)
    drafted = mx.stack(tokens, axis=1)  # (B, G+1)
    prob = mx.stack(probs, axis=1)  # (B, G)
    present = confident_prefix(prob >= eta)
    return Chain(
        tokens=mx.where(present, drafted, ABSENT),
        present=present,
        probs=prob,
        cache=cache,
        own=own,
    )


def prefill(model: Verifier, adapter: Adapter, rows: list[list[int]], slots: int):
    """The adapter's cache after each row's committed text ``rows`` (B lists of ids):
    its cache, ``slots`` slots per row (>= the longest row). Runs the target's first
    ``exit_layer`` layers on a scratch cache, then the adapter, chunk by chunk (host side,
    before the decode loop)."""
    B = len(rows)
    cache = model.make_cache(B, slots)
    own = adapter.make_cache(B, slots)
    lengths = mx.zeros((B,), mx.int32)
    for _, tokens, counts in padded_chunks(rows):
        cache, own = adapter_prefill(model, adapter, tokens, lengths, cache, own, slots)
        lengths = lengths + counts
        mx.eval(cache, own)  # per chunk, before the decode loop
    return own
