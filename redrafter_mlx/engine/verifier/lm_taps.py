"""The taps ``lm_model.LmModel`` installs in mlx-lm's modules (docs/design/any-model.md).

A tap changes a module's class to a subclass with another ``__call__`` (``patched``), so its
parameters keep their names and every call outside the engine's forward is unchanged: the
layers' module gives the hidden state (``hidden_tap``), each layer its input and a
recurrent layer's call (``layer_tap``, which also ends an early exit), a learned position
embedding each token's own position (``position_tap``); ``fast_rope_at`` reaches a family
that calls ``mx.fast.rope`` with the cache's offset itself. The rope modules' tap is
``lm_rope.rope_tap``. Each reads the current call (``lm_cache.LmCall``) from ``_rd_owner``.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx
import mlx.nn as nn

from .lm_cache import LmCall, StateCache, path_layer
from .lm_rope import rope_rows


def patched(module: nn.Module, call_fn, tag: str) -> None:
    """Give ``module`` a ``__call__`` of ``call_fn(self, original, *args, **kwargs)``: its class
    becomes a subclass (one per class and tag), so its parameters keep their names."""
    base = type(module)
    cache = patched.classes
    key = (base, tag)
    if key not in cache:

        def __call__(self, *args, **kwargs):
            return call_fn(self, base.__call__, *args, **kwargs)

        cache[key] = type(f"{base.__name__}", (base,), {"__call__": __call__})
    module.__class__ = cache[key]


patched.classes = {}


def hidden_tap(self, original, *args, **kwargs):
    """The layers' module: its output is the engine's hidden state, or, while the head is
    read (``LmModel.logits``), the given hidden state stands in for it."""
    owner = self._rd_owner
    if owner.substitute is not None:
        return owner.substitute
    h = original(self, *args, **kwargs)
    if owner.call is not None:
        owner.call.hidden = h
    elif owner.probing:
        owner.last_hidden = h
    return h


class Exited(Exception):
    """Raised by the layer tap at an early exit (``LmModel.run_to``): no later layer runs."""


def layer_tap(self, original, *args, **kwargs):
    """Every layer: record its input when a drafter reads it, and a recurrent layer's whole
    call, which the commit runs again over the accepted tokens (``StateCommit``), and over a
    tree runs as one batch row per path (``path_layer``); at an early exit
    (``LmModel.run_to``), keep its input and stop the forward there. The input is the first
    argument, given by position or by name (GPT-J's ``block(inputs=h, ...)``)."""
    call = self._rd_owner.call
    if call is not None:
        x = args[0] if args else next(iter(kwargs.values()))
        if self._rd_index == call.stop:
            call.exit = x
            raise Exited
        if self._rd_index in call.model.feature_layers:
            call.features[self._rd_index] = x
        recurrent = False
        for value in (*args, *kwargs.values()):
            if isinstance(value, StateCache):
                call.recorded[value.index] = (self, args, kwargs)
                recurrent = True
        if recurrent and call.paths is not None:
            return path_layer(self, original, call, args, kwargs)
    return original(self, *args, **kwargs)


def position_tap(self, original, ids, *args, **kwargs):
    """A learned position embedding (GPT-2's ``wpe``): each token's own position instead of
    the ids a family computes from the cache offset (``offset + arange``, wrong in a tree)."""
    call = self._rd_owner.call
    if call is not None and ids.shape == call.positions.shape:
        ids = call.positions
    return original(self, ids, *args, **kwargs)


@contextlib.contextmanager
def fast_rope_at(call: LmCall):
    """While ``call`` runs, ``mx.fast.rope`` given the call's own offset object (a family
    that rotates by ``cache.offset`` itself, as nanochat and talkie do) rotates each token at
    its own position; every other call of it is unchanged."""
    original = mx.fast.rope

    def rope(x, *args, offset, **kwargs):
        if offset is not call.offset:
            return original(x, *args, offset=offset, **kwargs)
        rows = lambda r, off: original(r, *args, offset=off, **kwargs)
        return rope_rows(rows, x, call.positions)

    mx.fast.rope = rope
    try:
        yield
    finally:
        mx.fast.rope = original
