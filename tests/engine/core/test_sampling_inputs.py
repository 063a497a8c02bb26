"""Sampling values at their limits, in every path.

Item 1: a ``top_k`` of 2**31 or more crashed the batched step (int32 cast) and failed every
row in flight. Now every value a client can send is checked or made to fit when its row is
admitted (``sampling.one_row``): a top_k of the vocabulary size or more is no filter, absurd
floats are refused naming the field, and an error in one row's settings fails that row alone.

Item 2: tiny valid settings gave garbage (float32 overflow, values rounded to 0). A
temperature below ``GREEDY_TEMPERATURE`` is greedy, a tiny top_p keeps the most likely token,
and min_p near 0 / 1 is no filter / the top token, in the API, the CLI and the server alike.
"""

from __future__ import annotations

import asyncio

import httpx
import mlx.core as mx
import numpy as np
import pytest

import redrafter_mlx.engine.loop.prefilling as prompts_module
from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core import tree
from redrafter_mlx.engine.core.sampling import (
    GREEDY_TEMPERATURE,
    SETTING_LIMIT,
    RowSampler,
    SamplerConfig,
    draw,
    one_row,
    process_logits,
    target_log_weights,
)
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.scheduler import Scheduler
from tests.support.cli import invoke, model_args, run_json
from tests.support.models import run_decode, tiny_drafter, tiny_model
from tests.support.serving import Server, staggered, stream

HUGE_K = 3_000_000_000  # > 2**31: the int32 cast raised std::bad_cast
TINY = [1e-12, 1e-38, 1e-40, 1e-300, 5e-324]  # temperatures below GREEDY_TEMPERATURE
PROMPTS = [[1, 5, 9, 2, 7], [1, 3, 3, 8]]
SHAPES = [BeamShape(1, 1), BeamShape(2, 3), BeamShape(1, 3, None, 1, 4)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(vocab=64, hidden=32, layers=2, seed=3)


def decode(model, shape, sampler, seed=None, prompts=PROMPTS, n=12):
    drafter = tiny_drafter(model) if shape.drafts else None
    out, _ = run_decode(
        model, drafter, prompts, max_tokens=n, sampler=sampler, seed=seed, shape=shape, adapt=False
    )
    return out


# --------------------------------------------------------------------------- the rules


def test_top_k_at_or_past_the_vocabulary_is_no_filter():
    V = 64
    for k, held in [(V - 1, V - 1), (V, 0), (2**31, 0), (HUGE_K, 0), (10**30, 0)]:
        rows = one_row(SamplerConfig(1.0, top_k=k), V)
        assert np.array(rows.settings.top_k).tolist() == [held]
        assert ("top_k" in rows.mode.filters) == (held > 0)


@pytest.mark.parametrize(
    "fields, name",
    [
        (dict(temperature=2e6), "temperature"),
        (dict(temperature=-1e-300), "temperature"),
        (dict(repetition_penalty=1e-7), "repetition_penalty"),
        (dict(repetition_penalty=1e7), "repetition_penalty"),
        (dict(presence_penalty=1e7), "presence_penalty"),
        (dict(frequency_penalty=-1e7), "frequency_penalty"),
        (dict(logit_bias=((3, 1e7),)), "logit_bias"),
        (dict(logit_bias=((3, -1e300),)), "logit_bias"),
        (dict(logit_bias=((2**40, 1.0),)), "logit_bias"),
    ],
)
def test_values_the_step_cannot_hold_are_refused_naming_the_field(fields, name):
    with pytest.raises(ParamError) as e:
        SamplerConfig(**fields).validate(64)
    assert e.value.param == name and name in e.value.message


def test_the_limits_themselves_are_held_and_run(model):
    cfg = SamplerConfig(
        temperature=SETTING_LIMIT,
        repetition_penalty=1 / SETTING_LIMIT,
        presence_penalty=-SETTING_LIMIT,
        frequency_penalty=SETTING_LIMIT,
        logit_bias=((3, SETTING_LIMIT), (4, -SETTING_LIMIT)),
    ).validate(64)
    for shape in SHAPES[:2]:
        out = decode(model, shape, cfg, seed=1)
        assert all(0 <= t < 64 for row in out for t in row) and all(len(r) == 12 for r in out)


def test_greedy_is_one_rule():
    assert SamplerConfig(GREEDY_TEMPERATURE / 2).greedy
    assert not SamplerConfig(GREEDY_TEMPERATURE).greedy
    for t in TINY:
        rows = one_row(SamplerConfig(t, top_p=0.5), 64)
        assert SamplerConfig(t).greedy and not rows.mode.sample
        assert np.array(rows.settings.temperature).tolist() == [0.0]


def test_the_smallest_sampling_temperature_does_not_overflow():
    """Large logits (a bias at its limit) at the smallest temperature that samples: finite
    log-weights, the runner-up (1/16 below the top) about 6e9 nats below it, so the draw is
    the top token."""
    logits = mx.array([[[3e4, 3e4 - 0.0625, -3e4, 0.0]]]) + SETTING_LIMIT
    sampler = RowSampler.from_config(SamplerConfig(GREEDY_TEMPERATURE), 4, mx.random.key(0))
    x = np.array(target_log_weights(logits, sampler))[0, 0]
    assert np.isfinite(x).all() and (x[0] - x[1:] > 1e9).all(), x
    assert np.array(draw(logits, sampler)).tolist() == [[0]]


def _numpy_keep(logits, cfg):
    """The tokens ``cfg`` keeps, by the filters' definitions (a brute-force oracle)."""
    x = logits.astype(np.float64) / cfg.temperature
    keep = np.ones_like(x, dtype=bool)
    if 0 < cfg.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][cfg.top_k - 1]
    if cfg.top_p < 1.0:
        p = np.exp(x - x[keep].max()) * keep
        p /= p.sum()
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        chosen = order[(before < cfg.top_p) | (np.arange(len(x)) == 0)]
        keep &= p >= p[chosen].min()
    if cfg.min_p > 0.0:
        p = np.exp(x - x[keep].max()) * keep
        p /= p.sum()
        keep &= p >= cfg.min_p * p.max()
    return keep


def _nearby(cfg):
    """``cfg`` with top_p and min_p moved by 1e-4 either way (where they are not extreme)."""
    for d in (-1e-4, 1e-4):
        top_p = cfg.top_p + d if 0.01 < cfg.top_p < 1.0 else cfg.top_p
        min_p = cfg.min_p + d if cfg.min_p > 0.01 else cfg.min_p
        yield SamplerConfig(cfg.temperature, top_p, cfg.top_k, min_p)


def test_the_filters_keep_what_their_definitions_keep():
    """The one filter chain against a float64 brute force, over random logits and settings
    (gaps of 1e-3 or more between logits, so float32 cannot change the verdicts)."""
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(200):
        V = int(rng.integers(2, 30))
        logits = rng.permutation(np.arange(V) * 1e-3 + rng.normal(0, 3, V).round(2))
        cfg = SamplerConfig(
            temperature=float(rng.choice([0.3, 1.0, 2.5])),
            top_k=int(rng.choice([0, 1, 3, V, V + 5])),
            top_p=float(rng.choice([1.0, 0.9, 0.5, 1e-300])),
            min_p=float(rng.choice([0.0, 0.05, 0.3, 1e-300])),
        )
        got = np.array(process_logits(mx.array(logits, dtype=mx.float32), cfg)) > -np.inf
        want = _numpy_keep(logits, cfg)
        if any((_numpy_keep(logits, near) != want).any() for near in _nearby(cfg)):
            continue  # within 1e-4 of a verdict's boundary: float32 may flip it
        assert got.tolist() == want.tolist(), cfg
        checked += 1
    assert checked > 150


# --------------------------------------------------------------------------- the API


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_api_top_k_past_int32_runs_as_no_filter(model, shape):
    """Before: RuntimeError: std::bad_cast."""
    plain = decode(model, shape, SamplerConfig(1.0), seed=5)
    assert decode(model, shape, SamplerConfig(1.0, top_k=HUGE_K), seed=5) == plain


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label)
def test_api_tiny_settings_are_greedy(model, shape):
    """Before: a temperature of 1e-38 overflowed (garbage), 1e-40 rounded to 0 (NaN), and a
    top_p of 1e-300 rounded to 0 dropped every token (token 0 every time)."""
    greedy = decode(model, shape, SamplerConfig())
    assert decode(model, shape, SamplerConfig(1.5), seed=2) != greedy  # sampling differs
    for t in TINY:
        assert decode(model, shape, SamplerConfig(t), seed=2) == greedy, t
    assert decode(model, shape, SamplerConfig(1.5, top_p=1e-300), seed=2) == greedy
    assert decode(model, shape, SamplerConfig(1.5, min_p=1 - 1e-12), seed=2) == greedy
    sampled = decode(model, shape, SamplerConfig(1.5), seed=2)
    assert decode(model, shape, SamplerConfig(1.5, min_p=1e-300), seed=2) == sampled


# --------------------------------------------------------------------------- the CLI


def _tokens(app, pair, *flags):
    args = ("generate", *model_args(pair), "-p", "Hi there", "-n", 6, *flags)
    return run_json(app, *args)["tokens"]


def test_cli_top_k_past_int32_and_tiny_settings(app, pair):
    """``generate --temp 1 --top-k 3000000000`` printed ``std::bad_cast``; tiny settings
    printed garbage."""
    assert _tokens(app, pair, "--temp", 1, "--top-k", HUGE_K, "--seed", 4) == _tokens(
        app, pair, "--temp", 1, "--seed", 4
    )
    greedy = _tokens(app, pair, "--temp", 0)
    for flags in (["--temp", "1e-38"], ["--temp", "1e-40"], ["--temp", "1", "--top-p", "1e-300"]):
        assert _tokens(app, pair, *flags, "--seed", 4) == greedy, flags


def test_cli_refuses_an_absurd_temperature_naming_the_flag(app, pair):
    result = invoke(app, "generate", *model_args(pair), "-p", "Hi", "-n", 2, "--temp", "1e7")
    assert result.exit_code == 2, result.output
    assert "--temp" in result.output and "Traceback" not in result.output


# --------------------------------------------------------------------------- the server


def _solo(model, drafter, shape, prompt, sampler):
    out, _ = run_decode(
        model, drafter, [prompt], max_tokens=16, sampler=sampler, seed=sampler.seed,
        shape=shape, adapt=False,
    )  # fmt: skip
    return out[0]


@pytest.mark.parametrize("shape", [BeamShape(2, 3), None], ids=str)
def test_server_rows_with_limit_settings_equal_the_api(model, shape):
    """Rows at the limits in one batch each equal the API's run alone (before: the top_k row
    failed every row; the 1e-300 row's first token went through another path)."""
    drafter = tiny_drafter(model) if shape is not None else None
    prompts = [[1, 5, 9, 2, 7], [1, 3, 3, 8], [2, 4, 6], [1, 1, 2, 3, 5, 8]]
    rows = [
        SamplerConfig(1.0, top_k=HUGE_K, seed=11),
        SamplerConfig(1e-300, seed=12),
        SamplerConfig(1.3, top_p=1e-300, seed=13),
        SamplerConfig(0.0),
    ]
    sched = Scheduler(model, drafter, shape, (), max_batch=4)
    sinks = staggered(sched, prompts, [16] * len(prompts), rows, turn=False)
    for prompt, sampler, sink in zip(prompts, rows, sinks):
        assert sink.last.error is None, sink.last.error
        alone = _solo(model, drafter, shape or BeamShape(1, 1), prompt, sampler)
        assert sink.tokens == alone, sampler
    greedy = _solo(model, drafter, shape or BeamShape(1, 1), prompts[1], SamplerConfig())
    assert sinks[1].tokens == greedy


def test_server_a_row_whose_settings_fail_fails_alone(model, monkeypatch):
    """An error building one row's settings (at its admission) answers that request with a
    500; the other three rows run on and equal their solo runs."""
    shape = BeamShape(2, 3)
    drafter = tiny_drafter(model)
    real = prompts_module.one_row

    def one_row_failing(cfg, vocab_size):
        if cfg is not None and cfg.top_k == 7:
            raise RuntimeError("std::bad_cast")
        return real(cfg, vocab_size)

    monkeypatch.setattr(prompts_module, "one_row", one_row_failing)
    prompts = [[1, 5, 9, 2, 7], [1, 3, 3, 8], [2, 4, 6], [1, 1, 2, 3, 5, 8]]
    rows = [
        SamplerConfig(0.0),
        SamplerConfig(1.0, top_k=7, seed=3),
        SamplerConfig(1.0, seed=4),
        SamplerConfig(0.0),
    ]
    sched = Scheduler(model, drafter, shape, (), max_batch=4)
    sinks = staggered(sched, prompts, [16] * len(prompts), rows, turn=False)
    assert sinks[1].last.error and sinks[1].last.status == 500 and not sinks[1].tokens
    for i in (0, 2, 3):
        assert sinks[i].last.error is None, sinks[i].last.error
        assert sinks[i].tokens == _solo(model, drafter, shape, prompts[i], rows[i])


@pytest.fixture(scope="module")
def server():
    tree._chain_mask.cache_clear()  # as test_serve_hostile's: no array cached by another thread
    s = Server()
    yield s
    s.close()
    tree._chain_mask.cache_clear()


def test_http_four_concurrent_requests_one_with_a_huge_top_k(server):
    """The issue's run: 4 concurrent greedy requests, one sampling with top_k 3e9; before,
    3 of the 4 got ``500 engine error: RuntimeError: std::bad_cast``."""
    body = dict(model="tiny", kind="completions", max_tokens=12, stream=True)
    greedy = [dict(body, prompt=p, temperature=0) for p in ("alpha beta", "gamma", "delta eta")]
    huge = dict(body, prompt="alpha", temperature=1.0, top_k=HUGE_K, seed=9)
    plain = dict(huge, top_k=0)

    async def main():
        async with httpx.AsyncClient(timeout=60) as client:
            alone = [await stream(client, server.url, b) for b in (*greedy, plain)]
            jobs = (stream(client, server.url, b) for b in (*greedy, huge))
            return alone, list(await asyncio.gather(*jobs))

    alone, together = asyncio.run(main())
    assert all(status == 200 for status, _, _ in together), together
    assert together == alone


def test_http_tiny_settings_are_greedy(server):
    """Before: the server and the API disagreed at temperature 1e-300 (the first token went
    through another path); now both are greedy, as is a top_p of 1e-300."""
    body = dict(model="tiny", prompt="alpha beta gamma", max_tokens=16)

    def text(**fields):
        r = httpx.post(server.url + "/v1/completions", json={**body, **fields}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.5, seed=2) != greedy
    assert text(temperature=1e-300, seed=2) == greedy
    assert text(temperature=1.5, top_p=1e-300, seed=2) == greedy
    r = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": {"3": 1e7}})
    assert r.status_code == 400 and "logit_bias" in r.text
