"""Two chains in a static layout (``two_chains``; the step's case for one drafter beam and
one lookup chain at full capacity): no packing, a chain node that repeats the beam's prefix
judged by the beam's draw. Greedy
identity is in test_lookup.py / test_penalties.py (their hybrid shapes run this step);
here, the layout and exact sampling where the two candidates share prefixes."""

from __future__ import annotations

import mlx.core as mx
import pytest

import tests.support.sampling as sampling
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import pack
from redrafter_mlx.engine.decoding.decode import shape_candidates
from redrafter_mlx.engine.decoding.two_chains import two_chain_layout
from redrafter_mlx.engine.drafting.held import held_sources
from tests.support.models import OracleDrafter, greedy_prefilled, near_bigram_model, tiny_model


def test_the_static_layout_is_the_packed_tree_of_two_distinct_chains():
    """Beam and chain that differ at their first draft: the layout's depth and mask are
    what ``tree.pack`` gives for them."""
    L, Lk = 4, 6
    beams = mx.array([[[7, 1, 1, 1, -1, -1], [7, 2, 2, 2, 2, 2]]])
    present = mx.array([[[k < L for k in range(Lk)], [True] * Lk]])
    tree = pack(beams, L + Lk - 1, present)
    depth, mask, beam_slots, chain_slots = two_chain_layout(L, Lk)
    assert depth.tolist() == tree.depth.tolist()
    assert mask.tolist() == tree.mask.tolist()
    assert beam_slots.tolist() == [[0, 1, 2, 3, 3, 3]]
    assert chain_slots.tolist() == [[0, 4, 5, 6, 7, 8]]


def test_only_full_capacity_hybrids_of_one_beam_and_one_chain_take_the_static_layout():
    """The draft phase decides from the candidates: two single chains, the first full, and
    a slot for every token of both."""
    model = tiny_model(vocab=16)
    drafter = OracleDrafter(model)
    state = greedy_prefilled(model, [1, 2, 3, 1, 2], 64)

    def two(shape):
        return shape_candidates(model, state, shape, held_sources(drafter), window=64).two

    assert two(BeamShape(1, 4, None, 1, 8)) == (4, 8)
    assert two(BeamShape(1, 4, 6, 1, 8)) is None  # short capacity: ranked
    assert two(BeamShape(2, 4, None, 1, 8)) is None
    assert two(BeamShape.lookup_only(1, 8)) is None


@pytest.mark.slow
def test_sampling_with_shared_prefixes_is_exact(monkeypatch):
    """A repeating prompt where the drafter and the chain often propose the same tokens:
    judging the chain's copies of the beam's nodes by their own draws (two draws for one
    prefix) fails this test (p ~ 1e-5); one draw per prefix passes."""
    monkeypatch.setattr(sampling, "PROMPT", [1, 2, 0, 1, 2, 0, 1])
    model = near_bigram_model(7, attn_scale=0.05, vocab=4, hidden=32, scale=0.5)
    drafter = OracleDrafter(model, noise=0.0)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    shape = BeamShape(1, 3, None, 1, 4)
    counts, stats = sampling.sample_counts(
        model, drafter, cfg, n, seed=321, shape=shape, adapt=False
    )
    assert stats["source_tokens"]["lookup"] > 0.1 * n  # the chain wins often
    expected = sampling.exact_joint(model, cfg)
    assert sampling.chi_square_pvalue(counts, expected, n) > 1e-3
