"""The KV-cache session and the rules of the generation loop.

A :class:`Session` holds the KV cache of B rows across calls, with the token ids each row
holds, so a chat turn prefills only its new tokens. The cache is preallocated per layer as
(B, n_kv_heads, slots, head_dim) and grown rarely, by whole quanta of ``SLOT_QUANTUM`` slots
(docs/design/kv-cache.md).

The loop over it (``batch.BatchGenerator``, which generation and the server drive) and its
clients take three rules from here: how many tokens a row may emit (:func:`token_limit`),
where its output stops exactly (:func:`stop_at`: no token after EOS or beyond the limit,
even inside an accepted run), and how far attention reaches for a queued step
(:func:`step_window`).

A session is used by one thread and one generation at a time (:meth:`Session.claim`): MLX
binds arrays to the creating thread's streams, and a decode loop owns the cache until it ends.
"""

from __future__ import annotations

import threading
from collections.abc import Container, Sequence

import mlx.core as mx

from ..base.errors import RedrafterError
from ..drafting.sources import grow_states, padded_chunks
from ..verifier.entries import cache_slots, dtype_of, grown
from ..verifier.protocol import Verifier
from .decode import DecodeState, prefill_chunk

SLOT_QUANTUM = 256


def bucket(n: int, quantum: int = SLOT_QUANTUM) -> int:
    """Round up to whole ``quantum`` slots (cache sizes and attention windows)."""
    return -(-n // quantum) * quantum


def ensure_slots(state: DecodeState, needed: int) -> DecodeState:
    """``state`` with at least ``needed`` cache slots (grown, rarely, by whole quanta)."""
    if needed > cache_slots(state.cache):
        slots = bucket(needed)
        state = state._replace(
            cache=grown(state.cache, slots),
            history=None if state.history is None else grown_history(state.history, slots),
            sources=grow_states(state.sources, slots),
        )
    return state


def grown_history(history: mx.array, slots: int) -> mx.array:
    """The (B, S) token history zero-extended to ``slots`` (a rare copy)."""
    pad = slots - history.shape[1]
    if pad <= 0:
        return history
    return mx.concatenate([history, mx.zeros((history.shape[0], pad), history.dtype)], axis=1)


def text_history(rows: list[list[int]], slots: int) -> mx.array:
    """Each row's token ids in a (B, slots) array, zero-padded: the lookup's history."""
    return mx.array([r + [0] * (slots - len(r)) for r in rows], dtype=mx.int32)


def step_window(longest: int, inflight: int, per_step: int, slots: int) -> int:
    """The attention window of a step queued now: a bucket above every row's possible length.

    ``longest``: the longest row as last read; ``inflight`` steps already queued may each add
    up to ``per_step`` tokens to it, and the new step writes ``slots`` slots past it.
    """
    return bucket(longest + inflight * per_step + slots)


def token_limit(model: Verifier, prompt_len: int, max_tokens: int) -> tuple[int, str]:
    """(most tokens a row may emit, why it stops there): ``max_tokens`` (``"length"``) or
    what is left of the model's context (``"context"``)."""
    room = (model.max_context or 1 << 30) - prompt_len
    return min(max_tokens, room), "length" if max_tokens <= room else "context"


def stop_at(
    tokens: Sequence[int], eos: Container[int], room: int, at_limit: str = "length"
) -> tuple[list[int], str | None]:
    """The tokens of one row's step that are emitted, and why the row finished (or None).

    Stops exactly: at EOS (``"stop"``, the EOS token itself is not emitted) or once ``room``
    more tokens are emitted (``at_limit``), even when the step accepted more.
    """
    new = []
    for t in tokens:
        if t in eos:
            return new, "stop"
        new.append(t)
        if len(new) >= room:
            return new, at_limit
    return new, None


class SessionInUse(RedrafterError, RuntimeError):
    """A :class:`Session` used from another thread than its own, or by a second generation
    while one holds its cache; the message says which and how to fix it. The refused call
    changes nothing: the session stays usable by its thread and its generation."""


class Session:
    """KV cache for B rows plus, per row, the token ids it holds (for prefix reuse).

    ``cached[r]`` are exactly the tokens whose K/V occupy row r's slots [0, len(cached[r])).
    A decode loop owns the cache while it runs (``cache`` is None until it hands it back);
    only the thread that created the session may use it (:meth:`claim`). The cache is the
    model's entries (``verifier.entries``).
    """

    def __init__(self, model: Verifier, batch: int = 1):
        self.model = model
        self.batch = batch
        self.thread = threading.get_ident()  # MLX streams (and so these arrays) are per thread
        self.cache = model.make_cache(batch, SLOT_QUANTUM)
        self.lengths = mx.zeros((batch,), dtype=mx.int32)
        self.cached: list[list[int]] = [[] for _ in range(batch)]

    @property
    def slots(self) -> int:
        return cache_slots(self.cache)

    def ensure_slots(self, needed: int) -> None:
        """Grow the cache (rarely: by whole quanta) so that ``needed`` slots exist."""
        if needed > self.slots:
            self.cache = grown(self.cache, bucket(needed))

    @property
    def in_use(self) -> bool:
        """Whether a decode loop holds the cache (it has not handed it back yet)."""
        return self.cache is None

    def claim(self) -> None:
        """Refuse (:class:`SessionInUse`) use from another thread or while a generation holds
        the cache: MLX arrays live on their thread's streams (using them elsewhere fails, or
        crashes the process), and two loops on one cache would overwrite each other."""
        here = threading.get_ident()
        if here != self.thread:
            raise SessionInUse(
                f"this Session was created on thread {self.thread} and is used from thread "
                f"{here}; MLX arrays belong to the thread that made them: create the Session on "
                "the thread that generates with it (one Session per thread)"
            )
        if self.in_use:
            raise SessionInUse(
                "this Session's cache is held by a generation that has not finished (a "
                "stream_generate/decode generator still open); exhaust or close() that "
                "generator first, or give each concurrent generation its own Session"
            )

    def reuse(self, prompts: list[list[int]]) -> list[list[int]]:
        """Keep each row's longest cached prefix of its prompt; return the tokens to prefill.

        At least one prompt token is always prefilled (its hidden state starts decoding).
        A model with recurrent layers keeps a prefix only when it is the whole cached text:
        their state cannot be rewound to a shorter one.
        Starts a generation's use of the session: :meth:`claim` first.
        """
        self.claim()
        keep = []
        rewinds = not getattr(self.model, "recurrent", False)
        for cached, prompt in zip(self.cached, prompts):
            n = 0
            limit = min(len(cached), len(prompt) - 1)
            while n < limit and cached[n] == prompt[n]:
                n += 1
            if not rewinds and n < len(cached):  # a recurrent state holds all it took in
                n = 0
            keep.append(n)
        self.lengths = mx.array(keep, dtype=mx.int32)
        self.cached = [p[:n] for p, n in zip(prompts, keep)]
        return [p[n:] for p, n in zip(prompts, keep)]

    def reset(self) -> None:
        self.lengths = mx.zeros((self.batch,), dtype=mx.int32)
        self.cached = [[] for _ in range(self.batch)]


def prefill_session(
    session: Session,
    new_tokens: list[list[int]],
    quantum: int = SLOT_QUANTUM,
    sync: bool = True,
):
    """Run each row's new prompt tokens; returns the hidden state at each row's last one.

    Each chunk attends to the cache's first slots rounded up to ``quantum`` (a finer one
    attends over fewer empty slots; the cache still grows by whole ``SLOT_QUANTUM`` quanta).
    ``sync=False`` leaves the chunks' graph to be evaluated with whatever reads it (a caller
    that queues other work meanwhile: ``selfgen``'s lanes), instead of one by one here.
    """
    session.claim()
    model = session.model
    B = session.batch
    known = [len(c) for c in session.cached]  # exact row lengths before each chunk
    h_last = mx.zeros((B, model.state_width), dtype=dtype_of(session.cache))
    for chunk, tokens, counts in padded_chunks(new_tokens):
        T = tokens.shape[1]
        window = bucket(max(known) + T, quantum)
        session.ensure_slots(window)
        h, lengths, session.cache = prefill_chunk(
            model, tokens, counts, session.lengths, session.cache, window
        )
        known = [k + len(c) for k, c in zip(known, chunk)]
        h_last = mx.where((counts > 0)[:, None], h, h_last)
        session.lengths = lengths
        if sync:  # per chunk, not per step
            mx.eval(h_last, session.lengths, session.cache)
    return h_last
