"""Sampling exactness: ReDrafter samples follow the model's own (processed) distribution.

Each batch row is an independent sample (its own Gumbel noise), so one batched decode gives
thousands of samples. The first 3 tokens are compared with the exact joint distribution,
computed by enumerating prefixes, with a chi-square test (fixed seeds: deterministic).
"""

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig, process_logits
from redrafter_mlx.engine.core.shape import BeamShape
from tests.support.models import OracleDrafter, near_bigram_model, tiny_drafter
from tests.support.sampling import chi_square_pvalue, exact_joint, sample_counts

pytestmark = pytest.mark.slow  # make test-fast leaves these out


CONFIGS = [
    SamplerConfig(temperature=1.0),
    SamplerConfig(temperature=0.7, top_k=3),
    SamplerConfig(temperature=1.3, top_p=0.8),
    SamplerConfig(temperature=1.0, min_p=0.1, top_p=0.95),
]


@pytest.mark.parametrize(
    "cfg", CONFIGS, ids=lambda c: f"T{c.temperature}-k{c.top_k}-p{c.top_p}-m{c.min_p}"
)
def test_redrafter_sampling_matches_exact_distribution(cfg):
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    drafter = OracleDrafter(model, noise=0.2)
    expected = exact_joint(model, cfg)
    n = 3000
    counts, stats = sample_counts(model, drafter, cfg, n, seed=123, beam_width=3, beam_length=4)
    assert stats["tokens_per_step"] > 1.3  # accepted drafts are really being tested
    assert chi_square_pvalue(counts, expected, n) > 1e-3


def test_autoregressive_sampling_matches_exact_distribution():
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    counts, _ = sample_counts(model, None, cfg, n, seed=5)
    assert chi_square_pvalue(counts, exact_joint(model, cfg), n) > 1e-3


def test_random_drafter_small_capacity_is_exact():
    """Exactness holds for any drafter and any packing capacity (truncated trees)."""
    model = near_bigram_model(9, attn_scale=0.3, vocab=5, hidden=32, scale=1.0)
    drafter = tiny_drafter(model, 10)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    counts, _ = sample_counts(
        model, drafter, cfg, n, seed=77, beam_width=4, beam_length=4, capacity=5
    )
    assert chi_square_pvalue(counts, exact_joint(model, cfg), n) > 1e-3


def test_chi_square_detects_a_biased_sampler():
    """The test has power: the distribution at a different temperature is rejected."""
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    counts, _ = sample_counts(model, None, SamplerConfig(temperature=1.15), 3000, seed=5)
    assert (
        chi_square_pvalue(counts, exact_joint(model, SamplerConfig(temperature=1.0)), 3000) < 1e-3
    )


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05]]))
    keep = lambda cfg: (process_logits(logits, cfg) > -mx.inf).tolist()[0]
    assert keep(SamplerConfig(1.0, top_k=2)) == [True, True, False, False]
    assert keep(SamplerConfig(1.0, top_p=0.8)) == [True, True, False, False]
    assert keep(SamplerConfig(1.0, top_p=0.81)) == [True, True, True, False]
    assert keep(SamplerConfig(1.0, min_p=0.35)) == [True, True, False, False]


@pytest.mark.parametrize(
    "shape",
    [
        BeamShape(2, 3, None, 2, 4),
        BeamShape.lookup_only(2, 4),
        BeamShape(1, 4, 4, 1, 4),
        BeamShape(1, 4, None, 1, 4),  # one beam and one chain: the static layout
        BeamShape(1, 3, None, 1, 5),
    ],
    ids=lambda s: s.label,
)
def test_sampling_with_lookup_matches_exact_distribution(shape):
    """Lookup chains in the tree (beside the drafter, alone, or competing for short capacity)
    keep every emitted token the target's own draw."""
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    drafter = OracleDrafter(model, noise=0.2) if shape.drafts else None
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    counts, stats = sample_counts(model, drafter, cfg, n, seed=321, shape=shape, adapt=False)
    assert stats["source_tokens"]["lookup"] > 0.005 * n  # lookup chains were accepted
    assert chi_square_pvalue(counts, exact_joint(model, cfg), n) > 1e-3


PENALIZED = SamplerConfig(
    temperature=1.0,
    repetition_penalty=2.0,
    repetition_context_size=3,
    presence_penalty=0.5,
    frequency_penalty=0.4,
    logit_bias=((2, 0.8),),
)


@pytest.mark.parametrize(
    "shape",
    [BeamShape(1, 1), BeamShape(3, 4), BeamShape(4, 4, 5), BeamShape(2, 3, None, 2, 4)],
    ids=lambda s: s.label,
)
def test_sampling_with_penalties_matches_exact_distribution(shape):
    """Each tree node's penalties read its own path: speculative samples follow the
    penalised target exactly (and the penalised target is not the plain one, below)."""
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    drafter = OracleDrafter(model, noise=0.2) if shape.drafts else None
    n = 3000
    counts, stats = sample_counts(model, drafter, PENALIZED, n, seed=99, shape=shape, adapt=False)
    if shape.drafts:
        assert stats["tokens_per_step"] > 1.2  # accepted drafts are really being tested
    assert chi_square_pvalue(counts, exact_joint(model, PENALIZED), n) > 1e-3


def test_chi_square_detects_missing_penalties():
    """Power: samples drawn without the penalties are rejected against the penalised target."""
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    plain = SamplerConfig(temperature=1.0)
    counts, _ = sample_counts(model, None, plain, 3000, seed=5)
    assert chi_square_pvalue(counts, exact_joint(model, PENALIZED), 3000) < 1e-3
