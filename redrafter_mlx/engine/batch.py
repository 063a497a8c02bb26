"""The engine's one generation loop: rows that join and leave a batch, each with its own
sampling settings, penalties, logit bias and seed (after mlx-lm's ``BatchGenerator``).

``BatchGenerator`` holds the decode state of B rows and owns everything between "prompts are
prefilled" (``Prefill``, chunk by chunk) and "their tokens come out, stopped exactly":
placing rows (an empty batch takes their cache as is; else their K/V, hidden state, init
token and key are written into free rows), growing and shrinking the batch (a re-lay of the
cache over one of a few row counts, rare), the queue-then-read pipeline (``queue`` a step
with ``mx.async_eval``, ``read`` an older one that is computed), exact stopping at EOS or a
row's limit (``cache.stop_at``), each row's statistics, the shape choice (a
``batch_choice.ShapePolicy``: each step's shape, and what each step gave) and the stateful
draft sources' catch-up after steps without them (``catch_up``; ``sources.py``, "Sources
that sit out steps"). ``step`` is one
turn of the loop: the next step queued and the previous one read, in the order
``platform.read_first`` measured for the backend. Its clients are thin: generation
(``generation.generate_steps``) and the server's scheduler, which keeps the requests, their
events and the broadcast to other ranks.

The step (``make_batch_step``, compiled once per configuration and kept on the model by
``batch_step``) is the one every loop runs, and the one ``bench --profile`` times.

The step is compiled for a fixed B (one of the row buckets), and nothing about the rows is a
compile key: per-row settings travel as arrays:

    active      (B,) bool     free rows compute but never advance their cache length
    rows        each row's sampling settings (``engine.sampling.RowSettings``: temperature,
                top-p, top-k, min-p, penalties, logit bias), each row's built when it is
                admitted (``sampling.one_row``, checked there), stacked by ``stack_rows``
    row_keys    (B, 2) uint32 one PRNG key per row, split once per step like a solo run's

A row's draws therefore equal the same request decoded alone (same key sequence, same
per-row math); see ``engine.sampling.draw``. Static switches (``StepMode``) only pick
how much sampling machinery the batch needs: argmax only, or Gumbel with the filters some
row uses, and whether any row has a logit bias or a penalty (with the history span its
windows need), and whether a row branches (``StepMode.split``).

Parallel branches (APAR, ``engine.branches``): a row whose ``branches`` holds its request's
``BranchTree`` passes its emitted tokens through it (``grow_branches``); a fork makes a new
row copied from the parent's (``fork``: no prefill, no roll-back, the fork being always a
step's last token) whose next draw is forced to the child token (``SplitRows.forced``). Forks
are granted per step where the branch limit leaves room (``fork_grants``), never by the
batch's free rows: a child with none free waits (``WaitingFork``, ``seat``), and its
parent's slot goes to it when the parent leaves first, so a request's answer is the one it
gives alone (``reserved``: free rows kept for the step in flight's forks). Where the backend reads
first (``platform.read_first``: the CPU) a branching row's step is read before the next is
queued; elsewhere the next step is queued first as long as no fork the step in flight may
make could change the next one's grants (``queue_ahead``: the limits far off), and a fork
then copies that step's own end state (``Queued.end``). docs/design.md, "The loop".
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

from .adaptive import rank0_shape
from .batch_choice import ShapePolicy
from .branches import BranchTree, Fork, SplitRows, step_split
from .cache import (
    SLOT_QUANTUM,
    Session,
    ensure_slots,
    prefill_session,
    step_window,
    stop_at,
    text_history,
)
from .decode import (
    DecodeState,
    StepOutput,
    autoregressive_step,
    first_draw,
    redrafter_step,
)
from .held import held_modules, held_sources, slot_items
from .lookup import LookupShadow
from .platform import read_first
from .sampling import (
    Rows,
    RowSampler,
    RowSettings,
    SamplerConfig,
    StepMode,
    one_row,
    row_keys_of,
    row_settings,
    stack_rows,
)
from .shape import AR, BeamShape
from .sources import (
    PREFILL_CHUNK,
    SOURCE_NAMES,
    DraftContext,
    by_source,
    map_states,
    sized_sources,
    stateful,
    step_capacity,
)


def split_row_keys(row_keys: mx.array) -> tuple[mx.array, mx.array]:
    """Split each row's key as a solo run splits its one key: (B, 2) -> next (B, 2), draw (B, 2)."""
    both = mx.vmap(mx.random.split)(row_keys)  # (B, 2, 2)
    return both[:, 0], both[:, 1]


def make_batch_step(model, drafter, shape, mode: StepMode, compiled: bool = True, draft=None):
    """A step ``(state, row_keys, active, rows, window, split) -> (state, row_keys,
    StepOutput)``; ``active`` (B,) bool, ``rows`` the batch's ``RowSettings``, ``split`` its
    rows' branching arrays (``branches.SplitRows``; read when ``mode.split``, else None).

    ``shape=None`` decodes autoregressively; a shape without drafter beams speculates from
    lookup chains alone (they read ``state.history``). Compile keys: B, cache slots, window.
    ``drafter`` and ``draft`` (the draft slot): the sources the loop holds
    (``held.held_sources``), every stateful one's state in ``state.sources``; the step runs
    those the shape turns on and passes the others' states through.
    ``run.counter["traces"]`` counts tracings (each is a compile).
    """
    held = held_sources(drafter, draft)
    for source in held:
        source.check(model)

    def step(
        init_token,
        hidden,
        lengths,
        keys,
        values,
        history,
        sources,
        row_keys,
        active,
        rows,
        window,
        split,
    ):
        counter["traces"] += 1
        draw_keys = row_keys  # unused by an all-greedy batch: its keys need not advance
        if mode.sample:
            row_keys, draw_keys = split_row_keys(row_keys)
        split = SplitRows(*split) if mode.split else None
        sampler = RowSampler(RowSettings(*rows), draw_keys, mode, split)
        state = DecodeState(init_token, hidden, lengths, keys, values, history, sources)
        if shape is None:
            nxt, out = autoregressive_step(model, state, sampler, window)
        else:
            nxt, out = redrafter_step(model, held, state, shape, sampler, window)
        nxt = nxt._replace(lengths=mx.where(active, nxt.lengths, 0))  # free rows stay empty
        return (*nxt, row_keys, *out)

    counter = {"traces": 0}
    # Weights are implicit inputs, read at every call: a model, drafter or draft model updated
    # in place (e.g. by training between evaluations) is never served with stale weights.
    modules = (model, *held_modules(held))
    weights = [m.state for m in modules if isinstance(m, nn.Module)]
    fn = mx.compile(step, inputs=weights) if compiled else step

    def run(
        state: DecodeState,
        row_keys: mx.array,
        active,
        rows: RowSettings,
        window: int,
        split: SplitRows | None = None,
    ):
        out = fn(*state, row_keys, active, tuple(rows), window, tuple(split or ()))
        fields = len(DecodeState._fields)
        return DecodeState(*out[:fields]), out[fields], StepOutput(*out[fields + 1 :])

    run.counter = counter  # tracings (each is a compile)
    return run


MAX_BATCH_STEPS = 16  # per model: shapes x sampling modes x drafters


def batch_step(
    model,
    drafter,
    shape: BeamShape | None,
    mode: StepMode,
    compiled: bool = True,
    draft=None,
):
    """The compiled batch step of this configuration, kept on the model (compiled once for
    every loop over it: each chat turn, each request batch)."""
    cache = model.__dict__.setdefault("_batch_steps", {})
    if shape is not None and getattr(model, "recurrent", False) and not shape.verifies_chain:
        shape = chain_for_recurrent(model, shape)
    layers = getattr(model, "feature_layers", ())
    slot = tuple(id(item) for item in slot_items(draft))
    key = (id(drafter), shape, mode, compiled, layers, slot)
    if key not in cache:
        while len(cache) >= MAX_BATCH_STEPS:  # drop the oldest (and the drafter it holds)
            cache.pop(next(iter(cache)))
        cache[key] = make_batch_step(model, drafter, shape, mode, compiled, draft)
    return cache[key]


def chain_for_recurrent(model, shape: BeamShape) -> BeamShape:
    """``shape.as_chain()``, said once per model: a model with recurrent layers verifies one
    chain a step (their state follows a chain, not a tree's branches)."""
    chain = shape.as_chain()
    if not model.__dict__.get("_chain_said"):
        model.__dict__["_chain_said"] = True
        warnings.warn(
            f"{model.model_type} keeps recurrent state, which follows one chain a step, not "
            f"a tree: {shape.label} runs as {chain.label} (one drafter beam, one lookup "
            "chain, or the draft model's chain, whichever each row ranks first)",
            stacklevel=3,
        )
    return chain


def uniform_step(
    model,
    drafter,
    shape: BeamShape | None,
    sampler: SamplerConfig,
    rows: int,
    seed: int = 0,
    compiled: bool = True,
    draft=None,
):
    """The batch step (``batch_step``) of ``rows`` active rows that all draw with ``sampler``,
    as ``run(state, window) -> (state, StepOutput)`` with the rows' keys (from ``seed``,
    split every step) carried inside: the product's own step, for measurements and tests.
    ``shape=None``: plain decoding; ``run.step``: the compiled step (``.counter``);
    ``draft``: the draft slot for the shape's ``D1×L`` chains (``held.slot_items``; the
    stateful sources' states in ``state.sources``)."""
    mode, settings = row_settings([sampler] * rows, model.vocab_size)
    draft = draft if shape and shape.model_length else None
    step = batch_step(model, drafter if shape else None, shape, mode, compiled, draft)
    active = mx.ones((rows,), dtype=mx.bool_)
    keys = {"rows": row_keys_of(mx.random.key(seed), rows)}

    def run(state: DecodeState, window: int):
        state, keys["rows"], out = step(state, keys["rows"], active, settings, window)
        return state, out

    run.step = step
    return run


# --------------------------------------------------------------------------- rows


@dataclass
class RowStats:
    """One row's counters (the server's per-request stats; a generation call sums its rows'
    into ``generation.DecodeStats``). Its steps are counted once, in ``accept_hist``: the
    step count, tokens they emitted and accepted drafts are read from it."""

    prompt_tokens: int
    generated: int = 0
    by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))  # accepted
    drafted: int = 0  # draft tokens its steps could accept (a shape's longest candidate, less 1)
    packed: int = 0  # tree slots its steps used
    accept_hist: list[int] = field(default_factory=list)  # [i]: steps that emitted i + 1
    queued_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0
    branches: int = 0  # a branching request's branches (``request_stats``), 0: branching off

    @property
    def steps(self) -> int:
        """Steps that advanced it."""
        return sum(self.accept_hist)

    @property
    def emitted_by_steps(self) -> int:
        """Tokens its steps emitted (accepted drafts + a bonus each)."""
        return sum((i + 1) * n for i, n in enumerate(self.accept_hist))

    @property
    def tokens_per_step(self) -> float:
        return self.emitted_by_steps / max(self.steps, 1)

    @property
    def accepted_drafts(self) -> int:
        """Draft tokens its steps' verifier accepted: each step emits them and one more."""
        return self.emitted_by_steps - self.steps

    @staticmethod
    def summed(stats: Sequence[RowStats]) -> RowStats:
        """The counters of ``stats`` (rows of one request or call, the first the root; at
        least one) added up: tokens, steps (row-steps, so tokens per step stays a per-row
        mean), accepted drafts per source, tree slots and the accept histogram; prompt
        tokens and times are the first's, decode time the longest."""
        root = stats[0]
        hist = [0] * max(len(r.accept_hist) for r in stats)
        for r in stats:
            for i, n in enumerate(r.accept_hist):
                hist[i] += n
        return RowStats(
            root.prompt_tokens,
            generated=sum(r.generated for r in stats),
            by_source=[sum(col) for col in zip(*(r.by_source for r in stats))],
            drafted=sum(r.drafted for r in stats),
            packed=sum(r.packed for r in stats),
            accept_hist=hist,
            queued_s=root.queued_s,
            ttft_s=root.ttft_s,
            decode_s=max(r.decode_s for r in stats),
        )

    def record(
        self, count: int, by_source: tuple[int, ...], packed: int, shape: BeamShape | None
    ) -> None:
        """A step of ``shape`` (None: plain decoding) gave this row ``count`` tokens
        (accepted drafts + the bonus), its accepted drafts ``by_source`` (one count per
        ``SOURCE_NAMES``), in ``packed`` tree slots."""
        self.by_source = [a + b for a, b in zip(self.by_source, by_source)]
        self.drafted += shape.longest - 1 if shape else 0
        self.packed += packed
        self.accept_hist += [0] * (count - len(self.accept_hist))
        self.accept_hist[count - 1] += 1

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
            **({"branches": self.branches} if self.branches else {}),
        )


@dataclass
class Row:
    """A sequence in a batch row. ``length``: its exact cache length as last read; ``limit``:
    the most tokens it may emit, ``at_limit`` why (``"length"`` / ``"context"``);
    ``owner``: the client's handle (the scheduler's request record).

    Branching (APAR, ``engine.branches``): ``branches`` is the request's ``BranchTree``
    (None: branching off) and ``branch`` this row's branch in it; every branch of a request
    is a row (``family``: all of them, the root first; a child shares its root's owner,
    sampler and limit, which bounds its own row like any row's). ``forced``: the token its
    next root draw is forced to (a new child's child token), -1: none."""

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
    sampling: Rows | None = None  # its sampling as arrays (``one_row``); None: built at its step
    branches: BranchTree | None = None
    branch: int = 0
    forced: int = -1
    forced_queued: bool = False  # its forced draw is in a queued step (later ones draw freely)
    family: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if not self.family:
            self.family.append(self)

    @property
    def request_done(self) -> bool:
        """Whether every row of its request finished (branching off: this row)."""
        return all(r.finished for r in self.family)

    @property
    def request_finish(self) -> str | None:
        """Why its request finished (None: it goes on): branching off, this row's reason;
        with branches, once every branch has, from the answer alone, not from which branch
        stopped how (that follows the timing: a branch whose text lies past the answer's
        end may stop at the budget or at its EOS): ``"context"`` when the context cap
        (``at_limit``) cut a branch inside the answer (the text before its cut ends before
        the budget: ``BranchTree.ends``), else ``"length"`` when the answer reached its
        budget (as a plain answer of ``max_tokens`` tokens does) or a row's own limit cut
        it, else ``"stop"``. Each branch's row is bounded by the context on its own (the
        prompt, its row: ``BranchTree.row``), so an answer may hold more tokens than the
        cap."""
        if self.branches is None:
            return self.finish
        if not self.request_done:
            return None
        tree, budget = self.branches, self.branches.budget
        ends = tree.ends()
        for row in self.family:
            if row.finish == "context" and (budget is None or ends[row.branch] < budget):
                return "context"
        if budget is not None and len(tree.linear()) >= budget:
            return "length"
        limits = (r.finish for r in self.family if r.finish not in ("stop", "context", None))
        return next(limits, "stop")

    def request_stats(self) -> RowStats:
        """Its request's counters: this row's, or with branches every branch's row's summed
        (``RowStats.summed``), ``branches`` set."""
        if self.branches is None:
            return self.stats
        total = RowStats.summed([r.stats for r in self.family])
        total.branches = len(self.branches.branches)
        return total


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
        trees = [row.branches for row in self.rows] if self.rows else [None] * rows
        fork_ok = fork_ok or [False] * rows
        ids, split = step_split(trees, fork_ok, [-1] * rows, getattr(model, "split_ids", ()))
        if ids:  # a branching row, or an APAR model's linear rows (no split token drawn)
            mode = mode._replace(split=ids)
            last = mx.array([p[-1] for p in prompts], mx.int32)
        sampler = RowSampler(settings, row_keys_of(first_key, rows), mode, split)
        history = text_history(prompts, self.session.slots) if self.sampler.reads_text else None
        lengths = mx.array([len(p) for p in prompts], mx.int32)
        first = first_draw(model, self.hidden, sampler, history, lengths, last)
        return first.tolist(), row_keys_of(rng, rows)


class Turn(NamedTuple):
    """What one ``BatchGenerator.next`` gave: rows that joined (their first token),
    rows a step advanced, and prefills that failed on their own (the batch goes on)."""

    joined: list[RowStep]
    stepped: list[RowStep]
    failed: list[tuple[Prefill, Exception]]


class RowStep(NamedTuple):
    """What one step gave one row: the tokens it emits (``new``, exact stop), why it finished
    (None: it goes on), and the step's own count (accepted drafts + bonus), tree slots used
    and accepted drafts per source (``SOURCE_NAMES`` order; empty: none)."""

    row: Row
    new: list[int]
    finish: str | None
    count: int
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
    grants: tuple[bool, ...] = ()  # per owner: whether it may fork in this step
    end: tuple = ()  # (init_token (B,), hidden (B, H), lengths (B,), row_keys (B, 2)) after it


@dataclass
class WaitingFork:
    """A child branch's row waiting for a slot (``BatchGenerator.fork``): ``row`` (in its
    request's ``family``, slot -1 until seated), ``source``: the running row whose cache
    holds the child's prefix (its parent, or the heir its parent's slot went to), ``end``:
    the small arrays of the fork, (init_token (1,), hidden (1, H), lengths (1,), row_keys
    (1, 2))."""

    row: Row
    source: Row
    end: tuple


def take_rows(
    state: DecodeState, row_keys: mx.array, idx: mx.array | None, extra: int = 0
) -> tuple[DecodeState, mx.array]:
    """The decode state and keys (B, 2) of rows ``idx`` (b,) in that order (None: all B),
    then ``extra`` empty rows (zeros): the cache rows (the draft sources' states too)
    copied (rare: a batch's resize)."""

    def pick(a):  # (B, ...) -> (b + extra, ...)
        a = a if idx is None else a[idx]
        if extra:
            return mx.concatenate([a, mx.zeros((extra, *a.shape[1:]), a.dtype)])
        return a

    s = state
    return s._replace(
        init_token=pick(s.init_token),
        hidden=pick(s.hidden),
        lengths=pick(s.lengths),
        keys=[pick(k) for k in s.keys],
        values=[pick(v) for v in s.values],
        history=None if s.history is None else pick(s.history),
        sources=map_states(s.sources, pick),
    ), pick(row_keys)


def row_buckets(max_batch: int) -> list[int]:
    """Batch sizes the step is compiled for: 1, 2, 4, ... below ``max_batch``, then it."""
    sizes = [1]
    while sizes[-1] * 2 < max_batch:
        sizes.append(sizes[-1] * 2)
    return sizes + ([max_batch] if max_batch > 1 else [])


class BatchGenerator:
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
        draft=None,
    ):
        self.model, self.drafter, self.draft = model, drafter, draft  # draft: the slot
        self.held = held_sources(drafter, draft)  # every source, in ``DecodeState`` order
        for source in self.held:
            source.bind(model)  # e.g. an adapter's shortlist head rows, before any compile
        self.stateful = stateful(self.held)  # those with a state in ``DecodeState.sources``
        # Per stateful source: committed tokens its state may miss (``sources.py``, "Sources
        # that sit out steps"); host side, from the shapes queued, never read from the device.
        self.behind = [0] * len(self.stateful)
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

    # ------------------------------------------------------------------ rows joining

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
        self.state = DecodeState(
            first, hidden, session.lengths, session.keys, session.values, history, sources
        )
        session.keys = session.values = None  # the batch owns the cache (in-place updates)
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
        for cache, row_cache in (
            (self.state.keys, session.keys),
            (self.state.values, session.values),
        ):
            for layer, src in enumerate(row_cache):
                cache[layer][r : r + 1, :, : src.shape[2]] = src[i : i + 1]
        s = self.state
        history = s.history
        if history is not None:  # the row's text so far: its prompt, all in the cache
            text = text_history(session.cached[i : i + 1], history.shape[1])
            history = mx.where(at[:, None], text, history)
        for state, row_state in zip(s.sources, self._prefilled_sources(session, slice(i, i + 1))):
            for cache, row_cache in zip(state, row_state):  # (keys, values)
                for layer, src in enumerate(row_cache):
                    cache[layer][r : r + 1, :, : src.shape[2]] = src
        self.state = s._replace(
            init_token=mx.where(at, first, s.init_token),
            hidden=mx.where(at[:, None], hidden, s.hidden),
            lengths=mx.where(at, session.lengths[i], s.lengths),
            history=history,
        )
        self.row_keys = mx.where(at[:, None], rng[None], self.row_keys)

    # ------------------------------------------------------------------ rows leaving

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
        keep = not self.release and row.branches is None  # a branch's row is always freed
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

    # ------------------------------------------------------------------ branches

    def grow_branches(
        self,
        row: Row,
        new: list[int],
        finish: str | None,
        drafted: list[bool] | None = None,
        read: tuple[Queued, int] | None = None,
    ) -> None:
        """A branching row's emitted tokens into its request's tree (``BranchTree.extend``,
        with ``drafted``: which were accepted drafts); a fork makes the child's row
        (``fork``; ``read``: the step read and the row's index in it, None: its first
        token, just joined), a finished row finishes its branch."""
        tree = row.branches
        if tree is None:
            return
        drafted = drafted or [False] * len(new)
        if row.forced >= 0:  # a child's first step: its forced child token, already recorded
            if new[:1] != [row.forced]:
                raise RuntimeError(f"branch {row.branch} did not draw its forced child token")
            new, drafted, row.forced = new[1:], drafted[1:], -1
        # A row that ends here makes no child: a fork at its token limit has no room for one.
        ext = tree.extend(row.branch, new, can_fork=finish is None, drafted=drafted)
        if ext.keep != len(new):  # fork_ok grants no fork past the limits (``_split``)
            raise RuntimeError(f"branch {row.branch} forked past the branch limit")
        if ext.fork is not None:
            self.fork(row, ext.fork, read)
        if finish is not None:
            tree.finish(row.branch)

    def end_answers(self, rows) -> list[Row]:
        """After a step (or a join) of ``rows``: the branches whose text would all lie past
        their answer's end (``BranchTree.past_budget``) finish (``"length"``), their rows
        freed; returns those rows. Once per step, after every row's tokens, so what a
        request decodes never depends on its rows' order in the batch."""
        ended = []
        for row in {id(r.branches): r for r in rows if r.branches is not None}.values():
            past = row.branches.past_budget()
            for other in row.family:
                if other.branch in past:
                    other.finish = "length"
                    self.leave(other)
                    row.branches.finish(other.branch)
                    ended.append(other)
        return ended

    def fork(self, parent: Row, fork: Fork, read: tuple[Queued, int] | None = None) -> Row:
        """A new row for ``fork``'s child: a copy of the parent's row (K/V, the draft
        sources' states such as a draft model's cache, text, hidden state, init token = the
        fork token, key; no prefill), whose next draw is forced to the child token.

        The fork's state is the parent's after the step that drew the fork token (a fork is
        always a step's last token: ``branches.fork_not_drafted``): ``read``, that step and
        the parent's index in it, whose end state (``Queued.end``) gives the small arrays
        (None: the parent's row as it is now, a first token, the row just joined); they are
        kept with the child (``WaitingFork.end``). The caches and the text are copied when
        the child is seated, from the row that holds the prefix then (``WaitingFork.source``):
        its later steps write only past the fork's length, which the child's own steps
        overwrite. With no row free the child waits (``seat``; its parent goes on) rather
        than the fork being refused: a request forks where it would alone."""
        tree = parent.branches
        child = Row(
            parent.sampler,
            parent.limit,
            parent.length,
            RowStats(parent.stats.prompt_tokens),
            owner=parent.owner,
            at_limit=parent.at_limit,
            slot=-1,
            out=parent.out,
            sampling=parent.sampling,
            branches=tree,
            branch=fork.child,
            forced=tree.rules.child_id,
            family=parent.family,
        )
        parent.family.append(child)
        s, i = self.state, parent.slot
        end = (s.init_token, s.hidden, s.lengths, self.row_keys)
        if read is not None:
            end, i = read[0].end, read[1]
        end = tuple(a[i : i + 1] for a in end)  # this row's: (1,), (1, H), (1,), (1, 2)
        self.waiting.append(WaitingFork(child, parent, end))
        self.seat()
        return child

    @property
    def free_rows(self) -> int:
        """Rows a waiting child may take now: ``max_batch`` less the running rows and the
        rows the waiting prefills will take (``insert``: admitted first, they keep theirs)."""
        prefilling = sum(len(job.prompts) for job in self.prefills)
        return self.max_batch - len(self.active) - prefilling

    def seat(self) -> None:
        """Seat waiting children (``fork``) in free rows, oldest first."""
        while self.waiting and self.free_rows > 0:
            waiting = self.waiting.pop(0)
            if None not in self.rows:
                self.resize(self.bucket_for(len(self.rows) + 1))
            self._seat(waiting, self.rows.index(None))

    def _seat(self, waiting: WaitingFork, c: int) -> None:
        """Put a waiting child in slot ``c``: the caches and text of its source's row
        (unless ``c`` is that row's own slot, handed over: ``leave``), then the small arrays
        of its fork (``WaitingFork.end``)."""
        s, p = self.state, waiting.source.slot
        at = mx.arange(len(self.rows)) == c
        history = s.history
        if p != c:
            source_caches = [part for state in s.sources if state is not None for part in state]
            for cache in (s.keys, s.values, *source_caches):
                for layer in cache:
                    layer[c : c + 1] = layer[p : p + 1]
            if history is not None:
                history = mx.where(at[:, None], history[p : p + 1], history)

        def copied(a, row):  # (B, ...): slot c takes ``row`` (1, ...)
            return mx.where(at.reshape((-1,) + (1,) * (a.ndim - 1)), row, a)

        init_token, hidden, lengths, row_keys = waiting.end
        self.state = s._replace(
            init_token=copied(s.init_token, init_token),
            hidden=copied(s.hidden, hidden),
            lengths=copied(s.lengths, lengths),
            history=history,
        )
        self.row_keys = copied(self.row_keys, row_keys)
        child = waiting.row
        child.slot, child.joined = c, time.perf_counter()
        self.rows[c] = child
        self.vacated.pop(c, None)
        self._params = None

    def fork_grants(self, rows: list[Row | None], in_flight: bool = True) -> list[bool]:
        """Which of ``rows`` may fork in the draw made now: each branching row its tree
        allows (``BranchTree.fork_allowed``), in row order, as long as its request's branch
        limit leaves room for the children (one fork per row per draw), so every fork drawn
        is made. The batch's free rows play no part: a child with no row free waits for one
        (``fork``), so a request forks where it would alone, whatever else the batch runs.
        ``in_flight``: the step in flight, not yet read, forks wherever it was granted (the
        branches it may make are taken); False: it forks nowhere."""
        taken: dict[int, int] = {}
        if in_flight and self.pending is not None:
            for row, granted in zip(self.pending.owners, self.pending.grants):
                if granted:
                    taken[id(row.branches)] = taken.get(id(row.branches), 0) + 1
        room: dict[int, int] = {}
        grants = []
        for row in rows:
            tree = row.branches if row is not None else None
            ok = tree is not None and not row.finished and tree.fork_allowed(row.branch)
            if ok:
                left = tree.rules.max_branches - len(tree.branches) - taken.get(id(tree), 0)
                ok = room.setdefault(id(tree), left) > 0
            if ok:
                room[id(tree)] -= 1
            grants.append(ok)
        return grants

    @property
    def reserved(self) -> int:
        """Free rows kept for the forks of the step in flight (its grants, at most the rows
        free after the waiting children's: ``free_rows``), so that a new request admitted
        meanwhile does not make them wait."""
        if self.pending is None:
            return 0
        return max(0, min(sum(self.pending.grants), self.free_rows - len(self.waiting)))

    def _split(self, grants: list[bool]) -> tuple[tuple[int, ...], SplitRows | None]:
        """The step's split ids and per-row branching arrays (``branches.step_split``: none
        without a branching row, unless the model has split tokens: then its linear rows
        must not draw them). A child's forced draw is queued once."""
        trees = [r.branches if r is not None else None for r in self.rows]
        forced = [r.forced if r is not None and not r.forced_queued else -1 for r in self.rows]
        return step_split(trees, grants, forced, getattr(self.model, "split_ids", ()))

    @property
    def branching(self) -> bool:
        """Whether a running row has branching on."""
        return any(r.branches is not None for r in self.active)

    def queue_ahead(self) -> bool:
        """Whether the next step may be queued before the one in flight is read, with
        branching rows (each a fork in waiting): when no fork that step could make changes
        the next step's grants (limits far off: its grants are the same whether it forks
        everywhere it may or nowhere). A fork then copies the step's own end state
        (``Queued.end``): the next step only writes past it. Otherwise the step is read
        first and the grants see its forks."""
        if not self.branching:
            return True
        return self.fork_grants(self.rows) == self.fork_grants(self.rows, in_flight=False)

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

    # ------------------------------------------------------------------ stepping

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
            self._params = (mode._replace(split=ids), active, settings, split, grants)
        return self._params

    def _step_fn(self, shape: BeamShape | None, mode: StepMode):
        return batch_step(self.model, self.drafter, shape, mode, self.compiled, self.draft)

    def catch_up(self, shape: BeamShape | None, window: int) -> None:
        """Before queueing a step of ``shape``: each stateful source it runs whose state may
        miss more committed tokens than its own draft re-runs (``covers``) re-runs them
        now (``catch_up``, lazy: the step's graph takes the result); then account for the
        step in every stateful source's bound (``sources.py``, "Sources that sit out
        steps")."""
        running = sized_sources(self.held, shape) if shape is not None else []
        ran = {source.state_index: source for source in running if source.stateful}
        for i, source in ran.items():
            missed = self.behind[i]
            if missed <= source.covers:
                continue
            s = self.state
            ctx = DraftContext(
                self.model, s.hidden, s.init_token, s.lengths, s.history, window,
                own=s.sources[i], keys=s.keys, values=s.values,
            )  # fmt: skip
            state, cache = source.catch_up(ctx, missed)
            sources = list(s.sources)
            sources[i] = state
            s = s._replace(sources=tuple(sources))
            if cache is not None:
                s = s._replace(keys=cache[0], values=cache[1])
            self.state = s
            self.catch_ups += 1
        for i in range(len(self.stateful)):
            if i in ran:
                self.behind[i] = ran[i].covers
            else:
                self.behind[i] += shape.longest if shape else 1

    def most_slots(self) -> int:
        """The most slots a step of the policy's shapes writes past a row: its ``slots``, and
        each shape's ``sources.step_capacity`` (further draft-slot chains)."""
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

    def insert(self, job: Prefill) -> None:
        """Queue prompts to join (their rows in ``job.rows``); ``next`` prefills them."""
        self.prefills.append(job)
        self._params = None  # the rows forks may take (``fork_grants``) count it

    def next(self, budget: int | None = PREFILL_CHUNK) -> Turn:
        """One call advances everyone: up to ``budget`` prompt tokens of the waiting
        prefills, in order (at least one chunk; None: all of them), each joining with its
        first token once complete; the batch shrunk if mostly free; then one ``step``.

        A prefill or first draw that raises fails that prefill alone (``Turn.failed``); a
        failure in the batch's own work (a join, the step) raises, with every prefill not
        joined in ``prefills`` (those that failed alone too), for the client to answer."""
        turn = Turn([], [], [])
        try:
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
                    for row, (new, finish) in zip(job.rows, joined):
                        turn.joined.append(RowStep(row, new, finish, 1, 0))
            self.fit()
            turn.stepped.extend(self.step())
        except Exception:
            self.prefills[:0] = [job for job, _ in turn.failed]
            raise
        return turn

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
        window = step_window(longest, self.inflight, self.policy.per_step, self.most_slots())
        self.state = ensure_slots(self.state, window)
        shape = self.next_shape()
        self.catch_up(shape, window)
        mode, active, rows, split, grants = self._row_params()
        key = (shape, mode, len(self.rows), window, self.state.keys[0].shape[2])
        started = time.perf_counter() if key in self._traced else None  # else: it compiles
        self._traced.add(key)
        step = self._step_fn(shape, mode)
        state, self.state = self.state, None  # only the step's graph holds the cache
        host = time.perf_counter()
        try:
            state, self.row_keys, out = step(state, self.row_keys, active, rows, window, split)
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
            delivered.append(RowStep(row, new, finish, counts[r], packed[r], by[r]))
            if row.finished and row.shadow is not None:
                resolved += row.shadow.finish(0)
        for row in self.end_answers([d.row for d in delivered]):
            if row.shadow is not None:
                resolved += row.shadow.finish(0)
        self.policy.finished(len(step.owners), step.shape or AR, ran, seconds)
        self.policy.lookup_seen(resolved)
        return delivered
