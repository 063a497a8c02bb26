"""The generation loop and the public API: ``stream_generate``, ``generate``, ``batch_generate``.

The loop keeps the next step queued with ``mx.async_eval`` and reads only arrays of steps
already computed (text streams one step behind). It stops exactly: no token after EOS or
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
from .cache import (
    Session,
    ensure_slots,
    prefill_session,
    step_window,
    stop_at,
    text_history,
    token_limit,
)
from .decode import DecodeState, first_draw, make_step
from .distributed import shared_seed
from .drafter import Drafter
from .lookup import LookupShadow
from .memory import check_step_memory
from .model import Model
from .sampling import SamplerConfig, check_seed
from .shape import BeamShape

MAX_COMPILED_STEPS = 16  # per model: beam shapes x sampler configs x drafters


DEFAULT_SHAPE = BeamShape(4, 4)


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
    """

    tokens: list[list[int]]
    accepted: list[int]
    drafted: list[list[bool]]
    finish: list[str | None]
    stats: DecodeStats
    looked_up: list[int] = field(default_factory=list)


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


def get_step(model, drafter, shape: BeamShape, sampler: SamplerConfig):
    """The compiled step for this configuration, kept on the model (compiled once)."""
    cache = model.__dict__.setdefault("_compiled_steps", {})
    key = (id(drafter), shape, sampler, getattr(model, "feature_layers", ()))
    if key not in cache:
        while len(cache) >= MAX_COMPILED_STEPS:  # drop the oldest (and the drafter it holds)
            cache.pop(next(iter(cache)))
        cache[key] = make_step(model, drafter, shape, sampler)
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
) -> Iterator[DecodeEvent]:
    """Decode B rows; yield one :class:`DecodeEvent` per step with each row's new tokens.

    ``drafter=None`` or an autoregressive ``shape`` decodes plainly (one token per step).
    ``adapt``: every few steps run the shape with the best measured tokens/s among plain
    decoding, ``shape`` and the single beams ``W1×L``..``W1×L2`` (``True``), or as an
    :class:`Adaptive` says;
    ``False`` pins ``shape``. Greedy output is the same whatever shape runs; a seeded sample
    depends on the shapes (one draw per tree node), so ``True`` pins when sampling with a
    ``seed`` (reproducible), while an explicit :class:`Adaptive` still adapts.
    Rows that finish stop emitting; the loop ends when all rows have finished.
    A ``shape`` whose step cannot fit in memory raises ``memory.ShapeTooLarge`` first.
    """
    prompts = [list(map(int, p)) for p in prompts]
    shape = shape.validate(model.vocab_size).runnable(drafter is not None)
    if not shape.drafts:
        drafter = None
    sampler = sampler.validate(model.vocab_size)
    check_seed(seed)
    layers = getattr(getattr(drafter, "args", None), "feature_layers", None)
    if layers and tuple(layers) != model.feature_layers:
        model.capture_features(layers)  # what ``loading.attach`` does (a drafter loaded alone)
    _check_prompts(model, prompts, max_tokens)
    longest = max(len(p) for p in prompts) + max_tokens
    check_step_memory(model, drafter, shape, len(prompts), longest, not sampler.greedy)
    session = session or Session(model, len(prompts))
    if session.batch != len(prompts):
        raise ValueError(f"session has {session.batch} rows but {len(prompts)} prompts were given")
    # Per row: most tokens, and why it stops there (the length asked for, or a full context).
    limits, at_limit = zip(*(token_limit(model, len(p), max_tokens) for p in prompts))
    eos = set(int(e) for e in eos_token_ids)

    tic = time.perf_counter()
    new_tokens = session.reuse(prompts)
    prefilled = sum(len(t) for t in new_tokens)
    hidden = prefill_session(session, new_tokens)
    group = getattr(model, "group", None)  # tensor parallel: every rank must draw alike
    seed = shared_seed(seed, group) if group is not None else seed
    rng = mx.random.key(seed if seed is not None else int(time.time_ns() % (1 << 31)))
    rng, first_key = mx.random.split(rng)
    history = text_history(prompts, session.slots)
    first = first_draw(model, hidden, sampler, first_key, history, session.lengths)
    state = DecodeState(first, hidden, session.lengths, session.keys, session.values, rng, history)

    B = len(prompts)
    out = [[] for _ in range(B)]
    finish: list[str | None] = [None] * B
    if adapt is True and seed is not None and not sampler.greedy:
        adapt = False  # the schedule follows wall time: a seeded sample must be reproducible
    plan = StepPlan(get_step, model, drafter, shape, sampler, adapt)
    stats = _Stats(
        prompt_tokens=sum(len(p) for p in prompts),
        prefilled=prefilled,
        prompt_s=0.0,
        length=max(plan.per_step, 2),
    )

    def emit(row: int, toks: list[int]) -> tuple[list[int], int]:
        """Append row tokens up to EOS / its limit; return (new tokens, tokens consumed)."""
        new, done = stop_at(toks, eos, limits[row] - len(out[row]), at_limit[row])
        if done is not None:
            finish[row] = done
        out[row].extend(new)
        return new, len(new)

    box = {"state": state}  # the newest queued state, handed back to the session
    del state
    try:
        session.keys = session.values = None  # the loop owns the cache now (in-place updates)
        first_tokens = first.tolist()  # once per call, before the decode loop
        stats.prompt_s = time.perf_counter() - tic
        first_new = [emit(r, [first_tokens[r]])[0] for r in range(B)]
        stats.generated += sum(len(t) for t in first_new)
        stats.first_token_s = time.perf_counter() - tic
        gen_tic = time.perf_counter()
        yield DecodeEvent(
            first_new,
            [0] * B,
            [[False] * len(t) for t in first_new],
            list(finish),
            stats.snapshot(gen_tic),
            [0] * B,
        )

        per_step = plan.per_step  # most a step can add to a row
        horizon = plan.lookup_horizon
        shadow = LookupShadow([p + o for p, o in zip(prompts, out)], horizon) if horizon else None
        width = plan.slots  # slots a step writes past a row
        lengths = [len(p) for p in prompts]  # exact, as of the last step read
        inflight = 0

        def queue(matches=None):
            """Queue one step; attention covers a bucket above every row's possible length.

            The state is taken out of ``box`` so that, while the step is dispatched, nothing
            but its graph holds the cache: a held reference makes every K/V write copy it.
            """
            nonlocal inflight
            state = box.pop("state")
            try:
                window = step_window(max(lengths), inflight, per_step, width)
                state = ensure_slots(state, window)
                host = time.perf_counter()
                state, out = plan.next(matches)(state, window)
                mx.async_eval(out, state)
            finally:
                box["state"] = state  # handed back to the session even if interrupted
            stats.host_s += time.perf_counter() - host
            inflight += 1
            return out

        def matches():
            """Each running row's lookup match state now (the per-step choice's input)."""
            return [shadow.match(r) for r in range(B) if finish[r] is None]

        # A per-step choice reads step k before queueing step k+1 (it needs the text so
        # far); otherwise step k+1 is queued before step k is read.
        each_step = plan.each_step
        pending = None
        if not all(finish):
            pending = queue(matches() if each_step else None)
        while pending is not None:
            nxt = None if each_step else queue()
            # Host reads of step k only, which is computed; step k+1 is already queued.
            toks, counts, packed = (
                pending.tokens.tolist(),
                pending.count.tolist(),
                pending.packed.tolist(),
            )
            looked = [0] * B if pending.looked_up is None else pending.looked_up.tolist()
            inflight -= 1
            plan.finished([c for c, f in zip(counts, finish) if f is None])
            if shadow is not None:  # what a lookup chain would have given, rows still going
                seen = [shadow.step(r, toks[r][: counts[r]]) for r in range(B) if not finish[r]]
                plan.lookup_seen([pair for row in seen for pair in row])
            lengths = [n + c for n, c in zip(lengths, counts)]
            stats.steps += 1
            new_rows, acc_rows, drafted_rows = [], [], []
            for r in range(B):
                if finish[r] is not None:
                    new_rows.append([]), acc_rows.append(0), drafted_rows.append([])
                    looked[r] = 0
                    continue
                new, used = emit(r, toks[r][: counts[r]])
                stats.record(counts[r], packed[r], used, looked[r])
                new_rows.append(new)
                acc_rows.append(counts[r] - 1)
                drafted_rows.append([i < counts[r] - 1 for i in range(len(new))])
            if each_step and not all(finish):
                nxt = queue(matches())
            pending = nxt if not all(finish) else None
            yield DecodeEvent(
                new_rows, acc_rows, drafted_rows, list(finish), stats.snapshot(gen_tic), looked
            )
    finally:
        _hand_back(session, box["state"], prompts, out)


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
    host_s: float = 0.0
    first_token_s: float = 0.0
    hist: list[int] = field(default_factory=list)
    looked_up: int = 0

    def record(self, count: int, packed: int, used: int, looked_up: int = 0) -> None:
        if not self.hist:
            self.hist = [0] * self.length
        self.hist[min(count, self.length) - 1] += 1
        self.looked_up += looked_up
        self.row_steps += 1
        self.emitted_by_steps += count
        self.packed_sum += packed
        self.generated += used

    def snapshot(self, gen_tic: float) -> DecodeStats:
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
            host_ms_per_step=1e3 * self.host_s / max(self.steps, 1),
            peak_memory_gb=mx.get_peak_memory() / 1e9,
            accept_hist=list(self.hist),
            accepted_tokens=self.emitted_by_steps - self.row_steps,
            lookup_tokens=self.looked_up,
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
    shape: BeamShape = DEFAULT_SHAPE,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    session: Session | None = None,
    adapt: Adaptive | bool = True,
) -> Iterator[GenerationResponse]:
    """Stream one prompt's continuation. ``drafter=None`` decodes autoregressively.

    ``shape``: the beam shape (:class:`BeamShape`, W beams of L tokens, optional packing
    capacity); with ``adapt`` (the default) the loop switches between it, the shorter single
    beams and plain decoding by measured tokens/s (``decode``). ``sampler``: greedy by
    default, else temperature / top-p / top-k / min-p (:class:`SamplerConfig`), drawn from
    ``seed``. ``prompt`` is a string (encoded with BOS) or a list of token ids. Pass a
    ``Session`` to reuse its KV cache across calls (only tokens not already cached are
    prefilled).
    """
    from .tokenizer import StreamDecoder

    detok = StreamDecoder(tokenizer)
    events = decode(
        model,
        drafter,
        [_prompt_ids(tokenizer, prompt)],
        max_tokens=max_tokens,
        shape=shape,
        sampler=sampler,
        seed=seed,
        eos_token_ids=tokenizer.eos_token_ids,
        session=session,
        adapt=adapt,
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
    shape: BeamShape = DEFAULT_SHAPE,
    sampler: SamplerConfig = SamplerConfig(),
    seed: int | None = None,
    session: Session | None = None,
    adapt: Adaptive | bool = True,
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
        shape=shape,
        sampler=sampler,
        seed=seed,
        eos_token_ids=tokenizer.eos_token_ids if tokenizer is not None else (),
        session=session,
        adapt=adapt,
    ):
        for r, t in enumerate(ev.tokens):
            out[r].extend(t)
    return out
