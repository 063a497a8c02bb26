"""Sampling exactness of the early-exit and draft-model sources (issue 49), alone and merged.

The emitted tokens must be exact samples from the target whatever proposes the candidates:
the early-exit adapter's chain (the target's first layer, an adapter and its head, with the
confidence cut), alone and in one tree with lookup chains; a draft model's chain, alone
and merged with lookup and the drafter; both in one tree; the adapter in the draft slot
beside the recurrent drafter. Checked by the chi-square test of
``tests/engine/core/test_sampling.py`` against the exact joint distribution of the first 3 tokens:

* solo settings: one decode of 3,000 rows that all draw with one setting
  (``generation.generate_steps``, the API's path);
* batched, different settings per row: one batch of the product's step
  (``step.make_batch_step``) whose rows are groups with their own settings and seeds,
  greedy rows included; each group is tested against its own distribution, the greedy rows
  equal plain decoding, and lone rows equal their own solo run with the same seed (a row's
  draws cannot depend on its neighbours).

Power: the same test rejects a group's samples against another group's distribution, and
rejects a verifier that lets the early-exit chain's first draft through unchecked (the
bias of trusting the drafter), so a source that bent the distribution would be caught.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import redrafter_mlx.engine.decoding.decode as decode
from redrafter_mlx.engine.core.sampling import (
    RowSampler,
    SamplerConfig,
    one_row,
    row_keys_of,
    stack_rows,
)
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import text_history
from redrafter_mlx.engine.decoding.decode import DecodeState, first_draw, prefill_chunk
from redrafter_mlx.engine.decoding.step import make_batch_step
from redrafter_mlx.engine.drafting.draft_model import prefill as draft_prefill
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter
from redrafter_mlx.engine.drafting.early_exit_chain import prefill as early_exit_prefill
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import SOURCE_NAMES
from tests.support.models import OracleDrafter, run_decode
from tests.support.sampling import PROMPT, chi_square_pvalue, exact_joint, sample_counts
from tests.support.sources import HOT, N, draft_model_for, early_exit_pair, target

pytestmark = pytest.mark.slow  # thousands of rows per test (make test-fast leaves them out)

COOL = SamplerConfig(temperature=0.7, top_k=3)
NUCLEUS = SamplerConfig(temperature=1.3, top_p=0.8)


# ----------------------------------------------------------------------------- solo settings


@pytest.mark.parametrize(
    "label, eta",
    [("W1xL4", None), ("W1xL4", 0.0), ("W1xL3+K1xL4", None), ("W1xL4+K1xL3 C5", 0.0)],
)
def test_early_exit_sampling_is_exact(label, eta):
    """The chain alone, with a lookup chain in one tree, and both cut by a short capacity;
    with the confidence cut (absent nodes) and without it (full chains)."""
    model, adapter = early_exit_pair(eta)
    counts, stats = sample_counts(
        model, adapter, HOT, N, seed=41, shape=BeamShape.parse(label), adapt=False
    )
    assert stats["source_tokens"]["early_exit"] > 0.1 * N  # its drafts are really tested
    if "K" in label:
        assert stats["source_tokens"]["lookup"] > 0.005 * N
    assert chi_square_pvalue(counts, exact_joint(model, HOT), N) > 1e-3


def test_draft_model_sampling_with_drafter_and_lookup_is_exact():
    """The draft model's chain in one tree with the drafter's beams and a lookup chain."""
    model = target()
    counts, stats = sample_counts(
        model,
        OracleDrafter(model, noise=0.2),
        COOL,
        N,
        seed=43,
        shape=BeamShape.parse("W2xL3+K1xL3+D1xL4"),
        adapt=False,
        draft_model=draft_model_for(model),
    )
    assert stats["source_tokens"]["draft_model"] > 0.05 * N
    assert chi_square_pvalue(counts, exact_joint(model, COOL), N) > 1e-3


def test_early_exit_and_draft_model_in_one_tree_sampling_is_exact():
    """The adapter's chain, a draft model's chain and a lookup chain in one tree (both
    stateful sources held and refreshed in one step)."""
    model, adapter = early_exit_pair()
    counts, stats = sample_counts(
        model,
        adapter,
        HOT,
        N,
        seed=47,
        shape=BeamShape.parse("W1xL3+K1xL3+D1xL4"),
        adapt=False,
        draft_model=draft_model_for(model),
    )
    assert stats["source_tokens"]["early_exit"] > 0.05 * N
    assert stats["source_tokens"]["draft_model"] > 0.05 * N
    assert chi_square_pvalue(counts, exact_joint(model, HOT), N) > 1e-3


def test_recurrent_drafter_and_an_early_exit_adapter_in_the_draft_slot_sampling_is_exact():
    """The recurrent drafter's beams, a lookup chain and the early-exit adapter's chain in
    the draft slot (``--draft-model <early-exit folder>``) in one tree: the adapter refreshed
    over the drafter's and lookup's accepted paths."""
    model, adapter = early_exit_pair()
    counts, stats = sample_counts(
        model,
        OracleDrafter(model, noise=0.2),
        HOT,
        N,
        seed=53,
        shape=BeamShape.parse("W1xL3+K1xL3+D1xL4"),
        adapt=False,
        draft_model=adapter,
    )
    assert stats["source_tokens"]["drafter"] > 0.05 * N
    assert stats["source_tokens"]["early_exit"] > 0.05 * N
    assert stats["source_tokens"]["draft_model"] == 0  # the slot holds no draft model
    assert chi_square_pvalue(counts, exact_joint(model, HOT), N) > 1e-3


# ----------------------------------------------------------------- batched, settings per row


def mixed_batch(model, drafter, shape, groups, steps=3, draft_model=None):
    """One batch of the product's step over groups of rows, each group (settings, rows,
    seed) drawing as one request of that many rows (``prefilling.Prefill``'s keys: a lone row's
    are its seed's own). Every row's prompt is PROMPT. Returns (per group, each row's
    emitted tokens; accepted drafts per source name)."""
    sizes = [n for _, n, _ in groups]
    B, slots, V = sum(sizes), 64, model.vocab_size
    rows = [list(PROMPT)] * B
    settings = stack_rows([one_row(cfg, V) for cfg, n, _ in groups for _ in range(n)], V)
    first_keys, keys = [], []
    for _, n, seed in groups:  # as Prefill.first_token
        rng, first = mx.random.split(mx.random.key(seed))
        first_keys.append(row_keys_of(first, n))
        keys.append(row_keys_of(rng, n))
    keys = mx.concatenate(keys)
    zero = mx.zeros((B,), mx.int32)
    tokens = mx.array(rows, mx.int32)
    hidden, lengths, cache = prefill_chunk(
        model, tokens, zero + len(PROMPT), zero, model.make_cache(B, slots), slots
    )
    history = text_history(rows, slots)
    sampler = RowSampler(settings.settings, mx.concatenate(first_keys), settings.mode)
    token = first_draw(model, hidden, sampler, history, lengths)
    sources = ()
    if isinstance(drafter, EarlyExitAdapter):
        sources += (early_exit_prefill(model, drafter, rows, slots),)
    if draft_model is not None:
        sources += (draft_prefill(draft_model, rows, slots),)
    state = DecodeState(token, hidden, lengths, cache, history, sources)
    step = make_batch_step(
        model, held_sources(drafter, draft_model), shape, settings.mode, compiled=True
    )
    active = mx.ones((B,), mx.bool_)
    out = [[t] for t in token.tolist()]
    by_source = dict.fromkeys(SOURCE_NAMES, 0)
    for _ in range(steps):
        state, keys, got = step(state, keys, active, settings.settings, slots)
        counts, emitted = got.count.tolist(), got.tokens.tolist()
        for r, (c, s) in enumerate(zip(counts, got.source.tolist())):
            out[r] += emitted[r][:c]
            by_source[SOURCE_NAMES[s]] += c - 1
    per_group, at = [], 0
    for n in sizes:
        per_group.append(out[at : at + n])
        at += n
    return per_group, by_source


def histogram(rows, depth=3) -> dict:
    counts = {}
    for row in rows:
        counts[tuple(row[:depth])] = counts.get(tuple(row[:depth]), 0) + 1
    return counts


GREEDY = SamplerConfig()
LONE = [(COOL, 1, 5), (NUCLEUS, 1, 6), (HOT, 1, 7)]  # single rows, compared with solo runs


def mixed_groups(n):
    return [(HOT, n, 11), (GREEDY, 2, 0), *LONE, (COOL, n, 12)]


def check_mixed(model, drafter, shape, source, draft_model=None, n=N // 2):
    """Run ``mixed_groups`` in one batch: each sampled group exact against its own
    distribution (and rejected against the other's: the test tells settings apart), the
    greedy rows plain decoding, each lone row its own solo run."""
    (hot, greedy, *lone, cool), by_source = mixed_batch(
        model, drafter, shape, mixed_groups(n), draft_model=draft_model
    )
    assert by_source[source] > 0.1 * n  # the source's drafts are really tested
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=4, shape=AR)
    assert all(row[:4] == plain[0] for row in greedy)
    for (cfg, _, seed), row in zip(LONE, lone):
        solo, _ = run_decode(
            model, drafter, [PROMPT], max_tokens=4, sampler=cfg, seed=seed, shape=shape,
            adapt=False, draft_model=draft_model,
        )  # fmt: skip
        assert row[0][:4] == solo[0], cfg
    want_hot, want_cool = exact_joint(model, HOT), exact_joint(model, COOL)
    assert chi_square_pvalue(histogram(hot), want_hot, n) > 1e-3
    assert chi_square_pvalue(histogram(cool), want_cool, n) > 1e-3
    assert chi_square_pvalue(histogram(cool), want_hot, n) < 1e-3  # power: tells them apart


@pytest.mark.parametrize("label", ["W1xL4", "W1xL3+K1xL4"])
def test_early_exit_rows_with_their_own_settings_are_exact(label):
    model, adapter = early_exit_pair(0.0)
    check_mixed(model, adapter, BeamShape.parse(label), "early_exit")


@pytest.mark.parametrize("label", ["D1xL4", "W2xL3+K1xL3+D1xL4"])
def test_draft_model_rows_with_their_own_settings_are_exact(label):
    model = target()
    shape = BeamShape.parse(label)
    drafter = OracleDrafter(model, noise=0.2) if shape.drafts else None
    check_mixed(model, drafter, shape, "draft_model", draft_model=draft_model_for(model))


# ------------------------------------------------------------------------------------ power


def test_the_test_rejects_a_verifier_that_trusts_the_first_draft(monkeypatch):
    """Power against a source-shaped bias: a verifier whose root draw is replaced by the
    first candidate's first draft (the early-exit chain's greedy token) is rejected, with
    the same rows, seeds and shape that pass above."""
    real = decode.accept_phase

    def trusting(beams, target, unpacker, capacity):
        target = mx.concatenate([beams[:, 0, 1:2], target[:, 1:]], axis=1)
        return real(beams, target, unpacker, capacity)

    monkeypatch.setattr(decode, "accept_phase", trusting)
    model, adapter = early_exit_pair(0.0)
    (hot,), by_source = mixed_batch(model, adapter, BeamShape.parse("W1xL4"), [(HOT, N, 11)])
    assert by_source["early_exit"] > N  # every step accepts at least one draft
    assert chi_square_pvalue(histogram(hot), exact_joint(model, HOT), N) < 1e-3
