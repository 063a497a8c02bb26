"""Two chains in a static layout: the step's tree when a step's candidates are one full
chain and one other chain, with a slot for every token of both (the default hybrid: one
drafter beam and one lookup chain, ``W1xL + K1xLk`` at full capacity;
``decode.draft_phase`` decides, ``decode.redrafter_step`` runs it).

No packing: the tree's depth and mask are constants, and a second-chain token that repeats
the first chain's prefix is verified in its own slot but judged by the first chain's draw
(one draw per distinct prefix, as the trie would give: lossless, and exact when sampling).
Whichever chain accepts more wins (the first on a tie), and its path moves to consecutive
slots in one scatter per cache array.

Shapes: B rows, n = max(L1, L2) positions per chain, C = L1 + L2 - 1 slots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx

from ..core.tree import PackedTree, arange


@functools.lru_cache(maxsize=32)
def two_chain_layout(length: int, chain_length: int):
    """The static tree of one chain of L1 = ``length`` tokens and one of L2 =
    ``chain_length``, sharing the init token.

    Slot 0 holds the init token, slots 1 .. L1-1 the first chain's drafts, slots
    L1 .. L1+L2-2 the second's. Returns constants: depth (1, C), ancestor mask (1, C, C), and
    the slot of each position of the first chain (1, n) (padded with its last slot) and of
    the second (1, n).
    """
    C = length + chain_length - 1
    depth = [0] + list(range(1, length)) + list(range(1, chain_length))
    branch = [0] + [1] * (length - 1) + [2] * (chain_length - 1)  # root, first, second
    mask = [
        [j == i or (j == 0) or (branch[j] == branch[i] and depth[j] <= depth[i]) for j in range(C)]
        for i in range(C)
    ]
    n = max(length, chain_length)
    beam_slots = [min(k, length - 1) for k in range(n)]
    chain_slots = [0] + [length - 1 + k for k in range(1, chain_length)]
    chain_slots += [chain_slots[-1]] * (n - chain_length)
    return (
        mx.array([depth], dtype=mx.int32),
        mx.array([mask], dtype=mx.bool_),
        mx.array([beam_slots], dtype=mx.int32),
        mx.array([chain_slots], dtype=mx.int32),
    )


class TwoChains(NamedTuple):
    tree: PackedTree  # tokens (B, C), depth (1, C), mask (1, C, C), unpacker (B, 2, n)
    slots: tuple  # (first (1, n), second (1, n)) each position's slot
    present: mx.array  # (B, 2, n) bool
    packed: mx.array  # (B,) int32 slots holding a token


def lay_two_chains(beams: mx.array, present: mx.array, lengths: tuple[int, int]) -> TwoChains:
    """The static tree of ``beams`` (B, 2, n): the first chain fills its L1 tokens, the second
    is present where ``present`` (B, 2, n) says; ``lengths``: (L1, L2)."""
    L1, L2 = lengths
    depth, mask, first_slots, second_slots = two_chain_layout(L1, L2)
    second = mx.where(present[:, 1, 1:L2], beams[:, 1, 1:L2], 0)
    tokens = mx.concatenate([beams[:, 0, :L1], second], axis=1)  # (B, C)
    packed = (L1 + present[:, 1].sum(axis=1) - 1).astype(mx.int32)
    C = tokens.shape[1]  # each chain's slots, C past its end: the tree's two paths (B, 2, n)
    both = mx.concatenate([first_slots, second_slots], axis=0)[None]
    unpacker = mx.where(present[:, :2], both, C).astype(mx.int32)
    tree = PackedTree(tokens, depth, None, unpacker, mask)
    return TwoChains(tree, (first_slots, second_slots), present, packed)


def accept_two_chains(beams: mx.array, target: mx.array, layout: TwoChains):
    """4. Accept on a two-chain layout: ``beams`` (B, 2, n) as judged, ``target`` (B, C) the
    draws. A second-chain node whose prefix is the first chain's takes the first's draw.
    Returns (tokens (B, n) emitted, n (B,) accepted drafts, bonus (B,), path_slots (B, n),
    path (B, n), best (B,) the winning chain)."""
    first_slots, second_slots = layout.slots
    first, second = beams[:, 0], beams[:, 1]
    on_first = mx.take_along_axis(target, mx.broadcast_to(first_slots, first.shape), axis=1)
    own = mx.take_along_axis(target, mx.broadcast_to(second_slots, second.shape), axis=1)
    shared = mx.cumprod((second == first).astype(mx.int32), axis=1) > 0  # (B, n)
    on_second = mx.where(shared, on_first, own)
    first_run = _run(first, on_first, layout.present[:, 0])
    second_run = _run(second, on_second, layout.present[:, 1])
    take_second = second_run > first_run  # (B,)
    n = mx.maximum(first_run, second_run)
    pick = take_second[:, None]
    path = mx.where(pick, second, first)
    path_slots = mx.where(pick, second_slots, first_slots)  # (B, n)
    path_target = mx.where(pick, on_second, on_first)
    bonus = mx.take_along_axis(path_target, n[:, None], axis=1)[:, 0]
    k = arange(first.shape[1])[None, :]
    out = mx.where(k < n[:, None], mx.roll(path, -1, axis=1), 0)
    out = mx.where(k == n[:, None], bonus[:, None], out)
    return out, n, bonus, path_slots, path, take_second.astype(mx.int32)


def drawn_slots(beams: mx.array, layout: TwoChains, best: mx.array) -> mx.array:
    """The slot whose draw each emitted position of the winning chain took (``best`` (B,)
    from ``accept_two_chains``; ``beams`` (B, 2, n) as judged): a second-chain position
    whose prefix is the first chain's took the first's draw. Returns (B, n) int32."""
    first_slots, second_slots = layout.slots
    shared = mx.cumprod((beams[:, 1] == beams[:, 0]).astype(mx.int32), axis=1) > 0  # (B, n)
    second = mx.where(shared, first_slots, second_slots)
    return mx.where(best[:, None] > 0, second, first_slots).astype(mx.int32)


def _run(candidate, draws, present):
    """Accepted drafts of one candidate: the leading k = 1.. with candidate[k] == draws[k-1]
    (present): (B, n), (B, n), (B or 1, n) -> (B,) int32."""
    match = (candidate[:, 1:] == draws[:, :-1]) & present[:, 1:]
    return mx.cumprod(match.astype(mx.int32), axis=1).sum(axis=1).astype(mx.int32)
