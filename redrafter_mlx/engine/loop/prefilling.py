"""Prompt processing, the loop's first part: prompts prefilled chunk by chunk in their own
cache (``Prefill``), then placed into free rows of the batch (``PromptProcessing.join``),
every stateful draft source's state prefilled with them (``Source.prefill``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core.branches import step_split
from ..core.logprobs import logprob_bucket, rows_of
from ..core.sampling import RowSampler, SamplerConfig, one_row, row_keys_of, stack_rows
from ..decoding.cache import Session, ensure_slots, prefill_session, text_history
from ..decoding.decode import DecodeState, first_draw_logprobs
from ..drafting.sources import PREFILL_CHUNK
from ..verifier.entries import place_row
from .rows import Row, RowStep


@dataclass
class Prefill:
    """Prompts prefilled in their own cache (``session``, one row per prompt), one chunk at a
    time, before they join a batch (``BatchGenerator.join``): a server's request (one row), or
    a generation call's rows (a chat ``Session`` keeps its cached prefix: only the rest is
    run). ``seed``: the rows' draws' seed (``row_keys_of``); ``owner``: the client's handle."""

    prompts: list[list[int]]
    sampler: SamplerConfig
    seed: int
    session: Session
    owner: Any = None
    rows: list[Row] = field(default_factory=list)  # the rows they become (one per prompt)
    started: float = field(default_factory=time.perf_counter)
    done: int = 0  # tokens of each row's new part prefilled so far
    hidden: mx.array | None = None  # (B, H) at each row's last prefilled token
    first_logprobs: list | None = None  # per row, its first token's (``RowStep.logprobs``)

    def __post_init__(self):
        self.new = self.session.reuse(self.prompts)  # each row's tokens not cached yet
        self.kept = [len(c) for c in self.session.cached]

    @property
    def prefilled(self) -> int:
        """Prompt tokens to run (those not already cached)."""
        return sum(len(t) for t in self.new)

    def advance(self) -> int:
        """Prefill the next chunk of every row; returns its token count.

        Chunk by chunk through the engine's own prefill, with the session's cached tokens
        kept current, this computes exactly what one prefill of the prompts computes.
        """
        chunks = [t[self.done : self.done + PREFILL_CHUNK] for t in self.new]
        hidden = prefill_session(self.session, chunks)
        if self.hidden is not None:  # a row whose prompt ended in an earlier chunk keeps its own
            ran = mx.array([len(c) > 0 for c in chunks])
            hidden = mx.where(ran[:, None], hidden, self.hidden)
        self.hidden = hidden
        self.done += PREFILL_CHUNK
        self.session.cached = [p[: k + self.done] for p, k in zip(self.prompts, self.kept)]
        return sum(len(c) for c in chunks)

    @property
    def complete(self) -> bool:
        return self.done >= max(len(t) for t in self.new)

    def first_token(self, model, fork_ok: list[bool] | None = None) -> tuple[list[int], mx.array]:
        """Each row's first token, drawn now with its own key (so that an error in its own
        prefill or draw surfaces here, not in a batched step), and the rows' next keys
        (B, 2) (``row_keys_of``: a lone row's are the seed's own). Rows with branching on
        draw under its rules, forking where ``fork_ok`` (per row) says they may."""
        rng, first_key = mx.random.split(mx.random.key(self.seed))
        prompts, rows = self.prompts, len(self.prompts)
        own = one_row(self.sampler, model.vocab_size)  # checked here: a bad value fails it alone
        for row in self.rows or ():
            row.sampling = own
        mode, settings = stack_rows([own] * rows, model.vocab_size)
        last = None
        trees = [row.tree for row in self.rows] if self.rows else [None] * rows
        fork_ok = fork_ok or [False] * rows
        ids, split = step_split(trees, fork_ok, [-1] * rows, getattr(model, "split_ids", ()))
        if ids:  # a branching row, or an APAR model's linear rows (no split token drawn)
            mode = mode._replace(split=ids)
            last = mx.array([p[-1] for p in prompts], mx.int32)
        tops = [row.logprobs for row in self.rows] if self.rows else [None] * rows
        asked = [t for t in tops if t is not None]
        mode = mode._replace(logprobs=logprob_bucket(max(asked, default=None)))
        sampler = RowSampler(settings, row_keys_of(first_key, rows), mode, split)
        history = text_history(prompts, self.session.slots) if self.sampler.reads_text else None
        lengths = mx.array([len(p) for p in prompts], mx.int32)
        first, logprobs = first_draw_logprobs(model, self.hidden, sampler, history, lengths, last)
        if logprobs is not None:
            self.first_logprobs = rows_of(logprobs, [1] * rows, tops)
        return first.tolist(), row_keys_of(rng, rows)


class PromptProcessing:
    """Prefill and join: the part of ``batch.BatchGenerator`` that admits prompts (its
    ``prefills`` queue, ``insert``, ``prefill_turn``) and writes their rows into the batch
    (``join``)."""

    def insert(self, job: Prefill) -> None:
        """Queue prompts to join (their rows in ``job.rows``); ``next`` prefills them."""
        self.prefills.append(job)
        self._params = None  # the rows forks may take (``fork_grants``) count it

    def prefill_turn(self, budget: int | None, turn) -> None:
        """Up to ``budget`` prompt tokens of the waiting prefills, in order (at least one
        chunk; None: all of them), each joining with its first token once complete (into
        ``turn.joined``); a prefill or first draw that raises fails that prefill alone
        (``turn.failed``)."""
        while self.prefills and (budget is None or budget > 0):
            job = self.prefills[0]
            try:
                ran = job.advance()
                first = None
                if job.complete:
                    first = job.first_token(self.model, self.fork_grants(job.rows))
            except Exception as e:  # this prefill's own work: the others go on
                self.prefills.pop(0)
                turn.failed.append((job, e))
                continue
            budget = None if budget is None else budget - ran
            if first is not None:
                joined = self.join(job.rows, job.session, job.hidden, *first)
                self.prefills.pop(0)  # after the join: a failing join leaves it to answer
                logprobs = job.first_logprobs or [None] * len(job.rows)
                for row, (new, finish), own in zip(job.rows, joined, logprobs):
                    own = None if own is None else own[: len(new)]
                    turn.joined.append(RowStep(row, new, finish, 1, 0, (), own))

    def join(
        self, rows: list[Row], session: Session, hidden: mx.array, first: list[int], keys
    ) -> list[tuple[list[int], str | None]]:
        """Place prefilled ``rows`` (``session``'s rows, their hidden states (b, H) at the last
        prompt token, first tokens drawn, next keys (b, 2): a ``Prefill``) into free rows,
        growing the batch when none is free. An empty batch with no step in flight takes the
        session's cache itself (no copy; the session gives it up). Returns each row's first
        token's emitted part and why it finished (None: it goes on)."""
        empty = all(r is None for r in self.rows) and self.pending is None
        if empty and len(rows) in self.buckets:
            self._adopt(rows, session, hidden, first, keys)
        else:
            for i, row in enumerate(rows):
                if None not in self.rows:
                    self.resize(self.bucket_for(len(self.rows) + 1))
                r = self.rows.index(None)
                self._place(r, session, i, hidden[i : i + 1], mx.array(first[i : i + 1]), keys[i])
                row.slot = r
                self.rows[r] = row
                self.vacated.pop(r, None)
        self._params = None
        now = time.perf_counter()
        for row, token, text in zip(rows, first, session.cached):
            row.joined = now
            row.shadow = self.policy.shadow([*text, token])
        emitted = [self.emit(row, [token]) for row, token in zip(rows, first)]
        for row, (new, finish) in zip(rows, emitted):
            self.grow_branches(row, new, finish)
        self.end_answers(rows)
        return emitted

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
        self.state = ensure_slots(self.state, session.slots)
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
