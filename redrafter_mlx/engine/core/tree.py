"""Dynamic tree attention: deduplicate beam prefixes and pack them into a static-capacity buffer.

Beams (B, W, L) share prefixes (all share the init token). We verify each distinct prefix
once: unique tokens are packed beam-major into C slots (C is static, so no host read and no
recompile per size). Beams are sorted by score, so when unique tokens overflow C only the
weakest beams are truncated — a truncated beam is a shorter candidate, never a wrong one.

All functions are tensor ops (no Python loops over beams or tokens, no host reads).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx


@functools.lru_cache(maxsize=256)
def arange(n: int) -> mx.array:
    """``mx.arange(n)`` (int32) as a constant: inside ``mx.compile`` it is data captured by the
    trace, not an op recomputed at every call (each op costs ~10-20 us on the CPU backend)."""
    return mx.array(list(range(n)), dtype=mx.int32)


@functools.lru_cache(maxsize=64)
def eye(n: int) -> mx.array:
    """(n, n) bool identity as a constant (see ``arange``)."""
    return mx.array([[i == j for j in range(n)] for i in range(n)], dtype=mx.bool_)


def default_capacity(width: int, length: int) -> int:
    """Worst case of unique tokens: every beam shares only the init token."""
    return width * (length - 1) + 1


def dedup_prefix(beams: mx.array) -> mx.array:
    """prefix_tree[b, i, k] = smallest beam j with beams[b, j, :k+1] == beams[b, i, :k+1].

    beams: (B, W, L) int -> (B, W, L) int32.
    """
    L = beams.shape[-1]
    matches = beams[:, :, None, :] == beams[:, None, :, :]  # (B, W, W, L)
    same_prefix = mx.cumsum(matches.astype(mx.int32), axis=-1) == arange(L + 1)[1:]
    return mx.argmax(same_prefix.astype(mx.int32), axis=2).astype(mx.int32)


class PackedTree(NamedTuple):
    tokens: mx.array  # (B, C) packed token ids (0 in unused slots)
    depth: mx.array  # (B, C) position of each slot inside its beam (0 = init token)
    valid: mx.array  # (B, C) bool, False for unused slots
    unpacker: mx.array  # (B, W, L) slot of beam token (i, k); >= C when truncated away
    mask: mx.array  # (B, C, C) bool, slot c may attend to slot c' (ancestor-or-self)


def pack(beams: mx.array, capacity: int, present: mx.array | None = None) -> PackedTree:
    """Pack the unique prefix tokens of ``beams`` (B, W, L) beam-major into ``capacity`` slots.

    ``present`` (B, W, L) bool, a prefix of each beam: beams shorter than L (lookup chains,
    a drafter's beams beside longer chains) hold absent tokens after their end, which take
    no slot and never match (their ``unpacker`` entry is C). Absent tokens must differ from
    every real token id (e.g. -1), so that no real prefix is shared with them.
    """
    B, W, L = beams.shape
    C = capacity
    if W == 1 and present is None:  # one chain: nothing to deduplicate, slot k holds token k
        return chain_tree(beams, C)
    prefix_tree = dedup_prefix(beams)
    unique = prefix_tree == arange(W)[None, :, None]  # (B, W, L)
    if present is not None:
        unique = unique & present
    flat_unique = unique.reshape(B, W * L)
    flat_slot = mx.cumsum(flat_unique.astype(mx.int32), axis=-1) - 1  # slot if unique
    # A shared token sits in the slot of the first beam holding that prefix.
    owner_flat = prefix_tree * L + arange(L)[None, None, :]  # (B, W, L) flat index
    unpacker = mx.take_along_axis(flat_slot, owner_flat.reshape(B, W * L), axis=1)
    unpacker = unpacker.reshape(B, W, L)
    if present is not None:
        unpacker = mx.where(present, unpacker, C)
    # Inverse map: for each slot c, the flat (i, k) whose unique token landed there.
    hits = (flat_slot[:, None, :] == arange(C)[None, :, None]) & flat_unique[:, None, :]
    valid = mx.any(hits, axis=-1)  # (B, C)
    src = mx.argmax(hits.astype(mx.int32), axis=-1)  # (B, C) flat index
    tokens = mx.where(valid, mx.take_along_axis(beams.reshape(B, W * L), src, axis=1), 0)
    depth = mx.where(valid, src % L, 0).astype(mx.int32)
    # Ancestors-or-self of slot c = unpacker[i_c, 0..k_c].
    ancestors = mx.take_along_axis(unpacker, (src // L)[:, :, None], axis=1)  # (B, C, L)
    upto = arange(L)[None, None, :] <= depth[:, :, None]  # (B, C, L)
    is_anc = (ancestors[..., None] == arange(C)) & upto[..., None]  # (B, C, L, C)
    mask = mx.any(is_anc, axis=2) & valid[:, :, None]
    mask = mask | eye(C)[None]  # unused slots attend to themselves
    return PackedTree(tokens.astype(mx.int32), depth, valid, unpacker.astype(mx.int32), mask)


def chain_tree(beams: mx.array, capacity: int) -> PackedTree:
    """``pack`` of a single beam (B, 1, L) into C = L slots, from constants and views only."""
    B, W, L = beams.shape
    assert W == 1 and capacity == L, (W, capacity, L)
    k = mx.broadcast_to(arange(L)[None], (B, L))
    return PackedTree(
        beams[:, 0].astype(mx.int32),
        k,
        mx.broadcast_to(mx.array(True), (B, L)),
        k[:, None, :],
        mx.broadcast_to(_chain_mask(L), (B, L, L)),
    )


def unpack(packed: mx.array, unpacker: mx.array) -> mx.array:
    """Gather per-slot values back onto beams: (B, C, ...) -> (B, W, L, ...).

    Truncated tokens (slot >= C) read slot C-1; callers mask them with ``unpacker < C``.
    """
    B, W, L = unpacker.shape
    C = packed.shape[1]
    idx = mx.minimum(unpacker, C - 1).reshape(B, W * L)
    extra = packed.shape[2:]
    idx = idx.reshape(B, W * L, *([1] * len(extra)))
    out = mx.take_along_axis(packed, idx, axis=1)
    return out.reshape(B, W, L, *extra)


def chain_mask(T: int) -> mx.array:
    """The tree mask of a single chain (prefill, AR step): causal, (1, T, T) bool."""
    return _chain_mask(T)


@functools.lru_cache(maxsize=64)
def _chain_mask(T: int) -> mx.array:
    # Built from data (no pending op): a lazy ``[None]`` cached here, first made while one
    # thread compiles, fails when another thread (the server's engine loop) reads it.
    return mx.array([[[j <= i for j in range(T)] for i in range(T)]], dtype=mx.bool_)


def cache_mask(lengths: mx.array, tree_mask: mx.array, slots: int) -> mx.array:
    """Attention mask over all cache slots for T new tokens written at ``[len, len+T)``.

    lengths: (B,); tree_mask: (B or 1, T, T) -> (B, 1, T, slots) bool. A new token sees the
    committed prefix ``[0, len)`` plus the new tokens its tree mask allows.
    """
    T = tree_mask.shape[-1]
    s = arange(slots)[None, :]
    rel = s - lengths[:, None]  # (B, slots)
    prefix = rel < 0
    in_new = (rel >= 0) & (rel < T)
    B = lengths.shape[0]
    tm = mx.broadcast_to(tree_mask, (B, T, T))
    cols = mx.broadcast_to(mx.clip(rel, 0, T - 1)[:, None, :], (B, T, slots))
    tree = mx.take_along_axis(tm, cols, axis=2) & in_new[:, None, :]
    return (prefix[:, None, :] | tree)[:, None]
