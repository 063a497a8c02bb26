"""One decode step, top to bottom: draft -> pack -> verify -> accept -> cache update.

A step is a pure function of mx arrays with static shapes for a given (B, W, L, K, Lk, C,
cache slots), so it runs under ``mx.compile`` and never reads the device. The candidates
come from draft sources (``sources.py``): the drafter's W beams (or, an early-exit adapter
as the drafter, its one chain: ``early_exit.py``), K context-lookup chains (``lookup.py``)
and the draft slot's chains (a draft model's, ``draft_model.py``, an early-exit adapter's
beside the recurrent drafter, or any other draft-slot source: ``held.py``), in one tree. The
autoregressive baseline is the same machinery with one token per step.

State carried between steps (``DecodeState``):
    init_token (B,)   the token the LLM produced last; not yet in the cache
    hidden     (B, H) the LLM's normed hidden state at the last cached token; (B, (1+k)H)
               with the k feature layers a drafter reads (``Verifier.capture_features``)
    lengths    (B,)   committed cache length per row
    cache             the target's cache entries (``verifier.entries``: ``Slots`` per
                      attention cache, (B, n_kv, S, D) keys and values; ``State`` per
                      recurrent layer, (B, 1, F)), each with its own commit
    history    (B, S) the committed token ids, slot by slot (None: no lookup)
    sources           every stateful held source's state, in held order (an early-exit
                      adapter's, a draft model's cache: entries too; ``held.held_sources``)

Rows draw with their own keys (``sampling.RowSampler``, split per step by the batch step,
``step.batch_step``): the state carries no key.

A step's output for the host (``StepOutput``): ``tokens`` (B, L) with ``count`` (B,) valid
entries per row — the accepted draft tokens followed by the bonus token — and
``source`` (B,): the id of the source whose candidate was accepted (``SOURCE_NAMES``; the
host counts ``count - 1`` accepted drafts for it, ``sources.by_source``); ``logprobs``:
each emitted token's log-probability and the most likely tokens of its node's
distribution (``core.logprobs``), when the step's ``StepMode.logprobs`` asks for them.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx

from ..core.branches import fork_not_drafted, split_logits
from ..core.logprobs import TokenLogprobs, on_slots, token_logprobs
from ..core.penalties import node_text
from ..core.sampling import RowSampler, draw, process_text
from ..core.shape import BeamShape
from ..core.tree import arange, cache_mask, chain_mask, pack, unpack
from ..drafting.lookup import write_history
from ..drafting.sources import (
    ABSENT,
    DraftContext,
    absorbed,
    merge,
    pad,
    present_of,
    sized_sources,
    step_capacity,
)
from ..verifier.entries import committed
from ..verifier.protocol import Verifier
from .two_chains import accept_two_chains, drawn_slots, lay_two_chains


class DecodeState(NamedTuple):
    init_token: mx.array
    hidden: mx.array
    lengths: mx.array
    cache: tuple
    history: mx.array | None = None
    sources: tuple = ()


class StepOutput(NamedTuple):
    tokens: mx.array  # (B, L) emitted tokens, first ``count`` valid
    count: mx.array  # (B,) tokens emitted this step (accepted + bonus)
    packed: mx.array  # (B,) tree slots in use this step
    source: mx.array | None = None  # (B,) int32 source id of the accepted path (SOURCE_NAMES)
    logprobs: TokenLogprobs | None = None  # (B, L) and (B, L, n): StepMode.logprobs on


class Candidates(NamedTuple):
    """The draft phase's output: every candidate of the tree, in packing order."""

    beams: mx.array  # (B, N, L) token ids, init token first; ABSENT past a candidate's end
    present: mx.array | None  # (B, N, L) bool, None when every candidate fills L
    source: mx.array  # (B or 1, N) int32, each candidate's source id (``SOURCE_NAMES``)
    states: tuple = ()  # the stateful sources' new states, in source order
    only: int | None = None  # the one source every candidate came from, if so
    cache: tuple | None = None  # the target's cache a source wrote above each row's
    # length while drafting (``Proposal.cache``), for the verify; None: untouched
    two: tuple | None = None  # (L1, L2): two chains in a static layout (``two_chains``)


def accept(beams, target, unpacker, capacity):
    """Longest beam agreeing with the target draws.

    beams: (B, W, L); target: (B, C) one target draw per packed node; unpacker: (B, W, L).
    Node (i, k) holds the draw for the token after beams[i, :k+1]; beam i accepts the longest
    run k = 1.. with beams[i, k] == draw(i, k-1) (truncated nodes never match).
    Returns best beam (B,), accepted draft tokens n (B,), and the draws on beams (B, W, L).
    """
    on_beams = unpack(target, unpacker)  # (B, W, L)
    present = unpacker < capacity
    match = (beams[:, :, 1:] == on_beams[:, :, :-1]) & present[:, :, 1:]
    run = mx.cumprod(match.astype(mx.int32), axis=-1).sum(axis=-1)  # (B, W)
    best = mx.argmax(run, axis=-1).astype(mx.int32)
    n = mx.take_along_axis(run, best[:, None], axis=1)[:, 0].astype(mx.int32)
    return best, n, on_beams


def slot_destinations(lengths, path_slots, n, capacity: int):
    """Cache slot each of the C packed slots moves to at the commit: (B, C) int32.

    Slot ``path_slots[k]`` goes to ``len + k`` for k <= n (B,); every other slot to
    ``len + C - 1``, past the new length ``len + n + 1`` unless all C slots are on the
    path (then there is no other slot): junk there is overwritten later.
    """
    P = path_slots.shape[1]
    k = arange(P)[None, None, :]  # (1, 1, P)
    on = (path_slots[:, None, :] == arange(capacity)[None, :, None]) & (k <= n[:, None, None])
    depth = (on * (k + 1)).sum(axis=-1)  # (B, C) 1 + the path position; 0: off the path
    return lengths[:, None] + mx.where(depth > 0, depth - 1, capacity - 1).astype(mx.int32)


def draft_phase(sources: list, ctx: DraftContext, capacity: int, states: tuple = ()):
    """1. Draft: every source's candidates, in one tree order (``sources.merge``).

    All start at the init token. Packing is candidate-major and truncates the last
    candidates first, so the order is the ranking: per row, higher-ranked sources first (a
    row whose best lookup match is at least ``STRONG_MATCH`` tokens puts its lookup chains
    first, any other row its drafter beams), the drafter's dropped beams last. ``sources``:
    sized (``sources.sized_sources``); ``states``: every held stateful source's state
    (``DecodeState.sources``): each running one reads its own (``Source.state_index``),
    the others pass through. One candidate per source in a ``capacity`` that holds only
    one of them: each row takes its top-ranked one, and the step verifies a single chain
    (no tree to pack or commit). Two, one full chain and one chain, with a slot for every
    token of both: ``two_chains`` (a static layout, no packing).
    """
    proposals, ids, new_states, cache = [], [], list(states), None
    for source in sources:
        own = states[source.state_index] if source.stateful else None
        p = source.propose(ctx._replace(own=own))
        if p.cache is not None:  # the next source and the verify read the written cache
            cache = p.cache
            ctx = ctx._replace(cache=cache)
        proposals.append(p)
        ids.append(source.source_id)
        if source.stateful:
            new_states[source.state_index] = p.state
    states = tuple(new_states)
    one_each = all(p.tokens.shape[1] == 1 and p.tail is None for p in proposals)
    if len(proposals) > 1 and one_each and capacity <= min(p.tokens.shape[2] for p in proposals):
        # Room for one chain only: another could add no slot, so pick one per row.
        tokens, source = pick_one(proposals, ids, capacity)
        return Candidates(tokens, None, source, states, cache=cache)
    full = 1 + sum(p.tokens.shape[2] - 1 for p in proposals)
    if len(proposals) == 2 and one_each and proposals[0].present is None and capacity == full:
        first, second = proposals
        n = max(first.tokens.shape[2], second.tokens.shape[2])
        tokens = mx.concatenate([pad(first.tokens, n, ABSENT), pad(second.tokens, n, ABSENT)], 1)
        present = mx.concatenate([present_of(first, n), present_of(second, n)], axis=1)
        source = mx.array([ids], mx.int32)
        lengths = (first.tokens.shape[2], second.tokens.shape[2])
        return Candidates(tokens, present, source, states, cache=cache, two=lengths)
    merged = merge(proposals, ids)
    return Candidates(merged.tokens, merged.present, merged.source, states, merged.only, cache)


def pick_one(proposals: list, ids: list[int], capacity: int):
    """Each row's top-ranked candidate (ties: source order) of proposals of one candidate
    each, cut to ``capacity`` (absent positions: any id). Returns tokens (B, 1, C) and
    source ids (B, 1)."""
    best, best_rank, best_id = None, None, None
    for p, i in zip(proposals, ids):
        tokens = p.tokens[:, :, :capacity]
        if p.present is not None:
            tokens = mx.where(p.present[:, :, :capacity], tokens, 0)
        if best is None:
            best, best_rank, best_id = tokens, p.rank, mx.array(i, mx.int32)
            continue
        take = p.rank > best_rank  # (B,) or a bool
        if isinstance(take, bool):
            if take:
                best, best_rank, best_id = tokens, p.rank, mx.array(i, mx.int32)
            continue
        best = mx.where(take[:, None, None], tokens, best)
        best_id = mx.where(take, i, best_id)
        best_rank = mx.maximum(p.rank, best_rank) if len(proposals) > 2 else None
    B = best.shape[0]
    return best, mx.broadcast_to(best_id, (B,))[:, None]


def shape_candidates(
    model: Verifier, state: DecodeState, shape: BeamShape, sources: tuple, window=0
) -> Candidates:
    """``draft_phase`` of the held ``sources`` (``held.held_sources``) a step of ``shape``
    runs (``sources.sized_sources``) on ``state``, at its capacity (a measuring or testing
    entry; the step builds the same)."""
    ctx = DraftContext(
        model, state.hidden, state.init_token, state.lengths, state.history, window,
        cache=state.cache,
    )  # fmt: skip
    capacity = step_capacity(shape, sources)
    return draft_phase(sized_sources(sources, shape), ctx, capacity, state.sources)


def verify_phase(
    model: Verifier,
    tree,
    lengths,
    cache: tuple,
    sampler: RowSampler,
    window: int,
    history=None,
    fresh=None,
):
    """3. Verify all C packed tokens in one forward, written at ``[len, len+C)``.

    Each node draws from the target given its own path (penalties read that path too), with
    its row's settings and key (``sampler``).
    ``fresh``: a list that receives what each cache entry's commit reads (``Verifier``).
    Returns (hidden (B, C, H), target draws (B, C), the cache).
    """
    hidden, logits, cache = verify_logits(
        model, tree, lengths, cache, sampler, window, history, fresh
    )
    return hidden, draw(logits, sampler), cache


def verify_logits(model, tree, lengths, cache, sampler, window, history=None, fresh=None):
    """``verify_phase`` up to the draws: (hidden (B, C, H), each node's processed logits
    (B, C, V), the cache ``fresh`` describes)."""
    capacity = tree.tokens.shape[1]
    positions = lengths[:, None] + tree.depth
    write_idx = lengths[:, None] + arange(capacity)[None, :]
    mask = cache_mask(lengths, tree.mask, window)
    # a recurrent layer runs the tree's root-to-leaf paths (``unpacker`` (B, W, L)) as rows
    hidden, cache = model(
        tree.tokens, positions, mask, cache, write_idx, fresh, paths=tree.unpacker
    )
    text = tree_text(sampler, history, lengths, tree.tokens, tree.depth, tree.mask)
    logits = process_text(model.logits(hidden), sampler, text, positions + 1)
    logits = split_logits(logits, tree.tokens, tree.depth == 0, sampler)
    return hidden, logits, cache


def tree_text(sampler, history, lengths, tokens=None, depth=None, ancestors=None):
    """Each node's penalty window (``penalties.node_text``), or None when no penalty reads text.

    tokens, depth: (B, C); ancestors: (B or 1, C, C) bool ancestor-or-self; no tree: the
    window right after the committed text (the first draw after a prompt).
    """
    if not sampler.reads_text:
        return None
    if history is None:
        raise ValueError("a repetition, presence or frequency penalty needs the token history")
    span, context = sampler.penalty_window()
    return node_text(history, lengths, span, context, tokens, depth, ancestors)


def accept_phase(beams, target, unpacker, capacity: int):
    """4. Accept the longest agreeing beam; the bonus is the target draw after it.

    Returns (tokens (B, L) emitted, n (B,) accepted drafts, bonus (B,), path_slots (B, P),
    path (B, P) the committed path's tokens (init token first), best beam (B,) or None),
    where P = min(L, C): an accepted path never holds more tokens than the tree's slots.
    """
    B, W, length = beams.shape
    k = arange(length)[None, :]
    P = min(length, capacity)
    if W == 1:  # one chain packed in order: slot k is beam token k, nothing to choose
        path_beam, path_target = beams[:, 0], target
        match = (path_beam[:, 1:] == target[:, :-1]).astype(mx.int32)
        n = mx.cumprod(match, axis=-1).sum(axis=-1).astype(mx.int32)
        bonus = mx.take_along_axis(path_target, n[:, None], axis=1)[:, 0]
        tokens = mx.where(k < n[:, None], mx.roll(path_beam, -1, axis=1), bonus[:, None])
        tokens = mx.where(k <= n[:, None], tokens, 0)
        return tokens, n, bonus, mx.broadcast_to(k, (B, length)), path_beam, None
    best, n, target_on_beams = accept(beams, target, unpacker, capacity)
    path_beam = mx.take_along_axis(beams, best[:, None, None], axis=1)[:, 0]  # (B, L)
    path_target = mx.take_along_axis(target_on_beams, best[:, None, None], axis=1)[:, 0]
    path_slots = mx.take_along_axis(unpacker, best[:, None, None], axis=1)[:, 0]
    path_slots = mx.minimum(path_slots, capacity - 1)  # past the run: any slot in the tree
    bonus = mx.take_along_axis(path_target, n[:, None], axis=1)[:, 0]
    tokens = mx.where(k < n[:, None], mx.roll(path_beam, -1, axis=1), 0)
    tokens = mx.where(k == n[:, None], bonus[:, None], tokens)
    return tokens, n, bonus, path_slots[:, :P], path_beam[:, :P], best


def commit_phase(cache, lengths, path_slots, hidden, n, fresh, capacity: int, in_place: bool):
    """5. Commit the accepted path (init token + n drafts) to the cache: each entry its own
    way (``entries.committed``): an attention cache moves the path's K/V from its packed
    slots to ``[len, len + n]`` (``slot_destinations``), a recurrent state is taken at the
    accepted length.

    ``fresh``: what the verify left each entry's commit. ``in_place``: the path already
    sits in consecutive slots (W = 1: slot k is token k), so no K/V moves. Returns (the
    cache, next hidden (B, H) at the last accepted token, next lengths (B,)).
    """
    dst = None if in_place else slot_destinations(lengths, path_slots, n, capacity)  # (B, C)
    cache = committed(cache, fresh, dst, n + 1, path_slots)
    last_slot = mx.take_along_axis(path_slots, n[:, None], axis=1)  # (B, 1)
    next_hidden = mx.take_along_axis(hidden, last_slot[:, :, None], axis=1)[:, 0]
    return cache, next_hidden, lengths + n + 1


def redrafter_step(
    model: Verifier,
    held: tuple,
    state: DecodeState,
    shape: BeamShape,
    sampler: RowSampler,
    window: int,
):
    """One speculative step of ``shape``, each row drawing with its own settings and key
    (``sampler``). Returns (next DecodeState, StepOutput).

    ``held``: the loop's draft sources (``held.held_sources``); the step runs those the
    shape turns on (``sources.sized_sources``), their states in ``state.sources``.
    ``window``: attention covers cache slots [0, window); it must exceed every row's
    length + capacity (the loop picks it in buckets, so it is a rare compile key).
    """
    B = state.lengths.shape[0]
    capacity = step_capacity(shape, held)  # each further draft-slot chain gets its room
    ctx = DraftContext(
        model, state.hidden, state.init_token, state.lengths, state.history, window,
        cache=state.cache,
    )  # fmt: skip
    cand = draft_phase(sized_sources(held, shape), ctx, capacity, state.sources)  # 1. draft
    cache = cand.cache or state.cache
    beams = cand.beams
    if beams.shape[1] == 1:  # a lone chain fills its C slots
        if cand.present is not None:
            beams = mx.where(cand.present, beams, 0)
        beams = beams[:, :, :capacity]
    if beams.shape[1] > 1 and getattr(model, "verifies", "tree") != "tree":  # at trace time
        raise ValueError(
            f"{shape.label} packs a tree, which this model cannot verify ({model.narrowing}): "
            f"run {shape.as_chain().label} (step.batch_step does)"
        )
    if cand.two:  # 2. pack: two chains in a static layout, or the trie of every candidate
        layout = lay_two_chains(beams, cand.present, cand.two)
        tree = layout.tree
    else:
        tree = pack(beams, capacity, cand.present if beams.shape[1] > 1 else None)
    fresh = []  # per cache entry, what the verify left its commit (the path's K/V, ...)
    hidden, logits, cache = verify_logits(  # 3. verify
        model, tree, state.lengths, cache, sampler, window, state.history, fresh
    )
    target = draw(logits, sampler)
    judged = fork_not_drafted(beams, sampler)  # a fork is only ever the bonus
    if cand.two:  # 4. accept
        tokens, n, bonus, path_slots, path, best = accept_two_chains(judged, target, layout)
    else:
        accepted = accept_phase(judged, target, tree.unpacker, capacity)
        tokens, n, bonus, path_slots, path, best = accepted
    history = state.history
    if history is not None:
        history = write_history(history, state.lengths, path)  # junk past n
    cache, next_hidden, lengths = commit_phase(  # 5. commit
        cache, state.lengths, path_slots, hidden, n, fresh, capacity, beams.shape[1] == 1
    )
    states = cand.states
    if any(source.absorbs for source in held):  # 6. the sources that take in the path
        path_hidden = mx.take_along_axis(hidden, path_slots[:, :, None], axis=1)  # (B, P, W)
        states = absorbed(held, states, model, path, state.hidden, path_hidden, state.lengths)
    next_state = DecodeState(bonus, next_hidden, lengths, cache, history, states)
    if beams.shape[1] == 1:  # one chain fills every slot: a constant, no kernel
        packed = mx.broadcast_to(mx.array(capacity, dtype=mx.int32), (B,))
    elif cand.two:
        packed = layout.packed
    else:
        packed = mx.broadcast_to(tree.valid.sum(axis=-1).astype(mx.int32), (B,))
    source = cand.source
    if cand.only is not None:  # one source: a constant
        chosen = mx.broadcast_to(mx.array(cand.only, mx.int32), (B,))
    elif best is None or source.shape[1] == 1:
        chosen = mx.broadcast_to(source[:, 0], (B,))
    else:
        chosen = mx.take_along_axis(mx.broadcast_to(source, beams.shape[:2]), best[:, None], 1)
        chosen = chosen[:, 0]
    logprobs = None
    if sampler.mode.logprobs:  # each emitted token from the node that drew it
        slots = drawn_slots(judged, layout, best) if cand.two else path_slots
        logprobs = token_logprobs(on_slots(logits, slots, tokens.shape[1]), tokens, sampler)
    return next_state, StepOutput(tokens, n + 1, packed, chosen.astype(mx.int32), logprobs)


def autoregressive_step(
    model: Verifier, state: DecodeState, sampler: RowSampler, window: int, held: tuple = ()
):
    """One plain decoding step (the baseline): commit the init token, draw the next.
    ``held``: the loop's sources; those that take in every committed token (``absorbs``)
    take in this one."""
    lengths = state.lengths
    B = lengths.shape[0]
    tokens = state.init_token[:, None]
    mask = cache_mask(lengths, chain_mask(1), window)
    hidden, cache = model(tokens, lengths[:, None], mask, state.cache, lengths[:, None])
    logits = model.logits(hidden)  # (B, 1, V)
    text = tree_text(
        sampler, state.history, lengths, tokens, 0 * tokens, mx.ones((1, 1, 1), mx.bool_)
    )
    logits = process_text(logits, sampler, text, lengths[:, None] + 1)
    logits = split_logits(logits, tokens, mx.array([[True]]), sampler)
    nxt = draw(logits[:, 0], sampler)
    one = mx.ones((B,), dtype=mx.int32)
    history = state.history
    if history is not None:
        history = write_history(history, lengths, tokens)
    states = absorbed(held, state.sources, model, tokens, state.hidden, None, lengths)
    next_state = DecodeState(nxt, hidden[:, 0], lengths + 1, cache, history, states)
    logprobs = token_logprobs(logits, nxt[:, None], sampler) if sampler.mode.logprobs else None
    return next_state, StepOutput(nxt[:, None], one, one, None, logprobs)


def first_draw(
    model: Verifier, hidden, sampler: RowSampler, history, lengths, last=None
) -> mx.array:
    """The token after the prompt: hidden (B, H) at each row's last prompt token -> (B,),
    drawn with each row's settings and key (``sampler``).

    Penalties read the last tokens of the prompt (``history`` (B, S) holds it, ``lengths``
    (B,) its length per row); the branching rules read ``last`` (B,), each prompt's last
    token (needed when ``sampler.mode.split``).
    """
    return first_draw_logprobs(model, hidden, sampler, history, lengths, last)[0]


def first_draw_logprobs(model: Verifier, hidden, sampler: RowSampler, history, lengths, last=None):
    """``first_draw``, and its token's logprobs ((B, 1) and (B, 1, n): ``core.logprobs``)
    when ``sampler.mode.logprobs`` asks for them (else None)."""
    logits = model.logits(hidden)[:, None]  # (B, 1, V)
    text = tree_text(sampler, history, lengths)
    logits = process_text(logits, sampler, text, lengths[:, None])  # the first output token
    if last is not None:
        logits = split_logits(logits, last[:, None], mx.array([[True]]), sampler)
    token = draw(logits[:, 0], sampler)
    if not sampler.mode.logprobs:
        return token, None
    return token, token_logprobs(logits, token[:, None], sampler)


def prefill_chunk(model: Verifier, tokens, counts, lengths, cache: tuple, window: int):
    """Run T prompt tokens per row (right-padded) at ``[len, len+T)``, attending to [0, window).

    tokens: (B, T); counts: (B,) real tokens per row in this chunk (may be 0).
    Returns (hidden at each row's last real token (B, H), lengths + counts, the cache).
    """
    _B, T = tokens.shape
    idx = lengths[:, None] + arange(T)[None, :]
    mask = cache_mask(lengths, chain_mask(T), window)
    hidden, cache = model(tokens, idx, mask, cache, idx, counts=counts)
    last = mx.maximum(counts - 1, 0)[:, None, None]
    h_last = mx.take_along_axis(hidden, last, axis=1)[:, 0]
    return h_last, lengths + counts, cache
