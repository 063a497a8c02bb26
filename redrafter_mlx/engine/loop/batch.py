"""The engine's one generation loop: rows that join and leave a batch, each with its own
sampling settings, penalties, logit bias and seed (after mlx-lm's ``BatchGenerator``, which
composes a prompt-processing batch and a generation batch).

``BatchGenerator`` is the orchestrator of parts that each own their state and are built and
tested alone (tests/test_loop_parts.py):

* the batch's state (``batch_state.BatchState``: the rows in their slots, the
  ``DecodeState``, the rows' keys, the rows' stacked parameters and their one
  ``invalidate``; growing and shrinking the batch, a re-lay over one of a few row counts);
* prompt processing (``prefilling.PromptProcessing``: ``Prefill``, chunk by chunk, then the
  first token; the rows placed by ``BatchState.join``: an empty batch takes the rows' cache
  as is, else their K/V, hidden state, init token, key and every stateful source's state are
  written into free rows);
* generation (``stepping.Stepping``: each step's shape from the ``batch_choice.ShapePolicy``,
  the stateful sources' catch-up after steps without them, ``queue`` a step with
  ``mx.async_eval`` and ``read`` one that is computed);
* parallel branches (``branch_rows.Branches``: APAR forks, waiting children and grants),
  None until a row that may branch is admitted, so a loop without one never calls into it.

It keeps the order of the queue-then-read pipeline (``step``: as ``platform.read_first``
measured for the backend), exact stopping at EOS or a row's limit (``cache.stop_at``, in
``emit``) and rows leaving (``leave``). ``next`` is one turn: the waiting prefills, then
one ``step``. Its clients are thin: generation (``generation.generate_steps``) and the
server's scheduler, which keeps the requests, their events and the broadcast to other
ranks. The step every loop runs is ``step.batch_step``; the rows are ``rows.Row``.
docs/design.md, "The loop".
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import NamedTuple

import mlx.core as mx

from ..core.shape import AR
from ..decoding.cache import stop_at
from ..drafting.sources import PREFILL_CHUNK, Source
from .batch_choice import ShapePolicy
from .batch_state import BatchState
from .branch_rows import Branches
from .prefilling import Prefill, PromptProcessing
from .rows import Row, RowStep
from .stepping import Queued, Read, Stepping


class Turn(NamedTuple):
    """What one ``BatchGenerator.next`` gave: rows that joined (their first token),
    rows a step advanced, and prefills that failed on their own (the batch goes on)."""

    joined: list[RowStep]
    stepped: list[RowStep]
    failed: list[tuple[Prefill, Exception]]


class BatchGenerator:
    """Decode state over up to ``max_batch`` rows that join and leave between steps.

    ``sources``: the run's draft sources (``held.held_sources``, resolved once at the API:
    ``run.Run``); ``policy``: each step's shape (``batch_choice.ShapePolicy``; ``AR``: plain
    decoding); ``eos``: the token ids that end a row; ``group``: the ranks of a split model
    (rank 0 names each step's shape); ``release``: a finished row leaves its slot (else it
    keeps it and its cache, emitting nothing: ``generation.generate_steps`` hands the cache
    back). Its parts: ``batch_state``, ``prompts``, ``stepping`` and ``branches`` (None
    while no row may branch); the module docstring.
    """

    def __init__(
        self,
        model,
        sources: tuple[Source, ...],
        policy: ShapePolicy,
        eos: Container[int] = (),
        max_batch: int = 8,
        compiled: bool = True,
        group=None,
        release: bool = True,
    ):
        self.model, self.policy = model, policy
        self.batch_state = BatchState(model, sources, max_batch)
        for source in sources:
            source.bind(model)  # e.g. an adapter's shortlist head rows, before any compile
        self.prompts = PromptProcessing(model, self.batch_state)
        self.stepping = Stepping(self.batch_state, policy, compiled, group)
        self.branches: Branches | None = None  # built when a row that may branch joins
        self.eos = eos
        self.max_batch = max_batch
        self.release = release

    # ------------------------------------------------------------ the parts' state, read

    @property
    def sources(self) -> tuple[Source, ...]:
        return self.batch_state.sources

    @property
    def state(self):
        """The batch's ``DecodeState`` (None before the first join or ``reset``)."""
        return self.batch_state.state

    @property
    def rows(self) -> list[Row | None]:
        return self.batch_state.rows

    @property
    def active(self) -> list[Row]:
        return self.batch_state.active

    @property
    def resizes(self) -> int:
        return self.batch_state.resizes

    @property
    def pending(self) -> Queued | None:
        """The step queued and not yet read."""
        return self.stepping.pending

    @property
    def host_s(self) -> float:
        return self.stepping.host_s

    @property
    def prefills(self) -> list[Prefill]:
        """The prefills waiting to join, in order (``insert``)."""
        return self.prompts.prefills

    @prefills.setter
    def prefills(self, jobs: list[Prefill]) -> None:
        self.prompts.prefills = jobs

    @property
    def waiting(self) -> list:
        """Children waiting for a free row (``branch_rows.WaitingFork``)."""
        return self.branches.waiting if self.branches is not None else []

    @property
    def reserved(self) -> int:
        """Free rows kept for the forks of the step in flight (``Branches.reserved``)."""
        return self.branches.reserved(self.pending) if self.branches is not None else 0

    # ------------------------------------------------------------ rows coming and going

    def reset(self) -> None:
        """Fresh state: every row free, an empty cache (also after a failure)."""
        self.batch_state.reset()
        self.stepping.reset()
        self.prompts.prefills = []
        self.branches = None
        self.policy.reset()

    def settle(self) -> None:
        """Wait for a step still in flight (queued, never read)."""
        if self.pending is not None:
            mx.eval(self.pending.out, self.state, self.batch_state.row_keys)

    def insert(self, job: Prefill) -> None:
        """Queue prompts to join (their rows in ``job.rows``); ``next`` prefills them. A row
        that may branch (``Row.tree``) brings in the branching part."""
        if self.branches is None and any(row.tree is not None for row in job.rows):
            self.branches = Branches(self.batch_state, self.prompts)
        self.prompts.insert(job)

    def fork_grants(self, rows: list[Row | None]) -> list[bool]:
        """Which of ``rows`` may fork in the draw made now (``Branches.fork_grants``; none
        without the branching part)."""
        if self.branches is None:
            return [False] * len(rows)
        return self.branches.fork_grants(rows, self.pending)

    def leave(self, row: Row) -> None:
        """Free ``row``'s slot: it stops emitting now and its cache length returns to 0
        (without ``release`` it keeps its slot and cache, emitting nothing). A branch's row
        whose children wait for rows hands its slot to the one with the longest prefix
        instead (``Branches.hand_over``: its cache already holds it); a waiting child just
        stops waiting. A freed slot seats the next waiting child (``seat``)."""
        row.finished = True
        branches = self.branches
        if branches is not None and branches.stop_waiting(row):
            return
        keep = not self.release and row.tree is None  # a branch's row is always freed
        if self.rows[row.slot] is not row or keep:
            return
        if branches is not None and branches.hand_over(row):
            return
        self.batch_state.free(row)
        self.seat()

    def seat(self) -> None:
        """Seat waiting children in free rows (``Branches.seat``)."""
        if self.branches is not None:
            self.branches.seat()

    def cache_slot(self, row: Row) -> int | None:
        """The slot whose cache still holds ``row``'s (``BatchState.cache_slot``)."""
        return self.batch_state.cache_slot(row)

    def drop(self, row: Row) -> None:
        """End ``row``'s whole request now (cancelled, or answered with an error): its
        waiting children stop waiting, then every row it holds leaves its slot."""
        family = row.family
        if self.branches is not None:
            self.branches.drop_waiting(family)
        for branch in family:
            self.leave(branch)

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

    def end_answers(self, rows) -> list[Row]:
        """The branches of ``rows`` past their answer's end (``Branches.past_budget``), their
        rows freed; returns those rows."""
        if self.branches is None:
            return []
        ended = self.branches.past_budget(rows)
        for row in ended:
            self.leave(row)
        return ended

    def join(self, rows: list[Row], session, hidden, first: list[int], keys):
        """Place prefilled ``rows`` into the batch (``BatchState.join``), then each one's
        first token's emitted part and why it finished (None: it goes on)."""
        self.batch_state.join(rows, session, hidden, first, keys, adopt=self.pending is None)
        now = time.perf_counter()
        for row, token, text in zip(rows, first, session.cached):
            row.joined = now
            row.shadow = self.policy.shadow([*text, token])
        emitted = [self.emit(row, [token]) for row, token in zip(rows, first)]
        if self.branches is not None:
            for row, (new, finish) in zip(rows, emitted):
                self.branches.grow(row, new, finish)
        self.end_answers(rows)
        return emitted

    # ------------------------------------------------------------ a turn

    def next(self, budget: int | None = PREFILL_CHUNK) -> Turn:
        """One call advances everyone: the waiting prefills, the batch shrunk if mostly
        free, then one ``step``. A failure in the batch's own work (a join, the step)
        raises, with every prefill not joined in ``prefills`` (those that failed alone
        too), for the client to answer."""
        turn = Turn([], [], [])
        try:
            for job, first in self.prompts.ready(budget, turn.failed, self.fork_grants):
                joined = self.join(job.rows, job.session, job.hidden, *first)
                logprobs = job.first_logprobs or [None] * len(job.rows)
                for row, (new, finish), own in zip(job.rows, joined, logprobs):
                    own = None if own is None else own[: len(new)]
                    turn.joined.append(RowStep(row, new, finish, 1, 0, (), own))
            self.batch_state.fit()
            turn.stepped.extend(self.step())
        except Exception:
            self.prefills[:0] = [job for job, _ in turn.failed]
            raise
        return turn

    def step(self) -> list[RowStep]:
        """One turn of the loop: queue the next step for the running rows and read the one
        queued before it, as ``Stepping.reads_first`` says (else the device never waits for
        the host's reading and shape choice: the step is queued first; with branching rows,
        read first as ``platform.read_first`` says, else as ``Branches.queue_ahead``
        allows). Returns what the read step gave each row it ran that was still going (none
        on the first turn)."""
        got, stepping, branches = [], self.stepping, self.branches
        if stepping.pending is not None:
            branching = branches is not None and branches.branching
            first = branching and (branches.read_first or not branches.queue_ahead(self.pending))
            if stepping.reads_first or first:
                got, stepping.pending = self.read(stepping.pending), None
            elif branching:
                branches.ahead += 1
        self.seat()  # rows a join left free (a waiting prefill counts until it joins)
        nxt = None
        if any(not row.finished for row in self.active):
            nxt = stepping.queue(self.fork_grants(self.rows))
        if stepping.pending is not None:
            got += self.read(stepping.pending)
        stepping.pending = nxt
        return got

    def read(self, step: Queued) -> list[RowStep]:
        """A computed step's tokens for the rows it ran that are still going: per row, the
        part emitted (exact stop) and why it finished (None: it goes on)."""
        got: Read = self.stepping.read(step)
        ran, resolved, delivered = [], [], []
        for r, row in enumerate(step.owners):  # r: the row's index when the step was queued
            if row is None or row.finished:
                continue
            count, by, packed = got.counts[r], got.by[r], got.packed[r]
            tokens = got.tokens[r][:count]
            ran.append(count)
            row.length += count
            row.stats.record(count, by, packed, step.shape)
            if row.shadow is not None:  # what a lookup chain would have given this step
                resolved += row.shadow.step(0, tokens)
            new, finish = self.emit(row, tokens)
            if self.branches is not None:
                drafted = [i < count - 1 for i in range(len(new))]
                self.branches.grow(row, new, finish, drafted, (step, r))
            own = None if got.logprobs[r] is None else got.logprobs[r][: len(new)]
            delivered.append(RowStep(row, new, finish, count, packed, by, own))
            if row.finished and row.shadow is not None:
                resolved += row.shadow.finish(0)
        for row in self.end_answers([d.row for d in delivered]):
            if row.shadow is not None:
                resolved += row.shadow.finish(0)
        self.policy.finished(len(step.owners), step.shape or AR, ran, got.seconds)
        self.policy.lookup_seen(resolved)
        return delivered
