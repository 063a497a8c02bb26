"""Batched decoding: rows that join and leave a batch, each with its own sampling settings,
penalties, logit bias and seed (the engine's analogue of mlx-lm's ``BatchGenerator``).

``BatchDecoder`` holds the decode state of B rows and owns everything between "a prefilled
sequence joins" and "its tokens come out, stopped exactly": placing a row (its K/V, hidden
state, init token and key written into a free row), growing and shrinking the batch (a
re-lay of the cache over one of a few row counts, rare), the queue-then-read pipeline
(``queue`` a step with ``mx.async_eval``, ``read`` an older one that is computed), exact
stopping at EOS or a row's limit (``cache.stop_at``), each row's statistics, and the
adaptive shape choice's feedback (``batch_choice.BatchChoice``). The server's scheduler is
its client: it keeps the requests, their events and the broadcast to other ranks.

The step is compiled for a fixed B (one of the row buckets), and nothing about the rows is a
compile key: per-row settings travel as arrays:

    active      (B,) bool     free rows compute but never advance their cache length
    rows        each row's sampling settings (``engine.sampling.RowSettings``: temperature,
                top-p, top-k, min-p, penalties, logit bias), built by ``row_settings``
    row_keys    (B, 2) uint32 one PRNG key per row, split once per step like a solo run's

A row's draws therefore equal the same request decoded alone (same key sequence, same
per-row math); see ``engine.sampling.draw_rows``. Static switches (``StepMode``) only pick
how much sampling machinery the batch needs: argmax only, or Gumbel with the filters some
row uses, and whether any row has a logit bias or a penalty (with the history span its
windows need).
"""

from __future__ import annotations

import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .adaptive import Adaptive, rank0_shape
from .batch_choice import BatchChoice
from .cache import (
    PREFILL_CHUNK,
    SLOT_QUANTUM,
    Session,
    ensure_slots,
    prefill_session,
    step_window,
    stop_at,
    text_history,
)
from .decode import DecodeState, StepOutput, autoregressive_step, first_draw, redrafter_step
from .draft_model import prefill as draft_prefill
from .lookup import LookupShadow
from .sampling import RowSampler, RowSettings, SamplerConfig, StepMode, row_settings
from .shape import AR, BeamShape
from .sources import LOOKUP, SOURCE_NAMES, by_source, map_states


def split_row_keys(row_keys: mx.array) -> tuple[mx.array, mx.array]:
    """Split each row's key as a solo run splits its one key: (B, 2) -> next (B, 2), draw (B, 2)."""
    both = mx.vmap(mx.random.split)(row_keys)  # (B, 2, 2)
    return both[:, 0], both[:, 1]


def make_batch_step(model, drafter, shape, mode: StepMode, compiled: bool = True, draft=None):
    """A step ``(state, row_keys, active, rows, window) -> (state, row_keys, StepOutput)``;
    ``active`` (B,) bool, ``rows`` the batch's ``RowSettings``.

    ``shape=None`` decodes autoregressively; a shape without drafter beams speculates from
    lookup chains alone (they read ``state.history``). ``state.rng`` is unused
    (rows draw with ``row_keys``) and passes through. Compile keys: B, cache slots, window.
    ``draft``: a draft model for the shape's ``D1×L`` chain (its cache in ``state.sources``).
    """

    def step(
        init_token,
        hidden,
        lengths,
        keys,
        values,
        rng,
        history,
        sources,
        row_keys,
        active,
        rows,
        window,
    ):
        counter["traces"] += 1
        draw_keys = row_keys  # unused by an all-greedy batch: its keys need not advance
        if mode.sample:
            row_keys, draw_keys = split_row_keys(row_keys)
        sampler = RowSampler(RowSettings(*rows), draw_keys, mode)
        state = DecodeState(init_token, hidden, lengths, keys, values, rng, history, sources)
        if shape is None:
            nxt, out = autoregressive_step(model, state, sampler, window)
        else:
            nxt, out = redrafter_step(
                model, drafter if shape.drafts else None, state, shape, sampler, window, draft
            )
        held = mx.where(active, nxt.lengths, 0)  # free rows stay empty
        nxt = nxt._replace(lengths=held, rng=rng)
        return (*nxt, row_keys, *out)

    counter = {"traces": 0}
    weights = [m.state for m in (model, drafter, draft) if isinstance(m, nn.Module)]
    fn = mx.compile(step, inputs=weights) if compiled else step

    def run(state: DecodeState, row_keys: mx.array, active, rows: RowSettings, window: int):
        out = fn(*state, row_keys, active, tuple(rows), window)
        fields = len(DecodeState._fields)
        return DecodeState(*out[:fields]), out[fields], StepOutput(*out[fields + 1 :])

    run.counter = counter  # tracings (each is a compile)
    return run


MAX_BATCH_STEPS = 16  # per model: shapes x sampling modes x drafters


def batch_step(
    model, drafter, shape: BeamShape | None, mode: StepMode, compiled: bool = True, draft=None
):
    """The compiled batch step of this configuration, kept on the model (compiled once for
    every loop over it: each chat turn, each request batch)."""
    cache = model.__dict__.setdefault("_batch_steps", {})
    key = (id(drafter), id(draft), shape, mode, compiled, getattr(model, "feature_layers", ()))
    if key not in cache:
        while len(cache) >= MAX_BATCH_STEPS:  # drop the oldest (and the drafter it holds)
            cache.pop(next(iter(cache)))
        cache[key] = make_batch_step(model, drafter, shape, mode, compiled, draft)
    return cache[key]


# --------------------------------------------------------------------------- rows


@dataclass
class RowStats:
    """One row's counters; ``tokens_per_step`` counts tokens each step emitted."""

    prompt_tokens: int
    generated: int = 0
    steps: int = 0
    emitted_by_steps: int = 0
    accepted_drafts: int = 0
    lookup_drafts: int = 0  # accepted drafts that came from a context-lookup chain
    by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))
    drafted: int = 0  # draft tokens its steps could accept (a shape's longest candidate, less 1)
    queued_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_by_steps / max(self.steps, 1)

    def record(self, count: int, by_source: list[int], shape: BeamShape | None) -> None:
        """A step gave this row ``count`` tokens (accepted drafts + the bonus), its accepted
        drafts ``by_source`` (one count per ``SOURCE_NAMES``)."""
        self.steps += 1
        self.emitted_by_steps += count
        self.accepted_drafts += count - 1
        self.by_source = [a + b for a, b in zip(self.by_source, by_source)]
        self.lookup_drafts = self.by_source[LOOKUP]
        self.drafted += shape.longest - 1 if shape else 0

    def to_dict(self) -> dict:
        """JSON-ready speculation stats; ``acceptance_rate`` = accepted / drafted tokens."""
        drafted = self.drafted
        return dict(
            steps=self.steps,
            tokens_per_step=round(self.tokens_per_step, 4),
            accepted_draft_tokens=self.accepted_drafts,
            **{f"accepted_from_{name}": n for name, n in zip(SOURCE_NAMES, self.by_source)},
            acceptance_rate=round(self.accepted_drafts / drafted, 4) if drafted else 0.0,
            generation_tps=round(self.generated / max(self.decode_s, 1e-9), 2),
            time_to_first_token=round(self.ttft_s, 4),
            queue_s=round(self.queued_s, 4),
        )


@dataclass
class Row:
    """A sequence in a batch row. ``length``: its exact cache length as last read; ``limit``:
    the most tokens it may emit, ``at_limit`` why (``"length"`` / ``"context"``);
    ``owner``: the client's handle (the scheduler's request record)."""

    sampler: SamplerConfig
    limit: int
    length: int
    stats: RowStats
    owner: Any = None
    at_limit: str = "length"
    joined: float = field(default_factory=time.perf_counter)
    slot: int = 0
    out: int = 0
    finished: bool = False
    finish: str | None = None  # why it finished: "stop" (EOS), "length" or "context"
    shadow: LookupShadow | None = None  # what lookup would have given it (adaptive shapes)


@dataclass
class Prefill:
    """A prompt prefilled alone in a one-row cache, one chunk at a time, before it joins a
    batch (``BatchDecoder.join``); ``seed``: its draws' seed; ``owner``: the client's handle."""

    prompt: list[int]
    sampler: SamplerConfig
    seed: int
    session: Session
    owner: Any = None
    started: float = field(default_factory=time.perf_counter)
    done: int = 0  # prompt tokens prefilled so far
    hidden: mx.array | None = None  # (1, H) at the last prefilled token

    def advance(self) -> int:
        """Prefill the next chunk; returns its token count.

        Chunk by chunk through the engine's own prefill, with the session's cached tokens
        kept current, this computes exactly what one solo prefill of the prompt computes.
        """
        chunk = self.prompt[self.done : self.done + PREFILL_CHUNK]
        self.hidden = prefill_session(self.session, [chunk])
        self.done += len(chunk)
        self.session.cached = [self.prompt[: self.done]]
        return len(chunk)

    @property
    def complete(self) -> bool:
        return self.done == len(self.prompt)

    def first_token(self, model) -> tuple[int, mx.array]:
        """The first token, drawn now with the prompt's own key (so that an error in its own
        prefill or draw surfaces here, not in a batched step), and its next key (2,)."""
        rng, first_key = mx.random.split(mx.random.key(self.seed))
        prompt, sampler = self.prompt, self.sampler
        history = text_history([prompt], len(prompt)) if sampler.reads_text else None
        lengths = mx.array([len(prompt)], mx.int32)
        first = first_draw(model, self.hidden, sampler, first_key, history, lengths)
        return first.item(), rng


class RowStep(NamedTuple):
    """What one step gave one row: the tokens it emits (``new``, exact stop), why it finished
    (None: it goes on), and the step's own count (accepted drafts + bonus), accepted
    drafts from a lookup chain, tree slots used and accepted drafts per source."""

    row: Row
    new: list[int]
    finish: str | None
    count: int
    looked_up: int
    packed: int
    by_source: tuple[int, ...] = ()


@dataclass
class Queued:
    """A queued step: its output, the rows it ran (by index when queued: as many as the
    batch had), its shape (None: plain decoding), and when it was queued (None: not a step
    time, e.g. it compiled)."""

    out: StepOutput
    owners: tuple[Row | None, ...]
    shape: BeamShape | None
    started: float | None


def row_buckets(max_batch: int) -> list[int]:
    """Batch sizes the step is compiled for: 1, 2, 4, ... below ``max_batch``, then it."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes + ([max_batch] if max_batch > 1 else [])


class BatchDecoder:
    """Decode state over up to ``max_batch`` rows that join and leave between steps.

    ``shape``: the asked beam shape (None: plain decoding); ``adapt``: choose each step's
    shape among its candidates (``BatchChoice``); ``eos``: the token ids that end a row;
    ``group``: the ranks of a split model (rank 0 names each step's shape).
    """

    def __init__(
        self,
        model,
        drafter,
        shape: BeamShape | None,
        eos: Container[int] = (),
        max_batch: int = 8,
        compiled: bool = True,
        group=None,
        adapt: Adaptive | bool = False,
        choice=None,
        release: bool = True,
        draft=None,
    ):
        self.model, self.drafter, self.draft = model, drafter, draft
        self.shape = shape
        self.eos = eos
        self.max_batch = max_batch
        self.buckets = row_buckets(max_batch)
        self.compiled = compiled
        self.group = group
        self.leader = group is None or group.rank() == 0
        self.per_step = 1 if shape is None else shape.longest  # most tokens a step adds
        self.width = 1 if shape is None else shape.slots  # slots a step writes past a row
        # The shape choice: ``choice`` (its interface is BatchChoice's; ``decode`` passes its
        # ``adaptive.StepPlan``), else adaptive (``BatchChoice``) or None (one shape).
        self.choice = choice
        if choice is None and adapt and shape is not None:
            self.choice = BatchChoice(shape, adapt if isinstance(adapt, Adaptive) else Adaptive())
        if self.choice is not None:
            self.per_step, self.width = self.choice.per_step, self.choice.slots
        self.pin_seeded = choice is None  # a seeded sampled row runs the asked shape
        self.release = release  # a finished row leaves its slot (else it stays, emitting nothing)
        self._traced: set = set()  # (shape, mode, rows, window, slots) of steps already run
        self.host_s = 0.0  # time spent queueing steps (dispatch)
        self.resizes = 0  # re-lays of the cache (grow or shrink)
        self.state = None  # built by ``reset`` on the thread that runs the loop (MLX streams)
        self.rows: list[Row | None] = [None]

    # ------------------------------------------------------------------ state

    def reset(self) -> None:
        """Fresh state: every row free, an empty cache (also after a failure)."""
        B, model = self.buckets[0], self.model
        keys, values = model.make_cache(B, SLOT_QUANTUM)
        dtype = keys[0].dtype
        self.state = DecodeState(
            mx.zeros((B,), mx.int32),
            mx.zeros((B, model.state_width), dtype),
            mx.zeros((B,), mx.int32),
            keys,
            values,
            mx.random.key(0),  # unused: rows draw with row_keys
            mx.zeros((B, SLOT_QUANTUM), mx.int32),  # the text: lookup and penalties read it
            self._empty_sources(B),
        )
        self.row_keys = mx.zeros((B, 2), mx.uint32)
        self.rows: list[Row | None] = [None] * B
        self.inflight = 0
        self._params = None
        if self.choice is not None:
            self.choice.reset()

    def _empty_sources(self, B: int) -> tuple:
        """The stateful draft sources' empty states (a draft model's cache) for B rows."""
        if self.draft is None:
            return ()
        return (self.draft.make_cache(B, SLOT_QUANTUM),)

    @property
    def active(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def settle(self, step: Queued | None) -> None:
        """Wait for a step still in flight (queued, never read)."""
        if step is not None:
            mx.eval(step.out, self.state, self.row_keys)

    def adopt(self, state: DecodeState, row_keys: mx.array, rows: list[Row]) -> None:
        """Start from a state that already holds ``rows`` (a session prefilled together, its
        first tokens drawn: ``decode``), row ``r`` in slot ``r``."""
        self.state, self.row_keys, self.rows = state, row_keys, list(rows)
        for r, row in enumerate(self.rows):
            row.slot = r
        self.inflight, self._params = 0, None

    # ------------------------------------------------------------------ rows joining

    def join(
        self, row: Row, session: Session, hidden: mx.array, first: int, rng: mx.array
    ) -> list[int]:
        """Place a prefilled one-row ``session`` (its hidden state (1, H) at the last prompt
        token, its first token drawn, its next key ``rng`` (2,)) into a free row, growing
        the batch when none is free. Returns the first token's emitted part."""
        if None not in self.rows:
            self.resize(self.bucket_for(len(self.rows) + 1))
        r = self.rows.index(None)
        prompt = session.cached[0]
        if self.choice is not None:
            row.shadow = self.choice.shadow([*prompt, first])
        self._place(r, session, hidden, mx.array([first], mx.int32), rng)
        row.slot = r
        self.rows[r] = row
        self._params = None
        return self.emit(row, [first])

    def _place(self, r: int, session: Session, hidden, first, rng) -> None:
        """Write a prefilled one-row session into batch row ``r`` (lazy array updates)."""
        self.state = ensure_slots(self.state, session.slots)
        at = mx.arange(len(self.rows)) == r  # (B,)
        for cache, row_cache in (
            (self.state.keys, session.keys),
            (self.state.values, session.values),
        ):
            for layer, src in enumerate(row_cache):
                cache[layer][r : r + 1, :, : src.shape[2]] = src
        s = self.state
        history = s.history
        if history is not None:  # the row's text so far: its prompt, all in the cache
            text = text_history(session.cached, history.shape[1])
            history = mx.where(at[:, None], text, history)
        if s.sources:  # the draft model's cache of the row's prompt
            if self.draft is self.model:  # its own draft: the same K/V as its prefill
                dk, dv = session.keys, session.values
            else:
                dk, dv = draft_prefill(self.draft, session.cached, s.keys[0].shape[2])
            for cache, row_cache in ((s.sources[0][0], dk), (s.sources[0][1], dv)):
                for layer, src in enumerate(row_cache):
                    cache[layer][r : r + 1, :, : src.shape[2]] = src
        self.state = s._replace(
            init_token=mx.where(at, first, s.init_token),
            hidden=mx.where(at[:, None], hidden, s.hidden),
            lengths=mx.where(at, session.lengths, s.lengths),
            history=history,
        )
        self.row_keys = mx.where(at[:, None], rng[None], self.row_keys)

    # ------------------------------------------------------------------ rows leaving

    def leave(self, row: Row) -> None:
        """Free ``row``'s slot: it stops emitting now and its cache length returns to 0
        (without ``release`` it keeps its slot and cache, emitting nothing)."""
        r = row.slot
        row.finished = True
        if self.rows[r] is not row or not self.release:
            return
        self.rows[r] = None
        self._params = None
        at = mx.arange(len(self.rows)) == r
        self.state = self.state._replace(lengths=mx.where(at, 0, self.state.lengths))

    def emit(self, row: Row, tokens: list[int]) -> tuple[list[int], str | None]:
        """The part of ``tokens`` the row emits, up to EOS / its limit, and why it finished
        (None: it goes on); a finished row leaves its slot."""
        new, finish = stop_at(tokens, self.eos, row.limit - row.out, row.at_limit)
        row.out += len(new)
        row.stats.generated += len(new)
        row.stats.decode_s = time.perf_counter() - row.joined
        if finish is not None:
            row.finish = finish
            self.leave(row)
        return new, finish

    # ------------------------------------------------------------------ batch size

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def fit(self) -> None:
        """Shrink the batch once at most a quarter of its rows are in use (hysteresis)."""
        n, active = len(self.rows), len(self.active)
        if n > 1 and active <= n // 4:
            self.resize(self.bucket_for(max(active, 1)))

    def resize(self, n: int) -> None:
        """Re-lay the batch over ``n`` rows, active rows first (a copy of the cache; rare).

        Growing appends free rows; shrinking keeps the active rows in order. Rows are
        independent, so moving one changes none of its values.
        """
        rows = self.rows
        self.resizes += 1
        if n > len(rows):
            order, extra = list(range(len(rows))), n - len(rows)
        else:
            used = [i for i, row in enumerate(rows) if row is not None]
            order = (used + [i for i, row in enumerate(rows) if row is None])[:n]
            extra = 0
        idx = mx.array(order, dtype=mx.int32)

        def pick(a):  # (len(rows), ...) -> (n, ...)
            if extra:
                return mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])
            return a[idx]

        s = self.state
        self.state = s._replace(
            init_token=pick(s.init_token),
            hidden=pick(s.hidden),
            lengths=pick(s.lengths),
            keys=[pick(k) for k in s.keys],
            values=[pick(v) for v in s.values],
            history=None if s.history is None else pick(s.history),
            sources=map_states(s.sources, pick),
        )
        self.row_keys = pick(self.row_keys)
        self.rows = [rows[i] for i in order] + [None] * extra
        for i, row in enumerate(self.rows):
            if row is not None:
                row.slot = i
        self._params = None

    # ------------------------------------------------------------------ stepping

    def _row_params(self):
        """(StepMode, active (B,), RowSettings): rebuilt only after rows join or leave."""
        if self._params is None:
            configs = [r.sampler if r is not None else None for r in self.rows]
            mode, settings = row_settings(configs, self.model.vocab_size)
            active = mx.array([r is not None for r in self.rows])
            self._params = (mode, active, settings)
        return self._params

    def _step_fn(self, shape: BeamShape | None, mode: StepMode):
        drafter = self.drafter if shape else None
        return batch_step(self.model, drafter, shape, mode, self.compiled, self.draft)

    def next_shape(self) -> BeamShape | None:
        """The shape of the step queued now: the fixed one; with adaptive shapes, the
        choice for this batch's size and its rows' match states, or the asked shape while
        a row samples with its own seed (its draws follow the shape of every step, so it
        runs what ``generate --seed`` runs). Split across ranks, rank 0's choice."""
        if self.choice is None:
            return self.shape
        shape = None
        if self.leader:
            running = [row for row in self.active if not row.finished]
            seeded = [r for r in running if r.sampler.seed is not None and not r.sampler.greedy]
            matches = [row.shadow.match(0) if row.shadow else 0 for row in running]
            pinned = self.pin_seeded and bool(seeded)
            shape = self.shape if pinned else self.choice.next(len(self.rows), matches)
        if self.group is not None:
            shape = rank0_shape(shape, self.choice.shapes, self.group)
        return None if shape.is_autoregressive else shape

    def queue(self) -> Queued:
        """Queue one step for all rows; attention covers every active row's possible length."""
        longest = max(row.length for row in self.active)
        window = step_window(longest, self.inflight, self.per_step, self.width)
        self.state = ensure_slots(self.state, window)
        shape = self.next_shape()
        mode, active, rows = self._row_params()
        key = (shape, mode, len(self.rows), window, self.state.keys[0].shape[2])
        started = time.perf_counter() if key in self._traced else None  # else: it compiles
        self._traced.add(key)
        step = self._step_fn(shape, mode)
        state, self.state = self.state, None  # only the step's graph holds the cache
        host = time.perf_counter()
        try:
            state, self.row_keys, out = step(state, self.row_keys, active, rows, window)
            mx.async_eval(out, state, self.row_keys)
        finally:
            self.state = state
        self.host_s += time.perf_counter() - host
        self.inflight += 1
        return Queued(out, tuple(self.rows), shape, started)

    def read(self, step: Queued) -> list[RowStep]:
        """A computed step's tokens for the rows it ran that are still going: per row, the
        part emitted (exact stop) and why it finished (None: it goes on)."""
        out = step.out
        tokens, counts = out.tokens.tolist(), out.count.tolist()  # this step is computed
        sources = out.source.tolist() if out.source is not None else [None] * len(counts)
        by = [by_source(s, c - 1) for s, c in zip(sources, counts)]
        packed = out.packed.tolist()
        self.inflight -= 1
        seconds = None if step.started is None else time.perf_counter() - step.started
        ran, resolved, delivered = [], [], []
        for r, row in enumerate(step.owners):  # r: the row's index when the step was queued
            if row is None or row.finished:
                continue
            ran.append(counts[r])
            row.length += counts[r]
            row.stats.record(counts[r], by[r], step.shape)
            if row.shadow is not None:  # what a lookup chain would have given this step
                resolved += row.shadow.step(0, tokens[r][: counts[r]])
            new, finish = self.emit(row, tokens[r][: counts[r]])
            delivered.append(RowStep(row, new, finish, counts[r], by[r][LOOKUP], packed[r], by[r]))
            if row.finished and row.shadow is not None:
                resolved += row.shadow.finish(0)
        if self.choice is not None:
            self.choice.finished(len(step.owners), step.shape or AR, ran, seconds)
            self.choice.lookup_seen(resolved)
        return delivered
