"""The batch's state, the one object the loop's parts share (``batch.BatchGenerator``
composes it with prompt processing, stepping and, when a row may branch, the branches).

``BatchState`` owns what describes the B rows now: the rows in their slots (``rows``, None:
free), the ``DecodeState`` (``state``: cache, hidden states, init tokens, lengths, text,
the stateful sources' states), the rows' PRNG keys (``row_keys``, (B, 2)), the slots freed
since the last step was queued (``vacated``), per stateful source the committed tokens its
state may miss (``behind``, ``sources.py``, "Sources that sit out steps"), and the rows'
parameters stacked for a step (``row_params``), rebuilt after ``invalidate``, the one place
that says they changed. Every write to the rows or their arrays goes through its methods:
``reset``, ``join`` (prefilled rows placed), ``seat`` (a row copied from another: a fork),
``free`` (a row leaves) and ``resize`` (a re-lay over another row count).
"""

from __future__ import annotations

import mlx.core as mx

from ..core.branches import step_split
from ..core.logprobs import logprob_bucket
from ..core.sampling import one_row, stack_rows
from ..decoding.cache import SLOT_QUANTUM, Session, ensure_slots, text_history
from ..decoding.decode import DecodeState
from ..drafting.held import check_sources
from ..drafting.sources import Source, stateful
from ..verifier.entries import dtype_of, place_row
from .rows import Row, row_buckets, take_rows


class BatchState:
    """The rows of a batch of up to ``max_batch`` rows over ``model`` and the run's
    ``sources`` (``held.held_sources``, in ``DecodeState`` order), and their arrays (the
    module docstring). ``state`` is None until ``reset`` or a first ``join``."""

    def __init__(self, model, sources: tuple[Source, ...], max_batch: int):
        check_sources(sources)
        self.model, self.sources = model, sources
        self.stateful = stateful(sources)  # those with a state in ``DecodeState.sources``
        self.max_batch = max_batch
        self.buckets = row_buckets(max_batch)
        self.state: DecodeState | None = None
        self.row_keys: mx.array | None = None
        self.rows: list[Row | None] = [None]
        self.vacated: dict[int, Row] = {}  # slots freed since the last step queued
        self.behind = [0] * len(self.stateful)
        self.resizes = 0  # re-lays of the cache (grow or shrink)
        self._params = None

    def reset(self) -> None:
        """Every row free over the smallest bucket, an empty cache (also after a failure)."""
        B, model = self.buckets[0], self.model
        cache = model.make_cache(B, SLOT_QUANTUM)
        self.state = DecodeState(
            mx.zeros((B,), mx.int32),
            mx.zeros((B, model.state_width), dtype_of(cache)),
            mx.zeros((B,), mx.int32),
            cache,
            mx.zeros((B, SLOT_QUANTUM), mx.int32),  # the text: lookup and penalties read it
            tuple(s.empty_state(model, B, SLOT_QUANTUM) for s in self.stateful),
        )
        self.row_keys = mx.zeros((B, 2), mx.uint32)
        self.rows = [None] * B
        self.vacated = {}
        self.behind = [0] * len(self.stateful)
        self.invalidate()

    @property
    def active(self) -> list[Row]:
        return [row for row in self.rows if row is not None]

    @property
    def empty(self) -> bool:
        return all(r is None for r in self.rows)

    def invalidate(self) -> None:
        """The rows' stacked parameters (``row_params``) are rebuilt at the next step: rows
        joined or left, a child's forced draw was queued, or a prefill was admitted."""
        self._params = None

    def row_params(self, grants: list[bool]):
        """(StepMode, active (B,), RowSettings, SplitRows or None, grants) for a step where
        ``grants`` (per row) says which rows may fork; kept until ``invalidate`` or other
        grants. Without a branching row the split is the model's split tokens' alone
        (``branches.step_split``: an APAR model's linear rows must not draw them)."""
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
            trees = [r.tree if r is not None else None for r in self.rows]
            forced = [r.forced if r is not None and not r.forced_queued else -1 for r in self.rows]
            ids, split = step_split(trees, grants, forced, getattr(self.model, "split_ids", ()))
            tops = [r.logprobs for r in self.rows if r is not None and r.logprobs is not None]
            mode = mode._replace(split=ids, logprobs=logprob_bucket(max(tops, default=None)))
            self._params = (mode, active, settings, split, grants)
        return self._params

    def ensure_slots(self, slots: int) -> None:
        """The cache grown to hold ``slots`` slots per row (``cache.ensure_slots``)."""
        self.state = ensure_slots(self.state, slots)

    def open_step(self) -> DecodeState:
        """Hand the state to a step: it writes into free rows (``vacated`` cleared) and only
        its graph holds the cache until ``close_step`` (``state`` is None meanwhile)."""
        self.vacated = {}
        state, self.state = self.state, None
        return state

    def close_step(self, state: DecodeState, row_keys: mx.array | None = None) -> None:
        """The state (and the rows' keys) a step gave back (``open_step``)."""
        self.state = state
        if row_keys is not None:
            self.row_keys = row_keys

    def caught_up(self, i: int, own, cache: tuple | None) -> None:
        """Stateful source ``i``'s state after its catch-up (``Source.catch_up``), and the
        target's cache when it wrote it."""
        s = self.state
        sources = list(s.sources)
        sources[i] = own
        s = s._replace(sources=tuple(sources))
        if cache is not None:
            s = s._replace(cache=cache)
        self.state = s

    def bucket_for(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def free_slot(self) -> int:
        """A free slot, the batch grown to the next bucket when none is."""
        if None not in self.rows:
            self.resize(self.bucket_for(len(self.rows) + 1))
        return self.rows.index(None)

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
        self.invalidate()

    def fit(self) -> None:
        """Shrink the batch once at most a quarter of its rows are in use (hysteresis)."""
        n, active = len(self.rows), len(self.active)
        if n > 1 and active <= n // 4:
            self.resize(self.bucket_for(max(active, 1)))

    def cache_slot(self, row: Row) -> int | None:
        """The slot whose cache still holds ``row``'s (its slot while it runs, or since it
        left if no step was queued after: a later step writes into free rows), else None."""
        slot = row.slot  # a row that left keeps its last slot, which a re-lay may drop
        running = 0 <= slot < len(self.rows) and self.rows[slot] is row
        return slot if running or self.vacated.get(slot) is row else None

    def free(self, row: Row) -> None:
        """``row``'s slot freed: its cache length returns to 0 (the cache stays until a step
        writes the slot: ``cache_slot``)."""
        r = row.slot
        self.rows[r] = None
        self.vacated[r] = row
        self.invalidate()
        at = mx.arange(len(self.rows)) == r
        self.state = self.state._replace(lengths=mx.where(at, 0, self.state.lengths))

    def join(
        self, rows: list[Row], session: Session, hidden: mx.array, first: list[int], keys, adopt
    ) -> None:
        """Place prefilled ``rows`` (``session``'s rows, their hidden states (b, H) at the
        last prompt token, first tokens drawn, next keys (b, 2): a ``prefilling.Prefill``)
        into free rows, growing the batch when none is free. ``adopt`` (an empty batch with
        no step in flight, the rows a bucket): the batch takes the session's cache itself
        (no copy; the session gives it up)."""
        if adopt and self.empty and len(rows) in self.buckets:
            self._adopt(rows, session, hidden, first, keys)
        else:
            for i, row in enumerate(rows):
                r = self.free_slot()
                self._place(r, session, i, hidden[i : i + 1], mx.array(first[i : i + 1]), keys[i])
                row.slot = r
                self.rows[r] = row
                self.vacated.pop(r, None)
        self.invalidate()

    def _adopt(self, rows, session: Session, hidden, first, keys) -> None:
        """Take a prefilled session's cache as the whole batch, row ``i`` in slot ``i``."""
        history = text_history(session.cached, session.slots)
        first = mx.array(first, mx.int32)
        sources = self._prefilled_sources(session, slice(None))
        self.state = DecodeState(first, hidden, session.lengths, session.cache, history, sources)
        session.cache = None  # the batch owns the cache (in-place updates)
        self.row_keys, self.rows = keys, list(rows)
        for r, row in enumerate(self.rows):
            row.slot = r
        self.behind = [0] * len(self.stateful)  # every source prefilled with every row

    def _prefilled_sources(self, session: Session, rows: slice) -> tuple:
        """The stateful sources' states after ``session``'s ``rows``' prompts (all in its
        cache: ``Source.prefill``)."""
        return tuple(s.prefill(self.model, session, rows) for s in self.stateful)

    def _place(self, r: int, session: Session, i: int, hidden, first, rng) -> None:
        """Write row ``i`` of a prefilled session into batch row ``r`` (lazy array updates)."""
        self.ensure_slots(session.slots)
        at = mx.arange(len(self.rows)) == r  # (B,)
        place_row(self.state.cache, r, session.cache, i)
        s = self.state
        history = s.history
        if history is not None:  # the row's text so far: its prompt, all in the cache
            text = text_history(session.cached[i : i + 1], history.shape[1])
            history = mx.where(at[:, None], text, history)
        for state, row_state in zip(s.sources, self._prefilled_sources(session, slice(i, i + 1))):
            place_row(state, r, row_state, 0)
        self.state = s._replace(
            init_token=mx.where(at, first, s.init_token),
            hidden=mx.where(at[:, None], hidden, s.hidden),
            lengths=mx.where(at, session.lengths[i], s.lengths),
            history=history,
        )
        self.row_keys = mx.where(at[:, None], rng[None], self.row_keys)

    def seat(self, row: Row, c: int, source: Row, end: tuple) -> None:
        """Put ``row`` in slot ``c`` as a copy of ``source``'s row: its caches and text
        (unless ``c`` is ``source``'s own slot, handed over), then ``end``'s small arrays,
        (init_token (1,), hidden (1, H), lengths (1,), row_keys (1, 2)) (a fork's)."""
        s, p = self.state, source.slot
        at = mx.arange(len(self.rows)) == c
        history = s.history
        if p != c:
            for cache in (s.cache, *(state for state in s.sources if state is not None)):
                place_row(cache, c, cache, p)
            if history is not None:
                history = mx.where(at[:, None], history[p : p + 1], history)

        def copied(a, one):  # (B, ...): slot c takes ``one`` (1, ...)
            return mx.where(at.reshape((-1,) + (1,) * (a.ndim - 1)), one, a)

        init_token, hidden, lengths, row_keys = end
        self.state = s._replace(
            init_token=copied(s.init_token, init_token),
            hidden=copied(s.hidden, hidden),
            lengths=copied(s.lengths, lengths),
            history=history,
        )
        self.row_keys = copied(self.row_keys, row_keys)
        row.slot = c
        self.rows[c] = row
        self.vacated.pop(c, None)
        self.invalidate()

    def end_of(self, row: Row) -> tuple:
        """``row``'s small arrays now, (init_token (1,), hidden (1, H), lengths (1,),
        row_keys (1, 2)) (what a fork copies from a row just joined)."""
        s, i = self.state, row.slot
        return tuple(a[i : i + 1] for a in (s.init_token, s.hidden, s.lengths, self.row_keys))
