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
    Proposal.cache    the target's cache, written above each row's length (or None)

A source is one object (a ``Source``) that owns its whole life: its per-row state (the
empty state, the prefill where rows join, the catch-up after steps that ran without it),
its part of each step's tree (``length_in`` the shape, ``for_step``, ``propose``), its
checks against the target, its modules (compile inputs), its memory and profile parts and
its name in the stats. The loop holds an ordered tuple of them (``held.held_sources``, the
one place that turns the ``drafter`` and draft slots into sources and orders them) and
never asks which kind one is. Adding a source is one class in its own module, registered
by name (``register_source``: its id in ``StepOutput.source`` and its column in the
stats), passed in the draft slot (``draft_model=``; ``docs/design/adding-a-source.md``).

A source reads the step's ``DraftContext``: the target model, its hidden state at the last
cached token, the init token, the committed lengths and text (``history``), the attention
window, and ``own``, the source's state carried in ``DecodeState.sources``. A source state is
a cache of the verifier's entry types (``verifier.entries``: ``Slots``, (B, n_kv, S, D) keys
and values), so the loop grows, re-lays and places it like the target's cache, each entry
by its own methods (``grow_states``, ``map_states``). A source whose state must follow the
committed text (a draft model's K/V cache) re-runs, at the start of its next draft, the
last committed tokens whatever source had them accepted: nothing is moved at the commit,
and the step needs no per-source commit hook. ``for_step`` tells it the longest candidate
of the step's other sources (``other``), which bounds what another source's accepted path
commits.

Sources that sit out steps (the adaptive choice runs shapes with and without a stateful
source). A stateful source's state follows the committed text only on the steps that run
it, so the rule is:

* ``DecodeState.sources`` holds one state per stateful source the loop *holds* (not per
  source a shape runs), in held order; a step of a shape without one passes its state
  through untouched (``decode.draft_phase``);
* each stateful source says how many committed tokens its own draft re-runs first
  (``covers``: a draft model's ``catchup - 1``, an early-exit chain's ``refresh``), which
  bounds what a step of it leaves behind for the next;
* the loop (host side, between steps) keeps, per held source, a bound on the committed
  tokens its state misses: after a step that ran it, that step's ``covers``; each step
  that did not, plus the most tokens that step commits (its shape's ``longest``; plain
  decoding: 1). Before queueing a step that runs the source with the bound above that
  step's ``covers``, it queues ``catch_up(ctx, bound)``: the source re-runs each row's last
  ``bound`` committed tokens, read from ``DraftContext.history`` (the device's text, which
  includes the step still in flight: the host never reads it), in chunks of
  ``catch_up_chunk(bound)`` (``catch_up_positions``); then the bound is 0. Lazy arrays
  only: no host read, and the step's graph takes the caught-up state as input;
* rows joining while the source is off get its state prefilled with their prompt when they
  join (``prefill``), so they start in sync; a forked row copies its parent's.

Re-running a token already in sync rewrites the same K/V, so the bound may overshoot; it
may never undershoot (tests/engine/drafting/test_source_choice.py shows a missing catch-up
changes drafts).
The verifier decides what is emitted: a stale source state only costs acceptance, so the
greedy-identity tests check the caches directly as well.
"""

from __future__ import annotations

import abc
import copy
from typing import Any, NamedTuple

import mlx.core as mx

from ..core.footprint import StepMemory
from ..verifier.entries import grown, rows_of

ABSENT = -1  # token id of a candidate position that holds nothing
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


SOURCE_NAMES: list[str] = []  # every registered source's name; its index is its id


def register_source(name: str) -> int:
    """The id of the source named ``name`` (``StepOutput.source``, the stats' column), new
    names appended: a source class calls it once, at import (``source_id = ...``)."""
    if name not in SOURCE_NAMES:
        SOURCE_NAMES.append(name)
    return SOURCE_NAMES.index(name)


DRAFTER = register_source("drafter")
LOOKUP = register_source("lookup")
DRAFT_MODEL = register_source("draft_model")
EARLY_EXIT = register_source("early_exit")
MTP = register_source("mtp")  # heads/: a model's own MTP layers (``mtp_source.py``)


class DraftContext(NamedTuple):
    """What a source may read to propose (B rows)."""

    model: Any  # the target Model (an early-exit source runs its first layers)
    hidden: mx.array  # (B, H) the target's hidden state at the last cached token
    init_token: mx.array  # (B,) the token the target produced last, not yet cached
    lengths: mx.array  # (B,) committed tokens per row
    history: mx.array | None  # (B, S) committed token ids, slot by slot
    window: int  # attention covers cache slots [0, window)
    own: Any = None  # this source's state (``DecodeState.sources[i]``)
    cache: tuple | None = None  # the target's cache entries (an early-exit source runs the
    # target's first layers on it)


class Proposal(NamedTuple):
    tokens: mx.array  # (B, N, L) int32, init token first, ABSENT past a candidate's end
    present: mx.array | None  # (B, N, L) bool; None: every candidate fills L
    rank: Any = 0  # int or (B,) int: higher packs first
    state: Any = None  # the source's state after drafting
    tail: tuple | None = None  # (tokens, present) packed after every source's candidates
    cache: tuple | None = None  # the target's cache after drafting, written only above
    # each row's length (the verify overwrites those slots); None: untouched


STATEFUL_LIFE = ("empty_state", "prefill", "catch_up")  # what a stateful source defines


class Source(abc.ABC):
    """A draft source a loop holds (the module docstring). A subclass sets ``source_id``
    (``register_source``) and defines ``propose``; a stateful one (``stateful = True``)
    defines ``covers`` and its state's life too (checked when the class is made):

    - ``empty_state(model, batch, slots)``: its state for ``batch`` empty rows of ``slots``
      cache slots;
    - ``prefill(model, session, rows)``: its state after the prompts of ``session``'s
      ``rows`` (all in its cache: ``cache.Session``; ``session.cached[rows]`` their tokens);
    - ``catch_up(ctx, count)``: (its state after re-running each row's last ``count``
      committed tokens, the target's cache if it wrote it, else None). Lazy:
      no host read.

    ``part``: the shape's part that turns it on and sizes it: ``"chain"`` (the draft slot:
    one chain of the shape's ``D1×L``, ``model_length``), ``"beams"`` (the drafter slot: the
    shape's W×L) or ``"lookup"`` (K×Lk). Sized for a step by ``for_step`` (a copy: ``length``
    its candidates' tokens, the init token included; ``other`` the longest candidate of the
    step's other sources)."""

    source_id: int = -1
    stateful: bool = False
    part: str = "chain"
    order: int = 50  # the draft slot's order, lower first (``held.held_sources``)
    one_per_run: bool = False  # a run holds at most one source of this class
    length: int = 0
    other: int = 0
    state_index: int = -1  # sized: its state's index in ``DecodeState.sources``
    covers: int = 0  # stateful, sized: committed tokens its own draft re-runs (``for_step``)
    # stateful: its state takes in every step's committed path at the commit, from the step's
    # own arrays, whether or not it drafted (it defines ``absorb(model, own, path, before,
    # path_hidden, lengths)``: ``head_sources.HeadSource.absorb``; ``absorbed`` calls it)
    absorbs: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        life = (*STATEFUL_LIFE, *(("absorb",) if cls.absorbs else ()))
        missing = [m for m in life if cls.stateful and not callable(getattr(cls, m, 0))]
        if missing:
            raise TypeError(
                f"{cls.__name__} is stateful but does not define {', '.join(missing)}: a "
                "stateful source owns its state's life (docs/design/adding-a-source.md)"
            )

    @property
    def name(self) -> str:
        return SOURCE_NAMES[self.source_id]

    @property
    def modules(self) -> tuple:
        """The modules its steps read (their weights are the compiled step's inputs)."""
        return ()

    @property
    def feature_layers(self) -> tuple | None:
        """The target's layers whose features it reads (a drafter trained on other layers
        than the model taps sets the model's: ``Verifier.capture_features``); None: any."""
        return None

    def describe(self) -> str:
        """Its name for a banner or a table (the server's ``/health`` lists them)."""
        return self.name

    def memory(self, model, shape, batch: int, window: int):
        """Its share of a step's memory (``footprint.StepMemory``) for ``batch`` rows over
        ``window`` cache slots: the weights it holds, its state, and its draft's working set
        when ``shape`` runs it (the phases run one after the other)."""
        return StepMemory(0, 0, 0)

    def profile_counts(self) -> dict:
        """Sized: the forwards of its own parts one step runs, by ``measure.profile``'s
        weight-read names (``WeightBytes.per_step``'s counts); {}: none priced."""
        return {}

    def price(self, pricer):
        """Its weight reads, by ``pricer`` (``measure.profile.WeightPricer``): a source
        calls the pricer's method for what it runs; None: it reads no weights of its own."""
        return None

    def once_message(self) -> str:
        """Why a second source of its class is refused (``one_per_run``)."""
        return f"the {self.name} source was given twice: a run holds one; pass it once"

    def check(self, model) -> None:
        """ValueError naming the fix unless it can draft for ``model`` (before anything runs;
        a source with nothing to check passes)."""
        return None

    def bind(self, model) -> None:
        """Prepare for ``model`` before any step is compiled (e.g. bind a head; a source with
        nothing to prepare does nothing)."""
        return None

    def length_in(self, shape) -> int:
        """Tokens of its candidates in a step of ``shape``, the init token included; 0: the
        step runs without it."""
        return {"chain": shape.model_length, "beams": shape.length if shape.drafts else 0}.get(
            self.part, 0
        )

    def for_step(self, shape, length: int, other: int) -> Source:
        """A copy sized for a step of ``shape``: ``length`` tokens (``length_in``), ``other``
        the longest candidate of the step's other sources (0: none)."""
        sized = copy.copy(self)
        sized.length, sized.other = length, other
        return sized

    @abc.abstractmethod
    def propose(self, ctx: DraftContext) -> Proposal:
        """Its candidates for the step (inside the compiled step: tensor ops, no host read)."""


DraftSource = Source  # the public name (``redrafter_mlx.DraftSource``)


def sized_sources(held, shape) -> list[Source]:
    """The sources of ``held`` a step of ``shape`` runs, in held order, each sized for it
    (``Source.for_step``) and given ``state_index``: its state's index in
    ``DecodeState.sources`` (one per stateful held source, in held order; -1: none)."""
    lengths = [source.length_in(shape) for source in held]
    running = [i for i, n in enumerate(lengths) if n]
    out = []
    for i in running:
        other = max([0, *(lengths[j] for j in running if j != i)])
        sized = held[i].for_step(shape, lengths[i], other)
        sized.state_index = state_index(held, i)
        out.append(sized)
    return out


def state_index(held, i: int) -> int:
    """The index of ``held[i]``'s state in ``DecodeState.sources`` (-1: it has none)."""
    return sum(1 for s in held[:i] if s.stateful) if held[i].stateful else -1


def absorbed(held, states: tuple, model, path, before, path_hidden, lengths) -> tuple:
    """Every held stateful source's state after a step's commit: an ``absorbs`` one's
    through its ``absorb`` (the arguments as there), the others' as they are."""
    states = list(states)
    for i, source in enumerate(held):
        if source.absorbs:
            j = state_index(held, i)
            states[j] = source.absorb(model, states[j], path, before, path_hidden, lengths)
    return tuple(states)


def stateful(held) -> list[Source]:
    """The held sources with a state, in ``DecodeState.sources`` order."""
    return [s for s in held if s.stateful]


def step_capacity(shape, sources) -> int:
    """Packed slots a step of ``shape`` verifies with the sources ``sources`` (held or sized):
    the shape's (``BeamShape.slots``), and with no capacity asked, room for each chain of the
    draft slot past the first (``BeamShape.max_packed`` counts one ``D1×L`` chain). Every
    place that sizes a step by its slots asks this (the step, the loop's attention window,
    the memory check, the profile)."""
    extra = _extra_chains(shape, sources)
    if extra and shape.capacity is None:
        return shape.max_packed + extra * (shape.model_length - 1)
    return shape.slots


def step_candidates(shape, sources) -> int:
    """Candidates a step of ``shape`` packs with ``sources``: the shape's
    (``BeamShape.beams``, one ``D1×L`` chain) and each further draft-slot chain."""
    return shape.beams + _extra_chains(shape, sources)


def _extra_chains(shape, sources) -> int:
    chains = sum(1 for s in sources if s.part == "chain")
    return max(chains - 1, 0) if shape.model_length else 0


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
        present = [present_of(p, n) for p in proposals]
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


def present_of(p: Proposal, n: int) -> mx.array:
    """(B, N, n) bool: where a proposal's candidates hold a token, padded to ``n``."""
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


def grow_states(states: tuple, slots: int) -> tuple:
    """Every source state (a cache of entries) with ``slots`` cache slots."""
    return tuple(None if s is None else grown(s, slots) for s in states)


def map_states(states: tuple, fn) -> tuple:
    """Apply ``fn`` to every per-row array of every source state (a re-lay of rows)."""
    return tuple(None if s is None else rows_of(s, fn) for s in states)
