"""An early-exit adapter paired with a tiny target (``make_pair``, ``prefill``), and the demo model
and run settings its training tests use."""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitArgs,
)
from redrafter_mlx.engine.drafting.early_exit_chain import (
    adapter_write,
)
from tests.support.models import _randomize, tiny_model
from tests.support.paths import ROOT

SLOTS = 32


LAYERS = 3


EXIT = 2


def make_pair(seed=0, **kw):
    model = tiny_model(seed=seed, layers=LAYERS, **kw)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, EXIT))
    _randomize(adapter, seed + 7, 1.0)
    return model, adapter


def prefill(model, adapter, prompts: list[list[int]]):
    """Right-padded batch prefill of the target and the adapter caches; returns lengths and
    the caches (init tokens are the prompts' last tokens, so the prompt minus it is cached)."""
    B, T = len(prompts), max(len(p) for p in prompts) - 1
    H = model.hidden_size
    body = [p[:-1] + [0] * (T - len(p) + 1) for p in prompts]
    tokens = mx.array(body, dtype=mx.int32)
    lengths = mx.zeros((B,), dtype=mx.int32)
    idx = mx.broadcast_to(mx.arange(T, dtype=mx.int32)[None], (B, T))
    mask = cache_mask(lengths, chain_mask(T), SLOTS)
    cache = model.make_cache(B, SLOTS)
    model.capture_features([EXIT])
    try:
        hidden, cache = model(tokens, idx, mask, cache, idx)
    finally:
        model.capture_features([])
    own = adapter.make_cache(B, SLOTS)
    _, own = adapter_write(adapter, hidden[..., H:], lengths, own, SLOTS)
    counts = mx.array([len(p) - 1 for p in prompts], dtype=mx.int32)
    init = mx.array([p[-1] for p in prompts], dtype=mx.int32)
    return init, counts, cache, own


DEMO = ROOT / "redrafter_mlx" / "demo_model" / "base"


RUN = dict(batch_size=128, seq_len=64, lr=1e-3, quiet=True, save_every=3)
