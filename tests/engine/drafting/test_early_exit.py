"""The early-exit self-drafter (engine/drafting/early_exit.py): chain drafting against a brute-force
reference that recomputes every draft from scratch, the confidence cut, cache safety, and the
adapter folder."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitArgs,
    check_pair,
    is_early_exit,
    load_adapter,
    save_adapter,
)
from redrafter_mlx.engine.drafting.early_exit_chain import (
    adapter_prefill,
    confident_prefix,
    draft_chain,
)
from redrafter_mlx.engine.drafting.sources import ABSENT
from redrafter_mlx.engine.verifier import slots as model_module
from tests.support.early_exit import EXIT, LAYERS, SLOTS, make_pair, prefill
from tests.support.models import tiny_model


def reference_next(model, adapter, seq: list[int]) -> tuple[int, float]:
    """The draft after ``seq`` from scratch: the whole sequence through the model (exit-layer
    residual captured by ``Model.__call__``), then the adapter over every position, fresh
    caches; greedy token and its probability."""
    T = len(seq)
    H = model.hidden_size
    tokens = mx.array([seq], dtype=mx.int32)
    pos = mx.arange(T, dtype=mx.int32)[None]
    mask = cache_mask(mx.array([0]), chain_mask(T), T)
    model.capture_features([EXIT])
    try:
        cache = model.make_cache(1, T)
        hidden, _ = model(tokens, pos, mask, cache, pos)
    finally:
        model.capture_features([])
    out, _ = adapter(hidden[..., H:], pos, mask, adapter.make_cache(1, T), pos)
    logits = model.logits(out[:, -1])[0]
    probs = mx.softmax(logits)
    token = int(mx.argmax(logits))
    return token, float(probs[token])


@pytest.mark.parametrize("fused", [False, True])
def test_chain_equals_brute_force_reference(monkeypatch, fused):
    monkeypatch.setattr(model_module, "FUSED_KERNELS", fused)
    model, adapter = make_pair()
    prompts = [[3, 9, 4, 17, 2, 8], [5, 11, 30]]
    init, lengths, cache, own = prefill(model, adapter, prompts)
    gamma = 5
    chain = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, gamma, 0.0)
    mx.eval(chain)
    assert chain.tokens.shape == (2, gamma + 1)
    assert chain.present.tolist() == [[True] * (gamma + 1)] * 2
    for row, prompt in enumerate(prompts):
        seq = list(prompt)
        for k in range(gamma):
            token, prob = reference_next(model, adapter, seq)
            assert int(chain.tokens[row, k + 1]) == token, (row, k)
            assert float(chain.probs[row, k]) == pytest.approx(prob, rel=1e-4, abs=1e-6)
            seq.append(token)


def test_confidence_cut_marks_later_drafts_absent():
    model, adapter = make_pair(seed=3)
    prompts = [[1, 2, 3, 4], [7, 7, 6, 5], [9, 20, 21]]
    init, lengths, cache, own = prefill(model, adapter, prompts)
    gamma = 6
    free = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, gamma, 0.0)
    probs = np.array(free.probs)
    eta = float(np.median(probs))  # some rows cut somewhere, some drafts pass
    cut = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, gamma, eta)
    present = np.array(cut.present)
    tokens = np.array(cut.tokens)
    assert np.array_equal(np.array(cut.probs), probs)  # the cut changes no draft
    assert not present.all() and present[:, 2:].any()
    for row in range(len(prompts)):
        want = [True, True]
        for k in range(1, gamma):
            want.append(want[-1] and probs[row, k - 1] >= eta)
        assert present[row].tolist() == want
        assert np.array_equal(tokens[row][present[row]], np.array(free.tokens)[row][want])
        assert (tokens[row][~present[row]] == ABSENT).all()
    strict = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, gamma, 1.5)
    assert np.array(strict.present).sum(axis=1).tolist() == [2, 2, 2]


def test_confident_prefix_rule():
    ok = mx.array([[True, False, True], [True, True, True], [False, True, True]])
    assert confident_prefix(ok).tolist() == [
        [True, True, True, False],
        [True, True, True, True],
        [True, True, False, False],
    ]


def test_target_cache_below_len_and_deep_layers_untouched():
    model, adapter = make_pair(seed=5)
    prompts = [[3, 9, 4, 17, 2, 8], [5, 11, 30]]
    init, lengths, cache, own = prefill(model, adapter, prompts)
    mx.eval(cache, own)
    chain = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, 4, 0.6)
    mx.eval(chain)
    for row, n in enumerate(lengths.tolist()):
        for before, after in zip(_arrays(cache + own), _arrays(chain.cache + chain.own)):
            assert np.array_equal(np.array(before[row, :, :n]), np.array(after[row, :, :n]))
    for layer in range(EXIT, LAYERS):  # the layers past the exit are not run at all
        assert chain.cache[layer] is cache[layer]
    for layer in range(EXIT):  # the drafted tokens' K/V are at [len, len + gamma]
        for row, n in enumerate(lengths.tolist()):
            assert np.abs(np.array(chain.cache[layer].keys[row, :, n : n + 5])).min() > 0


def _arrays(cache: tuple) -> list:
    """Every array of a cache's entries, in order."""
    return [a for entry in cache for a in entry]


def test_adapter_cache_holds_accepted_drafts():
    """After a step that accepts the whole chain, the adapter cache equals a prefill of the
    longer prompt (so the next draft needs no catch-up)."""
    model, adapter = make_pair(seed=2)
    prompt = [4, 8, 15, 16, 23]
    init, lengths, cache, own = prefill(model, adapter, [prompt])
    gamma = 3
    chain = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, gamma, 0.0)
    longer = prompt + np.array(chain.tokens)[0, 1:].tolist() + [0]
    _, n2, _, own2 = prefill(model, adapter, [longer])
    n = int(n2[0])
    for got, want in zip(chain.own, own2):
        assert np.allclose(np.array(got.keys[0, :, :n]), np.array(want.keys[0, :, :n]), atol=1e-4)


def test_adapter_folder_round_trip(tmp_path):
    model, adapter = make_pair()
    save_adapter(tmp_path / "ee", adapter)
    cfg = json.loads((tmp_path / "ee" / "config.json").read_text())
    assert cfg["kind"] == "early-exit" and cfg["exit_layer"] == EXIT
    assert is_early_exit(tmp_path / "ee") and not is_early_exit(tmp_path)
    loaded = load_adapter(tmp_path / "ee")
    check_pair(model, loaded)
    x = mx.random.normal((1, 3, model.hidden_size), key=mx.random.key(0))
    pos = mx.arange(3, dtype=mx.int32)[None]
    mask = cache_mask(mx.array([0]), chain_mask(3), 3)
    a = adapter(x, pos, mask, adapter.make_cache(1, 3), pos)[0]
    b = loaded(x, pos, mask, loaded.make_cache(1, 3), pos)[0]
    assert mx.array_equal(a, b)


def test_bad_adapter_folders_say_what_is_wrong(tmp_path):
    model, adapter = make_pair()
    save_adapter(tmp_path / "ee", adapter)
    cfg = json.loads((tmp_path / "ee" / "config.json").read_text())
    (tmp_path / "ee" / "config.json").write_text(json.dumps({**cfg, "kind": "recurrent"}))
    with pytest.raises(ValueError, match="not an early-exit adapter"):
        load_adapter(tmp_path / "ee")
    (tmp_path / "ee" / "config.json").write_text(json.dumps({**cfg, "num_layers": 2}))
    with pytest.raises(ValueError, match="missing .*layers.1"):
        load_adapter(tmp_path / "ee")
    with pytest.raises(ValueError, match="--exit-layer between 1 and 2"):
        EarlyExitArgs.for_target(model.args, 3)
    other = tiny_model(layers=LAYERS, hidden=16, heads=2, kv_heads=1)
    with pytest.raises(ValueError, match="hidden size 32"):
        check_pair(other, adapter)


def test_chain_compiles_so_it_reads_nothing_from_the_device():
    """``mx.compile`` refuses a function that evaluates an array (a host read) inside."""
    model, adapter = make_pair(seed=6)
    init, lengths, cache, own = prefill(model, adapter, [[3, 1, 4, 1, 5], [9, 2, 6]])
    want = draft_chain(model, adapter, init, lengths, cache, own, SLOTS, 4, 0.5)
    step = mx.compile(lambda *a: tuple(draft_chain(model, adapter, *a, SLOTS, 4, 0.5)))
    got = step(init, lengths, cache, own)
    assert mx.array_equal(got[0], want.tokens) and mx.array_equal(got[1], want.present)


def test_refresh_catches_up_tokens_that_another_source_committed():
    """Three tokens committed by the target alone (as when a lookup chain wins): the adapter
    cache lacks them, and ``refresh`` re-runs the last committed tokens so the chain equals
    the from-scratch reference; without it the drafts' probabilities differ."""
    model, adapter = make_pair(seed=8)
    prompts = [[3, 9, 4, 17, 2, 8], [5, 11]]
    init, lengths, cache, own = prefill(model, adapter, prompts)
    extra = [[init.tolist()[0], 6, 7], [init.tolist()[1], 13, 1]]  # committed elsewhere
    pos = lengths[:, None] + mx.arange(3, dtype=mx.int32)[None]
    mask = cache_mask(lengths, chain_mask(3), SLOTS)
    _, cache = model(mx.array(extra, dtype=mx.int32), pos, mask, cache, pos)
    seqs = [p[:-1] + e for p, e in zip(prompts, extra)]
    history = mx.array([s + [0] * (SLOTS - len(s)) for s in seqs], dtype=mx.int32)
    lengths = lengths + 3
    init = mx.array([21, 22], dtype=mx.int32)
    before = [np.array(entry.keys) for entry in cache]
    args = (model, adapter, init, lengths, cache, own, SLOTS, 3, 0.0)
    chain = draft_chain(*args, history=history, refresh=4)
    stale = draft_chain(*args)
    for row, seq in enumerate(seqs):
        seq = seq + [int(init[row])]
        for k in range(3):
            token, prob = reference_next(model, adapter, seq)
            assert int(chain.tokens[row, k + 1]) == token, (row, k)
            assert float(chain.probs[row, k]) == pytest.approx(prob, rel=1e-4, abs=1e-6)
            seq.append(token)
        n = int(lengths[row])
        for b, after in zip(before, chain.cache):
            assert np.array_equal(b[row, :, :n], np.array(after.keys[row, :, :n]))
    assert not np.allclose(np.array(stale.probs), np.array(chain.probs), atol=1e-4)


def test_adapter_prefill_equals_the_captured_exit_states():
    model, adapter = make_pair(seed=9)
    prompts = [[3, 9, 4, 17, 2, 8], [5, 11, 30]]
    _, _, cache, own = prefill(model, adapter, prompts)
    body = mx.array([p[:-1] + [0] * (6 - len(p)) for p in prompts], dtype=mx.int32)
    zero = mx.zeros((2,), dtype=mx.int32)
    idx = mx.broadcast_to(mx.arange(5, dtype=mx.int32)[None], (2, 5))
    mask = cache_mask(zero, chain_mask(5), SLOTS)
    _, cache2 = model(body, idx, mask, model.make_cache(2, SLOTS), idx)
    own2 = adapter.make_cache(2, SLOTS)
    cache3, own2 = adapter_prefill(model, adapter, body, zero, cache2, own2, SLOTS)
    keys = [entry.keys for entry in cache]
    for a, b in zip(_arrays(own) + keys, _arrays(own2) + [entry.keys for entry in cache3]):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-5)
