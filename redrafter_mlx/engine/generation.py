"""The generation loop and the public API: ``stream_generate``, ``generate``, ``batch_generate``.

``decode`` is a client of the engine's one batched loop (``batch.BatchDecoder``, which the
server's scheduler drives too): its rows are prefilled together in a ``Session``, adopted by
the batch, and decoded with step k+1 queued (``mx.async_eval``) before step k is read, in
every mode (text streams one step behind). It stops exactly: no token after EOS or
beyond ``max_tokens``, even when more were accepted in the same step (``cache.stop_at``). A
``Session`` (``engine/cache.py``) owns the KV cache of its rows across calls, so a chat turn
prefills only its new tokens.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields

import mlx.core as mx

from .adaptive import Adaptive, StepPlan
from .batch import BatchDecoder, Row, RowStats
from .cache import Session, prefill_session, text_history, token_limit
from .decode import DecodeState, first_draw, make_step
from .distributed import shared_seed
from .draft_model import check_draft_model
from .draft_model import prefill as draft_prefill
from .drafter import Drafter
from .memory import check_step_memory
from .model import Model
from .plan import DEFAULT_SHAPE, default_plan
from .platform import fresh_choice
from .sampling import RowSampler, SamplerConfig, check_seed, row_settings
from .shape import BeamShape
from .sources import LOOKUP, SOURCE_NAMES

MAX_COMPILED_STEPS = 16  # per model: beam shapes x sampler configs x drafters


@dataclass
class DecodeStats:
    """Running statistics of one ``decode`` call, as of the latest event.

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
    lookup_tokens: int = 0  # of those, taken from a context-lookup chain
    source_tokens: dict = field(default_factory=dict)  # of those, per draft source name

    def to_dict(self) -> dict:
        """The statistics as a JSON-ready dict (this class's fields)."""
        return {f.name: getattr(self, f.name) for f in fields(DecodeStats)}


@dataclass
class DecodeEvent:
    """What one step of ``decode`` produced for its B rows (the first event: the first token).

    tokens:   per row, the new tokens (after EOS/limit truncation; empty once finished)
    accepted: per row, draft tokens the verifier accepted this step
    drafted:  per row, for each new token, whether it was a draft (drafter or lookup)
    looked_up: per row, accepted draft tokens that came from a context-lookup chain
    finish:   per row, None while running, then ``"stop"`` (EOS), ``"length"`` (max_tokens)
              or ``"context"`` (the model's context is full)
    stats:    running statistics of the whole call
    by_source: per row, accepted draft tokens per source (``SOURCE_NAMES`` order)
    """

    tokens: list[list[int]]
    accepted: list[int]
    drafted: list[list[bool]]
    finish: list[str | None]
    stats: DecodeStats
    looked_up: list[int] = field(default_factory=list)
    by_source: list[tuple[int, ...]] = field(default_factory=list)


@dataclass
class GenerationResponse(DecodeStats):
    """One streamed chunk of one prompt plus the running stats (``DecodeStats`` fields).

    ``text``/``tokens`` are new since the previous response; ``drafted_tokens`` marks which of
    ``tokens`` came from the drafter; ``finish_reason`` is None until the last response.
    """

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0
    finish_reason: str | None = None
    drafted_tokens: list[bool] = field(default_factory=list)
    looked_up: int = 0

    @property
    def stats(self) -> DecodeStats:
        """The statistics alone."""
        return DecodeStats(**DecodeStats.to_dict(self))


def get_step(model, drafter, shape: BeamShape, sampler: SamplerConfig, draft=None):
    """The compiled step for this configuration, kept on the model (compiled once)."""
    cache = model.__dict__.setdefault("_compiled_steps", {})
    key = (id(drafter), id(draft), shape, sampler, getattr(model, "feature_layers", ()))
    if key not in cache:
        while len(cache) >= MAX_COMPILED_STEPS:  # drop the oldest (and the drafter it holds)
            cache.pop(next(iter(cache)))
        cache[key] = make_step(model, drafter, shape, sampler, draft=draft)
    return cache[key]


def decode(
    model: Model,
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
    draft_model: Model | None = None,
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
    (``draft_model.py``; the shape's ``D1×L``, else ``D1×`` its drafter length); it pins
    the shape (no adaptive choice yet: its cache follows only the steps that run it).
    """
    prompts = [list(map(int, p)) for p in prompts]
    if draft_model is not None:
        check_draft_model(model, draft_model)
        adapt = False
    shape = shape.validate(model.vocab_size).runnable(drafter is not None, draft_model is not None)
    if not shape.model_length:
        draft_model = None
    if not shape.drafts:
        drafter = None
    sampler = sampler.validate(model.vocab_size)
    seed = check_seed(seed) if seed is not None else sampler.seed
    layers = getattr(getattr(drafter, "args", None), "feature_layers", None)
    if layers and tuple(layers) != model.feature_layers:
        model.capture_features(layers)  # what ``loading.attach`` does (a drafter loaded alone)
    _check_prompts(model, prompts, max_tokens)
    longest = max(len(p) for p in prompts) + max_tokens
    check_step_memory(
        model, drafter, shape, len(prompts), longest, not sampler.greedy, draft=draft_model
    )
    session = session or Session(model, len(prompts))
    if session.batch != len(prompts):
        raise ValueError(f"session has {session.batch} rows but {len(prompts)} prompts were given")
    B = len(prompts)
    eos = set(int(e) for e in eos_token_ids)
    if adapt is True and seed is not None and not sampler.greedy:
        adapt = False  # the schedule follows wall time: a seeded sample must be reproducible
    plan = StepPlan(model, drafter, shape, sampler, adapt)
    batch = BatchDecoder(
        model, drafter, shape, eos, B, choice=plan, release=False, draft=draft_model
    )

    tic = time.perf_counter()
    new_tokens = session.reuse(prompts)
    prefilled = sum(len(t) for t in new_tokens)
    hidden = prefill_session(session, new_tokens)
    group = getattr(model, "group", None)  # tensor parallel: every rank must draw alike
    seed = shared_seed(seed, group) if group is not None else seed
    rng = mx.random.key(seed if seed is not None else int(time.time_ns() % (1 << 31)))
    rng, first_key = mx.random.split(rng)
    history = text_history(prompts, session.slots)
    # One key per row (a lone row: the run's own, so it draws as the server's row of the same
    # request and seed), split every step.
    mode, settings = row_settings([sampler] * B, model.vocab_size)
    rows_first = RowSampler(settings, _row_keys(first_key, B), mode)
    first = first_draw(model, hidden, rows_first, None, history, session.lengths)
    sources = ()
    if draft_model is model:  # the model as its own draft: its cache starts as the model's
        sources = ((list(session.keys), list(session.values)),)
    elif draft_model is not None:
        sources = (draft_prefill(draft_model, prompts, session.slots),)
    state = DecodeState(
        first, hidden, session.lengths, session.keys, session.values, rng, history, sources
    )

    out = [[] for _ in range(B)]
    rows = []
    for p in prompts:
        limit, at_limit = token_limit(model, len(p), max_tokens)
        rows.append(Row(sampler, limit, len(p), RowStats(len(p)), at_limit=at_limit))
    stats = _Stats(
        prompt_tokens=sum(len(p) for p in prompts),
        prefilled=prefilled,
        prompt_s=0.0,
        length=max(plan.per_step, 2),
    )
    try:
        session.keys = session.values = None  # the loop owns the cache now (in-place updates)
        batch.adopt(state, _row_keys(rng, B), rows)
        del state
        first_tokens = first.tolist()  # once per call, before the decode loop
        stats.prompt_s = time.perf_counter() - tic
        first_new = []
        for r, row in enumerate(rows):
            new, _ = batch.emit(row, [first_tokens[r]])
            out[r] += new
            first_new.append(new)
            row.shadow = plan.shadow(prompts[r] + out[r])
        stats.generated += sum(len(t) for t in first_new)
        stats.first_token_s = time.perf_counter() - tic
        gen_tic = time.perf_counter()
        yield DecodeEvent(
            first_new,
            [0] * B,
            [[False] * len(t) for t in first_new],
            [row.finish for row in rows],
            stats.snapshot(gen_tic, batch.host_s),
            [0] * B,
            [(0,) * len(SOURCE_NAMES)] * B,
        )

        # Step k+1 is queued before step k is read, in every mode: the device never waits
        # for the host's reading, lookup shadow and shape choice, which run while it works
        # (a per-step choice reads the match states one step stale).
        fresh = plan.each_step and fresh_choice()
        pending = batch.queue() if not all(row.finished for row in rows) else None
        while pending is not None:
            nxt = None if fresh else batch.queue()
            got = {id(g.row): g for g in batch.read(pending)}  # step k only: it is computed
            stats.steps += 1
            new_rows, acc_rows, drafted_rows, looked, by = [], [], [], [], []
            for r, row in enumerate(rows):
                g = got.get(id(row))
                if g is None:  # finished before this step
                    new_rows.append([]), acc_rows.append(0), drafted_rows.append([])
                    looked.append(0), by.append((0,) * len(SOURCE_NAMES))
                    continue
                out[r] += g.new
                stats.record(g.count, g.packed, len(g.new), g.by_source)
                new_rows.append(g.new)
                acc_rows.append(g.count - 1)
                drafted_rows.append([i < g.count - 1 for i in range(len(g.new))])
                looked.append(g.looked_up)
                by.append(g.by_source)
            done = all(row.finished for row in rows)
            if fresh and not done:
                nxt = batch.queue()
            pending = nxt if not done else None
            finish = [row.finish for row in rows]
            yield DecodeEvent(
                new_rows,
                acc_rows,
                drafted_rows,
                finish,
                stats.snapshot(gen_tic, batch.host_s),
                looked,
                by,
            )
    finally:
        if batch.state is not None:
            _hand_back(session, batch.state, prompts, out)


def _row_keys(key: mx.array, rows: int) -> mx.array:
    """(rows, 2) keys: ``key`` itself for one row, else ``rows`` keys split from it."""
    return key[None] if rows == 1 else mx.random.split(key, rows)


def _hand_back(session: Session, state: DecodeState, prompts, out) -> None:
    """Return the cache to the session: row r holds prompt + a prefix of its raw stream."""
    lengths = state.lengths.tolist()  # once, after the loop
    session.keys, session.values = state.keys, state.values
    held = [min(n - len(p), len(o)) for n, p, o in zip(lengths, prompts, out)]
    session.cached = [p + o[:h] for p, o, h in zip(prompts, out, held)]
    session.lengths = mx.array([len(c) for c in session.cached], dtype=mx.int32)


def _check_prompts(model: Model, prompts: list[list[int]], max_tokens: int) -> None:
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    V = model.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {V})")
    context = model.max_context
    if context is not None:
        longest = max(len(p) for p in prompts)
        if longest >= context:
            raise ValueError(
                f"prompt of {longest} tokens does not fit the model's context of {context} "
                f"tokens; shorten the prompt"
            )


@dataclass
class _Stats:
    prompt_tokens: int
    prefilled: int
    prompt_s: float
    length: int
    steps: int = 0
    generated: int = 0
    emitted_by_steps: int = 0
    packed_sum: int = 0
    row_steps: int = 0
    first_token_s: float = 0.0
    hist: list[int] = field(default_factory=list)
    by_source: list[int] = field(default_factory=lambda: [0] * len(SOURCE_NAMES))

    def record(self, count: int, packed: int, used: int, by_source=()) -> None:
        """One row-step: ``by_source`` its accepted drafts per source (``SOURCE_NAMES``)."""
        if not self.hist:
            self.hist = [0] * self.length
        self.hist[min(count, self.length) - 1] += 1
        for i, n in enumerate(by_source):
            self.by_source[i] += n
        self.row_steps += 1
        self.emitted_by_steps += count
        self.packed_sum += packed
        self.generated += used

    def snapshot(self, gen_tic: float, host_s: float) -> DecodeStats:
        """The statistics now (``host_s``: time spent queueing steps)."""
        elapsed = max(time.perf_counter() - gen_tic, 1e-9)
        return DecodeStats(
            steps=self.steps,
            prompt_tokens=self.prompt_tokens,
            prefilled_tokens=self.prefilled,
            generation_tokens=self.generated,
            prompt_tps=self.prefilled / max(self.prompt_s, 1e-9),
            generation_tps=self.generated / elapsed,
            tokens_per_step=self.emitted_by_steps / max(self.row_steps, 1),
            mean_packed=self.packed_sum / max(self.row_steps, 1),
            time_to_first_token=self.first_token_s,
            host_ms_per_step=1e3 * host_s / max(self.steps, 1),
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            accept_hist=list(self.hist),
            accepted_tokens=self.emitted_by_steps - self.row_steps,
            lookup_tokens=self.by_source[LOOKUP],
            source_tokens=dict(zip(SOURCE_NAMES, self.by_source)),
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
    draft_model: Model | None = None,
) -> Iterator[GenerationResponse]:
    """Stream one prompt's continuation. ``drafter=None`` speculates from context lookup
    alone; ``shape=BeamShape.autoregressive()`` decodes plainly (the baseline).

    ``shape``: the beam shape (:class:`BeamShape`, W beams of L tokens, optional packing
    capacity, lookup chains); None (the default) runs what ``chat`` runs on a machine with no
    tuned profile (``engine.plan.default_plan``: the chip's preset with a lookup chain). With
    ``adapt`` (the default) the loop switches between it, its parts, the shorter single
    beams and plain decoding by measured tokens/s (``decode``). ``sampler``: greedy by
    default, else temperature / top-p / top-k / min-p, penalties and logit bias
    (:class:`SamplerConfig`), drawn from ``seed`` (else ``sampler.seed``). ``prompt`` is a
    string (encoded with BOS) or a list of token ids. Pass a ``Session`` to reuse its KV
    cache across calls (only tokens not already cached are prefilled). ``draft_model``: a
    draft model sharing the tokenizer (``load(..., draft_model_path=...)``), whose chain
    joins the tree (``decode``).
    """
    from .tokenizer import StreamDecoder

    detok = StreamDecoder(tokenizer)
    events = decode(
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
            looked_up=ev.looked_up[0] if ev.looked_up else 0,
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
    draft_model: Model | None = None,
) -> list[list[int]]:
    """Token ids generated for each prompt, decoded together as one batch (the arguments of
    ``stream_generate``; a ``session`` has one row per prompt). ``tokenizer=None``: the
    prompts are token ids and no EOS stops a row."""
    ids = [_prompt_ids(tokenizer, p) for p in prompts]
    out = [[] for _ in ids]
    for ev in decode(
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
    ):
        for r, t in enumerate(ev.tokens):
            out[r].extend(t)
    return out
