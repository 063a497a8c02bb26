"""A draft model as a draft source: a separate (small) model sharing the target's vocabulary
proposes one greedy chain of ``Ld`` tokens per step (``BeamShape.model_length``), on the
device, with its own K/V cache.

The cache (in ``DecodeState.sources``: (keys, values), per layer (B, n_kv, S, D), slot p
holding the K/V of text position p like the target's) follows the committed text. A step
may commit tokens the draft model never ran: the bonus token, its own last draft, or
another source's accepted path. So each draft starts by re-running the last ``catchup``
committed positions, ``[len - catchup + 1, len]`` (the init token at ``len``), in one
forward, ``catchup`` covering every token committed since its last draft
(``catchup_tokens``: 2 for the chain alone), so after that forward the cache holds exactly
the committed tokens' K/V (slots past ``len`` hold junk until rewritten). Then ``Ld - 2``
one-token forwards extend the chain from its argmax. No host read; static shapes.
The verifier decides what is emitted, so a draft model can change speed, never the output.

A draft model's vocabulary may be the target's first ids, up to ``loading.MAX_ADDED_TOKENS``
fewer (the target grew by added tokens since, as an APAR model's split tokens): every id
it reads (prefill, catch-up, draft) passes ``known_ids`` first, an id it lacks read as id 0,
so it never indexes past its embedding; its drafts are its own ids, all the target's too.

Steps that do not run the draft model (another shape chosen, ``sources.py``: "Sources that
sit out steps") leave its cache further behind than ``catchup`` covers: the loop then runs
``DraftModelSource.catch_up`` over the missed committed positions before the step.

The draft slot (``draft=`` down the loop, ``draft_model=`` in the API, ``--draft-model``)
holds a draft model, an early-exit adapter (``early_exit.py``: its chain is then the
``D1×L``), or both (``DraftPair``: each proposes its own chain of the shape's
``model_length``). ``draft_model_of`` is the draft model it holds, ``early_exit.adapter_of``
the adapter, and ``slot_modules`` both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .early_exit import EarlyExitAdapter, adapter_of, pair
from .sources import DRAFT_MODEL, DraftContext, Proposal, catch_up_positions, padded_chunks
from .tree import arange, cache_mask, chain_mask


@dataclass(frozen=True, eq=False)
class DraftPair:
    """The draft slot holding a draft model and an early-exit adapter at once: in a step of
    a shape with a ``D1×L`` part each proposes its own chain of ``L`` tokens (the adapter's
    first, then the draft model's: ``decode.step_sources``), beside the drafter's beams and
    the lookup chains, and the loop holds both states (``batch.held_sources``). ``model``:
    a model sharing the target's tokenizer (the target itself allowed); ``adapter``: an
    ``EarlyExitAdapter`` for the target. Compared and hashed by identity."""

    model: Any
    adapter: EarlyExitAdapter

    def __post_init__(self):
        if not isinstance(self.adapter, EarlyExitAdapter):
            raise TypeError(
                f"DraftPair's adapter must be an early-exit adapter, got "
                f"{type(self.adapter).__name__}: DraftPair(draft model, adapter)"
            )
        if self.model is None or isinstance(self.model, EarlyExitAdapter):
            what = "None" if self.model is None else "an early-exit adapter"
            raise TypeError(
                f"DraftPair's model must be a draft model, got {what}: a run holds one "
                "adapter; DraftPair(draft model, adapter), or pass the adapter alone"
            )


def draft_model_of(draft) -> Any:
    """The draft model the draft slot holds: a pair's model, a plain draft model, or None
    (an early-exit adapter alone, or an empty slot)."""
    if isinstance(draft, DraftPair):
        return draft.model
    return None if draft is None or isinstance(draft, EarlyExitAdapter) else draft


def step_capacity(shape, draft) -> int:
    """Packed slots a step of ``shape`` verifies with the draft slot ``draft``: the shape's
    (``BeamShape.slots``), and with a ``DraftPair`` and no capacity asked, room for its
    second chain too (``BeamShape.max_packed`` counts one ``D1×L`` chain; the tree holds
    both). Every place that sizes a step by its slots asks this (the step, the loop's
    attention window, the memory check, the profile)."""
    if isinstance(draft, DraftPair) and shape.model_length and shape.capacity is None:
        return shape.max_packed + shape.model_length - 1
    return shape.slots


def step_candidates(shape, draft) -> int:
    """Candidates a step of ``shape`` packs with the draft slot ``draft``: the shape's
    (``BeamShape.beams``, which counts one ``D1×L`` chain), and a ``DraftPair``'s second
    chain. The packing's working set grows with them (``memory.pack_bytes``)."""
    if isinstance(draft, DraftPair) and shape.model_length:
        return shape.beams + 1
    return shape.beams


def slot_modules(draft) -> tuple:
    """The modules the draft slot holds: (model, adapter) of a pair, (draft,), or ()."""
    if isinstance(draft, DraftPair):
        return (draft.model, draft.adapter)
    return () if draft is None else (draft,)


class DraftModelSource:
    """A draft model's greedy chain of ``length`` tokens (init token first)."""

    source_id = DRAFT_MODEL
    stateful = True

    def __init__(self, draft, length: int, catchup: int):
        if length < 2:
            raise ValueError(f"a draft-model chain needs >= 2 tokens, got {length}")
        self.draft, self.length, self.catchup = draft, length, max(catchup, 1)

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
        keys, values = ctx.own
        S = keys[0].shape[2]
        history, lengths = ctx.history, ctx.lengths
        for pos in catch_up_positions(lengths, count):
            text = mx.take_along_axis(history, mx.minimum(pos, history.shape[1] - 1), axis=1)
            text = known_ids(self.draft, text)
            mask = (arange(ctx.window)[None, None, :] <= pos[:, :, None])[:, None]
            write = mx.where(pos < lengths[:, None], pos, mx.minimum(pos, S - 1))
            _, keys, values = self.draft(text, pos, mask, keys, values, write)
        return (keys, values), None

    def propose(self, ctx: DraftContext) -> Proposal:
        keys, values = ctx.own
        draft, lengths, window = self.draft, ctx.lengths, ctx.window
        T = self.catchup
        start = mx.maximum(lengths - (T - 1), 0)  # (B,)
        pos = start[:, None] + arange(T)[None, :]  # (B, T); past len: junk, rewritten later
        S = ctx.history.shape[1]
        text = mx.take_along_axis(ctx.history, mx.minimum(pos, S - 1), axis=1)
        text = mx.where(pos == lengths[:, None], ctx.init_token[:, None], text)
        text = known_ids(draft, text)
        mask = cache_mask(start, chain_mask(T), window)
        hidden, keys, values = draft(text, pos, mask, keys, values, pos)
        at = (lengths - start)[:, None, None]  # the init token's column
        logits = draft.logits(mx.take_along_axis(hidden, at, axis=1))  # (B, 1, V)
        token = mx.argmax(logits[:, 0], axis=-1).astype(mx.int32)  # (B,)
        chain = [ctx.init_token.astype(mx.int32), token]
        one = chain_mask(1)
        for k in range(1, self.length - 1):
            p = (lengths + k)[:, None]  # (B, 1)
            mask = cache_mask(lengths + k, one, window)
            hidden, keys, values = draft(token[:, None], p, mask, keys, values, p)
            token = mx.argmax(draft.logits(hidden)[:, 0], axis=-1).astype(mx.int32)
            chain.append(token)
        return Proposal(mx.stack(chain, axis=1)[:, None], None, 1, (keys, values))


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


def initial_state(draft, batch: int, slots: int, dtype=None) -> tuple:
    """An empty draft-model state for ``batch`` rows: (keys, values)."""
    return draft.make_cache(batch, slots, dtype)


def prefill(draft, rows: list[list[int]], slots: int) -> tuple:
    """The draft model's state after each row's committed text ``rows`` (B lists of ids):
    (keys, values), ``slots`` slots per row (>= the longest row). A row of n tokens holds
    their K/V at slots [0, n); the next draft re-runs its last ones anyway."""
    B = len(rows)
    keys, values = draft.make_cache(B, slots)
    lengths = mx.zeros((B,), mx.int32)
    for _, tokens, counts in padded_chunks(rows):
        T = tokens.shape[1]
        idx = lengths[:, None] + arange(T)[None, :]
        mask = cache_mask(lengths, chain_mask(T), slots)
        _, keys, values = draft(known_ids(draft, tokens), idx, mask, keys, values, idx)
        lengths = lengths + counts
        mx.eval(keys, values)  # per chunk, before the decode loop
    return keys, values


def check_draft_model(model, draft) -> None:
    """A draft model must share the target's vocabulary: the same ids, all of them or the
    first ones when the target has up to ``loading.MAX_ADDED_TOKENS`` more (added tokens,
    as an APAR model's split tokens: ``known_ids``); a clear error before anything runs."""
    from .loading import MAX_ADDED_TOKENS

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


def check_draft_slot(model, drafter, draft) -> None:
    """What the draft slot holds, checked against the target before anything runs: its
    early-exit adapter (``early_exit.pair``: checked, its shortlist bound; not in both
    slots: ``adapter_of``) and its draft model (``check_draft_model``), either or both (a
    ``DraftPair``). A path (``check_loaded``): TypeError; otherwise ValueError naming the
    fix."""
    if draft is None:
        return
    check_loaded(draft)
    adapter = adapter_of(drafter, draft)
    if adapter is not None and adapter is not drafter:
        pair(model, adapter)
    own = draft_model_of(draft)
    if own is not None:
        check_draft_model(model, own)


def check_loaded(draft) -> None:
    """TypeError unless the draft slot holds something loaded (a model, an early-exit adapter
    or a ``DraftPair``): a path names how to load it (``load(..., draft_model=path)``)."""
    if isinstance(draft, str | os.PathLike):
        raise TypeError(
            f"draft_model takes a loaded draft model, early-exit adapter or DraftPair, got the "
            f"path {str(draft)!r}; load it first: model, drafter, tokenizer, draft = "
            f"redrafter_mlx.load(model_path, drafter_path, draft_model={str(draft)!r}), then "
            "pass draft_model=draft"
        )
    if isinstance(draft, DraftPair | EarlyExitAdapter):
        return
    if not hasattr(draft, "vocab_size") or not callable(draft):
        raise TypeError(
            f"draft_model takes a loaded draft model, early-exit adapter or DraftPair, got "
            f"{type(draft).__name__}; load one with redrafter_mlx.load(model_path, "
            "drafter_path, draft_model=path) (its fourth item)"
        )
