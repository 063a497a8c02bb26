"""A draft model as a draft source: a separate (small) model sharing the target's vocabulary
proposes one greedy chain of ``Ld`` tokens per step (``BeamShape.model_length``), on the
device, with its own K/V cache.

The cache (in ``DecodeState.sources``: the draft model's entries, ``Slots`` per layer, slot p
holding the K/V of text position p like the target's) follows the committed text. A step
may commit tokens the draft model never ran: the bonus token, its own last draft, or
another source's accepted path. So each draft starts by re-running the last ``catchup``
committed positions, ``[len - catchup + 1, len]`` (the init token at ``len``), in one
forward, ``catchup`` covering every token committed since its last draft
(``catchup_tokens``: 2 for the chain alone), so after that forward the cache holds exactly
the committed tokens' K/V (slots past ``len`` hold junk until rewritten). Then ``Ld - 2``
one-token forwards extend the chain from its argmax. No host read; static shapes.
The verifier decides what is emitted, so a draft model can change speed, never the output.

A draft model's vocabulary may be the target's first ids, up to ``MAX_ADDED_TOKENS``
fewer (the target grew by added tokens since, as an APAR model's split tokens): every id
it reads (prefill, catch-up, draft) passes ``known_ids`` first, an id it lacks read as id 0,
so it never indexes past its embedding; its drafts are its own ids, all the target's too.

Steps that do not run the draft model (another shape chosen, ``sources.py``: "Sources that
sit out steps") leave its cache further behind than ``catchup`` covers: the loop then runs
``DraftModelSource.catch_up`` over the missed committed positions before the step.

The draft slot (``draft_model=``, in the API; ``--draft-model``)
holds any number of draft models and other draft-slot sources (``held.held_sources``); a
draft model is held as a ``DraftModelSource``, which owns its whole life: its empty state,
its prefill where rows join, its catch-up, its chain and its check against the target.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..core.footprint import Dims, StepMemory, draft_model_bytes, kv_bytes
from ..core.tree import arange, cache_mask, chain_mask
from ..verifier.entries import cache_slots, rows_of
from .sources import (
    DraftContext,
    Proposal,
    Source,
    catch_up_positions,
    padded_chunks,
    register_source,
)

MAX_ADDED_TOKENS = 8  # ids a model may have gained past its drafter's or draft model's vocabulary


class DraftModelSource(Source):
    """A draft model's greedy chain of ``length`` tokens (init token first): the shape's
    ``D1×L``. Its state is its own cache (``verifier.entries``: ``Slots`` per layer)."""

    source_id = register_source("draft_model")
    stateful = True
    order = 20  # after an early-exit adapter in the draft slot

    def __init__(self, draft: Any, length: int = 0, catchup: int = 2):
        self.draft, self.length, self.catchup = draft, length, max(catchup, 1)

    @property
    def modules(self) -> tuple:
        return (self.draft,)

    def describe(self) -> str:
        return f"draft model {getattr(self.draft, 'model_type', type(self.draft).__name__)}"

    def check(self, model) -> None:
        check_draft_model(model, self.draft)

    def for_step(self, shape, length: int, other: int) -> DraftModelSource:
        if length < 2:
            raise ValueError(f"a draft-model chain needs >= 2 tokens, got {length}")
        return DraftModelSource(self.draft, length, catchup_tokens([other]))

    def empty_state(self, model, batch: int, slots: int) -> tuple:
        return self.draft.make_cache(batch, slots)

    def profile_counts(self) -> dict:
        """A catch-up forward, then ``length - 2`` one-token forwards."""
        return {"draft_model_forwards": self.length - 1}

    def price(self, pricer):
        return pricer.draft_model(self.draft)

    def memory(self, model, shape, batch: int, window: int):
        """Its weights (none when it is the target itself), its K/V cache over the window,
        and its chain's working set (``footprint.draft_model_bytes``) when ``shape`` runs it."""
        dd = Dims.of(self.draft)
        weights = 0 if self.draft is model else dd.weight_bytes
        step = draft_model_bytes(dd, shape, batch, window) if shape.model_length else 0
        return StepMemory(weights, kv_bytes(dd, batch, window), step)

    def prefill(self, model, session, rows: slice) -> tuple:
        """The model as its own draft starts from the model's own prefill K/V (no second
        prefill); another draft model prefills the rows' prompts (``prefill``)."""
        if self.draft is model:
            return rows_of(session.cache, lambda a: a[rows])
        return prefill(self.draft, session.cached[rows], session.slots)

    @property
    def covers(self) -> int:
        """Committed tokens its draft re-runs itself (the last ``catchup - 1``, then the init
        token): the most a step of this source may leave behind for the next one."""
        return self.catchup - 1

    def catch_up(self, ctx: DraftContext, count: int) -> tuple:
        """Its state after re-running each row's last ``count`` committed positions,
        ``[len - count, len)`` (from 0 in a shorter row), read from ``ctx.history``, in
        chunks of ``sources.catch_up_chunk(count)`` tokens; positions at or past a row's
        length compute junk written above it. Returns (state, None): the target's cache is
        not touched. Lazy: no host read (the loop queues it before a step)."""
        cache = ctx.own
        S = cache_slots(cache)
        history, lengths = ctx.history, ctx.lengths
        for pos in catch_up_positions(lengths, count):
            text = mx.take_along_axis(history, mx.minimum(pos, history.shape[1] - 1), axis=1)
            text = known_ids(self.draft, text)
            mask = (arange(ctx.window)[None, None, :] <= pos[:, :, None])[:, None]
            write = mx.where(pos < lengths[:, None], pos, mx.minimum(pos, S - 1))
            _, cache = self.draft(text, pos, mask, cache, write)
        return cache, None

    def propose(self, ctx: DraftContext) -> Proposal:
        cache = ctx.own
        draft, lengths, window = self.draft, ctx.lengths, ctx.window
        T = self.catchup
        start = mx.maximum(lengths - (T - 1), 0)  # (B,)
        pos = start[:, None] + arange(T)[None, :]  # (B, T); past len: junk, rewritten later
        S = ctx.history.shape[1]
        text = mx.take_along_axis(ctx.history, mx.minimum(pos, S - 1), axis=1)
        text = mx.where(pos == lengths[:, None], ctx.init_token[:, None], text)
        text = known_ids(draft, text)
        mask = cache_mask(start, chain_mask(T), window)
        hidden, cache = draft(text, pos, mask, cache, pos)
        at = (lengths - start)[:, None, None]  # the init token's column
        logits = draft.logits(mx.take_along_axis(hidden, at, axis=1))  # (B, 1, V)
        token = mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)  # (B,)
        chain = [ctx.init_token.astype(mx.int32), token]
        one = chain_mask(1)
        for k in range(1, self.length - 1):
            p = (lengths + k)[:, None]  # (B, 1)
            mask = cache_mask(lengths + k, one, window)
            hidden, cache = draft(token[:, None], p, mask, cache, p)
            token = mx.argmax(draft.logits(hidden)[:, 0], axis=-1).astype(mx.int32)
            chain.append(token)
        return Proposal(mx.stack(chain, axis=1)[:, None], None, 1, cache)


def known_ids(draft, tokens: mx.array) -> mx.array:
    """``tokens`` (any shape, the target's ids) as the draft model reads them: an id past its
    vocabulary (one the target gained since: ``check_draft_model``) becomes id 0, so its
    embedding is never read out of range. The draft of such a position is a guess like any
    other: the verifier decides the output."""
    return mx.where(tokens < draft.vocab_size, tokens, 0)


def catchup_tokens(other_lengths) -> int:
    """Positions a draft re-runs so that its cache holds every committed token. Its own
    chain's drafts were run at their positions except the last one, so its own path
    leaves at most that draft and the bonus (2); another source's path of up to Lo tokens
    leaves up to Lo - 1 drafts and the bonus (Lo). ``other_lengths``: the other
    candidates' lengths, the init token included."""
    return max([2, *other_lengths])


def prefill(draft, rows: list[list[int]], slots: int) -> tuple:
    """The draft model's state after each row's committed text ``rows`` (B lists of ids):
    its cache, ``slots`` slots per row (>= the longest row). A row of n tokens holds
    their K/V at slots [0, n); the next draft re-runs its last ones anyway."""
    B = len(rows)
    cache = draft.make_cache(B, slots)
    lengths = mx.zeros((B,), mx.int32)
    for _, tokens, counts in padded_chunks(rows):
        T = tokens.shape[1]
        idx = lengths[:, None] + arange(T)[None, :]
        mask = cache_mask(lengths, chain_mask(T), slots)
        _, cache = draft(known_ids(draft, tokens), idx, mask, cache, idx)
        lengths = lengths + counts
        mx.eval(cache)  # per chunk, before the decode loop
    return cache


def check_draft_model(model, draft) -> None:
    """A draft model must share the target's vocabulary: the same ids, all of them or the
    first ones when the target has up to ``MAX_ADDED_TOKENS`` more (added tokens,
    as an APAR model's split tokens: ``known_ids``); a clear error before anything runs."""
    if getattr(draft, "recurrent", False):
        raise ValueError(
            f"the draft model ({draft.model_type}) has recurrent layers, whose state cannot "
            "re-run the positions a draft model re-runs each step; pick a draft model with "
            "attention layers only (the target may still be recurrent)"
        )
    if not 0 <= model.vocab_size - draft.vocab_size <= MAX_ADDED_TOKENS:
        raise ValueError(
            f"the draft model's vocabulary ({draft.vocab_size} ids) differs from the model's "
            f"({model.vocab_size}): a draft model must use the same tokenizer (the model may "
            f"have up to {MAX_ADDED_TOKENS} added ids more); pick one of the target's family "
            "(e.g. a smaller model of the same release)"
        )
