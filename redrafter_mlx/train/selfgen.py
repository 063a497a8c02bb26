"""Self-distillation data in one pass: the model's answers with the hidden states that made them.

For a response that is the model's own greedy output, the greedy continuation of every prefix
is the response itself (docs/design/distillation.md, "Self-distillation"), so a drafter's
training targets are read off the answer, and the hidden state of each position is the one
decoding computed anyway. Keeping it saves the separate forward over every sequence that
``targets="self"`` otherwise needs (the slowest stage of a large build).

It runs the engine's own step (``step.batch_step``, plain decoding, a key per row), first
draw (``decode.first_draw``), row compaction (``rows.take_rows``) and stop rule
(``cache.stop_at``), in a loop of its own rather than ``batch.BatchGenerator``'s: it keeps
every step's hidden state, prefills the prefix its prompts share once (``prefill_shared``)
in windows of ``WINDOW_QUANTUM`` slots, reads the device only every ``CHECK_EVERY`` steps
(not each step), drops ended rows by its own rule (``rows_to_keep``), keeps the end-of-turn
id in the answer, and interleaves batches on several CPU streams (``answers_in_lanes``).
As a ``BatchGenerator`` client it measured slower (docs/design.md, "The loop").

Shapes: B rows, n answer tokens of a row, H hidden, T drafter steps (predict_tokens).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..engine.core.sampling import RowSampler, SamplerConfig, row_keys_of, row_settings
from ..engine.decoding.cache import Session, bucket, ensure_slots, prefill_session, stop_at
from ..engine.decoding.decode import DecodeState, first_draw
from ..engine.decoding.step import batch_step
from ..engine.loop.rows import take_rows
from ..engine.verifier.entries import rows_of
from ..engine.verifier.protocol import Verifier

CHECK_EVERY = 16  # steps between host reads of "have all rows ended?"
# Attention windows in steps of 64 slots, not the engine's 256: a batch of answers attends
# over fewer empty slots (each window is one more compile of the step, a few per batch).
WINDOW_QUANTUM = 64
SHARED_PREFIX_MIN = 8  # a prefix all prompts share is prefilled once from this many tokens
DROP_FRACTION = 0.25  # ended rows leave the batch once they are this share of it


@dataclass
class Answer:
    """One row's greedy answer: ids (n,) with the end-of-turn id when it ended, and hidden
    (n, H): hidden[j] is the state whose greedy token is ids[j] (the last prompt token's for
    j = 0); (n, (1 + k) H) when the model captures k feature layers (the final normed state
    first, ``Verifier.capture_features``)."""

    ids: list[int]
    finish: str  # "stop" (an end-of-turn id was emitted) or "length"
    hidden: np.ndarray


def greedy_with_hidden(
    model: Verifier, prompts: list[list[int]], max_tokens: int, eos_token_ids
) -> list[Answer]:
    """Batched greedy decoding of ``prompts`` (B rows) keeping every step's hidden state.

    Tokens equal the engine's greedy decoding (the same compiled batch step); rows
    run until all have ended or ``max_tokens``; a row's answer is cut after its first
    end-of-turn id.
    """
    return answers_with_hidden(model, prompts, max_tokens, eos_token_ids)


def answers_with_hidden(
    model: Verifier,
    prompts: list[list[int]],
    max_tokens: int,
    eos_token_ids,
    temperature: float = 0.0,
    seed: int = 0,
) -> list[Answer]:
    """Batched decoding of ``prompts`` (B rows), greedy or sampled at ``temperature`` (seeded),
    keeping every step's hidden state (n, H) per row (see ``Answer``).

    Rows that have ended leave the batch once they are a quarter of it (checked every
    ``CHECK_EVERY`` steps; the batch keeps a multiple of 8 rows, so few shapes compile), so
    the steps run on the rows still answering.
    """
    job = Job(None, prompts, max_tokens, tuple(eos_token_ids), temperature, seed)
    return next(answers_in_lanes(model, [job], lanes=1))[1]


@dataclass
class Job:
    """One batch to answer (``answers_with_hidden``'s arguments); ``key``: the caller's
    own record of it (``SelfData``: the prompt rows)."""

    key: object
    prompts: list[list[int]]
    max_tokens: int
    eos_token_ids: tuple
    temperature: float = 0.0
    seed: int = 0


def answers_in_lanes(model: Verifier, jobs, lanes: int = 1):
    """Answer ``jobs`` (an iterable of ``Job``, drawn as lanes free up), ``lanes`` batches at
    a time; yields ``(job, answers)`` as each batch ends (not in job order when lanes > 1).

    Each lane decodes its batch on its own CPU stream; every round builds one step of each lane
    and queues them all with one ``mx.async_eval``, so one lane's single-threaded ops
    (attention over its cache, SiLU, norms) run while another's do: on the CPU backend MLX
    runs a stream's ops one at a time, and a step of a 135M model at 48 rows spends most of its
    time outside BLAS (docs/design/distillation.md, "Lanes"). Rows' answers are those of their batch
    decoded alone (same shapes, same ops, per-batch seeds).
    """
    streams = [mx.new_stream(mx.cpu) for _ in range(lanes)] if lanes > 1 else [None]
    jobs = iter(jobs)
    running: dict[int, tuple] = {}
    while True:
        for lane, stream in enumerate(streams):
            if lane not in running:
                job = next(jobs, None)
                if job is not None:
                    running[lane] = (job, _decode(model, job, stream))
        if not running:
            return
        queued = []
        for lane in list(running):
            job, steps = running[lane]
            try:
                queued.append(next(steps))
            except StopIteration as done:
                del running[lane]
                yield job, done.value
        # One call for all lanes: queued one lane at a time, the streams ran in turn.
        mx.async_eval(queued)


def _on(stream):
    """The context that runs MLX ops on ``stream`` (None: the default stream)."""
    return contextlib.nullcontext() if stream is None else mx.stream(stream)


def _decode(model: Verifier, job: Job, stream):
    """A generator that builds one decode step of ``job`` on ``stream`` per ``next`` and
    yields its state for the caller to queue (``mx.async_eval``); returns the answers
    (``StopIteration.value``); see ``answers_with_hidden``."""
    prompts, max_tokens = job.prompts, job.max_tokens
    with _on(stream):
        sampler = SamplerConfig(temperature=float(job.temperature))
        B = len(prompts)
        session, hidden = prefill_shared(model, prompts)  # (B, H)
        rng, first_key = mx.random.split(mx.random.key(job.seed))
        # Each row draws with its own key, as in every engine loop (``sampling.row_keys``).
        mode, settings = row_settings([sampler] * B, model.vocab_size)
        first_rows = RowSampler(settings, row_keys_of(first_key, B), mode)
        first = first_draw(model, hidden, first_rows, None, session.lengths)
        first = first.astype(mx.int32)
        state = DecodeState(first, hidden, session.lengths, session.cache)
        row_keys, active = row_keys_of(rng, B), mx.ones((B,), dtype=mx.bool_)
        session.cache = None  # the loop owns the cache (in-place K/V writes)
        step = batch_step(model, (), None, mode)  # plain decoding: the engine's own step
        eos = mx.array(sorted(int(e) for e in job.eos_token_ids) or [-1], dtype=mx.int32)
    rows = np.arange(B)  # the prompt each running row answers
    pieces: list[list] = [[] for _ in range(B)]  # per prompt: (ids, hidden) runs, in order
    hs, toks = [hidden], [first]
    longest = max(len(p) for p in prompts)  # of the running rows' prompts
    ended = np.zeros(B, dtype=bool)
    for i in range(1, max_tokens):
        with _on(stream):
            window = bucket(longest + i + 1, WINDOW_QUANTUM)
            state = ensure_slots(state, window)
            state, row_keys, _ = step(state, row_keys, active, settings, window)
            # state.hidden is the state at the token just committed, whose greedy draw is the
            # state's init_token: the same pairing as (hidden, first).
            hs.append(state.hidden)
            toks.append(state.init_token)
        yield state, row_keys  # queued by the caller, with every other lane's step
        if i % CHECK_EVERY == 0:
            with _on(stream):
                recent = mx.stack(toks[-CHECK_EVERY:], axis=1)  # (B, CHECK_EVERY)
                ended |= np.array(mx.any(recent[..., None] == eos, axis=(1, 2)))
                if ended.all():
                    break
                keep = rows_to_keep(ended)
                if len(keep) < len(rows):
                    collect(pieces, rows, hs, toks)
                    state, row_keys = take_rows(state, row_keys, mx.array(keep))
                    _, settings = row_settings([sampler] * len(keep), model.vocab_size)
                    active = mx.ones((len(keep),), dtype=mx.bool_)
                    rows, ended, hs, toks = rows[keep], ended[keep], [], []
                    longest = max(len(prompts[r]) for r in rows)
    with _on(stream):
        collect(pieces, rows, hs, toks)
    stops = set(int(e) for e in job.eos_token_ids)
    out = []
    for r in range(B):
        row = [int(t) for ids, _ in pieces[r] for t in ids]
        new, finish = stop_at(row, stops, max_tokens)  # the engine's stop rule
        n = len(new) + (finish == "stop")  # a training answer keeps its end-of-turn id
        finish = "stop" if finish == "stop" else "length"
        out.append(Answer(row[:n], finish, np.concatenate([h for _, h in pieces[r]])[:n]))
    return out


def prefill_shared(model: Verifier, prompts: list[list[int]]) -> tuple[Session, mx.array]:
    """A session holding every prompt's K/V, and the hidden state (B, H) at each prompt's
    last token. The prefix all prompts share (a chat template's system turn: 24 of SmolLM2's
    ~58 tokens) runs once and is copied to every row."""
    B = len(prompts)
    shared = min(len(p) for p in prompts) - 1  # the last token of each is always run
    for j in range(max(shared, 0)):
        if any(p[j] != prompts[0][j] for p in prompts):
            shared = j
            break
    session = Session(model, B)
    if B > 1 and shared >= SHARED_PREFIX_MIN:
        one = Session(model, 1)
        prefill_session(one, [prompts[0][:shared]], WINDOW_QUANTUM, sync=False)
        session.cache = rows_of(one.cache, lambda a: mx.repeat(a, B, axis=0))
        session.cached = [list(p[:shared]) for p in prompts]
    rest = session.reuse([list(p) for p in prompts])
    return session, prefill_session(session, rest, WINDOW_QUANTUM, sync=False)


def rows_to_keep(ended: np.ndarray) -> np.ndarray:
    """Indices of the running rows to keep (ascending): all of them until a quarter has
    ended, then the rows still answering, padded with ended ones to a multiple of 8."""
    if ended.mean() < DROP_FRACTION:
        return np.arange(len(ended))
    live = np.flatnonzero(~ended)
    size = min(-(-len(live) // 8) * 8, len(ended))
    pad = np.flatnonzero(ended)[: size - len(live)]
    return np.sort(np.concatenate([live, pad]))


def collect(pieces: list[list], rows: np.ndarray, hs: list, toks: list) -> None:
    """Append the steps in ``hs``/``toks`` (each (b, ...) per step) to each row's prompt."""
    if not toks:
        return
    ids = np.array(mx.stack(toks, axis=1))  # (b, steps)
    # (b, steps, H or (1 + k) H with feature layers); a residual past float16's range (an
    # outlier of a deep layer) is clipped, not stored as inf
    hid = np.array(mx.clip(mx.stack(hs, axis=1), -65504, 65504).astype(mx.float16))
    for j, r in enumerate(rows):
        pieces[r].append((ids[j], hid[j]))


def answer_targets(answer: Answer, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training positions of one answer: hidden (n, H), tokens (n, T+1), valid (n, T).

    Position j holds hidden[j], its token x0 = ids[j], and targets ids[j+1..j+T] (valid
    while inside the answer): for a greedy answer exactly ``distill.self_targets`` on prompt
    + answer; for a sampled one the model's own draws (with soft targets, the model's
    distribution at each of them, read from the same hidden states).
    """
    ids = np.asarray(answer.ids, dtype=np.int32)
    n = len(ids)
    pad = np.concatenate([ids, np.zeros(depth, dtype=np.int32)])
    offs = np.arange(n)[:, None] + np.arange(depth + 1)[None, :]
    tokens = pad[offs]
    valid = offs[:, 1:] < n
    return answer.hidden, tokens, valid
