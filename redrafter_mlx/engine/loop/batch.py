"""The engine's one generation loop: rows that join and leave a batch, each with its own
sampling settings, penalties, logit bias and seed (after mlx-lm's ``BatchGenerator``).

``BatchGenerator`` holds the decode state of B rows and orchestrates three parts, each in
its own module:

* prompt processing (``prefilling.py``: ``Prefill``, chunk by chunk, then ``join``: an empty
  batch takes the rows' cache as is, else their K/V, hidden state, init token, key and every
  stateful source's state are written into free rows);
* generation (``stepping.py``: each step's shape from the ``batch_choice.ShapePolicy``, the
  stateful sources' catch-up after steps without them, and the queue-then-read pipeline,
  ``queue`` a step with ``mx.async_eval`` and ``read`` an older one that is computed, in the
  order ``platform.read_first`` measured for the backend);
* parallel branches (``branch_rows.py``: APAR forks, waiting children and grants, a layer
  around the rows);

and itself keeps the rest: the rows' slots (growing and shrinking the batch: a re-lay of
the cache over one of a few row counts, rare), exact stopping at EOS or a row's limit
(``cache.stop_at``) and rows leaving. ``next`` is one turn: the waiting prefills, then one
``step``. Its clients are thin: generation (``generation.generate_steps``) and the server's
scheduler, which keeps the requests, their events and the broadcast to other ranks. The
step every loop runs is ``step.batch_step``; the rows are ``rows.Row``. docs/design.md,
"The loop".
"""

from __future__ import annotations

import time
from collections.abc import Container
from typing import NamedTuple

import mlx.core as mx

from ..base.platform import read_first
from ..decoding.cache import SLOT_QUANTUM, stop_at
from ..decoding.decode import DecodeState
from ..drafting.held import held_sources
from ..drafting.sources import PREFILL_CHUNK, stateful
from ..verifier.entries import dtype_of
from .batch_choice import ShapePolicy
from .branch_rows import BranchRows, WaitingFork
from .prefilling import Prefill, PromptProcessing
from .rows import Row, RowStep, row_buckets, take_rows
from .stepping import Queued, Stepping


class Turn(NamedTuple):
    """What one ``BatchGenerator.next`` gave: rows that joined (their first token),
    rows a step advanced, and prefills that failed on their own (the batch goes on)."""

    joined: list[RowStep]
    stepped: list[RowStep]
    failed: list[tuple[Prefill, Exception]]


class BatchGenerator(PromptProcessing, Stepping, BranchRows):
    """Decode state over up to ``max_batch`` rows that join and leave between steps.

    ``policy``: each step's shape (``batch_choice.ShapePolicy``; ``AR``: plain decoding);
    ``eos``: the token ids that end a row; ``group``: the ranks of a split model (rank 0
    names each step's shape); ``release``: a finished row leaves its slot (else it keeps
    it and its cache, emitting nothing: ``generation.generate_steps`` hands the cache back).
    """

    def __init__(
        self,
        model,
        drafter,
        policy: ShapePolicy,
        eos: Container[int] = (),
        max_batch: int = 8,
        compiled: bool = True,
        group=None,
        release: bool = True,
        draft_model=None,
    ):
        self.model, self.drafter, self.draft_model = model, drafter, draft_model  # the slots
        self.held = held_sources(drafter, draft_model)  # every source, in ``DecodeState`` order
        for source in self.held:
            source.bind(model)  # e.g. an adapter's shortlist head rows, before any compile
        self.stateful = stateful(self.held)  # those with a state in ``DecodeState.sources``
        # Per stateful source: committed tokens its state may miss (``sources.py``, "Sources
        # that sit out steps"); host side, from the shapes queued, never read from the device.
        self.behind = [0] * len(self.stateful)
        self.sized: dict = {}  # shape -> the sources a step of it runs, sized (``sized``)
        self.catch_ups = 0  # catch-ups queued (a source back after steps without it)
        self.policy = policy
        self.eos = eos
        self.max_batch = max_batch
        self.buckets = row_buckets(max_batch)
        self.compiled = compiled
        self.group = group
        self.leader = group is None or group.rank() == 0
        # The loop's read order: step k is read before step k+1 is queued when the policy
        # chooses each step from the text so far and the backend gains by it (measured).
        self.reads_first = policy.each_step and read_first()
        # Branching rows: each step read first as well (the CPU's measured default), else
        # queued ahead wherever no fork can change the next step (``queue_ahead``).
        self.branches_read_first = read_first()
        self.release = release
        self._traced: set = set()  # (shape, mode, rows, window, slots) of steps already run
        self.host_s = 0.0  # time spent queueing steps (dispatch)
        self.resizes = 0  # re-lays of the cache (grow or shrink)
        self.state = None  # built by ``reset`` on the thread that runs the loop (MLX streams)
        self.rows: list[Row | None] = [None]
        self.pending: Queued | None = None  # the step queued and not yet read
        self.inflight = 0  # steps queued and not yet read
        self.prefills: list[Prefill] = []  # waiting to join, in order (``insert``)
        self.waiting: list[WaitingFork] = []  # children waiting for a free row (``fork``)
        self.vacated: dict[int, Row] = {}  # slots freed since the last step queued (``cache_slot``)
        self.ahead = 0  # steps queued while one with a branching row was in flight

    def reset(self) -> None:
        """Fresh state: every row free, an empty cache (also after a failure)."""
        B, model = self.buckets[0], self.model
        cache = model.make_cache(B, SLOT_QUANTUM)
        self.state = DecodeState(
            mx.zeros((B,), mx.int32),
            mx.zeros((B, model.state_width), dtype_of(cache)),
            mx.zeros((B,), mx.int32),
            cache,
            mx.zeros((B, SLOT_QUANTUM), mx.int32),  # the text: lookup and penalties read it
            self._empty_sources(B),
        )
        self.row_keys = mx.zeros((B, 2), mx.uint32)
        self.rows: list[Row | None] = [None] * B
        self.inflight = 0
        self.pending = None
        self.prefills = []
        self.waiting = []
        self.vacated = {}
        self._params = None
        self.behind = [0] * len(self.stateful)
        self.policy.reset()

    def _empty_sources(self, B: int) -> tuple:
        """The stateful sources' empty states for B rows (``DecodeState.sources``)."""
        return tuple(s.empty_state(self.model, B, SLOT_QUANTUM) for s in self.stateful)

    @property
    def active(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    def settle(self) -> None:
        """Wait for a step still in flight (queued, never read)."""
        if self.pending is not None:
            mx.eval(self.pending.out, self.state, self.row_keys)

    def leave(self, row: Row) -> None:
        """Free ``row``'s slot: it stops emitting now and its cache length returns to 0
        (without ``release`` it keeps its slot and cache, emitting nothing). A branch's row
        whose children wait for rows (``fork``) hands its slot to the one with the longest
        prefix instead (its cache already holds it); a waiting child just stops waiting.
        A freed slot seats the next waiting child (``seat``)."""
        row.finished = True
        waiting = next((w for w in self.waiting if w.row is row), None)
        if waiting is not None:
            self.waiting.remove(waiting)
            return
        r = row.slot
        keep = not self.release and row.tree is None  # a branch's row is always freed
        if self.rows[r] is not row or keep:
            return
        heirs = [w for w in self.waiting if w.source is row]
        if heirs:
            heir = max(heirs, key=lambda w: w.row.length)  # the others' prefixes lie in its
            self.waiting.remove(heir)
            self._seat(heir, r)
            for w in heirs:
                w.source = heir.row
            return
        self.rows[r] = None
        self.vacated[r] = row
        self._params = None
        at = mx.arange(len(self.rows)) == r
        self.state = self.state._replace(lengths=mx.where(at, 0, self.state.lengths))
        self.seat()

    def cache_slot(self, row: Row) -> int | None:
        """The slot whose cache still holds ``row``'s (its slot while it runs, or since it
        left if no step was queued after: a later step writes into free rows), else None."""
        slot = row.slot  # a row that left keeps its last slot, which a re-lay may drop
        running = 0 <= slot < len(self.rows) and self.rows[slot] is row
        return slot if running or self.vacated.get(slot) is row else None

    def drop(self, row: Row) -> None:
        """End ``row``'s whole request now (cancelled, or answered with an error): its
        waiting children stop waiting, then every row it holds leaves its slot."""
        family = row.family
        self.waiting = [w for w in self.waiting if w.row.family is not family]
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
        self.vacated = {}  # free slots are not carried over
        if n > len(rows):
            order, extra, idx = list(range(len(rows))), n - len(rows), None
        else:
            used = [i for i, row in enumerate(rows) if row is not None]
            order = (used + [i for i, row in enumerate(rows) if row is None])[:n]
            extra, idx = 0, mx.array(order, dtype=mx.int32)
        self.state, self.row_keys = take_rows(self.state, self.row_keys, idx, extra)
        self.rows = [rows[i] for i in order] + [None] * extra
        for i, row in enumerate(self.rows):
            if row is not None:
                row.slot = i
        self._params = None

    def next(self, budget: int | None = PREFILL_CHUNK) -> Turn:
        """One call advances everyone: the waiting prefills (``prefill_turn``), the batch
        shrunk if mostly free, then one ``step``. A failure in the batch's own work (a
        join, the step) raises, with every prefill not joined in ``prefills`` (those that
        failed alone too), for the client to answer."""
        turn = Turn([], [], [])
        try:
            self.prefill_turn(budget, turn)
            self.fit()
            turn.stepped.extend(self.step())
        except Exception:
            self.prefills[:0] = [job for job, _ in turn.failed]
            raise
        return turn
