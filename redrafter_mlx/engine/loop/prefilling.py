"""Prompt processing, the loop's first part: prompts prefilled chunk by chunk in their own
cache (``Prefill``), queued and given their first tokens (``PromptProcessing``), then placed
into free rows of the batch (``BatchState.join``), every stateful draft source's state
prefilled with them (``Source.prefill``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from ..core.branches import step_split
from ..core.logprobs import logprob_bucket, rows_of
from ..core.sampling import RowSampler, SamplerConfig, one_row, row_keys_of, stack_rows
from ..decoding.cache import Session, prefill_session, text_history
from ..decoding.decode import first_draw_logprobs
from ..drafting.sources import PREFILL_CHUNK
from .batch_state import BatchState
from .rows import Row


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
    prompt_cache: Any = None  # a ``prompt_cache.PromptCache`` (one-row prefills only)
    cached_tokens: int = 0  # of the prompt, taken from the prompt cache

    def __post_init__(self):
        if self.prompt_cache is not None and len(self.prompts) == 1:
            n, entries = self.prompt_cache.lookup(self.prompts[0])
            if entries is not None:
                self.session.cache = entries
                self.session.cached = [self.prompts[0][:n]]
                self.cached_tokens = n
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
        if self.complete and self.prompt_cache is not None and len(self.prompts) == 1:
            self.prompt_cache.store(self.prompts[0], self.session.cache)
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
    """The loop's first part: the prompts waiting to join (``prefills``, in order), prefilled
    a chunk at a time and each given its first token (``ready``); the batch places them
    (``batch_state.BatchState.join``). Built alone over a model and the batch's state (whose
    rows' parameters an admitted prefill invalidates: forks count the rows it will take)."""

    def __init__(self, model, batch: BatchState):
        self.model, self.batch = model, batch
        self.prefills: list[Prefill] = []

    @property
    def rows_waiting(self) -> int:
        """Rows the waiting prefills will take (admitted first, they keep theirs)."""
        return sum(len(job.prompts) for job in self.prefills)

    def insert(self, job: Prefill) -> None:
        """Queue prompts to join (their rows in ``job.rows``); ``ready`` prefills them."""
        self.prefills.append(job)
        self.batch.invalidate()  # the rows forks may take (``fork_grants``) count it

    def ready(
        self, budget: int | None, failed: list, grants=None
    ) -> Iterator[tuple[Prefill, tuple[list[int], mx.array]]]:
        """Up to ``budget`` prompt tokens of the waiting prefills, in order (at least one
        chunk; None: all of them), yielding each complete one with its first tokens and next
        keys (``Prefill.first_token``; ``grants(rows)``: where its rows may fork, None:
        nowhere) for the caller to join; it leaves the queue once the caller asks for the
        next (a join that raises leaves it to answer). A prefill or first draw that raises
        fails that prefill alone (into ``failed``, with the error)."""
        while self.prefills and (budget is None or budget > 0):
            job = self.prefills[0]
            try:
                ran = job.advance()
                first = None
                if job.complete:
                    fork_ok = grants(job.rows) if grants is not None else None
                    first = job.first_token(self.model, fork_ok)
            except Exception as e:  # this prefill's own work: the others go on
                self.prefills.pop(0)
                failed.append((job, e))
                continue
            budget = None if budget is None else budget - ran
            if first is not None:
                yield job, first
                self.prefills.pop(0)  # after the join: a failing join leaves it to answer
