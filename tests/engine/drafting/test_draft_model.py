"""A draft model as a draft source (``engine/drafting/draft_model.py``,
``engine/drafting/sources.py``): greedy output equals plain decoding, alone and merged with
the drafter and lookup in one tree, solo and batched; the target as its own draft accepts
every draft; the draft model's own cache holds exactly the committed text's K/V after each
draft's catch-up; sampling is exact (chi-square, with its power check in test_sampling.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import tests.support.sampling as sampling
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.draft_model import DraftModelSource, check_draft_model, prefill
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import DRAFT_MODEL, SOURCE_NAMES, DraftContext
from tests.support.models import (
    greedy_prefilled,
    near_bigram_model,
    run_decode,
    step_sources,
    tiny_drafter,
    tiny_model,
)

PROMPTS = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2]]


def plain(model, prompts, n=24):
    out, _ = run_decode(model, None, prompts, max_tokens=n, shape=AR)
    return out


@pytest.mark.parametrize(
    "label", ["D1xL4", "D1xL3", "K1xL6+D1xL4", "W1xL3+K1xL5+D1xL4", "W2xL3+D1xL5", "D1xL4 C3"]
)
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    model = tiny_model(3, vocab=48, layers=2)
    draft = tiny_model(11, vocab=48, layers=1, hidden=16, heads=2, kv_heads=1)
    drafter = tiny_drafter(model, 4)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=24, shape=shape, draft_model=draft)
    assert got == want
    for r, prompt in enumerate(PROMPTS):  # each row alone: another row changes nothing
        solo, _ = run_decode(
            model, drafter, [prompt], max_tokens=24, shape=shape, draft_model=draft
        )
        assert solo[0] == want[r]
    assert set(stats["source_tokens"]) == set(SOURCE_NAMES)


def test_the_target_as_its_own_draft_accepts_every_draft_token():
    model = tiny_model(5, vocab=40, layers=2)
    want = plain(model, PROMPTS, 30)
    got, stats = run_decode(
        model, None, PROMPTS, max_tokens=30, shape=BeamShape.parse("D1xL4"), draft_model=model
    )
    assert got == want
    assert stats["tokens_per_step"] > 3.5  # 4 a step, except the last, cut steps
    assert stats["source_tokens"]["draft_model"] == stats["accepted_tokens"]


@pytest.mark.parametrize("label", ["K1xL6+D1xL3", "D1xL4", "W1xL3+D1xL2"])
def test_draft_cache_holds_the_committed_text_after_catch_up(label):
    """After steps that commit tokens the draft model did not draft (a lookup chain's, the
    drafter's, its own last draft, the bonus), its next catch-up leaves its cache equal to
    a fresh prefill of the text (a catch-up one token shorter fails this test)."""
    model = tiny_model(3, vocab=32, layers=2)
    draft = model if label == "D1xL4" else tiny_model(8, vocab=32, layers=2)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    shape = BeamShape.parse(label)
    drafter = tiny_drafter(model, 4) if shape.drafts else None
    slots = 64
    state = greedy_prefilled(model, prompt, slots, [prefill(draft, [prompt], slots)])
    step = uniform_step(
        model, held_sources(drafter, draft), shape, SamplerConfig(), 1, compiled=False
    )
    for _ in range(4):
        state, _ = step(state, slots)
    n = int(state.lengths[0])
    text = state.history[0, :n].tolist() + [int(state.init_token[0])]
    catchup = step_sources(shape, drafter, draft)[-1].catchup
    source = DraftModelSource(draft, 2, catchup)  # the catch-up alone (L = 2)
    ctx = DraftContext(model, state.hidden, state.init_token, state.lengths, state.history, slots)
    caught = source.propose(ctx._replace(own=state.sources[0])).state
    fresh = prefill(draft, [text], slots)
    for a, b in zip([a for e in caught for a in e], [b for e in fresh for b in e]):
        assert mx.allclose(a[:, :, : n + 1], b[:, :, : n + 1], atol=1e-4).item()


def test_a_vocabulary_mismatch_is_refused_before_anything_runs():
    model = tiny_model(1, vocab=32)
    with pytest.raises(ValueError, match="same tokenizer"):
        check_draft_model(model, tiny_model(2, vocab=40))
    with pytest.raises(ValueError, match="same tokenizer"):
        run_decode(model, None, [[1, 2]], max_tokens=4, draft_model=tiny_model(2, vocab=40))


def test_per_source_counts_add_up():
    model = tiny_model(5, vocab=40, layers=2)
    _, stats = run_decode(
        model,
        None,
        [[1, 2, 3, 1, 2, 3, 1, 2]],
        max_tokens=30,
        shape=BeamShape.parse("K1xL6+D1xL4"),
        draft_model=model,
    )
    assert sum(stats["source_tokens"].values()) == stats["accepted_tokens"]
    assert stats["source_tokens"][SOURCE_NAMES[DRAFT_MODEL]] > 0


def test_the_step_compiles_with_a_draft_model():
    model = tiny_model(5, vocab=40, layers=2)
    got, _ = run_decode(
        model, None, PROMPTS, max_tokens=12, shape=BeamShape.parse("D1xL3"), draft_model=model
    )
    assert got == plain(model, PROMPTS, 12)


@pytest.mark.slow
def test_sampling_with_a_draft_model_is_exact():
    """The draft model's chain, merged with a lookup chain in one tree: the sequence
    distribution matches the target's own (the power check: test_sampling's biased one)."""
    model = near_bigram_model(7, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    draft = near_bigram_model(3, attn_scale=0.05, vocab=6, hidden=32, scale=1.0)
    cfg = SamplerConfig(temperature=1.0)
    n = 3000
    counts, stats = sampling.sample_counts(
        model,
        None,
        cfg,
        n,
        seed=99,
        shape=BeamShape.parse("K1xL3+D1xL4"),
        adapt=False,
        draft_model=draft,
    )
    assert stats["source_tokens"]["draft_model"] > 0.1 * n  # its drafts are really tested
    assert sampling.chi_square_pvalue(counts, sampling.exact_joint(model, cfg), n) > 1e-3


def test_the_python_api_takes_a_draft_model():
    """``batch_generate`` / ``generate`` with ``draft_model=``: plain decoding's tokens."""
    from redrafter_mlx.engine.loop.generation import batch_generate

    model = tiny_model(5, vocab=40, layers=2)
    got = batch_generate(model, None, None, PROMPTS, max_tokens=12, draft_model=model, adapt=False)
    assert got == plain(model, PROMPTS, 12)


@pytest.mark.parametrize("itself", [False, True], ids=["small-draft", "self-draft"])
def test_rows_of_one_prefill_placed_into_a_running_batch_equal_plain_decoding(itself):
    """A prefill of two rows joins a batch already running one (each placed into a free row,
    its draft cache taken from that row of the prefill): every row equals plain decoding,
    and as its own draft every step accepts all its drafts but a cut last one."""
    from redrafter_mlx.engine.decoding.cache import Session
    from redrafter_mlx.engine.loop.batch import BatchGenerator
    from redrafter_mlx.engine.loop.batch_choice import FixedShape
    from redrafter_mlx.engine.loop.prefilling import Prefill
    from redrafter_mlx.engine.loop.rows import Row, RowStats

    model = tiny_model(5, vocab=48, layers=2)
    draft = model if itself else tiny_model(9, vocab=48, layers=1)
    shape = BeamShape.parse("D1xL4" if itself else "K1xL5+D1xL4")
    batch = BatchGenerator(model, held_sources(None, draft), FixedShape(shape), max_batch=4)
    batch.reset()
    first, later = PROMPTS[:1], PROMPTS[1:]

    def rows_of(prompts, n):
        return [Row(SamplerConfig(), n, len(p), RowStats(len(p))) for p in prompts]

    rows = rows_of(first, 24)
    batch.insert(Prefill(first, SamplerConfig(), 0, Session(model, 1), rows=rows))
    out = {id(r): [] for r in rows}
    for got in batch.next().joined + batch.next().stepped:  # it runs before the others join
        out[id(got.row)] += got.new
    more = rows_of(later, 20)
    out.update({id(r): [] for r in more})
    batch.insert(Prefill(later, SamplerConfig(), 0, Session(model, 2), rows=more))
    for _ in range(100):
        turn = batch.next()
        for got in turn.joined + turn.stepped:
            out[id(got.row)] += got.new
        if all(r.finished for r in rows + more):
            break
    for row, prompt, n in zip(rows + more, PROMPTS, [24, 20, 20]):
        assert out[id(row)] == plain(model, [prompt], n)[0]
        if itself:
            assert row.stats.by_source[DRAFT_MODEL] >= 3 * (row.stats.steps - 1)
