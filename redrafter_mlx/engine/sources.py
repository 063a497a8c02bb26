"""Draft sources: everything that proposes candidates for the verification tree.

The verifier does not care where a candidate came from: each tree node's target draw is the
model's own, and a path is accepted while its tokens equal the draws (greedy identity, exact
sampling, whatever proposes). So a step's draft phase (``decode.draft_phase``) is a loop
over sources, each proposing candidates that start at the init token:

    Proposal.tokens   (B, N, L) int32  init token first, ``ABSENT`` past a candidate's end
    Proposal.present  (B, N, L) bool   or None when every candidate fills L
    Proposal.rank     int or (B,) int  higher packs first (per row); ties keep source order
    Proposal.state    the source's own state after drafting (None: it has none)
    Proposal.tail     (tokens, present) packed after every source's candidates (or None)

A source reads the step's ``DraftContext``: the target model, its hidden state at the last
cached token, the init token, the committed lengths and text (``history``), the attention
window, and ``own``, the source's state carried in ``DecodeState.sources``. A source state is
a tuple of lists of per-row cache arrays, rows on axis 0 and cache slots on axis 2 (a K/V
cache: (B, n_kv, S, D)), so the loop grows, re-lays and places it like the target's cache
(``grow_states``, ``pick_rows``). A source whose state must follow the committed text (a
draft model's K/V cache) re-runs, at the start of its next draft, the last committed tokens
whatever source had them accepted (``draft_model.DraftModelSource``): nothing is moved at
the commit, and the step needs no per-source commit hook.

Every source has a fixed id (its index in ``SOURCE_NAMES``): a step reports, per row, the
id of the source whose candidate it accepted, ``StepOutput.source`` (B,), and the host
counts that step's accepted drafts for that source (``by_source``).

Adding a source touches: (1) its class (``source_id``, ``length``, ``stateful``,
``propose``), here or in its own module; (2) its name in ``SOURCE_NAMES``; (3)
``decode.step_sources``, which builds a step's sources from the shape; (4) the shape field
that turns it on and sizes it (``shape.BeamShape``: parse, label, ``max_packed``,
``longest``, ``runnable``, ``validate``); (5) a stateful source: its state's prefill where
rows start (``batch.BatchGenerator._empty_sources`` and ``_prefilled_sources``, as the
draft model's ``draft_model.prefill``); (6) a separate model: its argument down the loop
(``draft_model=``, like the drafter's: ``batch.make_batch_step`` / ``batch_step`` /
``uniform_step``, ``BatchGenerator``, ``generation``, the scheduler, the CLI's ``Engine``)
and ``memory.check_step_memory``'s ``draft``. Stats, bench rows, ``--json`` and the chat
line read ``SOURCE_NAMES`` and need nothing. An early-exit source (the target's first layers
and an adapter with its own K/V cache: ``early_exit.EarlyExitSource``) is (1)-(5), its
adapter passed as the drafter (its chain is the shape's W1×L beam) or in the draft-model
slot (``draft=``, its chain the shape's D1×L, beside the recurrent drafter's beams):
``decode.step_sources`` picks the source by the module's type, and every place that holds,
prefills or prices the adapter's state finds it with ``early_exit.adapter_of`` wherever it
sits (``batch.held_sources``, ``BatchGenerator``, ``memory.check_step_memory``,
``measure.profile``; the draft slot's checks: ``draft_model.check_draft_slot``,
``loading.load``). The draft slot may hold a draft model and an adapter at once
(``draft_model.DraftPair``: both chains in the shape's D1×L part), so those places read the
slot's draft model with ``draft_model.draft_model_of``, its modules with ``slot_modules``
and a step's packed slots with ``step_capacity``. ``DraftContext.model`` is the target, it
reads the target's cache (``DraftContext.keys``/``values``) and returns it with its first
layers' K/V written above each row's length (``Proposal.cache``), which the verify then
takes.

Sources that sit out steps (the adaptive choice runs shapes with and without a stateful
source). A stateful source's state follows the committed text only on the steps that run
it, so the rule is:

* ``DecodeState.sources`` holds one state per stateful source the loop *has* (not per
  source a shape runs), in a fixed order (``batch.held_sources``: early-exit, as the drafter
  or in the draft slot, then a draft model; both with a ``DraftPair``); a step of a shape
  without one passes its
  state through untouched (``batch.make_batch_step`` hands each step only the states of the
  sources it runs);
* each stateful source says how many committed tokens its own draft re-runs first
  (``covers``: a draft model's ``catchup - 1``, an early-exit chain's ``refresh``), which
  bounds what a step of it leaves behind for the next;
* the loop (``batch.BatchGenerator``, host side, between steps) keeps, per held source, a
  bound on the committed tokens its state misses: after a step that ran it, that step's
  ``covers``; each step that did not, plus the most tokens that step commits (its shape's
  ``longest``; plain decoding: 1). Before queueing a step that runs the source with the
  bound above that step's ``covers``, it queues ``catch_up(ctx, bound)``: the source re-runs
  each row's last ``bound`` committed tokens, read from ``DraftContext.history`` (the
  device's text, which includes the step still in flight: the host never reads it), in
  chunks of ``catch_up_chunk(bound)`` (``catch_up_positions``); then the bound is 0. Lazy
  arrays only: no host read, and the step's graph takes the caught-up state as input;
* rows joining while the source is off get its state prefilled with their prompt when they
  join (``BatchGenerator._prefilled_sources``), so they start in sync; a forked row copies
  its parent's.

Re-running a token already in sync rewrites the same K/V, so the bound may overshoot; it
may never undershoot (tests/test_source_choice.py shows a missing catch-up changes drafts).
The verifier decides what is emitted: a stale source state only costs acceptance, so the
greedy-identity tests check the caches directly as well.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import mlx.core as mx

from .drafter import beam_search, frontier_tree
from .lookup import ABSENT, STRONG_MATCH, lookup_chains

PREFILL_CHUNK = 512  # prompt tokens per row a prefill runs in one forward (every prefill's)


def padded_chunks(rows: list[list[int]], size: int = PREFILL_CHUNK):
    """B rows' token lists in chunks of ``size``, right-padded with 0, for a prefill: yields
    (the chunk's B lists, tokens (B, T) int32, counts (B,) int32 real tokens per row)."""
    longest = max((len(r) for r in rows), default=0)
    for begin in range(0, longest, size):
        chunk = [r[begin : begin + size] for r in rows]
        T = max(len(c) for c in chunk)
        tokens = mx.array([c + [0] * (T - len(c)) for c in chunk], dtype=mx.int32)
        yield chunk, tokens, mx.array([len(c) for c in chunk], dtype=mx.int32)


CATCH_UP_CHUNK = 64  # most tokens per row one catch-up forward re-runs


def catch_up_chunk(count: int) -> int:
    """Tokens per catch-up forward for ``count`` missed tokens: the power of two >= count
    (at least 4: few shapes to build), at most ``CATCH_UP_CHUNK``."""
    size = 4
    while size < min(count, CATCH_UP_CHUNK):
        size *= 2
    return size


def catch_up_positions(lengths: mx.array, count: int) -> list[mx.array]:
    """The text positions a catch-up of ``count`` tokens re-runs, chunk by chunk: each row's
    ``[len - count, len)`` (from 0 in a shorter row), as (B, T) int32 arrays of
    ``catch_up_chunk(count)`` positions; the last chunk's positions at or past a row's
    length are padding (the caller writes them above the length)."""
    T = catch_up_chunk(count)
    begin = mx.maximum(lengths - count, 0)[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
    return [begin + c for c in range(0, count, T)]


SOURCE_NAMES = ("drafter", "lookup", "draft_model", "early_exit")
DRAFTER, LOOKUP, DRAFT_MODEL, EARLY_EXIT = range(len(SOURCE_NAMES))


class DraftContext(NamedTuple):
    """What a source may read to propose (B rows)."""

    model: Any  # the target Model (an early-exit source runs its first layers)
    hidden: mx.array  # (B, H) the target's hidden state at the last cached token
    init_token: mx.array  # (B,) the token the target produced last, not yet cached
    lengths: mx.array  # (B,) committed tokens per row
    history: mx.array | None  # (B, S) committed token ids, slot by slot
    window: int  # attention covers cache slots [0, window)
    own: Any = None  # this source's state (``DecodeState.sources[i]``)
    keys: list | None = None  # the target's cache, per layer (B, n_kv, S, D) (an early-exit
    values: list | None = None  # source runs the target's first layers on it)


class Proposal(NamedTuple):
    tokens: mx.array  # (B, N, L) int32, init token first, ABSENT past a candidate's end
    present: mx.array | None  # (B, N, L) bool; None: every candidate fills L
    rank: Any = 0  # int or (B,) int: higher packs first
    state: Any = None  # the source's state after drafting
    tail: tuple | None = None  # (tokens, present) packed after every source's candidates
    cache: tuple | None = None  # (keys, values): the target's cache after drafting, written
    # only above each row's length (the verify overwrites those slots); None: untouched


class DraftSource(Protocol):
    """A source of draft candidates (see the module docstring)."""

    source_id: int  # index in SOURCE_NAMES
    length: int  # tokens of its candidates, the init token included
    stateful: bool  # whether it carries a state in ``DecodeState.sources``

    def propose(self, ctx: DraftContext) -> Proposal: ...


class DrafterSource:
    """The recurrent drafter's W beams of L tokens (beam search over its head), plus the
    beams the search dropped on the way as a tail (``drafter.frontier_tree``)."""

    source_id = DRAFTER
    stateful = False

    def __init__(self, drafter, width: int, length: int):
        self.drafter, self.width, self.length = drafter, width, length

    def propose(self, ctx: DraftContext) -> Proposal:
        frontiers = []
        beams, _, _ = beam_search(
            self.drafter,
            ctx.model.embed,
            ctx.hidden,
            ctx.init_token,
            self.width,
            self.length,
            frontiers,
        )
        return Proposal(beams, None, 1, None, frontier_tree(frontiers, self.length, ABSENT))


class LookupSource:
    """K context-lookup chains of Lk tokens (``lookup.lookup_chains``); a row whose best
    match is at least ``STRONG_MATCH`` tokens ranks them before the drafter's beams (rank
    1): their rank is the match length shifted so that ``STRONG_MATCH`` ranks 2, one
    shorter ties with the drafter (which comes first in source order)."""

    source_id = LOOKUP
    stateful = False

    def __init__(self, chains: int, length: int):
        self.chains, self.length = chains, length

    def propose(self, ctx: DraftContext) -> Proposal:
        found = lookup_chains(ctx.history, ctx.lengths, ctx.init_token, self.chains, self.length)
        rank = found.match[:, 0]  # (B,); a view when STRONG_MATCH is 2
        if STRONG_MATCH != 2:
            rank = rank + (2 - STRONG_MATCH)
        return Proposal(found.tokens, found.present, rank)


class Merged(NamedTuple):
    tokens: mx.array  # (B, N, L)
    present: mx.array | None  # (B, N, L) bool or None
    source: mx.array  # (B or 1, N) int32 source id of each candidate
    only: int | None = None  # the one source every candidate came from, if so


def merge(proposals: list[Proposal], ids: list[int]) -> Merged:
    """Every proposal's candidates in one tree order: by rank (per row, higher first, ties in
    source order), then every tail. Shorter candidates are padded with ``ABSENT``."""
    n = max(p.tokens.shape[2] for p in proposals)
    B = proposals[0].tokens.shape[0]
    tokens = [pad(p.tokens, n, ABSENT) for p in proposals]
    if all(p.present is None and p.tokens.shape[2] == n for p in proposals):
        present = None
    else:
        present = [_present(p, n) for p in proposals]
    source = [[i] * p.tokens.shape[1] for p, i in zip(proposals, ids)]  # static, per source
    ranks = [p.rank for p in proposals]
    if len(proposals) > 1 and any(isinstance(r, mx.array) for r in ranks):
        # Per-row order: a stable sort of the candidates by their source's rank.
        total = sum(p.tokens.shape[1] for p in proposals)
        keys = mx.concatenate(
            [_rank_keys(r, B, p.tokens.shape[1]) for r, p in zip(ranks, proposals)], axis=1
        )
        order = mx.argsort(keys * total + mx.arange(total)[None], axis=1)  # (B, N)
        tokens = mx.take_along_axis(mx.concatenate(tokens, 1), order[:, :, None], axis=1)
        if present is not None:
            present = mx.take_along_axis(mx.concatenate(present, 1), order[:, :, None], axis=1)
        flat = mx.array([[i for ids_ in source for i in ids_]], mx.int32)  # a constant
        source = mx.take_along_axis(mx.broadcast_to(flat, (B, total)), order, axis=1)
    else:
        order = sorted(range(len(proposals)), key=lambda i: -ranks[i])  # stable
        tokens = mx.concatenate([tokens[i] for i in order], axis=1)
        if present is not None:
            present = mx.concatenate([present[i] for i in order], axis=1)
        source = [i for k in order for i in source[k]]
    tails = [(p.tail, i) for p, i in zip(proposals, ids) if p.tail is not None]
    for (t_tokens, t_present), i in tails:
        if present is None:
            present = mx.broadcast_to(mx.array(True), tokens.shape)
        tokens = mx.concatenate([tokens, pad(t_tokens, n, ABSENT)], axis=1)
        present = mx.concatenate([present, pad(t_present, n, False)], axis=1)
        tail = [i] * t_tokens.shape[1]
        if isinstance(source, list):
            source += tail
        else:
            source = mx.concatenate([source, mx.broadcast_to(mx.array([tail]), (B, len(tail)))], 1)
    only = ids[0] if len(set(ids)) == 1 else None
    if isinstance(source, list):
        source = mx.array([source], mx.int32)  # a constant: no kernel
    return Merged(tokens, present, source, only)


def _rank_keys(rank, B: int, N: int) -> mx.array:
    """(B, N) sort keys of one source's N candidates: minus its rank (int or (B,))."""
    if isinstance(rank, mx.array):
        return mx.broadcast_to(-rank.astype(mx.int32)[:, None], (B, N))
    return mx.full((B, N), -rank, mx.int32)


def _present(p: Proposal, n: int) -> mx.array:
    B, N, L = p.tokens.shape
    if p.present is not None:
        return pad(p.present, n, False)
    return mx.broadcast_to(mx.arange(n)[None, None, :] < L, (B, N, n))


def pad(x: mx.array, n: int, value) -> mx.array:
    """Extend (B, N, L) along its last axis to ``n`` with ``value``."""
    B, N, L = x.shape
    if n <= L:
        return x
    return mx.concatenate([x, mx.full((B, N, n - L), value, dtype=x.dtype)], axis=-1)


def by_source(source: int | None, accepted: int) -> tuple[int, ...]:
    """One row-step's accepted drafts per source (host side): ``accepted`` for the source
    id ``source`` (None: a step with no source, plain decoding), 0 for the others."""
    return tuple(accepted if i == source else 0 for i in range(len(SOURCE_NAMES)))


def grow_states(states: tuple, slots: int, grow) -> tuple:
    """Every source state with ``slots`` cache slots (``grow``: ``cache.grow``)."""
    return tuple(None if s is None else tuple(grow(part, slots) for part in s) for s in states)


def map_states(states: tuple, fn) -> tuple:
    """Apply ``fn`` to every per-row array of every source state (a re-lay of rows)."""
    return tuple(None if s is None else tuple([fn(a) for a in part] for part in s) for s in states)
