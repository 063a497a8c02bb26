"""dedup / pack / mask / unpack against a brute-force trie in plain Python."""

import random

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.tree import cache_mask, dedup_prefix, default_capacity, pack, unpack
from tests.support.tree import brute_force


def random_beams(rng, W, L, vocab):
    """Beams with many shared prefixes: each beam copies a random prefix of an earlier one."""
    beams = [[7] + [rng.randrange(vocab) for _ in range(L - 1)]]
    for _ in range(W - 1):
        src = rng.choice(beams)
        keep = rng.randrange(1, L + 1)
        beams.append(src[:keep] + [rng.randrange(vocab) for _ in range(L - keep)])
    return beams


def test_design_example():
    beams = mx.array([[[91, 92, 93, 95], [91, 92, 94, 96], [91, 92, 93, 97]]])
    assert dedup_prefix(beams).tolist() == [[[0, 0, 0, 0], [0, 0, 1, 1], [0, 0, 0, 2]]]
    tree = pack(beams, default_capacity(3, 4))
    assert tree.tokens[0, :7].tolist() == [91, 92, 93, 95, 94, 96, 97]
    assert tree.depth[0, :7].tolist() == [0, 1, 2, 3, 2, 3, 3]
    assert tree.unpacker.tolist() == [[[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 6]]]
    assert tree.valid[0].tolist() == [True] * 7 + [False] * 3


@pytest.mark.parametrize("seed", range(40))
def test_pack_matches_trie(seed):
    rng = random.Random(seed)
    W, L = rng.randint(1, 8), rng.randint(2, 6)
    vocab = rng.choice([2, 3, 5, 50])
    B = rng.randint(1, 3)
    C = rng.randint(L, default_capacity(W, L))  # small C overflows
    rows = [random_beams(rng, W, L, vocab) for _ in range(B)]
    tree = pack(mx.array(rows), C)
    prefix_tree = dedup_prefix(mx.array(rows)).tolist()
    for b, beams in enumerate(rows):
        want_pt, want_tok, want_depth, want_unpacker, want_anc = brute_force(beams, C)
        n = len(want_tok)
        assert prefix_tree[b] == want_pt
        assert tree.valid[b].tolist() == [True] * n + [False] * (C - n)
        assert tree.tokens[b, :n].tolist() == want_tok
        assert tree.depth[b, :n].tolist() == want_depth
        got_unpacker = tree.unpacker[b].tolist()
        for i in range(W):
            for k in range(L):
                if want_unpacker[i][k] < C:
                    assert got_unpacker[i][k] == want_unpacker[i][k]
                else:
                    assert got_unpacker[i][k] >= C  # truncated away
        mask = tree.mask[b].tolist()
        for c in range(C):
            allowed = {c2 for c2 in range(C) if mask[c][c2]}
            assert allowed == (want_anc[c] if c < n else {c})  # pads see only themselves
        # Overflow truncates the weakest beams only: each beam keeps a prefix.
        for i in range(W):
            kept = [got_unpacker[i][k] < C for k in range(L)]
            assert kept == sorted(kept, reverse=True) and kept[0]
        assert all(got_unpacker[0][k] < C for k in range(L))  # the best beam always fits


def test_unpack_gathers_onto_beams():
    beams = mx.array([[[1, 2, 3], [1, 2, 4], [1, 5, 6]]])
    tree = pack(beams, 7)
    values = mx.arange(7)[None, :, None] * mx.ones((1, 7, 2))
    got = unpack(values, tree.unpacker)
    assert got.shape == (1, 3, 3, 2)
    assert got[0, :, :, 0].tolist() == tree.unpacker[0].tolist()


def test_cache_mask_prefix_and_tree():
    lengths = mx.array([2, 0])
    tree_mask = mx.array([[[True, False], [True, True]]] * 2)
    mask = cache_mask(lengths, tree_mask, 5)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
    ]
    assert mask[1, 0].tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
    ]
