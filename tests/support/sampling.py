"""Sampling exactness oracles: the exact joint distribution of the first tokens (with mlx-lm's
logit processors), sample counts and a chi-square p-value."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from mlx_lm.sample_utils import make_logits_processors

from redrafter_mlx.engine.core.sampling import (
    SamplerConfig,
    process_logits,
)
from redrafter_mlx.engine.decoding.decode import prefill_chunk
from tests.support.models import (
    run_decode,
)

PROMPT = [1, 3, 2]


DEPTH = 3


def next_probs(model, prefixes, cfg):
    """Processed next-token distribution after PROMPT + each prefix: (N, V) numpy."""
    seqs = mx.array([PROMPT + list(p) for p in prefixes], dtype=mx.int32)
    N, T = seqs.shape
    cache = model.make_cache(N, 256)
    zeros = mx.zeros((N,), dtype=mx.int32)
    h, _, _ = prefill_chunk(model, seqs, zeros + T, zeros, cache, 256)
    logits = model.logits(h)
    if cfg.reads_text or cfg.logit_bias:  # mlx-lm's processors over each prefix's own text
        logits = mx.array(
            np.stack(
                [mlx_lm_processed(row, PROMPT + list(p), cfg) for row, p in zip(logits, prefixes)]
            )
        )
    return np.array(mx.softmax(process_logits(logits, cfg), axis=-1))


def exact_joint(model, cfg):
    """{(t1, t2, t3): probability} for the first DEPTH generated tokens."""
    V = model.vocab_size
    joint = {(): 1.0}
    for _ in range(DEPTH):
        prefixes = list(joint)
        probs = next_probs(model, prefixes, cfg)
        joint = {
            p + (t,): joint[p] * probs[i, t]
            for i, p in enumerate(prefixes)
            for t in range(V)
            if probs[i, t] > 0
        }
    return joint


def chi_square_pvalue(counts: dict, expected: dict, n: int) -> float:
    """Pearson chi-square with cells of expected count < 5 pooled; Wilson–Hilferty p-value."""
    big = [c for c in expected if expected[c] * n >= 5]
    observed = [counts.get(c, 0) for c in big]
    exp = [expected[c] * n for c in big]
    rest_obs = n - sum(observed)
    rest_exp = n - sum(exp)
    assert all(c in expected for c in counts), "sampled a sequence of probability 0"
    if rest_exp >= 1:
        observed.append(rest_obs)
        exp.append(rest_exp)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, exp))
    k = len(exp) - 1
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def sample_counts(model, drafter, cfg, n, seed, **beam):
    out, stats = run_decode(
        model,
        drafter,
        [PROMPT] * n,
        max_tokens=DEPTH,
        seed=seed,
        sampler=cfg,
        **beam,
    )
    counts = {}
    for row in out:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    return counts, stats


def mlx_lm_processed(logits, text, cfg: SamplerConfig):
    """mlx-lm's processors over ``text`` (the tokens before the draw): (V,) -> (V,) numpy."""
    processors = make_logits_processors(
        dict(cfg.logit_bias),
        cfg.repetition_penalty,
        cfg.repetition_context_size,
        cfg.presence_penalty,
        cfg.repetition_context_size,
        cfg.frequency_penalty,
        cfg.repetition_context_size,
    )
    x = mx.array(logits)[None]
    tokens = mx.array(text, dtype=mx.int32)
    for p in processors:
        x = p(tokens, x)
    return np.array(x[0])


def lm_joint(model, cfg, prompt, depth: int = 2) -> dict:
    """{(t1, .., t_depth): probability} after ``prompt`` at ``cfg``'s temperature, from
    mlx-lm's own forward (``model.lm``): the oracle of a model the engine verifies through
    mlx-lm's class."""
    out = {(): 1.0}
    for _ in range(depth):
        grown = {}
        for prefix, p in out.items():
            logits = model.lm(mx.array([list(prompt) + list(prefix)]))[0, -1] / cfg.temperature
            for t, q in enumerate(mx.softmax(logits.astype(mx.float32)).tolist()):
                if q > 0:
                    grown[prefix + (t,)] = p * q
        out = grown
    return out
