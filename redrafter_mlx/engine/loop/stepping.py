"""Generation, the loop's second part: each step's shape, the stateful sources' catch-up,
queueing a step (``queue``, with ``mx.async_eval``) and reading one that is computed
(``read``); the orchestrator (``batch.BatchGenerator.step``) chooses their order, as
``platform.read_first`` measured for the backend. Built alone over the batch's state
(``batch_state.BatchState``) and a shape policy."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import mlx.core as mx

from ..base.platform import read_first
from ..core.logprobs import rows_of
from ..core.sampling import StepMode
from ..core.shape import BeamShape
from ..decoding.cache import step_window
from ..decoding.decode import StepOutput
from ..decoding.step import batch_step
from ..drafting.held import sources_key
from ..drafting.sources import DraftContext, by_source, sized_sources, step_capacity
from ..verifier.entries import cache_slots
from .adaptive import rank0_shape
from .batch_choice import ShapePolicy
from .batch_state import BatchState
from .rows import Row


@dataclass
class Queued:
    """A queued step: its output, the rows it ran (by index when queued: as many as the
    batch had), its shape (None: plain decoding), and when it was queued (None: not a step
    time, e.g. it compiled)."""

    out: StepOutput
    owners: tuple[Row | None, ...]
    shape: BeamShape | None
    started: float | None
    grants: tuple[bool, ...] = ()  # per owner: whether it may fork in this step
    end: tuple = ()  # (init_token (B,), hidden (B, H), lengths (B,), row_keys (B, 2)) after it


@dataclass
class Read:
    """A computed step read on the host: per row it ran (by its index when queued), the
    tokens (lists), counts (accepted drafts + bonus), tree slots used and accepted drafts per
    source (``sources.by_source``); ``seconds``: since it was queued (None: it compiled);
    ``logprobs``: per row, its tokens' (logprob, top) when it asked (``Row.logprobs``)."""

    step: Queued
    tokens: list
    counts: list[int]
    packed: list[int]
    by: list[tuple[int, ...]]
    seconds: float | None
    logprobs: list  # per row, its tokens' (logprob, top) (``RowStep.logprobs``) or None


class Stepping:
    """The loop's stepping part over ``batch`` (the rows and their arrays) and ``policy``
    (each step's shape): ``queue`` a step, ``read`` one, the stateful sources' ``catch_up``.
    ``group``: the ranks of a split model (rank 0 names each step's shape)."""

    def __init__(self, batch: BatchState, policy: ShapePolicy, compiled=True, group=None):
        self.batch, self.policy = batch, policy
        self.model, self.sources = batch.model, batch.sources
        self.key = sources_key(batch.sources)  # the compiled steps' (``step.batch_step``)
        self.compiled, self.group = compiled, group
        self.leader = group is None or group.rank() == 0
        # The loop's read order: step k is read before step k+1 is queued when the policy
        # chooses each step from the text so far and the backend gains by it (measured).
        self.reads_first = policy.each_step and read_first()
        self.sized: dict = {}  # shape -> the sources a step of it runs, sized (``sized``)
        self.catch_ups = 0  # catch-ups queued (a source back after steps without it)
        self._traced: set = set()  # (shape, mode, rows, window, slots) of steps already run
        self.host_s = 0.0  # time spent queueing steps (dispatch)
        self.pending: Queued | None = None  # the step queued and not yet read
        self.inflight = 0  # steps queued and not yet read

    def reset(self) -> None:
        self.pending, self.inflight = None, 0

    def _step_fn(self, shape: BeamShape | None, mode: StepMode):
        return batch_step(self.model, self.sources, shape, mode, self.compiled, self.key)

    def catch_up(self, shape: BeamShape | None, window: int) -> None:
        """Before queueing a step of ``shape``: each stateful source it runs whose state may
        miss more committed tokens than its own draft re-runs (``covers``) re-runs them
        now (``catch_up``, lazy: the step's graph takes the result); then account for the
        step in every stateful source's bound (``BatchState.behind``; ``sources.py``,
        "Sources that sit out steps")."""
        batch = self.batch
        running = self.sources_of(shape)
        ran = {source.state_index: source for source in running if source.stateful}
        for i, source in ran.items():
            missed = batch.behind[i]
            if missed <= source.covers:
                continue
            s = batch.state
            ctx = DraftContext(
                self.model, s.hidden, s.init_token, s.lengths, s.history, window,
                own=s.sources[i], cache=s.cache,
            )  # fmt: skip
            batch.caught_up(i, *source.catch_up(ctx, missed))
            self.catch_ups += 1
        for i in range(len(batch.stateful)):
            if i in ran:
                batch.behind[i] = ran[i].covers
            else:
                batch.behind[i] += shape.longest if shape else 1

    def sources_of(self, shape: BeamShape | None) -> list:
        """The held sources a step of ``shape`` runs, sized (``sources.sized_sources``; None:
        plain decoding runs none), kept per shape: the host reads them every step."""
        if shape is None:
            return []
        if shape not in self.sized:
            self.sized[shape] = sized_sources(self.sources, shape)
        return self.sized[shape]

    @functools.cached_property
    def most_slots(self) -> int:
        """The most slots a step of the policy's shapes writes past a row: its ``slots``, and
        each shape's ``sources.step_capacity`` (further draft-slot chains); the policy's
        shapes are fixed, so it is worked out once."""
        most = max(step_capacity(s, self.sources) for s in self.policy.shapes)
        return max(self.policy.slots, most)

    def next_shape(self) -> BeamShape | None:
        """The shape of the step queued now (None: plain decoding): the policy's, for this
        batch's size and its running rows' lookup match states. Split across ranks (with
        several shapes to choose from), rank 0's choice."""
        shape = None
        if self.leader:
            running = [row for row in self.batch.active if not row.finished]
            seeded = any(r.sampler.seed is not None and not r.sampler.greedy for r in running)
            matches = [row.shadow.match(0) if row.shadow else 0 for row in running]
            shape = self.policy.next(len(self.batch.rows), matches, seeded)
        if self.group is not None and len(self.policy.shapes) > 1:
            shape = rank0_shape(shape, self.policy.shapes, self.group)
        elif shape is None:  # a fixed shape: every rank runs it
            shape = self.policy.shapes[0]
        return None if shape.is_autoregressive else shape

    def queue(self, grants: list[bool]) -> Queued:
        """Queue one step for all rows (``grants``: per row, whether it may fork in it);
        attention covers every active row's possible length."""
        batch = self.batch
        longest = max(row.length for row in batch.active)
        window = step_window(longest, self.inflight, self.policy.per_step, self.most_slots)
        batch.ensure_slots(window)
        shape = self.next_shape()
        self.catch_up(shape, window)
        mode, active, settings, split, grants = batch.row_params(grants)
        key = (shape, mode, len(batch.rows), window, cache_slots(batch.state.cache))
        started = time.perf_counter() if key in self._traced else None  # else: it compiles
        self._traced.add(key)
        step = self._step_fn(shape, mode)
        state, row_keys = batch.open_step(), batch.row_keys
        host = time.perf_counter()
        try:
            state, row_keys, out = step(state, row_keys, active, settings, window, split)
            mx.async_eval(out, state, row_keys)
        finally:
            batch.close_step(state, row_keys)
        self.host_s += time.perf_counter() - host
        self.inflight += 1
        for row in batch.active:
            if row.forced >= 0 and not row.forced_queued:
                row.forced_queued = True
                batch.invalidate()
        end = ()
        if any(grants):  # what a fork copies (``fork``): small arrays, the cache is not held
            end = (state.init_token, state.hidden, state.lengths, batch.row_keys)
        return Queued(out, tuple(batch.rows), shape, started, tuple(grants), end)

    def read(self, step: Queued) -> Read:
        """A computed step's tokens, counts, tree slots and sources on the host."""
        out = step.out
        tokens, counts = out.tokens.tolist(), out.count.tolist()  # this step is computed
        sources = out.source.tolist() if out.source is not None else [None] * len(counts)
        by = [by_source(s, c - 1) for s, c in zip(sources, counts)]
        packed = out.packed.tolist()
        logprobs = [None] * len(counts)
        if out.logprobs is not None:
            tops = [None if row is None else row.logprobs for row in step.owners]
            logprobs = rows_of(out.logprobs, counts, tops)
        self.inflight -= 1
        seconds = None if step.started is None else time.perf_counter() - step.started
        return Read(step, tokens, counts, packed, by, seconds, logprobs)
