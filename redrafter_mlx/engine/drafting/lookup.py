"""Context lookup: draft candidates copied from the text itself (prompt + output so far).

Much of what a chat model writes is already in its context: the text it is asked to rewrite,
fix or summarise, the code it changes, its own earlier answer, its own repetitions. Each step
takes the text's suffix (the committed tokens followed by the init token), finds its latest
earlier occurrences, matching up to ``MAX_NGRAM`` tokens, and proposes what followed them as
candidate chains in the verification tree beside the drafter's beams. The verifier checks
every candidate against the model's own draws, so their origin never changes the output.

All tensor ops with static shapes (no host read, no per-step recompile), on:

    history   (B, S) int32  committed token ids per cache slot (slots >= len are junk)
    lengths   (B,)   int32  committed tokens per row
    init      (B,)   int32  the token the model produced last, at position ``len``

A chain is ``[init, t_{p+1}, ..., t_{p+Lk-1}]`` for the occurrence ending at position ``p``.
Chains rank by match length, then recency; the K chains have K distinct first draft tokens
(a second chain that starts like the first would add no branch to the tree). A chain
position without a match is absent: it takes no tree slot.

A continuation that runs into the present is read cyclically with the period
``d = len - p`` (the distance from the occurrence to the suffix): the token ``j`` draft
positions on is ``t_{p+1 + (j mod d)}``. When the text ends in a periodic run (a row of
``=``, a long number of zeros, indentation, a repeated word), the latest match of the suffix
overlaps the suffix itself (``d`` is the run's period), and the text so far holds only ``d``
tokens after it: read this way the chain is the run continued, as long as the chain, where
it would otherwise stop after ``d`` tokens (one for a run of one repeated token).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx

from ..core.tree import arange
from .sources import ABSENT, DraftContext, Proposal, Source, register_source

DEFAULT_CHAINS = 1  # lookup chains per step by default (the CLI's --lookup)
DEFAULT_CHAIN_LENGTH = 8  # tokens per chain, the init token included (--lookup-length)
MAX_NGRAM = 4  # longest suffix matched
MIN_NGRAM = 1  # shortest suffix that proposes a chain
STRONG_MATCH = 2  # a match this long ranks lookup chains before the drafter's beams


class LookupChains(NamedTuple):
    tokens: mx.array  # (B, K, Lk) int32, ABSENT where ``present`` is False
    present: mx.array  # (B, K, Lk) bool, a prefix of each chain (position 0 always)
    match: mx.array  # (B, K) int32 suffix tokens matched (0: no candidate)


def padded_text(history: mx.array, lengths: mx.array, init: mx.array, before: int) -> mx.array:
    """The row's text with ``before`` never-matching tokens in front: (B, S) -> (B, before + S + 1).

    Text position p sits at column ``before + p``; the init token at position ``len``. Slots
    past ``len`` hold junk (one slot is added so ``len`` fits when the cache is full). One
    kernel: the concatenation (its pads are constants), the init token written by the
    consumers' fused ``where``.
    """
    B = history.shape[0]
    front = mx.broadcast_to(_constant(ABSENT - 1, before), (B, before))
    back = mx.broadcast_to(_constant(ABSENT, 1), (B, 1))
    text = mx.concatenate([front, history, back], axis=1)
    at_end = arange(text.shape[1])[None, :] == (lengths + before)[:, None]
    return mx.where(at_end, init[:, None], text)


@functools.lru_cache(maxsize=16)
def _first(n: int) -> mx.array:
    """(1, n) bool, True at position 0 only, as captured data."""
    return mx.array([[k == 0 for k in range(n)]], dtype=mx.bool_)


@functools.lru_cache(maxsize=16)
def _constant(value: int, n: int) -> mx.array:
    """(1, n) int32 filled with ``value``, as captured data (see ``tree.arange``)."""
    return mx.array([[value] * n], dtype=mx.int32)


def match_scores(text: mx.array, lengths: mx.array, max_ngram: int, min_ngram: int):
    """Rank of each earlier position as a match of the suffix: (B, S) int32, -1 for none.

    ``text``: (B, max_ngram - 1 + S + 1) from ``padded_text``. With ``m[b, p]`` the largest
    n <= max_ngram such that text[p-n+1 .. p] == text[len-n+1 .. len], a position p < len
    with m >= ``min_ngram`` scores ``m * S + p`` (a longer match first, then the latest):
    the best is one max, and the score holds both the match and the position. One fused
    elementwise kernel over views of ``text``, plus the gather of the suffix.
    """
    before = max_ngram - 1
    width = text.shape[1]
    S = width - before - 1
    back = lengths[:, None] + before - arange(max_ngram)[None, :]  # (B, n) columns of the suffix
    suffix = mx.take_along_axis(text, back, axis=1)  # (B, max_ngram) text[len - j]
    run = total = None
    for j in range(max_ngram):
        shifted = text[:, before - j : before - j + S]  # text[p - j] at each position p
        eq = shifted == suffix[:, j : j + 1]
        run = eq if run is None else run & eq  # matched all of the last j + 1 tokens
        total = run.astype(mx.int32) if total is None else total + run
    pos = arange(S)[None, :]
    keep = (pos < lengths[:, None]) & (total >= min_ngram)
    return mx.where(keep, total * S + pos, -1)


def lookup_chains(
    history: mx.array,
    lengths: mx.array,
    init: mx.array,
    chains: int,
    length: int,
    max_ngram: int = MAX_NGRAM,
    min_ngram: int = MIN_NGRAM,
) -> LookupChains:
    """Up to ``chains`` continuations of the text's suffix, ``length`` tokens each with the
    init token first: (B, K, Lk). See the module docstring for the ranking.

    A handful of kernels per chain: the text, the scores (``match_scores``), one max, one
    gather of the continuation and fused elementwise ops (no sort, no argmax + gather).
    """
    S = history.shape[1]
    before = max_ngram - 1
    text = padded_text(history, lengths, init, before)  # (B, before + S + 1)
    score = match_scores(text, lengths, max_ngram, min_ngram)  # (B, S)
    following = text[:, before + 1 : before + 1 + S]  # text[p + 1] at each position p
    first = _first(length)  # (1, Lk) bool: position 0, the init token
    drafts = mx.maximum(arange(length) - 1, 0)[None, :]  # (1, Lk) draft position of each
    tokens, present, match = [], [], []
    for k in range(chains):
        best = mx.max(score, axis=1)  # (B,) m * S + p of the best match, -1: none
        found = (best >= 0)[:, None]  # (B, 1)
        end = mx.maximum(best, 0) % S  # (B,) the position p where the occurrence ends
        at = continuation(end, lengths, drafts)  # (B, Lk)
        at = mx.where(first, lengths[:, None], at)  # position 0: the init token
        chain = mx.take_along_axis(text, at + before, axis=1)
        keep = found | first
        tokens.append(mx.where(keep, chain, ABSENT))
        present.append(keep)
        match.append(mx.where(found[:, 0], best // S, 0))
        if k + 1 < chains:  # the next chain must branch at its first draft token
            score = mx.where(following == chain[:, 1:2], -1, score)
    return LookupChains(
        mx.stack(tokens, axis=1).astype(mx.int32),
        mx.stack(present, axis=1),
        mx.stack(match, axis=1).astype(mx.int32),
    )


def continuation(ends: mx.array, lengths: mx.array, steps: mx.array) -> mx.array:
    """Text positions of the tokens after the occurrence ending at ``ends`` (B,): (B, J).

    ``steps`` (1, J) counts draft positions from 0. The text is known up to ``len`` (the
    init token): past it, the continuation repeats with the period ``len - end`` (see the
    module docstring), so every position read is in ``(end, len]``. ``ends`` < ``lengths``.
    """
    period = mx.maximum(lengths - ends, 1)[:, None]  # (B, 1)
    return ends[:, None] + 1 + steps % period


def write_history(history: mx.array, lengths: mx.array, tokens: mx.array) -> mx.array:
    """Write each row's committed tokens (B, T) at ``[len, len+T)``: (B, S) -> (B, S).

    Entries past a row's accepted path are junk past its new length (overwritten later).
    """
    at = lengths[:, None] + arange(tokens.shape[1])[None, :]
    return mx.put_along_axis(history, at, tokens.astype(mx.int32), axis=1)


class LookupShadow:
    """What one lookup chain would have had accepted at each step, whatever shape ran.

    The host mirror of ``lookup_chains``' first chain (longest match of the last
    ``MAX_NGRAM`` tokens, then the latest, its continuation periodic past the text's end),
    over the text the loop has already read. At each
    step start it records the chain the step could have verified; once the text shows a token
    that differs from it (or has grown past it), the chain's accepted drafts are the leading
    tokens it shares with what the model actually wrote. The adaptive loop judges lookup
    shapes by these counterfactuals, so it notices text worth copying (a second turn, an
    editing task) while it runs plain decoding or the drafter, and notices it stopping.
    Plain Python on tokens already read: no device work, and an n-gram index makes each step
    O(new tokens).
    """

    def __init__(self, rows: list[list[int]], horizon: int, max_ngram: int = MAX_NGRAM):
        self.horizon = horizon  # draft tokens a chain holds (its length minus the init token)
        self.max_ngram = max_ngram
        self.text = [list(r) for r in rows]
        self.index: list[dict[tuple, int]] = [{} for _ in rows]
        self.indexed = [0] * len(rows)  # positions < this are in the index
        self.pending: list[list[tuple[int, list[int], int]]] = [[] for _ in rows]
        for r in range(len(rows)):
            self._index_upto(r)

    def _index_upto(self, r: int) -> None:
        """Index the n-grams ending at every position before the last (the init token)."""
        text, index = self.text[r], self.index[r]
        for p in range(self.indexed[r], len(text) - 1):
            for n in range(1, self.max_ngram + 1):
                if p - n + 1 < 0:
                    break
                index[tuple(text[p - n + 1 : p + 1])] = p
        self.indexed[r] = max(len(text) - 1, self.indexed[r])

    def _found(self, r: int) -> tuple[int, int]:
        """(n, p): the longest suffix of row ``r``'s text (n <= ``max_ngram``) that occurred
        earlier, and where that occurrence ends (the latest); (0, -1) without one."""
        text, index = self.text[r], self.index[r]
        for n in range(min(self.max_ngram, len(text)), 0, -1):
            p = index.get(tuple(text[-n:]))
            if p is not None:
                return n, p
        return 0, -1

    def match(self, r: int) -> int:
        """Tokens of row ``r``'s suffix that lookup matches now (0: no candidate)."""
        return self._found(r)[0]

    def chain(self, r: int) -> list[int]:
        """The draft tokens lookup proposes now for row ``r`` (empty: no match)."""
        return self._chain_and_match(r)[0]

    def _chain_and_match(self, r: int) -> tuple[list[int], int]:
        n, p = self._found(r)
        if not n:
            return [], 0
        text = self.text[r]
        period = len(text) - 1 - p  # the continuation repeats past the init token
        return [text[p + 1 + j % period] for j in range(self.horizon)], n

    def step(self, r: int, tokens: list[int]) -> list[tuple[int, int]]:
        """Row ``r``'s step emitted ``tokens``: returns ``(match, accepted)`` of the chains
        whose outcome is now known (one per earlier step start): the suffix tokens matched
        when the step started, and the chain's leading tokens the model then wrote."""
        start = len(self.text[r])
        self.pending[r].append((start, *self._chain_and_match(r)))
        self.text[r].extend(tokens)
        self._index_upto(r)
        return self._resolve(r, final=False)

    def finish(self, r: int) -> list[tuple[int, int]]:
        """Row ``r`` ended: resolve its remaining chains with the text as it is."""
        return self._resolve(r, final=True)

    def _resolve(self, r: int, final: bool) -> list[tuple[int, int]]:
        """A chain's outcome is known at its first token that differs from the text (or
        when the text has passed its end): resolving a miss at once, rather than when the
        text reaches the chain's full length, keeps the chooser's view of lookup current
        (a run of plain decoding would otherwise learn of a miss up to ``horizon`` steps
        late)."""
        text, done, keep = self.text[r], [], []
        for start, chain, match in self.pending[r]:
            n = 0
            while n < len(chain) and start + n < len(text) and chain[n] == text[start + n]:
                n += 1
            if not final and n < len(chain) and start + n >= len(text):
                keep.append((start, chain, match))  # it matches all the text written so far
                continue
            done.append((match, n))
        self.pending[r] = keep
        return done


class LookupSource(Source):
    """K context-lookup chains of Lk tokens (``lookup_chains``): the shape's K×Lk. A row
    whose best match is at least ``STRONG_MATCH`` tokens ranks them before the drafter's
    beams (rank 1): their rank is the match length shifted so that ``STRONG_MATCH`` ranks 2,
    one shorter ties with the drafter (which comes first in source order)."""

    source_id = register_source("lookup")
    part = "lookup"

    def __init__(self, chains: int = 0, length: int = 0):
        self.chains, self.length = chains, length

    def length_in(self, shape) -> int:
        return shape.chain_length if shape.lookup else 0

    def for_step(self, shape, length: int, other: int) -> LookupSource:
        return LookupSource(shape.lookup, length)

    def propose(self, ctx: DraftContext) -> Proposal:
        found = lookup_chains(ctx.history, ctx.lengths, ctx.init_token, self.chains, self.length)
        rank = found.match[:, 0]  # (B,); a view when STRONG_MATCH is 2
        if STRONG_MATCH != 2:
            rank = rank + (2 - STRONG_MATCH)
        return Proposal(found.tokens, found.present, rank)
