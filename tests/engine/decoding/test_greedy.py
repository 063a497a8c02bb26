"""Losslessness: greedy ReDrafter output == autoregressive output, token for token."""

import random

import pytest

from redrafter_mlx.engine.core.tree import default_capacity
from tests.support.models import (
    OracleDrafter,
    near_bigram_model,
    run_decode,
    tiny_drafter,
    tiny_model,
)


def make_case(seed):
    rng = random.Random(seed)
    vocab = rng.choice([16, 32, 64])
    kind = ["random", "oracle", "oracle"][seed % 3]
    shape = dict(
        vocab=vocab,
        hidden=rng.choice([32, 48]),
        layers=rng.randint(1, 2),
        heads=4,
        kv_heads=rng.choice([1, 2, 4]),
    )
    if kind == "random":
        model = tiny_model(seed, **shape)
        drafter = tiny_drafter(
            model,
            seed + 1000,
            layers=rng.randint(0, 2),
            exit_dim=rng.choice([None, 40]),
            rnn=rng.random() < 0.7,
        )
    else:
        model = near_bigram_model(seed, attn_scale=0.005, **shape)
        drafter = OracleDrafter(model, noise=rng.choice([0.0, 0.3, 1.0]), seed=seed)
    W, L = rng.randint(1, 8), rng.randint(2, 6)
    C = rng.choice([L, rng.randint(L, default_capacity(W, L)), default_capacity(W, L)])
    B = rng.randint(1, 4)
    prompts = [[1] + [rng.randrange(vocab) for _ in range(rng.randint(0, 12))] for _ in range(B)]
    return rng, model, drafter, prompts, dict(beam_width=W, beam_length=L, capacity=C)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(54))
def test_greedy_equals_autoregressive(seed):
    rng, model, drafter, prompts, beam = make_case(seed)
    max_tokens = rng.randint(1, 40)
    ar, _ = run_decode(model, None, prompts, max_tokens=max_tokens)
    eos = ()
    if seed % 2 and len(ar[0]) > 3:  # EOS somewhere inside the answer, often inside a run
        eos = (ar[0][rng.randrange(1, len(ar[0]))],)
        ar, _ = run_decode(model, None, prompts, max_tokens=max_tokens, eos_token_ids=eos)
    rd, _stats = run_decode(
        model, drafter, prompts, max_tokens=max_tokens, eos_token_ids=eos, **beam
    )
    assert rd == ar, f"case {seed}: {beam}, B={len(prompts)}"
    for row in rd:
        assert len(row) <= max_tokens and not set(eos) & set(row)


def test_stops_inside_accepted_runs():
    """With an oracle drafter every step accepts whole beams, so limits fall inside runs."""
    model = near_bigram_model(5, attn_scale=0.0, vocab=32, hidden=32)
    drafter = OracleDrafter(model, noise=0.0)
    full, stats = run_decode(model, drafter, [[1, 2]], max_tokens=30, beam_width=2, beam_length=5)
    assert stats["tokens_per_step"] == 5.0  # every step accepted its whole beam
    for max_tokens in range(1, 12):
        rd, _ = run_decode(
            model, drafter, [[1, 2]], max_tokens=max_tokens, beam_width=2, beam_length=5
        )
        assert rd[0] == full[0][:max_tokens]
    for stop_at in range(1, 8):
        eos = full[0][stop_at]
        first = full[0].index(eos)
        rd, _ = run_decode(
            model,
            drafter,
            [[1, 2]],
            max_tokens=30,
            eos_token_ids=(eos,),
            beam_width=2,
            beam_length=5,
        )
        assert rd[0] == full[0][:first]


def test_batch_rows_equal_rows_alone():
    model = tiny_model(11, vocab=32)
    drafter = tiny_drafter(model, 12)
    prompts = [[1, 4, 5, 6, 7, 8, 9], [1], [1, 3, 3]]
    together, _ = run_decode(model, drafter, prompts, max_tokens=25, beam_width=3, beam_length=4)
    for p, row in zip(prompts, together):
        alone, _ = run_decode(model, drafter, [p], max_tokens=25, beam_width=3, beam_length=4)
        assert alone[0] == row


def test_long_generation_crosses_cache_buckets():
    """Generation past several attention-window buckets (cache growth) stays exact."""
    model = near_bigram_model(2, attn_scale=0.005, vocab=32, hidden=32)
    drafter = OracleDrafter(model, noise=0.0)
    prompt = [[1] + list(range(2, 30)) * 10]  # 281 tokens: starts in the second bucket
    ar, _ = run_decode(model, None, prompt, max_tokens=600)
    rd, stats = run_decode(model, drafter, prompt, max_tokens=600, beam_width=4, beam_length=5)
    assert rd == ar and len(ar[0]) == 600
    assert stats["tokens_per_step"] > 1.5
