"""The server's decode step: the engine's step over fixed batch rows, each active or free.

Rows join and leave between steps, so nothing about them may be a compile key: the batch
size B is one of a few fixed sizes (the scheduler's row buckets), and per-row settings
travel as arrays:

    active      (B,) bool     free rows compute but never advance their cache length
    temperature (B,) float32  0 = greedy row
    top_p       (B,) float32
    row_keys    (B, 2) uint32 one PRNG key per row, split once per step like a solo run's
    repetition, presence, frequency (B,) float32, context (B,) int32, bias (B, V) float32:
                each row's penalties and logit bias (``engine.sampling.RowPenalties``)

A row's draws therefore equal the same request decoded alone (same key sequence, same
per-row math); see ``engine.sampling.draw_rows``. Static switches (``StepMode``) only pick
how much sampling machinery the batch needs: argmax only, Gumbel, or Gumbel with top-p, and
whether any row has a logit bias or a penalty (with the history span its windows need).
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from redrafter_mlx.engine.decode import (
    DecodeState,
    StepOutput,
    autoregressive_step,
    redrafter_step,
)
from redrafter_mlx.engine.sampling import RowPenalties, RowSampler


class StepMode(NamedTuple):
    """Static sampling switches of a compiled step: any row samples / any uses top-p / any
    has a logit bias / any has a penalty, reading ``span`` history tokens."""

    sample: bool = False
    nucleus: bool = False
    bias: bool = False
    penalize: bool = False
    span: int = 0


class RowParams(NamedTuple):
    """Per-row arrays of the batch, rebuilt on the host when rows join or leave."""

    active: mx.array  # (B,) bool
    temperature: mx.array  # (B,) float32
    top_p: mx.array  # (B,) float32
    repetition: mx.array  # (B,) float32, 1 = off
    presence: mx.array  # (B,) float32
    frequency: mx.array  # (B,) float32
    context: mx.array  # (B,) int32 penalty window
    bias: mx.array  # (B, V) float32, or (B, 1) zeros when no row has one


def split_row_keys(row_keys: mx.array) -> tuple[mx.array, mx.array]:
    """Split each row's key as a solo run splits its one key: (B, 2) -> next (B, 2), draw (B, 2)."""
    both = mx.vmap(mx.random.split)(row_keys)  # (B, 2, 2)
    return both[:, 0], both[:, 1]


def make_batch_step(model, drafter, shape, mode: StepMode, compiled: bool = True):
    """A step ``(state, row_keys, params, window) -> (state, row_keys, StepOutput)``.

    ``shape=None`` decodes autoregressively; a shape without drafter beams speculates from
    lookup chains alone (they read ``state.history``). ``state.rng`` is unused
    (rows draw with ``row_keys``) and passes through. Compile keys: B, cache slots, window.
    """

    def step(init_token, hidden, lengths, keys, values, rng, history, row_keys, params, window):
        row_keys, draw_keys = split_row_keys(row_keys)
        active, temperature, top_p, repetition, presence, frequency, context, bias = params
        penalties = None
        if mode.bias or mode.penalize:
            penalties = RowPenalties(
                repetition, presence, frequency, context, bias, mode.span, mode.penalize, mode.bias
            )
        sampler = RowSampler(temperature, top_p, draw_keys, mode.sample, mode.nucleus, penalties)
        state = DecodeState(init_token, hidden, lengths, keys, values, rng, history)
        if shape is None:
            nxt, out = autoregressive_step(model, state, sampler, window)
        else:
            nxt, out = redrafter_step(
                model, drafter if shape.drafts else None, state, shape, sampler, window
            )
        held = mx.where(active, nxt.lengths, 0)  # free rows stay empty
        nxt = nxt._replace(lengths=held, rng=rng)
        return (*nxt, row_keys, *out)

    weights = [m.state for m in (model, drafter) if isinstance(m, nn.Module)]
    fn = mx.compile(step, inputs=weights) if compiled else step

    def run(state: DecodeState, row_keys: mx.array, params: RowParams, window: int):
        out = fn(*state, row_keys, tuple(params), window)
        fields = len(DecodeState._fields)
        return DecodeState(*out[:fields]), out[fields], StepOutput(*out[fields + 1 :])

    return run
