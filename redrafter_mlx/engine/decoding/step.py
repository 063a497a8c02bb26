"""The batch step: one decode step over B rows, compiled once per configuration and kept on
the model (``batch_step``), the one every loop runs and the one ``bench --profile`` times.

The step is compiled for a fixed B (one of the row buckets), and nothing about the rows is a
compile key: per-row settings travel as arrays:

    active      (B,) bool     free rows compute but never advance their cache length
    settings    each row's sampling settings (``engine.core.sampling.RowSettings``: temperature,
                top-p, top-k, min-p, penalties, logit bias), each row's built when it is
                admitted (``sampling.one_row``, checked there), stacked by ``stack_rows``
    row_keys    (B, 2) uint32 one PRNG key per row, split once per step like a solo run's

A row's draws therefore equal the same request decoded alone (same key sequence, same
per-row math); see ``engine.core.sampling.draw``. Static switches (``StepMode``) only pick
how much sampling machinery the batch needs: argmax only, or Gumbel with the filters some
row uses, and whether any row has a logit bias or a penalty (with the history span its
windows need), whether a row branches (``StepMode.split``) and the top count of the
logprobs some row asks for (``StepMode.logprobs``).
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import mlx.nn as nn

from ..core.branches import SplitRows
from ..core.logprobs import TokenLogprobs
from ..core.sampling import (
    RowSampler,
    RowSettings,
    SamplerConfig,
    StepMode,
    row_keys_of,
    row_settings,
)
from ..core.shape import BeamShape
from ..drafting.held import check_sources, held_modules, sources_key
from ..drafting.sources import Source
from .decode import DecodeState, StepOutput, autoregressive_step, redrafter_step


def split_row_keys(row_keys: mx.array) -> tuple[mx.array, mx.array]:
    """Split each row's key as a solo run splits its one key: (B, 2) -> next (B, 2), draw (B, 2)."""
    both = mx.vmap(mx.random.split)(row_keys)  # (B, 2, 2)
    return both[:, 0], both[:, 1]


def make_batch_step(
    model, sources: tuple[Source, ...], shape, mode: StepMode, compiled: bool = True
):
    """A step ``(state, row_keys, active, settings, window, split) -> (state, row_keys,
    StepOutput)``; ``active`` (B,) bool, ``settings`` the batch's ``RowSettings``, ``split`` its
    rows' branching arrays (``branches.SplitRows``; read when ``mode.split``, else None).

    ``shape=None`` decodes autoregressively; a shape without drafter beams speculates from
    lookup chains alone (they read ``state.history``). Compile keys: B, cache slots, window.
    ``sources``: the sources the loop holds (resolved once: ``held.held_sources``), every
    stateful one's state in ``state.sources``; the step runs those the shape turns on and
    passes the others' states through.
    ``run.counter["traces"]`` counts tracings (each is a compile).
    """
    check_sources(sources)
    held = sources
    for source in held:
        source.check(model)

    def step(
        init_token,
        hidden,
        lengths,
        cache,
        history,
        sources,
        row_keys,
        active,
        settings,
        window,
        split,
    ):
        counter["traces"] += 1
        draw_keys = row_keys  # unused by an all-greedy batch: its keys need not advance
        if mode.sample:
            row_keys, draw_keys = split_row_keys(row_keys)
        split = SplitRows(*split) if mode.split else None
        sampler = RowSampler(RowSettings(*settings), draw_keys, mode, split)
        state = DecodeState(init_token, hidden, lengths, cache, history, sources)
        if shape is None:
            nxt, out = autoregressive_step(model, state, sampler, window, held)
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
        settings: RowSettings,
        window: int,
        split: SplitRows | None = None,
    ):
        out = fn(*state, row_keys, active, tuple(settings), window, tuple(split or ()))
        fields = len(DecodeState._fields)
        got = StepOutput(*out[fields + 1 :])
        if got.logprobs is not None:  # a compiled step gives the tree back as a tuple
            got = got._replace(logprobs=TokenLogprobs(*got.logprobs))
        return DecodeState(*out[:fields]), out[fields], got

    run.counter = counter  # tracings (each is a compile)
    return run


MAX_BATCH_STEPS = 16  # per model: shapes x sampling modes x drafters


def batch_step(
    model,
    sources: tuple[Source, ...],
    shape: BeamShape | None,
    mode: StepMode,
    compiled: bool = True,
    key: tuple | None = None,
):
    """The compiled batch step of this configuration, kept on the model (compiled once for
    every loop over it: each chat turn, each request batch, whose sources resolved again
    from the same modules have the same ``held.sources_key``; ``key``: that key, when the
    caller keeps it)."""
    cache = model.__dict__.setdefault("_batch_steps", {})
    if shape is not None:
        shape = narrowed(model, shape)
    layers = getattr(model, "feature_layers", ())
    key = (key or sources_key(sources), shape, mode, compiled, layers)
    if key not in cache:
        while len(cache) >= MAX_BATCH_STEPS:  # drop the oldest (and the sources it holds)
            cache.pop(next(iter(cache)))
        cache[key] = make_batch_step(model, sources, shape, mode, compiled)
    return cache[key]


def narrowed(model, shape: BeamShape) -> BeamShape | None:
    """The nearest shape the model's steps may verify (``Verifier.verifies``, found at load):
    ``shape`` itself on most models; ``shape.as_chain()`` where a tree cannot be verified (a
    model's recurrent state follows one chain; a family's positions do not reach a tree);
    plain decoding (None) where even a chain gives other logits. Said once per model, with
    why."""
    verifies = getattr(model, "verifies", "tree")
    if verifies == "tree" or shape.is_autoregressive:
        return shape
    if verifies == "chain" and shape.verifies_chain:
        return shape
    out = shape.as_chain() if verifies == "chain" else None  # None: the plain decoding step
    if not model.__dict__.get("_narrowing_said"):
        model.__dict__["_narrowing_said"] = True
        runs = (
            f"{out.label} (one drafter beam, one lookup chain, or the draft model's chain, "
            "whichever each row ranks first)"
            if verifies == "chain"
            else "plain decoding"
        )
        warnings.warn(f"{model.narrowing}: {shape.label} runs as {runs}", stacklevel=3)
    return out


def uniform_step(
    model,
    sources: tuple[Source, ...],
    shape: BeamShape | None,
    sampler: SamplerConfig,
    rows: int,
    seed: int = 0,
    compiled: bool = True,
):
    """The batch step (``batch_step``) of ``rows`` active rows that all draw with ``sampler``,
    as ``run(state, window) -> (state, StepOutput)`` with the rows' keys (from ``seed``,
    split every step) carried inside: the product's own step, for measurements and tests.
    ``shape=None``: plain decoding; ``run.step``: the compiled step (``.counter``);
    ``sources``: the run's (``held.held_sources``; the stateful ones' states in
    ``state.sources``), the draft slot's dropped for a shape without its ``D1×L`` chain and
    every one for plain decoding."""
    mode, settings = row_settings([sampler] * rows, model.vocab_size)
    check_sources(sources)
    if shape is None or not shape.model_length:
        sources = tuple(s for s in sources if shape is not None and s.part != "chain")
    step = batch_step(model, sources, shape, mode, compiled)
    active = mx.ones((rows,), dtype=mx.bool_)
    keys = {"rows": row_keys_of(mx.random.key(seed), rows)}

    def run(state: DecodeState, window: int):
        state, keys["rows"], out = step(state, keys["rows"], active, settings, window)
        return state, out

    run.step = step
    return run
