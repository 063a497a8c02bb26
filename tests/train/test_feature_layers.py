"""Multi-layer drafter features (``feature_layers``, EAGLE-3's idea): the model captures the
residual stream entering each listed layer in its own forward, and a drafter projects them.

Greedy output stays the model's own (any features, beam shape, lookup, batch rows); the
features a step keeps are those of a plain forward over the same tokens; configs round-trip;
a drafter without the key (every older drafter) runs exactly as before.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.decoding.cache import Session, bucket, ensure_slots, prefill_session
from redrafter_mlx.engine.decoding.decode import DecodeState, first_draw
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.drafter import Drafter, DrafterArgs
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.loading import LoadError, load, load_drafter
from redrafter_mlx.train.targets import cache_key
from redrafter_mlx.train.training import resolve_feature_layers
from tests.support.models import (
    VICUNA_TOKENIZER,
    near_bigram_model,
    run_decode,
    save_drafter_dir,
    save_model_dir,
    tiny_drafter,
    tiny_model,
)
from tests.support.paths import ROOT
from weights_convert.smollm2 import smollm2_path

SMOL_MODEL = smollm2_path()  # read at import, as test_smollm2 (tests run with a temp HOME)
PROMPTS = [[1, 5, 9, 3, 7, 2], [1, 4], [1, 8, 8, 8, 6, 2, 11, 5, 3]]


def reference_residuals(model, tokens: list[int]) -> tuple[mx.array, list[mx.array]]:
    """The final normed hidden states (N, H) and the residual entering each layer (N, H),
    by running mlx-lm's blocks one by one (a causal forward of ``tokens``, no cache, no
    capture)."""
    x = model.embed(mx.array(tokens, dtype=mx.int32)[None])
    inputs = []
    for layer in model.layers:
        inputs.append(x[0])
        x = layer(x, "causal", None)
    return model.model.norm(x)[0], inputs


# ------------------------------------------------------------------------------------------
# losslessness and the features a step keeps


@pytest.mark.parametrize(
    "layers,features,shape",
    [
        (3, [0, 2], dict(beam_width=1, beam_length=4)),
        (3, [1], dict(beam_width=3, beam_length=3)),
        (3, [0, 1, 2], dict(beam_width=4, beam_length=5, capacity=9)),
        (2, [1, 0], dict(beam_width=2, beam_length=4)),
    ],
)
def test_greedy_output_equals_plain_decoding(layers, features, shape):
    model = near_bigram_model(seed=layers, attn_scale=0.05, layers=layers, vocab=24)
    drafter = tiny_drafter(model, 7, feature_layers=features)
    plain, _ = run_decode(model, None, PROMPTS, max_tokens=40)
    fast, stats = run_decode(model, drafter, PROMPTS, max_tokens=40, **shape)
    assert fast == plain
    assert model.feature_layers == tuple(features)  # decode attached the drafter's layers
    assert stats["steps"] < 40 * len(PROMPTS)
    # with context lookup chains beside the drafter's beams (the engine default)
    looked, _ = run_decode(
        model, drafter, PROMPTS, max_tokens=40, shape=BeamShape(2, 4, None, 1, 5)
    )
    assert looked == plain


def test_the_step_keeps_the_accepted_tokens_features_of_a_plain_forward():
    """After each tree step, state.hidden is [final normed, residual into each feature layer]
    at the last committed token, equal to a plain causal forward over the same tokens."""
    model = near_bigram_model(seed=4, attn_scale=0.02, layers=3, vocab=12)
    features = [2, 0]
    drafter = tiny_drafter(model, 9, feature_layers=features)
    model.capture_features(features)
    H = model.hidden_size
    prompts = PROMPTS[:2]
    session = Session(model, len(prompts))
    hidden = prefill_session(session, [list(p) for p in prompts])
    assert hidden.shape == (2, 3 * H)
    sampler = SamplerConfig()
    rows = RowSampler.from_config(sampler, model.vocab_size, None, len(prompts))
    first = first_draw(model, hidden, rows, None, session.lengths)
    state = DecodeState(first, hidden, session.lengths, session.cache)
    # drafter beams and a context lookup chain (accepted on this repetitive model's text)
    shape = BeamShape(2, 4, None, 1, 5)
    step = uniform_step(model, held_sources(drafter), shape, sampler, len(prompts), compiled=False)
    texts = [list(p) for p in prompts]
    pending = [int(t) for t in np.array(first)]
    checked = 0
    for _ in range(10):
        window = bucket(max(len(t) for t in texts) + 8)
        state = ensure_slots(state, window)
        history = mx.array([t + [0] * (window - len(t)) for t in texts], mx.int32)
        state = state._replace(history=history)
        prev = list(pending)
        state, out = step(state, window)
        toks, count = np.array(out.tokens), np.array(out.count)
        for r in range(len(prompts)):
            emitted = [int(t) for t in toks[r, : count[r]]]
            # committed this step: the previous init token and the accepted drafts
            texts[r] += [prev[r]] + emitted[:-1]
            pending[r] = emitted[-1]
            final, inputs = reference_residuals(model, texts[r])
            want = mx.concatenate([final[-1], *(inputs[i][-1] for i in features)])
            got = state.hidden[r]
            assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
            checked += count[r] > 1  # an accepted draft: the node is deeper than the root
        assert np.array_equal(np.array(state.lengths), [len(t) for t in texts])
    assert checked > 0


def test_the_ar_step_and_a_batch_of_rows_keep_the_same_features():
    model = tiny_model(3, layers=3, vocab=24)
    model.capture_features([1])
    prompt = [1, 3, 5, 7]
    cache = model.make_cache(2, 32)
    lengths = mx.array([0, 0], mx.int32)
    tokens = mx.array([prompt, prompt[:2] + [0, 0]], mx.int32)
    idx = mx.arange(4, dtype=mx.int32)[None] + lengths[:, None]
    mask = cache_mask(lengths, chain_mask(4), 32)
    h, _ = model(tokens, idx, mask, cache, idx)
    final, inputs = reference_residuals(model, prompt)
    H = model.hidden_size
    assert h.shape == (2, 4, 2 * H)
    assert mx.allclose(h[0, :, :H], final, atol=1e-5).item()
    assert mx.allclose(h[0, :, H:], inputs[1], atol=1e-5).item()
    _, inputs2 = reference_residuals(model, prompt[:2])
    assert mx.allclose(h[1, :2, H:], inputs2[1], atol=1e-5).item()
    # logits read the final normed part only
    assert mx.array_equal(model.logits(h), model.logits(h[..., :H])).item()


# ------------------------------------------------------------------------------------------
# the default path is untouched


def _ops(*outputs) -> Counter:
    """The op names in the graph of ``outputs``, counted."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return Counter(re.findall(r'label ="([A-Za-z]+)', Path(f.name).read_text()))


def test_without_feature_layers_the_forward_and_the_drafter_add_no_op():
    model = tiny_model(0, layers=2)
    N = 5
    tokens = mx.array([[1, 2, 3, 4, 5]], mx.int32)
    cache = model.make_cache(1, N)
    idx = mx.arange(N, dtype=mx.int32)[None]
    mask = mx.tril(mx.ones((N, N), dtype=mx.bool_))[None, None]
    h, _ = model(tokens, idx, mask, cache, idx)
    # capturing a layer adds ops (its concatenation); capturing none again adds none
    model.capture_features([1])
    wide, _ = model(tokens, idx, mask, cache, idx)
    model.capture_features([])
    again, _ = model(tokens, idx, mask, cache, idx)
    assert h.shape[-1] == model.hidden_size and wide.shape[-1] == 2 * model.hidden_size
    assert _ops(again) == _ops(h) < _ops(wide)
    np.testing.assert_array_equal(np.array(wide[..., : model.hidden_size]), np.array(h))
    want = model.lm_head(reference_residuals(model, [1, 2, 3, 4, 5])[0]).astype(mx.float32)
    np.testing.assert_allclose(np.array(model.logits(h)[0]), np.array(want), atol=1e-4)
    drafter = tiny_drafter(model, 1)
    assert drafter.hidden_part(h) is h  # no slice, no projection
    assert "feature_proj" not in drafter and "feature_layers" not in drafter.args.to_config()


SMOL_PROMPT = "Explain why the sky is blue in two sentences."
# SmolLM2 fp32's greedy answer (40 tokens), made with the code before feature layers (git
# 40648b0) and the drafter shipped then: any lossless drafter gives these tokens.
SMOL_TOKENS = [504, 6376, 314, 4461, 281, 827, 8545, 975, 282, 253, 980, 1217, 13739, 43464]
SMOL_TOKENS += [24484, 28, 837, 1420, 13242, 5383, 6756, 282, 1512, 284, 314, 753, 6475, 411]
SMOL_TOKENS += [623, 6756, 30, 1550, 1420, 13242, 253, 11377, 282, 1512, 28, 357]
# The shipped drafter (multi-layer, built by make smollm2-drafter) on that prompt, no lookup:
# run_decode's tokens/step (the 870k-position build before it: 40 / 33 and 40 / 29; the 3,600-step
# one: 40 / 32 and 41 / 31; the 1,800-step one: 41 / 34 at both shapes). W4×L5 verifies the
# whole search tree (drafter.frontier_tree): 41 / 26 steps; its final beams alone took 41 / 28.
SMOL_STEPS = {(1, 4): 40 / 31, (4, 5): 41 / 26}


@pytest.mark.slow
@pytest.mark.skipif(not (SMOL_MODEL / "config.json").is_file(), reason="SmolLM2 is not converted")
def test_the_shipped_multi_layer_drafter_decodes_smollm2_losslessly():
    shipped = ROOT / "redrafter_mlx" / "smollm2_drafter"
    model, drafter, tok = load(SMOL_MODEL, shipped, "float32")
    assert drafter.args.feature_layers == [2, 15, 27] and model.feature_layers == (2, 15, 27)
    prompt = list(tok.chat_prompt([{"role": "user", "content": SMOL_PROMPT}]))
    for (w, length), per_step in SMOL_STEPS.items():
        out, stats = run_decode(
            model, drafter, [prompt], max_tokens=40, beam_width=w, beam_length=length
        )
        assert out[0] == SMOL_TOKENS
        assert stats["tokens_per_step"] == per_step


# ------------------------------------------------------------------------------------------
# config, loading, option parsing, cache keys


def test_a_multi_layer_drafter_round_trips_its_config(tmp_path):
    model = tiny_model(0, layers=3)
    drafter = tiny_drafter(model, 2, feature_layers=[2, 0])
    save_drafter_dir(drafter, tmp_path / "d")
    save_model_dir(model, tmp_path / "m", VICUNA_TOKENIZER)
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["feature_layers"] == [2, 0]
    back = load_drafter(tmp_path / "d", mx.float32)
    assert back.args.feature_layers == [2, 0]
    assert back.feature_proj.weight.shape == (32, 64)
    assert mx.array_equal(back.feature_proj.weight, drafter.feature_proj.weight).item()
    assert back.args.to_config() == drafter.args.to_config()
    loaded, _, _ = load(tmp_path / "m", tmp_path / "d", "float32")
    assert loaded.feature_layers == (2, 0) and loaded.state_width == 3 * 32
    # a drafter whose layers the model does not have is refused at load
    config["feature_layers"] = [5, 0]
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match="outside"):
        load(tmp_path / "m", tmp_path / "d", "float32")


def test_an_old_drafter_config_loads_unchanged():
    config = dict(vocab_size=32, hidden_size=16, exit_dim=32, num_draft_layers=1, rnn=True)
    args = DrafterArgs.from_config(dict(config, model_type="recurrent_drafting_drafter"))
    assert args.feature_layers is None
    assert args.to_config() == dict(config, model_type="recurrent_drafting_drafter")
    assert "feature_proj" not in Drafter(args)
    with pytest.raises(ValueError, match="feature_layers"):
        DrafterArgs.from_config(dict(config, feature_layers="2,15"))


def test_a_step_refuses_a_model_capturing_other_layers():
    model = tiny_model(0, layers=3)
    drafter = tiny_drafter(model, 2, feature_layers=[1])
    model.capture_features([2])
    with pytest.raises(ValueError, match="captures"):
        uniform_step(model, held_sources(drafter), BeamShape(1, 3), SamplerConfig(), 1)


def test_feature_layer_specs():
    deep = tiny_model(0, layers=30, hidden=16, heads=2, kv_heads=1)
    assert resolve_feature_layers("auto", deep) == (2, 15, 27)
    assert resolve_feature_layers("last", deep) == ()
    assert resolve_feature_layers("0,29", deep) == (0, 29)
    small = tiny_model(0, layers=2)
    assert resolve_feature_layers("auto", small) == (0, 1)
    for bad in ("30", "1,1", "a,b", "-1"):
        with pytest.raises(ValueError):
            resolve_feature_layers(bad, deep)
    from redrafter_mlx.engine.base.errors import ParamError
    from redrafter_mlx.train.options import DistillOptions

    assert DistillOptions().validate().feature_layers == "auto"  # the ablation's winner
    assert DistillOptions(feature_layers=" 2, 15 ").validate().feature_layers == "2,15"
    with pytest.raises(ParamError, match="feature layers"):
        DistillOptions(feature_layers="top").validate()


def test_target_caches_are_keyed_on_the_feature_layers():
    key = cache_key("model", "data", 512, 5, "self")
    assert cache_key("model", "data", 512, 5, "self", ()) == key  # caches made before
    assert cache_key("model", "data", 512, 5, "self", (2, 15, 27)) != key
    assert cache_key("model", "data", 512, 5, "self", (2, 15)) != cache_key(
        "model", "data", 512, 5, "self", (2, 15, 27)
    )


# ------------------------------------------------------------------------------------------
# distill end to end


@pytest.mark.slow
def test_distill_with_feature_layers_makes_a_drafter_that_loads_and_decodes(tmp_path):
    from typer.testing import CliRunner

    from redrafter_mlx.cli import _register, app
    from tests.support.train import TOY

    _register()
    model_dir = tmp_path / "model"
    save_model_dir(near_bigram_model(seed=0, vocab=32000, hidden=32), model_dir, VICUNA_TOKENIZER)
    out = model_dir / "drafter"
    args = ["distill", "--model", str(model_dir), "--out", str(out), *TOY]
    result = CliRunner().invoke(app, [*args, "--feature-layers", "0,1"])
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert config["feature_layers"] == [0, 1]
    (work,) = (out / "cache").glob("selfdata-*")
    assert work.name.endswith("-f0.1")
    shard = np.load(next((work / "hidden").glob("*.npy")))
    assert shard.shape[1] == 3 * 32 and shard.dtype == np.float16
    model, drafter, _ = load(model_dir, out)
    assert model.feature_layers == (0, 1)
    prompts = [[1, 319, 1781, 338], [1, 3575, 29901]]
    plain, _ = run_decode(model, None, prompts, max_tokens=20)
    fast, _ = run_decode(model, drafter, prompts, max_tokens=20, beam_width=2, beam_length=3)
    assert fast == plain
    # a last-layer run on the same answers: reuses the multi-layer folder (no generation)
    last = tmp_path / "last"
    result = CliRunner().invoke(
        app,
        [*args[:4], str(last), *TOY, "--cache-dir", str(out / "cache"), "--feature-layers", "last"],
    )
    assert result.exit_code == 0, result.output
    assert "reusing" in result.output
    assert "feature_layers" not in json.loads((last / "config.json").read_text())
    assert sorted(p.name for p in (out / "cache").glob("selfdata-*")) == [work.name]


def test_server_rows_with_a_feature_drafter_equal_plain_decoding():
    """The serving scheduler's batch rows (joining mid-generation, drafter + lookup) carry
    the wider hidden states: each row's greedy output equals plain decoding."""
    from redrafter_mlx.engine.loop.loading import attach
    from redrafter_mlx.serve.scheduler import Request, Scheduler

    model = near_bigram_model(seed=5, attn_scale=0.05, layers=3, vocab=24)
    drafter = tiny_drafter(model, 11, feature_layers=[0, 2])
    attach(model, drafter)  # what load does
    sched = Scheduler(model, drafter, BeamShape(2, 4, None, 1, 5), (), max_batch=2)
    sinks = []
    for i, prompt in enumerate(PROMPTS):
        tokens: list[int] = []
        sched.submit(Request(prompt, 18 + 6 * i, lambda ev, t=tokens: t.extend(ev.tokens)))
        sinks.append((prompt, 18 + 6 * i, tokens))
        for _ in range(3):
            sched.run_once()
    for _ in range(10_000):
        if not (sched.active_rows or sched.batch.pending is not None or sched.queue.qsize()):
            break
        sched.run_once()
    for prompt, n, tokens in sinks:
        assert tokens == run_decode(model, None, [prompt], max_tokens=n)[0][0]


def test_answers_keep_the_feature_layers_of_the_decoding_forward():
    """Self-distillation answers keep [final normed, residual into each feature layer] per
    position (float16), equal to a plain forward over prompt + answer, and the same tokens
    and final normed states as without features."""
    from redrafter_mlx.train.selfgen import answers_with_hidden

    model = tiny_model(6, layers=3, vocab=24)
    prompts = [[1, 4, 9], [1, 2, 3, 5, 8]]
    plain = answers_with_hidden(model, prompts, 12, [7])
    model.capture_features([2, 0])
    wide = answers_with_hidden(model, prompts, 12, [7])
    H = model.hidden_size
    for p, a, b in zip(prompts, plain, wide):
        assert a.ids == b.ids and b.hidden.shape == (len(b.ids), 3 * H)
        assert b.hidden.dtype == np.float16
        np.testing.assert_array_equal(a.hidden, b.hidden[:, :H])
        # hidden[j] is the state at the token before ids[j]: prompt[-1], then ids[:-1]
        final, inputs = reference_residuals(model, p + b.ids[:-1])
        at = slice(len(p) - 1, len(p) - 1 + len(b.ids))
        want = np.concatenate([np.array(x[at]) for x in (final, inputs[2], inputs[0])], axis=1)
        np.testing.assert_allclose(b.hidden.astype(np.float32), want, atol=2e-2, rtol=1e-2)
