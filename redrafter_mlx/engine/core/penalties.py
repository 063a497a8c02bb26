"""Logit processors that read the text: a logit bias, and repetition, presence and frequency
penalties over the last ``context`` tokens, exact at every node of a draft tree.

The rules are mlx-lm's (``mlx_lm.sample_utils.make_logits_processors``), applied in its order
to the raw logits before any temperature or truncation, over prompt + output:

* bias:       ``logit[t] += bias[t]``;
* repetition: a token seen in the window has its logit divided by ``p`` if positive, else
  multiplied by ``p`` (sign-aware, arXiv 1909.05858);
* presence:   ``logit[t] -= presence`` for a token seen at least once in the window;
* frequency:  ``logit[t] -= frequency * (times t appears in the window)``.

Under speculation the text before a tree node is the row's committed history followed by
the node's own path (the init token, then the node's ancestors, then the node), so each node
gets its own window: the last ``context`` tokens of ``history[:len] + path``. A deep node's
window holds fewer history tokens than a shallow one's. The window entries of node c are
``span`` history tokens (the last ``span`` committed) and the C tree tokens, each with a flag
saying whether it lies inside c's window (``NodeText``). Counting equal entries pairwise
((B, C, M, M), M = span + C, small) gives every entry its token's count in the window, so
scattering the processed logits back is deterministic: every entry of one token writes the
same value. No host read, static shapes: this runs inside the compiled step.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from .tree import arange


class NodeText(NamedTuple):
    """The penalty window of each node: ``tokens`` (B, C, M) int32 and ``inside`` (B, C, M)
    bool, True for entries within the node's last-``context`` tokens."""

    tokens: mx.array
    inside: mx.array


def node_text(
    history: mx.array,
    lengths: mx.array,
    span: int,
    context,
    tree_tokens: mx.array | None = None,
    depth: mx.array | None = None,
    ancestors: mx.array | None = None,
) -> NodeText:
    """Each node's window over the committed history and its own path.

    history: (B, S) committed ids (slots < len valid); lengths: (B,); span: static number of
    history tokens read (>= every row's context); context: int or (B,) int32 window size.
    tree_tokens, depth: (B, C) the packed tree (depth 0 = the init token); ancestors:
    (B or 1, C, C) bool, slot c descends from (or is) slot c'. Without a tree: one "node"
    whose window is the last ``context`` history tokens (the draw right after prefill).
    Returns NodeText with M = span + C entries per node.
    """
    B = lengths.shape[0]
    at = lengths[:, None] - span + arange(span)[None, :]  # (B, span) history positions
    tail = mx.take_along_axis(history, mx.maximum(at, 0), axis=1)
    ctx = _per_row(context, 2)  # (B or 1, 1)
    if tree_tokens is None:
        inside = (at >= 0) & (at >= lengths[:, None] - ctx)
        return NodeText(tail[:, None, :], inside[:, None, :])
    C = tree_tokens.shape[1]
    own = depth + 1  # (B, C) path tokens up to and including each node
    ctx3 = _per_row(context, 3)  # (B or 1, 1, 1)
    # History position p is in node c's window if p >= len + own_c - context.
    hist_in = (at[:, None, :] >= 0) & (
        at[:, None, :] >= (lengths[:, None] + own - ctx)[:, :, None]
    )  # (B, C, span)
    # Tree slot c' is in node c's window if it is on c's path and depth' > depth_c - context.
    tree_in = mx.broadcast_to(ancestors, (B, C, C)) & (depth[:, None, :] > depth[:, :, None] - ctx3)
    tokens = mx.concatenate(
        [
            mx.broadcast_to(tail[:, None, :], (B, C, span)),
            mx.broadcast_to(tree_tokens[:, None, :], (B, C, C)),
        ],
        axis=-1,
    )
    return NodeText(tokens.astype(mx.int32), mx.concatenate([hist_in, tree_in], axis=-1))


def _per_row(x, ndim: int):
    """A scalar as is, or a (B,) array reshaped to broadcast over ``ndim`` axes."""
    if isinstance(x, mx.array) and x.ndim == 1:
        return x.reshape((-1,) + (1,) * (ndim - 1))
    return x


def penalize(logits: mx.array, text: NodeText, repetition, presence, frequency) -> mx.array:
    """Repetition, presence and frequency penalties at each node: (B, C, V) -> (B, C, V).

    Each of ``repetition`` (1 = off), ``presence``, ``frequency`` (0 = off) is a float or a
    (B,) array (one value per row).
    """
    tokens, inside = text
    same = tokens[..., :, None] == tokens[..., None, :]  # (B, C, M, M)
    count = (same & inside[..., None, :]).sum(axis=-1).astype(mx.float32)  # (B, C, M)
    picked = mx.take_along_axis(logits, tokens, axis=-1)  # (B, C, M)
    seen = count > 0
    rep = _per_row(repetition, 3)
    x = mx.where(seen, mx.where(picked < 0, picked * rep, picked / rep), picked)
    x = x - _per_row(presence, 3) * seen.astype(mx.float32)
    x = x - _per_row(frequency, 3) * count
    return mx.put_along_axis(logits, tokens, x.astype(logits.dtype), axis=-1)


def bias_vector(bias: tuple[tuple[int, float], ...], vocab_size: int) -> mx.array:
    """A ``((token, bias), ...)`` map as a dense (V,) float32 vector to add to logits."""
    dense = [0.0] * vocab_size
    for token, value in bias:
        dense[token] += value
    return mx.array(dense, dtype=mx.float32)
