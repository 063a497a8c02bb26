"""The early-exit adapter's shortlist head: drafting reads K rows of the target's head
(``EarlyExitArgs.draft_vocab``, bound once by ``early_exit.pair``), the drafts are the
full head's best among those ids, decoding stays identical to plain decoding, the folder
keeps the list, and ``distill --kind early-exit --draft-vocab`` writes it."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from redrafter_mlx.engine.core.footprint import head_bytes
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitSource,
    bind_head,
    check_pair,
    load_adapter,
    pair,
    save_adapter,
)
from redrafter_mlx.engine.drafting.early_exit_chain import draft_chain, draft_top1
from redrafter_mlx.train import early_exit as EE
from tests.support.early_exit import DEMO, RUN, SLOTS, make_pair, prefill
from tests.support.models import SHAREGPT_SAMPLE, run_decode
from tests.support.sources import PROMPTS, plain, transparent_pair

IDS = [0, 3, 5, 8, 11, 17, 20, 30, 31, 40, 47, 50, 60]


def test_drafts_are_the_full_heads_best_among_the_shortlist():
    model, adapter = make_pair(seed=4, vocab=64)
    h = mx.random.normal((3, model.hidden_size), key=mx.random.key(1))
    adapter.set_shortlist(IDS)
    unbound = draft_top1(model, adapter, h)  # rows gathered on the spot
    bind_head(model, adapter)
    token, prob = draft_top1(model, adapter, h)
    logits = np.array(model.logits(h))
    best = [IDS[i] for i in logits[:, IDS].argmax(axis=1)]
    assert token.tolist() == best == unbound[0].tolist()
    sub = logits[:, IDS]
    want = np.exp(sub.max(axis=1) - np.log(np.exp(sub).sum(axis=1)))
    np.testing.assert_allclose(np.array(prob), want, rtol=1e-5)
    np.testing.assert_allclose(np.array(unbound[1]), want, rtol=1e-5)


def test_a_chain_with_the_whole_vocabulary_as_shortlist_is_the_full_heads_chain():
    model, adapter = make_pair(seed=2, vocab=64)
    prompts = [[3, 9, 4, 17, 2, 8], [5, 11, 30]]
    init, lengths, cache, own = prefill(model, adapter, prompts)
    full = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, 5, 0.6)
    adapter.set_shortlist(list(range(model.vocab_size)))
    pair(model, adapter)
    short = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, 5, 0.6)
    assert mx.array_equal(full.tokens, short.tokens)
    np.testing.assert_allclose(np.array(full.probs), np.array(short.probs), rtol=1e-5)
    adapter.set_shortlist(IDS)
    pair(model, adapter)
    cut = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, 5, 0.0)
    drafts = np.array(cut.tokens)[:, 1:]
    assert set(drafts.ravel()) <= set(IDS)


def test_quantized_head_rows_are_the_dequantized_rows():
    model, _ = make_pair(seed=3, vocab=64)
    ids = mx.array(IDS, mx.int32)
    dense = np.array(model.head_rows(ids))
    nn.quantize(model, group_size=32, bits=8)
    layer = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
    assert hasattr(layer, "scales")
    rows = np.array(model.head_rows(ids))
    whole = mx.dequantize(layer.weight, layer.scales, layer.biases, 32, 8)
    np.testing.assert_array_equal(rows, np.array(whole)[IDS])
    assert np.abs(rows - dense).max() < 0.05 * np.abs(dense).max()


@pytest.mark.parametrize("label", ["W1xL4", "W1xL4+K1xL6"])
def test_greedy_decoding_with_a_shortlist_adapter_equals_plain_decoding(label):
    """A target whose layers past the exit do nothing drafts its own greedy tokens: with the
    answers' ids in the shortlist every draft is accepted; with half of them left out, the
    drafts of those are never proposed, and the text is the target's own either way."""
    model, _ = transparent_pair()
    want = plain(model, PROMPTS, 30)
    used = sorted({t for row in want for t in row})
    shape = BeamShape.parse(label)
    for ids in (used, used[::2] + [47]):
        model, adapter = transparent_pair()  # a new adapter: steps are compiled per adapter
        adapter.args.extra["eta"] = 0.0
        adapter.set_shortlist(ids)
        got, stats = run_decode(model, adapter, PROMPTS, max_tokens=30, shape=shape)
        assert got == want
        early = stats["source_tokens"]["early_exit"]
        if ids == used:
            assert stats["tokens_per_step"] > 3.0 and early == stats["accepted_tokens"]
            full = early
        else:  # the left-out ids are never drafted: fewer accepted, none of them wrong
            assert 0 < early < full


def test_the_folder_keeps_the_shortlist_and_bad_ids_are_refused(tmp_path):
    model, adapter = make_pair(seed=1, vocab=64)
    adapter.set_shortlist(IDS)
    save_adapter(tmp_path / "ee", adapter)
    cfg = json.loads((tmp_path / "ee" / "config.json").read_text())
    assert cfg["draft_vocab"] == IDS
    loaded = load_adapter(tmp_path / "ee")
    assert loaded.args.draft_vocab == IDS and loaded.args.head_size == len(IDS)
    pair(model, loaded)
    h = mx.random.normal((2, model.hidden_size), key=mx.random.key(3))
    assert mx.array_equal(draft_top1(model, loaded, h)[0], draft_top1(model, adapter, h)[0])
    chain = EarlyExitSource(loaded, part="chain").memory(model, BeamShape.parse("D1xL4"), 1, 64)
    assert chain.step == head_bytes(1, 1, len(IDS))  # its draft step ranks the shortlist
    (tmp_path / "ee" / "config.json").write_text(json.dumps({**cfg, "draft_vocab": [1, 64]}))
    with pytest.raises(ValueError, match="draft_vocab holds ids outside"):
        check_pair(model, load_adapter(tmp_path / "ee"))
    plain = make_pair(seed=1, vocab=64)[1]
    save_adapter(tmp_path / "plain", plain)
    assert "draft_vocab" not in json.loads((tmp_path / "plain" / "config.json").read_text())


@pytest.mark.slow  # ~8 s
def test_distill_writes_the_most_frequent_training_tokens_as_the_shortlist(tmp_path):
    out = tmp_path / "ee"
    run = dict(RUN, steps=2, exit_layer=2, draft_vocab=64)
    EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], out, **run)
    cfg = json.loads((out / "config.json").read_text())
    ids = cfg["draft_vocab"]
    assert len(ids) == 64 and ids == sorted(ids)
    adapter = load_adapter(out)
    assert adapter.args.head_size == 64
    again = EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], tmp_path / "b", **run)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["draft_vocab"] == ids
    assert again["steps"] == 2
