"""The step under mx.compile, parity with mlx-lm, loading, sessions, and bad-input errors."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import redrafter_mlx
from redrafter_mlx.engine.core.sampling import SamplerConfig, StepMode
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.decode import DecodeState, prefill_chunk
from redrafter_mlx.engine.decoding.step import batch_step, uniform_step
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.loading import LoadError
from tests.support.models import (
    VICUNA_TOKENIZER,
    run_decode,
    save_drafter_dir,
    save_model_dir,
    tiny_drafter,
    tiny_model,
)


def test_step_compiles_and_never_retraces_per_step():
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    events = generate_steps(model, drafter, [[1, 2, 3]], max_tokens=120, shape=BeamShape(3, 4))
    for _ in events:
        pass
    step = batch_step(model, held_sources(drafter), BeamShape(3, 4), StepMode())
    # One trace per attention-window bucket (256 slots), never one per step.
    assert 1 <= step.counter["traces"] <= 2


def test_step_is_a_pure_graph_under_compile():
    """mx.compile raises on any host read (item/tolist/eval) inside the traced function."""
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    session = Session(model, 2)
    zeros = mx.zeros((2,), dtype=mx.int32)
    h, lengths, cache = prefill_chunk(
        model, mx.array([[1, 2, 3], [1, 4, 0]]), mx.array([3, 2]), zeros, session.cache, 256
    )
    state = DecodeState(mx.array([5, 6]), h, lengths, cache)
    sampler = SamplerConfig(temperature=0.8, top_p=0.9)
    step = uniform_step(model, held_sources(drafter), BeamShape(2, 3, 5), sampler, 2)
    before = step.step.counter["traces"]  # the step is kept on the model: maybe traced before
    for _ in range(3):
        state, out = step(state, 256)
    mx.eval(out)
    assert out.tokens.shape == (2, 3) and step.step.counter["traces"] - before <= 1


def _mlx_lm_logits(model_dir, tokens):
    from mlx_lm import load as mlx_lm_load

    ref, _ = mlx_lm_load(str(model_dir))
    return ref(mx.array([tokens]))[0]


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope_theta": 500000.0, "tie_word_embeddings": True},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
)
def test_logits_match_mlx_lm(tmp_path, extra):
    model = tiny_model(3, vocab=64, **extra)
    save_model_dir(model, tmp_path, VICUNA_TOKENIZER)
    mine, _, _ = redrafter_mlx.load(tmp_path, dtype="float32")
    tokens = [1, 5, 9, 33, 2, 17, 60, 4, 8, 8, 1, 0]
    cache = mine.make_cache(1, 256)
    T = len(tokens)
    zeros = mx.zeros((1,), dtype=mx.int32)
    idx = mx.arange(T)[None]
    from redrafter_mlx.engine.core.tree import cache_mask, chain_mask

    hidden, _ = mine(mx.array([tokens]), idx, cache_mask(zeros, chain_mask(T), 256), cache, idx)
    got = np.array(mine.logits(hidden)[0])
    want = np.array(_mlx_lm_logits(tmp_path, tokens).astype(mx.float32))
    assert np.abs(got - want).max() <= 1e-4


def test_load_pair_and_generate_from_directories(tmp_path):
    model = tiny_model(4, vocab=32000, hidden=32)
    drafter = tiny_drafter(model, 5, exit_dim=48)
    save_model_dir(model, tmp_path / "m", VICUNA_TOKENIZER)
    save_drafter_dir(drafter, tmp_path / "d")
    m, d, tok = redrafter_mlx.load(tmp_path / "m", tmp_path / "d")
    assert m.model.norm.weight.dtype == mx.float32  # CPU default
    ar = redrafter_mlx.generate(m, None, tok, "Hello there", max_tokens=12)
    rd_chunks = list(
        redrafter_mlx.stream_generate(
            m, d, tok, "Hello there", max_tokens=12, shape=BeamShape(2, 3)
        )
    )
    assert "".join(r.text for r in rd_chunks) == ar
    last = rd_chunks[-1]
    assert last.finish_reason == "length" and last.generation_tokens == 12
    assert sum(len(r.tokens) for r in rd_chunks) == 12 and last.steps >= 1
    assert last.tokens_per_step >= 1.0 and last.mean_packed >= 1.0


def test_quantized_model_loads_and_generates(tmp_path):
    from mlx_lm.utils import quantize_model

    model = tiny_model(4, vocab=64, hidden=64)
    save_model_dir(model, tmp_path / "m", VICUNA_TOKENIZER)
    config = json.loads((tmp_path / "m/config.json").read_text())
    qmodel, qconfig = quantize_model(model, config, group_size=32, bits=4)
    mx.save_safetensors(
        str(tmp_path / "m/model.safetensors"), dict(tree_flatten(qmodel.parameters()))
    )
    (tmp_path / "m/config.json").write_text(json.dumps(qconfig))
    m, _, _tok = redrafter_mlx.load(tmp_path / "m")
    out, _ = run_decode(m, None, [[1, 2, 3]], max_tokens=5)
    assert len(out[0]) == 5


def test_session_reuses_the_cache_across_turns():
    model = tiny_model(6)
    drafter = tiny_drafter(model, 7)
    session = Session(model, 1)
    turn1 = [1, 4, 5, 6]
    out1, s1 = run_decode(model, drafter, [turn1], max_tokens=10, session=session)
    assert s1["prefilled_tokens"] == 4
    turn2 = turn1 + out1[0] + [9, 9, 3]
    out2, s2 = run_decode(model, drafter, [turn2], max_tokens=10, session=session)
    assert s2["prefilled_tokens"] == 3  # only the new tokens
    fresh, _ = run_decode(model, drafter, [turn2], max_tokens=10)
    assert out2 == fresh


def test_bad_input_errors(tmp_path):
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    bad = [
        (dict(beam_width=0), "beam width"),
        (dict(beam_length=1), "beam length"),
        (dict(beam_width=2, beam_length=4, capacity=3), "capacity 3 < beam length"),
        (dict(beam_width=2, beam_length=4, capacity=9), "capacity 9 > width"),
        (dict(max_tokens=0), "max_tokens"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            run_decode(model, drafter, [[1, 2]], **{"max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match="context"):
        run_decode(model, drafter, [[1] * 4096], max_tokens=4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        run_decode(model, drafter, [[1, 99]], max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        run_decode(model, drafter, [[1]], max_tokens=4, sampler=SamplerConfig(temperature=-1))


def test_load_errors(tmp_path):
    with pytest.raises(LoadError, match="not found"):
        redrafter_mlx.load(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        redrafter_mlx.load(tmp_path / "empty")
    model = tiny_model(0, vocab=32000)
    save_model_dir(model, tmp_path / "m", VICUNA_TOKENIZER)
    cfg = json.loads((tmp_path / "m/config.json").read_text())
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt/config.json").write_text(json.dumps({**cfg, "model_type": "gpt9"}))
    with pytest.raises(LoadError, match="not one mlx-lm .* implements; upgrade mlx-lm"):
        redrafter_mlx.load(tmp_path / "gpt")
    other = tiny_model(1, vocab=32000, hidden=48)
    save_drafter_dir(tiny_drafter(other, 2), tmp_path / "d_hidden")
    with pytest.raises(LoadError, match="hidden_size"):
        redrafter_mlx.load(tmp_path / "m", tmp_path / "d_hidden")
    save_drafter_dir(tiny_drafter(tiny_model(1, vocab=100), 2), tmp_path / "d_vocab")
    with pytest.raises(LoadError, match="vocab_size"):
        redrafter_mlx.load(tmp_path / "m", tmp_path / "d_vocab")
    (tmp_path / "m/model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model"):
        redrafter_mlx.load(tmp_path / "m")


def test_vicuna_chat_prompt_format():
    from redrafter_mlx.engine.base.chat_format import vicuna_prompt
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer

    text = vicuna_prompt(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert text.endswith("USER: Hi ASSISTANT: Hello!</s>USER: Bye ASSISTANT:")
    assert text.startswith("A chat between a curious user")
    tok = load_tokenizer(VICUNA_TOKENIZER)
    ids = tok.chat_prompt(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Yo"},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert ids[0] == 1 and ids.count(2) == 1  # BOS, and </s> became the EOS id
    assert tok.decode(ids).endswith("Yo USER: Bye ASSISTANT:") or "Bye ASSISTANT:" in tok.decode(
        ids
    )


def test_beam_search_returns_sorted_scored_beams():
    import itertools

    from redrafter_mlx.engine.drafting.drafter import beam_search

    model = tiny_model(8, vocab=16)
    drafter = tiny_drafter(model, 9)
    hidden = mx.random.normal((2, model.hidden_size), key=mx.random.key(1))
    beams, scores, log_probs = beam_search(drafter, model.embed, hidden, mx.array([3, 4]), 4, 4)
    assert beams.shape == (2, 4, 4) and log_probs.shape == (2, 4, 3, 16)
    assert beams[:, :, 0].tolist() == [[3] * 4, [4] * 4]
    s = scores.tolist()
    assert all(row == sorted(row, reverse=True) for row in s)
    # A beam's score is the sum of its tokens' drafter log-probs.
    lp = np.array(log_probs)
    b = np.array(beams)
    for r, i in itertools.product(range(2), range(4)):
        total = sum(lp[r, i, k, b[r, i, k + 1]] for k in range(3))
        assert abs(total - s[r][i]) < 1e-4
    # Beams are distinct, and the first step expands into W distinct children.
    for r in range(2):
        assert len({tuple(x) for x in b[r].tolist()}) == 4


def test_drafter_updated_in_place_is_served_with_new_weights():
    """Compiled steps read weights at every call, not at trace time."""
    from mlx.utils import tree_flatten

    model = tiny_model(12)
    drafter = tiny_drafter(model, 13)
    kwargs = dict(max_tokens=30, beam_width=3, beam_length=4)
    run_decode(model, drafter, [[1, 2, 3]], **kwargs)
    donor = tiny_drafter(model, 14)
    drafter.load_weights(tree_flatten(donor.parameters()))
    _, in_place = run_decode(model, drafter, [[1, 2, 3]], **kwargs)
    _, fresh = run_decode(model, donor, [[1, 2, 3]], **kwargs)
    assert in_place["accept_hist"] == fresh["accept_hist"]
    assert in_place["mean_packed"] == fresh["mean_packed"]
