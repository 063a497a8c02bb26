"""The drafter's tree holds every beam its search kept at each depth, not only the final ones.

Beam search keeps W beams per depth; the final W beams share prefixes, so their tree alone
leaves part of the worst-case capacity 1 + W(L-1) empty (padding the verifier scores anyway).
The beams dropped on the way fill it exactly (``drafter.frontier_tree``). Checked here against
a brute-force list of the search's nodes, and against the final beams alone on the model.
"""

import itertools

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import default_capacity, pack
from redrafter_mlx.engine.decoding.decode import (
    DecodeState,
    accept_phase,
    shape_candidates,
    verify_phase,
)
from redrafter_mlx.engine.drafting.drafter import beam_search
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.lookup import ABSENT
from redrafter_mlx.engine.verifier.entries import cache_slots
from tests.support.models import OracleDrafter, near_bigram_model, tiny_drafter, tiny_model


def _state(model, prompts):
    """A decode state after prefilling ``prompts`` (rows of equal length)."""
    from redrafter_mlx.engine.decoding.cache import Session, prefill_session

    session = Session(model, len(prompts))
    session.reuse(prompts)
    hidden = prefill_session(session, [list(p) for p in prompts])
    session.ensure_slots(64)
    init = mx.argmax(model.logits(hidden), axis=-1).astype(mx.int32)
    return DecodeState(init, hidden, session.lengths, session.cache)


def _nodes(beams: np.ndarray, present: np.ndarray | None) -> set[tuple]:
    """Every distinct prefix (a tree node) of one row's candidates (N, L)."""
    out = set()
    for i, k in itertools.product(range(beams.shape[0]), range(beams.shape[1])):
        if present is None or present[i, k]:
            out.add(tuple(beams[i, : k + 1].tolist()))
    return out


@pytest.mark.parametrize("W,L", [(2, 3), (4, 5), (3, 6)])
def test_the_tree_holds_every_node_the_search_kept(W, L):
    model = tiny_model(4, vocab=64)
    drafter = tiny_drafter(model, 5)
    state = _state(model, [[1, 5, 9, 2], [1, 7, 7, 3], [1, 2, 3, 4]])
    cand = shape_candidates(model, state, BeamShape(W, L), held_sources(drafter))
    # the search's own nodes, depth by depth (brute force over its frontiers)
    frontiers = []
    final, _, _ = beam_search(drafter, model.embed, state.hidden, state.init_token, W, L, frontiers)
    assert len(frontiers) == L - 2
    C = default_capacity(W, L)
    tree = pack(cand.beams, C, cand.present)
    beams, present = np.array(cand.beams), np.array(cand.present)
    for b in range(3):
        searched = {tuple(np.array(final)[b, 0, :1].tolist())}
        for kept in [*frontiers, final]:
            searched |= {tuple(row) for row in np.array(kept)[b].tolist()}
        assert _nodes(beams[b], present[b]) == searched
        # distinct nodes per depth: the tree fills the worst-case capacity exactly
        assert len(searched) == C == int(np.array(tree.valid)[b].sum())
        assert (beams[b][~present[b]] == ABSENT).all()
    # the final beams come first, unchanged (packing truncates the last candidates first)
    assert np.array_equal(beams[:, :W], np.array(final))
    # and alone they leave slots empty: what the dropped beams fill
    alone = pack(final, C)
    assert int(np.array(alone.valid).sum()) < 3 * C


def _accepted(model, state, beams, present, C):
    """Drafts the greedy verifier accepts on candidates (B, N, L)."""
    tree = pack(beams, C, present)
    window = cache_slots(state.cache)
    greedy = RowSampler.from_config(SamplerConfig(), model.vocab_size, None, beams.shape[0])
    _, target, _ = verify_phase(model, tree, state.lengths, state.cache, greedy, window)
    return np.array(accept_phase(beams, target, tree.unpacker, C)[1])


def test_the_tree_accepts_at_least_what_the_final_beams_accept():
    """Same capacity, same draw per node: the candidates are a superset of the final beams,
    so every row accepts at least as many drafts, and over these seeds the dropped beams
    make some steps longer (so the comparison can fail either way)."""
    W, L = 4, 5
    C = default_capacity(W, L)
    longer = 0
    for seed in range(6):
        rng = np.random.default_rng(seed)
        model = near_bigram_model(seed, attn_scale=0.005, vocab=32)
        drafter = OracleDrafter(model, noise=1.0, seed=seed)
        state = _state(model, [[1, *rng.integers(0, 32, 6).tolist()] for _ in range(4)])
        cand = shape_candidates(model, state, BeamShape(W, L), held_sources(drafter))
        everything = _accepted(model, state, cand.beams, cand.present, C)
        final = _accepted(model, state, cand.beams[:, :W], None, C)
        assert (everything >= final).all(), seed
        longer += int((everything > final).sum())
    assert longer > 0


def test_a_smaller_capacity_keeps_the_final_beams_first():
    """With C below the worst case, the final beams pack as they did alone."""
    model = tiny_model(6, vocab=64)
    drafter = tiny_drafter(model, 7)
    state = _state(model, [[1, 4, 4, 8], [1, 9, 2, 2]])
    W, L, C = 4, 5, 8
    cand = shape_candidates(model, state, BeamShape(W, L), held_sources(drafter))
    tree = pack(cand.beams, C, cand.present)
    alone = pack(cand.beams[:, :W], C)
    on_final = np.array(tree.unpacker)[:, :W]
    assert np.array_equal(np.minimum(on_final, C), np.minimum(np.array(alone.unpacker), C))
    assert np.array(tree.valid).sum() >= np.array(alone.valid).sum()
