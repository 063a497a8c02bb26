"""Logit bias and repetition / presence / frequency penalties: mlx-lm's rules, exact at every
tree node, so speculation with them on emits what plain decoding with them on emits."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import make_logits_processors

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.penalties import node_text, penalize
from redrafter_mlx.engine.core.sampling import RowSampler, SamplerConfig, check_seed, process_text
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import pack
from tests.support.models import run_decode, save_model_dir, tiny_drafter, tiny_model
from tests.support.sampling import mlx_lm_processed

PENALTIES = dict(
    repetition_penalty=1.7,
    repetition_context_size=6,
    presence_penalty=0.4,
    frequency_penalty=0.3,
    logit_bias=((3, 1.5), (5, -0.7)),
)


def test_every_tree_node_gets_mlx_lm_penalties_over_its_own_path():
    """Brute force: each packed node's logits equal mlx-lm's processors applied to the
    committed history plus that node's path, at windows shorter and longer than the tree."""
    rng = np.random.default_rng(0)
    V, L, W = 12, 4, 3
    history = [[int(t) for t in rng.integers(0, V, n)] for n in (9, 3)]
    lengths = [len(h) for h in history]
    beams = rng.integers(0, V, (2, W, L))
    beams[:, :, 0] = beams[:, :1, 0]  # every beam starts at the row's init token
    beams[:, 1, :2] = beams[:, 0, :2]  # a shared prefix, so the pack makes a real tree
    tree = pack(mx.array(beams, dtype=mx.int32), 9)
    S = 16
    hist = mx.array([h + [0] * (S - len(h)) for h in history], dtype=mx.int32)
    C = tree.tokens.shape[1]
    logits = rng.normal(size=(2, C, V)).astype(np.float32)
    for context in (2, 5, 20):
        cfg = SamplerConfig(**{**PENALTIES, "repetition_context_size": context})
        text = node_text(
            hist, mx.array(lengths), context, context, tree.tokens, tree.depth, tree.mask
        )
        rows = RowSampler.from_config(cfg, V, None, 2)
        got = np.array(process_text(mx.array(logits), rows, text))
        tokens, depth, valid, mask = (
            np.array(a) for a in (tree.tokens, tree.depth, tree.valid, tree.mask)
        )
        for b in range(2):
            for c in range(C):
                if not valid[b, c]:
                    continue
                path = sorted((j for j in range(C) if mask[b, c, j]), key=lambda j: depth[b, j])
                text_c = history[b] + [int(tokens[b, j]) for j in path]
                want = mlx_lm_processed(logits[b, c], text_c, cfg)
                np.testing.assert_allclose(got[b, c], want, rtol=1e-6, atol=1e-6)


def test_the_first_draw_reads_the_prompt_tail():
    V = 10
    history = mx.array([[1, 2, 2, 7, 0, 0], [4, 0, 0, 0, 0, 0]], dtype=mx.int32)
    lengths = mx.array([4, 1])
    logits = np.random.default_rng(1).normal(size=(2, 1, V)).astype(np.float32)
    text = node_text(history, lengths, 3, 3)
    got = np.array(penalize(mx.array(logits), text, 2.0, 0.5, 0.25))
    cfg = SamplerConfig(repetition_penalty=2.0, repetition_context_size=3)
    cfg = SamplerConfig(**{**cfg.__dict__, "presence_penalty": 0.5, "frequency_penalty": 0.25})
    np.testing.assert_allclose(got[0, 0], mlx_lm_processed(logits[0, 0], [1, 2, 2, 7], cfg), 1e-6)
    np.testing.assert_allclose(got[1, 0], mlx_lm_processed(logits[1, 0], [4], cfg), 1e-6)


SHAPES = [
    BeamShape(1, 1),
    BeamShape(1, 4),
    BeamShape(3, 4),
    BeamShape(4, 4, 6),
    BeamShape(2, 3, None, 2, 4),
    BeamShape(1, 3, None, 1, 5),  # one beam and one chain: the static layout
    BeamShape.lookup_only(1, 6),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_greedy_with_penalties_is_plain_decoding_with_penalties(shape):
    model = tiny_model(3, vocab=16)
    drafter = tiny_drafter(model, 4) if shape.drafts else None
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [4, 4, 4]]
    cfg = SamplerConfig(**PENALTIES)
    plain, _ = run_decode(model, None, prompts, max_tokens=30, sampler=cfg, shape=BeamShape(1, 1))
    out, _ = run_decode(
        model, drafter, prompts, max_tokens=30, sampler=cfg, shape=shape, adapt=False
    )
    assert out == plain
    off, _ = run_decode(model, None, prompts, max_tokens=30, shape=BeamShape(1, 1))
    assert off != plain  # the penalties change the text (the test has teeth)


def test_plain_decoding_with_penalties_matches_mlx_lm(tmp_path):
    """Our autoregressive loop and mlx-lm's ``generate_step`` with the same processors."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model = tiny_model(5, vocab=24)
    save_model_dir(model, tmp_path)
    ref, _ = load_model(tmp_path)
    prompt = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    cfg = SamplerConfig(**PENALTIES)
    ours, _ = run_decode(model, None, [prompt], max_tokens=24, sampler=cfg, shape=BeamShape(1, 1))
    processors = make_logits_processors(dict(cfg.logit_bias), 1.7, 6, 0.4, 6, 0.3, 6)
    theirs = [
        int(t)
        for t, _ in generate_step(
            mx.array(prompt),
            ref,
            max_tokens=24,
            sampler=lambda x: mx.argmax(x, axis=-1),
            logits_processors=processors,
        )
    ]
    assert ours[0] == theirs


def test_bad_sampling_values_are_refused():
    for bad, field in [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(repetition_context_size=0), "repetition_context_size"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
        (dict(logit_bias=((2, float("nan")),)), "logit_bias"),
    ]:
        with pytest.raises(ParamError) as e:
            SamplerConfig(**bad).validate(16)
        assert e.value.param == field
    with pytest.raises(ParamError, match="outside the vocabulary"):
        SamplerConfig(logit_bias=((16, 1.0),)).validate(16)


@pytest.mark.parametrize("seed", [-1, 2**64, 1e20, True, "3"])
def test_bad_seeds_are_refused(seed):
    with pytest.raises(ParamError, match="seed must be an integer"):
        check_seed(seed)


def test_extreme_seeds_run():
    model = tiny_model(3, vocab=16)
    cfg = SamplerConfig(temperature=1.0)
    for seed in (0, 2**64 - 1):
        out, _ = run_decode(model, None, [[1, 2]], max_tokens=4, sampler=cfg, seed=seed)
        assert len(out[0]) == 4
    with pytest.raises(ParamError):
        run_decode(model, None, [[1, 2]], max_tokens=4, sampler=cfg, seed=-1)
