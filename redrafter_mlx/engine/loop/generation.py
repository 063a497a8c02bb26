"""The generation loop and the public API: ``stream_generate``, ``generate``, ``batch_generate``.

``generate_steps`` is a client of the engine's one batched loop (``batch.BatchGenerator``,
which the server's scheduler drives too): its rows are prefilled together in a ``Session``
(``prefilling.Prefill``), join the batch (which takes their cache as is), and advance one
``BatchGenerator.step`` per event (the batch keeps the next step queued with
``mx.async_eval`` where the backend gains by it, so text streams one step behind). It stops
exactly: no token after EOS or beyond ``max_tokens``, even when more were accepted in the
same step (``cache.stop_at``). A ``Session`` (``engine/decoding/cache.py``) owns the KV cache
of its rows across calls, so a chat turn prefills only its new tokens.

Parallel branches (APAR, ``engine.core.branches``): with branching on, each prompt's request owns
a ``BranchTree`` and its branches are rows of the batch (``BatchGenerator.fork``); an event
gives each prompt's rebuilt text as it becomes final (``BranchTree.take_final``: root ->
detail -> next, split tokens left out), and the request finishes when every branch has.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import mlx.core as mx

from ..base.distributed import shared_seed
from ..core.branches import BranchRules, Piece, check_branching_model, request_rows
from ..core.sampling import SamplerConfig, check_seed
from ..core.shape import BeamShape
from ..decoding.cache import SLOT_QUANTUM, Session
from ..decoding.decode import DecodeState
from ..drafting.drafter import Drafter
from ..drafting.sources import SOURCE_NAMES
from ..verifier.entries import rows_of
from ..verifier.protocol import Verifier
from .adaptive import Adaptive
from .arguments import api_arguments
from .batch import BatchGenerator
from .plan import DEFAULT_SHAPE, default_plan
from .prefilling import Prefill
from .rows import Row, RowStats
from .run import (
    Run,
    check_api_sources,
    check_branch_memory,
    check_prompts,
    make_row,
    resolve_branches,
)


@dataclass
class DecodeStats:
    """Running statistics of one ``generate_steps`` call, as of the latest event.

    ``tokens_per_step`` and ``mean_packed`` average over row-steps; ``accept_hist[i]`` counts
    row-steps that emitted ``i + 1`` tokens (accepted drafts + the bonus token).
    """

    steps: int = 0
    prompt_tokens: int = 0
    prefilled_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    tokens_per_step: float = 1.0
    mean_packed: float = 1.0
    time_to_first_token: float = 0.0
    host_ms_per_step: float = 0.0
    peak_memory_gb: float = 0.0
    accept_hist: list[int] = field(default_factory=list)
    accepted_tokens: int = 0  # draft tokens the verifier accepted, over all row-steps
    source_tokens: dict = field(default_factory=dict)  # of those, per draft source name
    branches: int = 0  # branches decoded (APAR; the roots counted), 0 with branching off

    def to_dict(self) -> dict:
        """The statistics as a JSON-ready dict (this class's fields)."""
        return {f.name: getattr(self, f.name) for f in fields(DecodeStats)}


@dataclass
class DecodeEvent:
    """What one step of ``generate_steps`` produced for its B rows (the first event: the
    first token).

    tokens:   per row, the new tokens (after EOS/limit truncation; empty once finished)
    accepted: per row, draft tokens the verifier accepted this step
    drafted:  per row, for each new token, whether it was a draft (drafter or lookup; with
              branching on, as the branch that wrote it accepted it)
    finish:   per row, None while running, then ``"stop"`` (EOS), ``"length"`` (max_tokens)
              or ``"context"`` (the model's context is full)
    stats:    running statistics of the whole call
    by_source: per row, accepted draft tokens per source (``SOURCE_NAMES`` order)
    branches: per row, with branching on, ``[(branch id, its new tokens), ...]`` this step
              (``tokens`` is then the rebuilt text's newly final part); empty else
    pieces:   per row, with branching on, the whole rebuilt text so far by branch, in text
              order (``BranchTree.pieces``: a live view's); empty else
    """

    tokens: list[list[int]]
    accepted: list[int]
    drafted: list[list[bool]]
    finish: list[str | None]
    stats: DecodeStats
    by_source: list[tuple[int, ...]] = field(default_factory=list)
    branches: list[list[tuple[int, list[int]]]] = field(default_factory=list)
    pieces: list[tuple[Piece, ...]] = field(default_factory=list)


@dataclass
class GenerationResponse(DecodeStats):
    """One streamed chunk of one prompt plus the running stats (``DecodeStats`` fields).

    ``text``/``tokens`` are new since the previous response; ``drafted_tokens`` marks which of
    ``tokens`` came from the drafter; ``finish_reason`` is None until the last response.
    With branching on, ``text``/``tokens`` are the rebuilt text's newly final part (each
    token's ``drafted_tokens`` mark carried from the branch that wrote it) and
    ``branch_tokens`` each branch's own new tokens this step (``DecodeEvent.branches``),
    ``branch_pieces`` the whole rebuilt text so far by branch (``DecodeEvent.pieces``).
    """

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    finish_reason: str | None = None
    drafted_tokens: list[bool] = field(default_factory=list)
    branch_tokens: list[tuple[int, list[int]]] = field(default_factory=list)  # (id, new)
    branch_pieces: tuple[Piece, ...] = ()

    @property
    def stats(self) -> DecodeStats:
        """The statistics alone."""
        return DecodeStats(**DecodeStats.to_dict(self))


def generate_steps(
    model: Verifier,
    drafter: Drafter | None,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 256,
    shape: BeamShape = DEFAULT_SHAPE,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    eos_token_ids: Sequence[int] = (),
    session: Session | None = None,
    adapt: Adaptive | bool = False,
    draft_model: Any = None,
    branches: BranchRules | None = None,
) -> Iterator[DecodeEvent]:
    """Decode B rows; yield one :class:`DecodeEvent` per step with each row's new tokens.

    ``drafter=None`` keeps only ``shape``'s lookup chains (none: plain decoding); an
    autoregressive ``shape`` decodes plainly (one token per step).
    ``adapt``: every few steps run the shape with the best measured tokens/s among plain
    decoding, ``shape`` and the single beams ``W1×L``..``W1×L2`` (``True``), or as an
    :class:`Adaptive` says;
    ``False`` pins ``shape``. Greedy output is the same whatever shape runs; a seeded sample
    depends on the shapes (one draw per tree node), so ``True`` pins when sampling with a
    ``seed`` (reproducible), while an explicit :class:`Adaptive` still adapts.
    Rows that finish stop emitting; the loop ends when all rows have finished.
    A ``shape`` whose step cannot fit in memory raises ``memory.ShapeTooLarge`` first.
    ``draft_model``: a model sharing the vocabulary whose greedy chain joins the tree
    (``draft_model.py``; the shape's ``D1×L``, else ``D1×`` its drafter length), or an
    early-exit adapter (``early_exit.py``: its chain is the ``D1×L``, beside the recurrent
    drafter's beams; an adapter in both slots is a ValueError), any ``sources.Source``, or a
    list of them (each proposes its own ``D1×L`` chain: ``held.held_sources``); adaptive
    runs choose among shapes with and without its chain, as with an early-exit adapter as
    the drafter (the loop catches a source's cache up on steps it sat out: ``sources.py``).
    ``branches``: the model's branching rules (``branches.branch_rules``; None: off): each
    row's branches decode as rows of their own (adaptive runs choose per batch size, as the
    server does: ``batch_choice.BatchChoice``; a fork copies the parent's draft-model
    cache too), and ``max_tokens`` bounds each prompt's answer, the rebuilt text (its first
    ``max_tokens`` tokens: ``branches``' module docstring, "The answer's length"); the
    events give the rebuilt text (module docstring); the session keeps the prompts' cache
    afterwards (no one row holds the rebuilt text, but every branch's starts with its
    prompt), so a next turn prefills what follows them.
    """
    run = Run.of(model, drafter, draft_model, shape)  # the slot checked, the shape resolved
    yield from run_steps(
        run,
        prompts,
        max_tokens=max_tokens,
        sampler=sampler,
        seed=seed,
        eos_token_ids=eos_token_ids,
        session=session,
        adapt=adapt,
        branches=branches,
    )


def run_steps(
    run: Run,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 256,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    eos_token_ids: Sequence[int] = (),
    session: Session | None = None,
    adapt: Adaptive | bool = False,
    branches: BranchRules | None = None,
) -> Iterator[DecodeEvent]:
    """``generate_steps`` over a run already resolved (``Run.of``, or ``Run.of_sources`` from
    a tuple of sources: the profile's loop), its other arguments as ``generate_steps``'s."""
    model, shape = run.model, run.shape
    prompts = [list(map(int, p)) for p in prompts]
    sampler = sampler.validate(model.vocab_size)
    seed = check_seed(seed) if seed is not None else sampler.seed
    check_prompts(model, prompts, max_tokens)
    if branches is not None:
        check_branching_model(model)
    row_tokens, _ = request_rows(branches, max_tokens)  # a row's most tokens
    longest = max(len(p) for p in prompts) + row_tokens
    B = len(prompts)
    max_batch = B * branches.max_branches if branches else B  # every branch is a row
    check_branch_memory(model, run.sources, shape, B, max_batch, longest, sampler)
    session = session or Session(model, len(prompts))
    if session.batch != len(prompts):
        raise ValueError(f"session has {session.batch} rows but {len(prompts)} prompts were given")
    eos = set(int(e) for e in eos_token_ids)
    if adapt is True and seed is not None and not sampler.greedy:
        adapt = False  # the schedule follows wall time: a seeded sample must be reproducible
    policy = run.policy(adapt, "branches" if branches else "fixed", sampler)
    batch = run.generator(policy, eos, max_batch, release=False)

    group = getattr(model, "group", None)  # tensor parallel: every rank must draw alike
    seed = shared_seed(seed, group) if group is not None else seed
    seed = seed if seed is not None else int(time.time_ns() % (1 << 31))
    rows = [make_row(model, sampler, len(p), max_tokens, branches) for p in prompts]
    out = [[] for _ in range(B)]

    tic = time.perf_counter()
    job = Prefill(prompts, sampler, seed, session, rows=rows)  # what the session lacks
    call = _Call(sum(len(p) for p in prompts), job.prefilled, length=max(policy.per_step, 2))
    batch.insert(job)
    try:
        turn = batch.next(budget=None)  # the prompts prefilled and joined; step 1 queued
        if turn.failed:
            raise turn.failed[0][1]
        first_new = [got.new for got in turn.joined]
        for r, new in enumerate(first_new):
            out[r] += new
        call.prompt_s = call.first_token_s = time.perf_counter() - tic
        call.started = time.perf_counter()
        if branches:
            yield _branch_event(rows, turn.joined, call.snapshot(_family(rows), batch.host_s))
        else:
            yield DecodeEvent(
                first_new,
                [0] * B,
                [[False] * len(t) for t in first_new],
                [row.finish for row in rows],
                call.snapshot(rows, batch.host_s),
                [(0,) * len(SOURCE_NAMES)] * B,
            )
        while not all(row.request_done for row in rows):
            stepped = batch.next().stepped
            if branches:
                call.steps += 1
                yield _branch_event(rows, stepped, call.snapshot(_family(rows), batch.host_s))
                continue
            got = {id(g.row): g for g in stepped}  # one step read
            call.steps += 1
            new_rows, acc_rows, drafted_rows, by = [], [], [], []
            for r, row in enumerate(rows):
                g = got.get(id(row))
                if g is None:  # finished before this step
                    new_rows.append([]), acc_rows.append(0), drafted_rows.append([])
                    by.append((0,) * len(SOURCE_NAMES))
                    continue
                out[r] += g.new
                new_rows.append(g.new)
                acc_rows.append(g.count - 1)
                drafted_rows.append([i < g.count - 1 for i in range(len(g.new))])
                by.append(g.by_source)
            yield DecodeEvent(
                new_rows,
                acc_rows,
                drafted_rows,
                [row.finish for row in rows],
                call.snapshot(rows, batch.host_s),
                by,
            )
    finally:
        if branches:
            _hand_back_prompts(session, batch, rows, prompts)
        elif batch.state is not None:
            _hand_back(session, batch.state, prompts, out)


def _family(rows: list[Row]) -> list[Row]:
    """Every row of the requests ``rows`` lead (their branches' rows)."""
    return [r for row in rows for r in row.family]


def _branch_event(rows: list[Row], stepped, stats: DecodeStats) -> DecodeEvent:
    """A branching call's event: per request, the rebuilt text's newly final tokens (with
    their draft marks, carried from the branches that wrote them), its branches' own tokens,
    accepted drafts summed over its rows."""
    tokens, drafted, accepted, by, per_branch = [], [], [], [], []
    for root in rows:
        mine = [g for g in stepped if g.row.tree is root.tree]
        final, marks = root.tree.take_final_marked()
        tokens.append(final)
        drafted.append(marks)
        accepted.append(sum(g.count - 1 for g in mine))
        own = [g.by_source or (0,) * len(SOURCE_NAMES) for g in mine]
        by.append(tuple(sum(b[i] for b in own) for i in range(len(SOURCE_NAMES))))
        per_branch.append([(g.row.branch, g.new) for g in mine])
    stats.branches = sum(len(root.tree.branches) for root in rows)
    return DecodeEvent(
        tokens,
        accepted,
        drafted,
        [root.request_finish for root in rows],
        stats,
        by,
        per_branch,
        [root.tree.pieces() for root in rows],
    )


def _hand_back(session: Session, state: DecodeState, prompts, out) -> None:
    """Return the cache to the session: row r holds prompt + a prefix of its raw stream."""
    lengths = state.lengths.tolist()  # once, after the loop
    session.cache = state.cache
    held = [min(n - len(p), len(o)) for n, p, o in zip(lengths, prompts, out)]
    session.cached = [p + o[:h] for p, o, h in zip(prompts, out, held)]
    session.lengths = mx.array([len(c) for c in session.cached], dtype=mx.int32)


def _hand_back_prompts(session: Session, batch: BatchGenerator, rows: list[Row], prompts) -> None:
    """With branches, return the prompts' cache to the session: the cache's rows are
    branches, not the rebuilt text, but every branch's row starts with its prompt, so the
    next turn prefills only what follows it. Each request's rows: one whose slot still holds
    its cache (``BatchGenerator.cache_slot``); with none (a prompt not yet joined) the session
    starts afresh."""
    slots = [] if batch.state is None else [_held_slot(batch, root) for root in rows]
    if not slots or None in slots:
        session.cache = batch.model.make_cache(len(prompts), SLOT_QUANTUM)
        session.reset()
        return
    idx = mx.array(slots, mx.int32)
    session.cache = rows_of(batch.state.cache, lambda a: a[idx])
    mx.eval(session.cache)  # a copy of its rows: the batch's cache is freed
    session.cached = [list(p) for p in prompts]
    session.lengths = mx.array([len(p) for p in prompts], dtype=mx.int32)


def _held_slot(batch: BatchGenerator, root: Row) -> int | None:
    """A slot that holds one of ``root``'s request's rows' cache (None: none does)."""
    return next((s for r in root.family if (s := batch.cache_slot(r)) is not None), None)


@dataclass
class _Call:
    """What one ``generate_steps`` call counts beyond its rows' own ``RowStats``: its prompts, its
    prefill and first-token times, and its steps (``length``: the accept histogram's size)."""

    prompt_tokens: int
    prefilled: int
    length: int
    prompt_s: float = 0.0
    first_token_s: float = 0.0
    started: float = 0.0  # when decoding began (after the first token)
    steps: int = 0

    def snapshot(self, rows: list[Row], host_s: float) -> DecodeStats:
        """The call's statistics now: its own counts and its rows' summed
        (``RowStats.summed``; ``host_s``: time spent queueing steps)."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        total = RowStats.summed([r.stats for r in rows])
        hist = [0] * self.length
        for i, n in enumerate(total.accept_hist):
            hist[min(i, self.length - 1)] += n
        return DecodeStats(
            steps=self.steps,
            prompt_tokens=self.prompt_tokens,
            prefilled_tokens=self.prefilled,
            generation_tokens=total.generated,
            prompt_tps=self.prefilled / max(self.prompt_s, 1e-9),
            generation_tps=total.generated / elapsed,
            tokens_per_step=total.tokens_per_step,
            mean_packed=total.packed / max(total.steps, 1),
            time_to_first_token=self.first_token_s,
            host_ms_per_step=1e3 * host_s / max(self.steps, 1),
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            accept_hist=hist if total.steps else [],
            accepted_tokens=total.accepted_drafts,
            source_tokens=dict(zip(SOURCE_NAMES, total.by_source)),
        )


def _prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def stream_generate(
    model,
    drafter,
    tokenizer,
    prompt,
    *,
    max_tokens: int = 256,
    shape: BeamShape | None = None,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    session: Session | None = None,
    adapt: Adaptive | bool = True,
    draft_model: Any = None,
    branches: str | BranchRules | None = "auto",
) -> Iterator[GenerationResponse]:
    """Stream one prompt's continuation. ``drafter=None`` speculates from context lookup
    alone; ``shape=BeamShape.autoregressive()`` decodes plainly (the baseline).

    ``shape``: the beam shape (:class:`BeamShape`, W beams of L tokens, optional packing
    capacity, lookup chains); None (the default) runs what ``chat`` runs on a machine with no
    tuned profile (``engine.loop.plan.default_plan``: the chip's preset with a lookup chain). A
    shape given needs the sources of its parts: ``drafter`` for its beams, ``draft_model``
    for its ``D1×L`` chain (``check_shape_sources``: a ParamError otherwise). With
    ``adapt`` (the default) the loop switches between it, its parts, the shorter single
    beams and plain decoding by measured tokens/s (``generate_steps``). ``sampler``: greedy by
    default, else temperature / top-p / top-k / min-p, penalties and logit bias
    (:class:`SamplerConfig`), drawn from ``seed`` (else ``sampler.seed``). ``prompt`` is a
    string (encoded with BOS) or a list of token ids. Pass a ``Session`` to reuse its KV
    cache across calls (only tokens not already cached are prefilled). ``draft_model``: a
    draft model sharing the tokenizer, an early-exit adapter, any ``redrafter_mlx.DraftSource``
    or a list of them (``load(..., draft_model=...)`` loads and checks models and adapters),
    whose chains join the tree (``generate_steps``). ``branches``: ``"auto"`` (on for an APAR model:
    its config's ``branches`` block), ``"on"``, ``"off"`` or ``BranchRules``
    (``resolve_branches``); with branching on, the text is the rebuilt text, streamed as it
    becomes final.
    """
    from ..base.tokenizer import StreamDecoder

    prompt, max_tokens, shape, sampler, seed, session = api_arguments(
        tokenizer, prompt, max_tokens, shape, sampler, seed, session
    )
    check_api_sources(drafter, draft_model, shape)
    rules = resolve_branches(tokenizer, branches)
    detok = StreamDecoder(tokenizer)
    events = generate_steps(
        model,
        drafter,
        [_prompt_ids(tokenizer, prompt)],
        max_tokens=max_tokens,
        shape=shape if shape is not None else default_plan(drafter).shape,
        sampler=sampler,
        seed=seed,
        eos_token_ids=tokenizer.eos_token_ids,
        session=session,
        adapt=adapt,
        draft_model=draft_model,
        branches=rules,
    )
    for ev in events:
        toks, done = ev.tokens[0], ev.finish[0]
        text = detok.add(toks) + (detok.flush() if done else "")
        yield GenerationResponse(
            **ev.stats.to_dict(),
            text=text,
            tokens=toks,
            accepted=ev.accepted[0],
            finish_reason=done,
            drafted_tokens=ev.drafted[0],
            branch_tokens=ev.branches[0] if ev.branches else [],
            branch_pieces=ev.pieces[0] if ev.pieces else (),
        )


def generate(model, drafter, tokenizer, prompt, **options) -> str:
    """The whole continuation as a string (the keyword arguments of ``stream_generate``)."""
    return "".join(r.text for r in stream_generate(model, drafter, tokenizer, prompt, **options))


def batch_generate(
    model,
    drafter,
    tokenizer,
    prompts: Sequence,
    *,
    max_tokens: int = 256,
    shape: BeamShape | None = None,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    session: Session | None = None,
    adapt: Adaptive | bool = True,
    draft_model: Any = None,
    branches: str | BranchRules | None = "auto",
) -> list[list[int]]:
    """Token ids generated for each prompt, decoded together as one batch (the arguments of
    ``stream_generate``; a ``session`` has one row per prompt). ``tokenizer=None``: the
    prompts are token ids and no EOS stops a row. With branching on, each prompt's ids are
    its rebuilt text."""
    prompts, max_tokens, shape, sampler, seed, session = api_arguments(
        tokenizer, prompts, max_tokens, shape, sampler, seed, session, batch=True
    )
    check_api_sources(drafter, draft_model, shape)
    rules = resolve_branches(tokenizer, branches)
    ids = [_prompt_ids(tokenizer, p) for p in prompts]
    out = [[] for _ in ids]
    for ev in generate_steps(
        model,
        drafter,
        ids,
        max_tokens=max_tokens,
        shape=shape if shape is not None else default_plan(drafter).shape,
        sampler=sampler,
        seed=seed,
        eos_token_ids=tokenizer.eos_token_ids if tokenizer is not None else (),
        session=session,
        adapt=adapt,
        draft_model=draft_model,
        branches=rules,
    ):
        for r, t in enumerate(ev.tokens):
            out[r].extend(t)
    return out
