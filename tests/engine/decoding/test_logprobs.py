"""Exact logprobs under speculation (issue 69, item 2): every emitted token's log-probability
and top tokens, through the server's scheduler, equal plain decoding's: an oracle that
prefills the prompt and the tokens before each one afresh and reads the whole distribution
of the next draw (``decode.first_draw_logprobs``, no tree, no step), for the drafter's
trees, lookup chains, two chains, a capacity below the beam length and a draft model (the
model as its own draft model), greedy and sampled; and batched rows equal their solo runs."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.core.logprobs import TokenLogprobs, drawn_log_probs, logprob_bucket
from redrafter_mlx.engine.core.sampling import (
    RowSampler,
    SamplerConfig,
    process_text,
    row_settings,
)
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.decoding.cache import Session, prefill_session, text_history
from redrafter_mlx.engine.decoding.decode import first_draw_logprobs
from redrafter_mlx.serve.requests import Request
from redrafter_mlx.serve.scheduler import Scheduler
from tests.support.models import tiny_drafter, tiny_model
from tests.support.serving import drain

V = 64
TOL = 2e-4
PROMPTS = [[1, 5, 9, 2, 7, 5, 9, 2], [3, 3, 8, 1, 3, 3, 8], [2, 4, 6, 2, 4]]
GREEDY = SamplerConfig()
SAMPLED = SamplerConfig(temperature=1.3, top_k=12, top_p=0.9, seed=7)
BIASED = SamplerConfig(temperature=0.8, min_p=0.05, logit_bias=((5, 2.0),), seed=3)
PENALIZED = SamplerConfig(repetition_penalty=1.3, presence_penalty=0.5, seed=1)


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=V, hidden=32, layers=2, seed=3)


@pytest.fixture(scope="module")
def drafter(model):
    return tiny_drafter(model)


class Sink:
    """A request's tokens and their logprobs, gathered from its events."""

    def __init__(self):
        self.tokens, self.logprobs, self.last = [], [], None

    def __call__(self, event):
        assert event.error is None, event.error
        self.tokens += event.tokens
        if event.tokens:
            assert event.logprobs is not None and len(event.logprobs) == len(event.tokens)
            self.logprobs += event.logprobs
        self.last = event


def served(model, drafter, shape, prompts, samplers, top=5, max_tokens=14, draft_model=None):
    """Each prompt's Sink, the requests submitted together into one batch."""
    sched = Scheduler(model, drafter, shape, (), max_batch=max(len(prompts), 1),
                      draft_model=draft_model)  # fmt: skip
    sinks = []
    for prompt, sampler in zip(prompts, samplers):
        sinks.append(Sink())
        sched.submit(Request(prompt, max_tokens, sinks[-1], sampler, logprobs=top))
    drain(sched)
    return sinks


def plain(model, text: list[int], cfg: SamplerConfig) -> np.ndarray:
    """The log-probabilities (V,) plain decoding draws the token after ``text`` from."""
    session = Session(model, 1)
    hidden = prefill_session(session, [text])
    rows = row_settings([cfg], V)
    sampler = RowSampler(rows.settings, mx.random.key(0)[None], rows.mode._replace(logprobs=V))
    history = text_history([text], session.slots)
    lengths = mx.array([len(text)], mx.int32)
    _, got = first_draw_logprobs(model, hidden, sampler, history, lengths)
    out = np.full(V, -np.inf, np.float32)
    out[np.array(got.top_ids[0, 0])] = np.array(got.top_logprobs[0, 0])
    return out


def check_exact(model, prompt, cfg, sink, top=5):
    """Each emitted token's logprob and top tokens equal plain decoding's."""
    assert sink.tokens and len(sink.logprobs) == len(sink.tokens)
    for k, (token, (own, tops)) in enumerate(zip(sink.tokens, sink.logprobs)):
        want = plain(model, prompt + sink.tokens[:k], cfg)
        assert math.isfinite(own), (k, token)
        assert abs(own - want[token]) < TOL, (k, token, own, want[token])
        assert len(tops) == top
        values = [lp for _, lp in tops]
        assert values == sorted(values, reverse=True)
        for i, lp in tops:
            assert (lp == want[i] == -np.inf) or abs(lp - want[i]) < TOL, (k, i, lp, want[i])
        best = np.sort(want)[::-1][:top]
        assert np.allclose(values, best, atol=TOL), (k, values, best)  # the same top tokens


SHAPES = {
    "tree": BeamShape(2, 4),
    "truncated-tree": BeamShape(3, 4, 5),
    "lookup": BeamShape.lookup_only(2, 4),
    "two-chains": BeamShape.parse("W1xL4+K1xL4"),
}


@pytest.mark.parametrize("cfg", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_speculative_logprobs_equal_plain_decoding(model, drafter, name, cfg):
    shape = SHAPES[name]
    prompt = PROMPTS[0]
    (sink,) = served(model, drafter if shape.width else None, shape, [prompt], [cfg])
    check_exact(model, prompt, cfg, sink)
    if cfg.greedy:  # the tokens themselves are plain decoding's
        (alone,) = served(model, None, None, [prompt], [cfg])
        assert sink.tokens == alone.tokens


def test_a_draft_model_accepting_drafts_gives_exact_logprobs(model):
    """The model as its own draft model: its greedy chain is accepted, so most tokens of a
    step come from drafts, and each one's logprob is still its own node's."""
    prompt = PROMPTS[1]
    for cfg in (GREEDY, SAMPLED):
        (sink,) = served(model, None, BeamShape.parse("D1xL4"), [prompt], [cfg], draft_model=model)
        assert sink.last.stats.accepted_drafts > 0
        check_exact(model, prompt, cfg, sink)


def test_batched_rows_with_their_own_settings_equal_their_solo_runs(model, drafter):
    """Three rows (greedy with penalties, sampled, sampled with a bias) in one batch: each
    row's tokens and logprobs are its solo run's, and plain decoding's."""
    shape, cfgs = BeamShape(2, 3), [PENALIZED, SAMPLED, BIASED]
    together = served(model, drafter, shape, PROMPTS, cfgs)
    for prompt, cfg, sink in zip(PROMPTS, cfgs, together):
        (alone,) = served(model, drafter, shape, [prompt], [cfg])
        assert sink.tokens == alone.tokens
        got, want = np.array([lp for lp, _ in sink.logprobs]), [lp for lp, _ in alone.logprobs]
        assert np.allclose(got, want, atol=TOL)
        check_exact(model, prompt, cfg, sink)


def test_rows_without_logprobs_get_none_and_top_0_gets_the_token_alone(model, drafter):
    sched = Scheduler(model, drafter, BeamShape(2, 3), (), max_batch=2)
    bare, off_events = Sink(), []
    sched.submit(Request(PROMPTS[0], 8, off_events.append))
    sched.submit(Request(PROMPTS[1], 8, bare, logprobs=0))
    drain(sched)
    assert all(e.logprobs is None for e in off_events)
    assert bare.logprobs and all(tops == () for _, tops in bare.logprobs)


def test_a_filtered_token_is_minus_infinity_among_the_top_ones(model, drafter):
    """top_k=2 keeps two tokens: the other top entries are -inf, the emitted one finite."""
    cfg = SamplerConfig(temperature=1.0, top_k=2, seed=5)
    (sink,) = served(model, drafter, BeamShape(2, 3), [PROMPTS[2]], [cfg])
    for own, tops in sink.logprobs:
        assert math.isfinite(own)
        assert [math.isfinite(lp) for _, lp in tops] == [True, True, False, False, False]
        assert math.isclose(sum(math.exp(lp) for _, lp in tops[:2]), 1.0, rel_tol=1e-5)
    check_exact(model, PROMPTS[2], cfg, sink)


def test_buckets_hold_the_count_and_refuse_past_20():
    assert [logprob_bucket(n) for n in (None, 0, 1, 2, 5, 6, 20)] == [0, 1, 1, 5, 5, 20, 20]
    with pytest.raises(ValueError, match="20"):
        logprob_bucket(21)
    assert TokenLogprobs._fields == ("logprob", "top_ids", "top_logprobs")


def test_the_drawn_distribution_is_the_tempered_one_and_a_greedy_rows_the_models():
    """Against numpy: a sampling row's log-softmax of logits / T (top_k keeping 3: the
    others -inf, the kept renormalised); a greedy row's of its biased logits at T = 1."""
    logits = np.random.default_rng(0).normal(size=(2, 3, V)).astype(np.float32) * 3
    cfgs = [SamplerConfig(temperature=0.7, top_k=3, seed=1), SamplerConfig(logit_bias=((4, 5.0),))]
    rows = row_settings(cfgs, V)
    sampler = RowSampler(rows.settings, mx.zeros((2, 2), mx.uint32), rows.mode)
    got = np.array(drawn_log_probs(process_text(mx.array(logits), sampler, None), sampler))

    def log_softmax(x):
        top = x.max(-1, keepdims=True)
        return x - top - np.log(np.exp(x - top).sum(-1, keepdims=True))

    tempered = logits[0] / 0.7
    kth = np.sort(tempered, -1)[:, -3][:, None]
    kept = np.where(tempered >= kth, tempered, -np.inf)
    assert np.allclose(got[0], log_softmax(kept), atol=1e-5)
    biased = logits[1].copy()
    biased[:, 4] += 5.0
    assert np.allclose(got[1], log_softmax(biased), atol=1e-5)
