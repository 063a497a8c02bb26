"""Draft heads people download as draft sources: one greedy chain of the shape's ``D1×L``
(MTP and EAGLE-3: one head forward per draft; DFlash: the whole chain from one forward).

A head (``heads/``) keeps an entry per text position p: the token at p + 1 paired with the
target's features at p (an MTP head: the final normed hidden state; an EAGLE-3 head: three
tapped layers, ``Verifier.capture_features``), its K/V in slot p of the source's state (a
cache of ``verifier.entries.Slots``, one per head layer). The state follows the committed
text at every commit, not by re-running text at the next draft:

* **absorb** (at every step's commit, whichever source won and whether this one drafted):
  the entries of positions ``[len - 1, len + n]`` pair the committed path's tokens (the
  init token, then the n accepted drafts) with the features before them (the step's own
  ``DecodeState.hidden``, then the verify's at the path's nodes): n + 1 entries from the
  step's own arrays, no host read; the ones past a row's new length are junk above it;
* **propose**: the entry of ``len - 1`` from the init token and ``DraftContext.hidden``
  (the features at the last cached token), whose output gives the first draft; each
  further draft's entry pairs it with the head's own output, as the head was trained.

So the state after a step holds every committed position's entry but the last (which needs
the token after it): a head never falls behind (``covers`` is unbounded, no catch-up). A
prefill runs the target over the prompt once more for its features (the session keeps only
the last one). Shapes: B rows, P path tokens, S slots, H hidden size, W the kept width.
"""

from __future__ import annotations

import abc

import mlx.core as mx

from ..core.footprint import StepMemory, module_bytes, own_cache_bytes
from ..core.tree import arange, cache_mask, chain_mask
from ..verifier.entries import Slots
from .heads import block, eagle3, mtp
from .heads.common import HeadMismatch, Target
from .heads.eagle3 import Eagle3Head
from .heads.loading import check_fit, target_dims
from .heads.mtp import MtpHead
from .sources import DraftContext, Proposal, Source, padded_chunks, register_source

NEVER_BEHIND = 1 << 30  # ``covers``: the commit keeps the state in step (``absorb``)


def target_of(model) -> Target:
    """What the head borrows from the target: its input embedding and its LM head."""
    return Target(model.embed, model.logits)


def head_cache(keys: list, values: list) -> tuple:
    """The head's (keys, values) lists as a cache of ``Slots``, one per MTP layer."""
    return tuple(Slots(k, v) for k, v in zip(keys, values))


def head_lists(cache: tuple) -> tuple[list, list]:
    """A cache of ``Slots`` as the head's (keys, values) lists."""
    return [e.keys for e in cache], [e.values for e in cache]


class HeadSource(Source):
    """A head's greedy chain of ``length`` tokens (init token first) per row (the module
    docstring). A kind says how its entries read the kept features (``entries``) and how
    it drafts (``chain``)."""

    stateful = True
    absorbs = True
    order = 30  # after an early-exit adapter and a draft model in the draft slot
    covers = NEVER_BEHIND

    def __init__(self, head, length: int = 0):
        self.head, self.length = head, length

    @property
    def modules(self) -> tuple:
        return (self.head,)

    title = "head"  # its name in a refusal

    def check(self, model) -> None:
        check_fit(self.head, target_dims(model))
        n = len(model.layers)
        past = [i for i in self.feature_layers or () if i >= n]
        if past:
            raise HeadMismatch(
                f"the {self.title} head fuses the output of the model's last layer (hidden "
                f"state {past[0]} of {n}), which this version does not tap: use a head that "
                "taps earlier layers"
            )

    def bind(self, model) -> None:
        layers = self.feature_layers
        if layers is not None and tuple(model.feature_layers) != layers:
            raise HeadMismatch(
                f"the {self.title} head reads the model's layers {list(layers)}, but the run "
                f"taps {list(model.feature_layers)} (a drafter trained on other layers): pass "
                "the head without that drafter"
            )

    def _taps(self, model, kept):
        """Its tapped layers' inputs of kept hidden states (..., W) -> (..., k*H): the
        kept state is the final normed one, then the taps in ``feature_layers``' order."""
        H = model.hidden_size
        return kept[..., H : H * (1 + len(self.feature_layers))]

    def for_step(self, shape, length: int, other: int) -> HeadSource:
        if length < 2:
            raise ValueError(f"a {self.name} chain needs >= 2 tokens, got {length}")
        return super().for_step(shape, length, other)

    def empty_state(self, model, batch: int, slots: int) -> tuple:
        return head_cache(*self.head.make_state(batch, slots, model.dtype))

    def make_cache(self, batch: int, slots: int, dtype=None) -> tuple:
        """Its state's entries (``footprint.own_cache_bytes`` reads their size)."""
        return head_cache(*self.head.make_state(batch, slots, dtype or mx.float32))

    def memory(self, model, shape, batch: int, window: int):
        """Its weights and its K/V over the window (its chain's working set is a few
        one-token forwards of its layers: not counted)."""
        cache = own_cache_bytes(self) * batch * window
        return StepMemory(module_bytes(self.head), cache, 0)

    def profile_counts(self) -> dict:
        return {f"{self.name}_forwards": max(self.length - 1, 0)}

    @abc.abstractmethod
    def entries(self, model, tokens, kept, positions, mask, keys, values):
        """The head over new entries: tokens (B, T) the tokens after their positions, kept
        (B, T, W) the target's kept hidden states at them, positions (B, T) their slots.
        Returns (outputs (B, T, H), keys, values)."""

    @abc.abstractmethod
    def chain(self, model, state, tokens, kept, start, depth: int):
        """The kind's ``propose`` (``heads/``): (drafts (B, depth), logits, state)."""

    def prefill(self, model, session, rows: slice) -> tuple:
        """The entries of each row's prompt (its last position's is junk until the first
        draft writes it): the target runs over the prompt on a scratch cache for its kept
        hidden states, chunk by chunk (host side, before the decode loop); each chunk's
        entries pair them with the next prompt tokens."""
        prompts = session.cached[rows]
        B, S = len(prompts), session.slots
        keys, values = self.head.make_state(B, S, model.dtype)
        scratch = model.make_cache(B, S)
        nxt = [p[1:] + [0] for p in prompts]  # the token after each position
        lengths = mx.zeros((B,), mx.int32)
        begin = 0
        for _, tokens, counts in padded_chunks(prompts):
            T = tokens.shape[1]
            idx = lengths[:, None] + arange(T)[None, :]
            mask = cache_mask(lengths, chain_mask(T), S)
            kept, scratch = model(tokens, idx, mask, scratch, idx, counts=counts)
            ahead = mx.array([(r[begin : begin + T] + [0] * T)[:T] for r in nxt], mx.int32)
            _, keys, values = self.entries(model, ahead, kept, idx, mask, keys, values)
            lengths, begin = lengths + counts, begin + T
            mx.eval(keys, values, scratch)  # per chunk, before the decode loop
        return head_cache(keys, values)

    def catch_up(self, ctx: DraftContext, count: int) -> tuple:
        """Never needed (``covers``: every commit absorbs the path): the state as it is."""
        return ctx.own, None

    def absorb(self, model, own: tuple, path, before, path_hidden, lengths) -> tuple:
        """The state after a commit (the module docstring): path (B, P) the committed
        path's tokens, init token first; before (B, W) the hidden state at the last token
        cached before the step; path_hidden (B, P, W) the verify's at the path's nodes (P =
        1: none needed); lengths (B,) the cache lengths before the step (>= 1)."""
        P = path.shape[1]
        kept = before[:, None]
        if P > 1:
            kept = mx.concatenate([kept, path_hidden[:, : P - 1]], axis=1)
        keys, values = head_lists(own)
        start = lengths - 1
        slots = start[:, None] + arange(P)[None, :]
        mask = cache_mask(start, chain_mask(P), keys[0].shape[2])
        _, keys, values = self.entries(model, path, kept, slots, mask, keys, values)
        return head_cache(keys, values)

    def propose(self, ctx: DraftContext) -> Proposal:
        tokens = ctx.init_token[:, None].astype(mx.int32)
        drafts, _, state = self.chain(
            ctx.model, head_lists(ctx.own), tokens, ctx.hidden[:, None], ctx.lengths - 1,
            self.length - 1,
        )  # fmt: skip
        chain = mx.concatenate([tokens, drafts], axis=1)[:, None]  # (B, 1, L)
        return Proposal(chain, None, 1, head_cache(*state))


class MtpSource(HeadSource):
    """The model's own MTP layers (``heads/mtp.py``): an entry pairs a token with the
    target's final normed hidden state before it."""

    source_id = register_source("mtp")
    title = "MTP"

    def describe(self) -> str:
        n = len(self.head.layers)
        return f"mtp ({n} MTP layer{'s' * (n > 1)})"

    def entries(self, model, tokens, kept, positions, mask, keys, values):
        H = model.hidden_size
        return self.head(
            model.embed(tokens), kept[..., :H], positions, mask, keys, values, positions
        )

    def chain(self, model, state, tokens, kept, start, depth: int):
        H = model.hidden_size
        return mtp.propose(self.head, target_of(model), state, tokens, kept[..., :H], start, depth)


class Eagle3Source(HeadSource):
    """An EAGLE-3 head (``heads/eagle3.py``): an entry pairs a token with three of the
    target's layers fused, the residual stream entering each (``feature_layers``, which the
    run taps: ``Verifier.capture_features``); drafts come through its own head and
    draft vocabulary (``d2t``)."""

    source_id = register_source("eagle3")
    title = "EAGLE-3"

    def __init__(self, head, length: int = 0, target_layers: int = 0):
        super().__init__(head, length)
        self.target_layers = target_layers  # the target's depth: the default taps read it

    @property
    def feature_layers(self) -> tuple:
        """The target's layers whose inputs it fuses: each tapped output's next layer."""
        return tuple(j + 1 for j in self.head.config.feature_layers(self.target_layers))

    def describe(self) -> str:
        return f"eagle3 (layers {list(self.feature_layers)})"

    def _embed(self, model):
        return model.embed if self.head.shares_embedding else self.head.embed_tokens

    def entries(self, model, tokens, kept, positions, mask, keys, values):
        embeds = self._embed(model)(tokens)
        hidden = self.head.fuse(self._taps(model, kept))
        return self.head(embeds, hidden, positions + 1, mask, keys, values, positions)

    def chain(self, model, state, tokens, kept, start, depth: int):
        features = self._taps(model, kept)
        return eagle3.propose(self.head, target_of(model), state, tokens, features, start, depth)


class BlockSource(HeadSource):
    """A DFlash block drafter (``heads/block.py``): an entry is the target's tapped layers
    at a position, fused (the token after it plays no part); a draft is one forward over
    ``[init token, mask x (block - 1)]`` attending to every entry, whose argmax at each
    block position is a draft: the whole chain from one forward. The block is the head's
    ``block_size``, or the chain's length where that is longer (lossless either way: the
    verify decides)."""

    source_id = register_source("dflash")
    title = "DFlash"

    def __init__(self, head, length: int = 0, target_layers: int = 0):
        super().__init__(head, length)
        self.target_layers = target_layers

    @property
    def feature_layers(self) -> tuple:
        """The target's layers whose inputs it fuses: each tapped output's next layer."""
        return tuple(j + 1 for j in self.head.config.feature_layers(self.target_layers))

    def describe(self) -> str:
        return f"dflash (block {self.head.config.block_size}, layers {list(self.feature_layers)})"

    def profile_counts(self) -> dict:
        return {f"{self.name}_forwards": 1 if self.length > 1 else 0}

    def entries(self, model, tokens, kept, positions, mask, keys, values):
        return self.head.context(self._taps(model, kept), positions, keys, values)

    def chain(self, model, state, tokens, kept, start, depth: int):
        size = max(self.head.config.block_size, depth + 1)
        drafts, logits, state = block.propose(
            self.head, target_of(model), state, self._taps(model, kept), start, tokens[:, -1],
            size,
        )  # fmt: skip
        return drafts[:, :depth], logits[:, :depth], state


def head_source(folder, model, dtype=None) -> Source:
    """The draft source of the head in ``folder`` (a published head's config names its
    kind: ``heads/formats.py``), checked against ``model``; ``HeadMismatch`` in one line for
    a head that does not fit, or a kind that loads but does not draft yet (DFlash)."""
    from .heads.loading import load_head

    head = load_head(folder, dtype)
    check_fit(head, target_dims(model))
    source = as_head_source(head, model)
    source.check(model)
    return source


def as_head_source(head, model) -> HeadSource:
    """The draft source of a head loaded for ``model``."""
    if isinstance(head, MtpHead):
        return MtpSource(head)
    if isinstance(head, Eagle3Head):
        return Eagle3Source(head, target_layers=len(model.layers))
    return BlockSource(head, target_layers=len(model.layers))
