"""Checks shared by the draft-head source tests (``engine/drafting/head_sources.py``)."""

from __future__ import annotations

import mlx.core as mx

from redrafter_mlx.engine.core.sampling import SamplerConfig, row_keys_of, row_settings
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.decode import DecodeState, prefill_chunk
from redrafter_mlx.engine.decoding.step import batch_step
from redrafter_mlx.engine.drafting.held import held_sources


def assert_state_follows_the_text(model, source, prompt, steps: int = 6, slots: int = 64):
    """Greedy steps of ``K1xL4+D1xL4`` with ``source`` in the draft slot, one row from
    ``prompt``: after each step (whichever source's path won) the head's state equals a
    from-scratch prefill of the committed text at every committed position but the last
    (the entry the next draft writes)."""
    model.capture_features(source.feature_layers)

    def committed(text):
        session = Session(model, 1)
        session.cached = [text]
        session.ensure_slots(slots)
        return source.prefill(model, session, slice(0, 1))

    zero = mx.zeros((1,), mx.int32)
    hidden, lengths, cache = prefill_chunk(
        model, mx.array([prompt]), zero + len(prompt), zero, model.make_cache(1, slots), slots
    )
    first = mx.argmax(model.logits(hidden), axis=-1).astype(mx.int32)
    history = mx.array([prompt + [0] * (slots - len(prompt))], mx.int32)
    state = DecodeState(first, hidden, lengths, cache, history, (committed(prompt),))
    mode, settings = row_settings([SamplerConfig()], model.vocab_size)
    step = batch_step(model, held_sources(None, source), BeamShape.parse("K1xL4+D1xL4"), mode)
    keys, active = row_keys_of(mx.random.key(0), 1), mx.ones((1,), mx.bool_)
    for _ in range(steps):
        state, _, _ = step(state, keys, active, settings, slots)
        n = int(state.lengths[0])
        want = committed(state.history[0, :n].tolist())
        for got, ref in zip(state.sources[0], want):
            for a, b in zip(got, ref):
                assert mx.allclose(a[:, :, : n - 1], b[:, :, : n - 1], atol=1e-4).item()
