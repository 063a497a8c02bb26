"""Generation, the loop's second part: each step's shape and row parameters, the stateful
sources' catch-up, and the queue-then-read pipeline (``queue`` a step with
``mx.async_eval``, ``read`` an older one that is computed), in the order
``platform.read_first`` measured for the backend (``Stepping.step``)."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import mlx.core as mx

from ..core.logprobs import logprob_bucket, rows_of
from ..core.sampling import StepMode, one_row, stack_rows
from ..core.shape import AR, BeamShape
from ..decoding.cache import ensure_slots, step_window
from ..decoding.decode import StepOutput
from ..decoding.step import batch_step
from ..drafting.sources import DraftContext, by_source, sized_sources, step_capacity
from ..verifier.entries import cache_slots
from .adaptive import rank0_shape
from .rows import Row, RowStep


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


class Stepping:
    """The stepping part of ``batch.BatchGenerator``: queue, read, catch-up."""

    def _row_params(self):
        """(StepMode, active (B,), RowSettings, SplitRows or None, grants): rebuilt only
        after rows join or leave (a fork joins a row), a child's forced draw is queued, or
        the rows' fork grants change."""
        grants = self.fork_grants(self.rows) if self.branching else [False] * len(self.rows)
        if self._params is not None and self._params[4] != grants:
            self._params = None
        if self._params is None:
            V = self.model.vocab_size
            for row in self.active:
                if row.sampling is None:
                    row.sampling = one_row(row.sampler, V)
            mode, settings = stack_rows(
                [r.sampling if r is not None else None for r in self.rows], V
            )
            active = mx.array([r is not None for r in self.rows])
            ids, split = self._split(grants)
            tops = [r.logprobs for r in self.active if r.logprobs is not None]
            mode = mode._replace(split=ids, logprobs=logprob_bucket(max(tops, default=None)))
            self._params = (mode, active, settings, split, grants)
        return self._params

    def _step_fn(self, shape: BeamShape | None, mode: StepMode):
        return batch_step(self.model, self.drafter, shape, mode, self.compiled, self.draft_model)

    def catch_up(self, shape: BeamShape | None, window: int) -> None:
        """Before queueing a step of ``shape``: each stateful source it runs whose state may
        miss more committed tokens than its own draft re-runs (``covers``) re-runs them
        now (``catch_up``, lazy: the step's graph takes the result); then account for the
        step in every stateful source's bound (``sources.py``, "Sources that sit out
        steps")."""
        running = self.sources_of(shape)
        ran = {source.state_index: source for source in running if source.stateful}
        for i, source in ran.items():
            missed = self.behind[i]
            if missed <= source.covers:
                continue
            s = self.state
            ctx = DraftContext(
                self.model, s.hidden, s.init_token, s.lengths, s.history, window,
                own=s.sources[i], cache=s.cache,
            )  # fmt: skip
            state, cache = source.catch_up(ctx, missed)
            sources = list(s.sources)
            sources[i] = state
            s = s._replace(sources=tuple(sources))
            if cache is not None:
                s = s._replace(cache=cache)
            self.state = s
            self.catch_ups += 1
        for i in range(len(self.stateful)):
            if i in ran:
                self.behind[i] = ran[i].covers
            else:
                self.behind[i] += shape.longest if shape else 1

    def sources_of(self, shape: BeamShape | None) -> list:
        """The held sources a step of ``shape`` runs, sized (``sources.sized_sources``; None:
        plain decoding runs none), kept per shape: the host reads them every step."""
        if shape is None:
            return []
        if shape not in self.sized:
            self.sized[shape] = sized_sources(self.held, shape)
        return self.sized[shape]

    @functools.cached_property
    def most_slots(self) -> int:
        """The most slots a step of the policy's shapes writes past a row: its ``slots``, and
        each shape's ``sources.step_capacity`` (further draft-slot chains); the policy's
        shapes are fixed, so it is worked out once."""
        most = max(step_capacity(s, self.held) for s in self.policy.shapes)
        return max(self.policy.slots, most)

    def next_shape(self) -> BeamShape | None:
        """The shape of the step queued now (None: plain decoding): the policy's, for this
        batch's size and its running rows' lookup match states. Split across ranks (with
        several shapes to choose from), rank 0's choice."""
        shape = None
        if self.leader:
            running = [row for row in self.active if not row.finished]
            seeded = any(r.sampler.seed is not None and not r.sampler.greedy for r in running)
            matches = [row.shadow.match(0) if row.shadow else 0 for row in running]
            shape = self.policy.next(len(self.rows), matches, seeded)
        if self.group is not None and len(self.policy.shapes) > 1:
            shape = rank0_shape(shape, self.policy.shapes, self.group)
        elif shape is None:  # a fixed shape: every rank runs it
            shape = self.policy.shapes[0]
        return None if shape.is_autoregressive else shape

    def step(self) -> list[RowStep]:
        """One turn of the loop: queue the next step for the running rows and read the one
        queued before it, as ``reads_first`` says (else the device never waits for the
        host's reading and shape choice: the step is queued first; with branching rows,
        read first as ``platform.read_first`` says, else as ``queue_ahead`` allows).
        Returns what the read step gave each row it ran that was still going (none on the
        first turn)."""
        got = []
        if self.pending is not None:
            branching = self.branching
            first = branching and (self.branches_read_first or not self.queue_ahead())
            if self.reads_first or first:
                got, self.pending = self.read(self.pending), None
            elif branching:
                self.ahead += 1
        self.seat()  # rows a join left free (a waiting prefill counts until it joins)
        nxt = self.queue() if any(not row.finished for row in self.active) else None
        if self.pending is not None:
            got += self.read(self.pending)
        self.pending = nxt
        return got

    def queue(self) -> Queued:
        """Queue one step for all rows; attention covers every active row's possible length."""
        self.vacated = {}  # the step writes into free rows
        longest = max(row.length for row in self.active)
        window = step_window(longest, self.inflight, self.policy.per_step, self.most_slots)
        self.state = ensure_slots(self.state, window)
        shape = self.next_shape()
        self.catch_up(shape, window)
        mode, active, settings, split, grants = self._row_params()
        key = (shape, mode, len(self.rows), window, cache_slots(self.state.cache))
        started = time.perf_counter() if key in self._traced else None  # else: it compiles
        self._traced.add(key)
        step = self._step_fn(shape, mode)
        state, self.state = self.state, None  # only the step's graph holds the cache
        host = time.perf_counter()
        try:
            state, self.row_keys, out = step(state, self.row_keys, active, settings, window, split)
            mx.async_eval(out, state, self.row_keys)
        finally:
            self.state = state
        self.host_s += time.perf_counter() - host
        self.inflight += 1
        for row in self.active:
            if row.forced >= 0 and not row.forced_queued:
                row.forced_queued, self._params = True, None
        end = ()
        if any(grants):  # what a fork copies (``fork``): small arrays, the cache is not held
            end = (state.init_token, state.hidden, state.lengths, self.row_keys)
        return Queued(out, tuple(self.rows), shape, started, tuple(grants), end)

    def read(self, step: Queued) -> list[RowStep]:
        """A computed step's tokens for the rows it ran that are still going: per row, the
        part emitted (exact stop) and why it finished (None: it goes on)."""
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
        ran, resolved, delivered = [], [], []
        for r, row in enumerate(step.owners):  # r: the row's index when the step was queued
            if row is None or row.finished:
                continue
            ran.append(counts[r])
            row.length += counts[r]
            row.stats.record(counts[r], by[r], packed[r], step.shape)
            if row.shadow is not None:  # what a lookup chain would have given this step
                resolved += row.shadow.step(0, tokens[r][: counts[r]])
            new, finish = self.emit(row, tokens[r][: counts[r]])
            drafted = [i < counts[r] - 1 for i in range(len(new))]
            self.grow_branches(row, new, finish, drafted, (step, r))
            own = None if logprobs[r] is None else logprobs[r][: len(new)]
            delivered.append(RowStep(row, new, finish, counts[r], packed[r], by[r], own))
            if row.finished and row.shadow is not None:
                resolved += row.shadow.finish(0)
        for row in self.end_answers([d.row for d in delivered]):
            if row.shadow is not None:
                resolved += row.shadow.finish(0)
        self.policy.finished(len(step.owners), step.shape or AR, ran, seconds)
        self.policy.lookup_seen(resolved)
        return delivered
