"""A model's own MTP layers as a draft source: one greedy chain of the shape's ``D1×L``.

The head (``heads/mtp.py``) keeps an entry per text position p: the token at p + 1 paired
with the target's final normed hidden state at p, its K/V in slot p of the source's state
(a cache of ``verifier.entries.Slots``, one per MTP layer). The state follows the committed
text at every commit, not by re-running text at the next draft:

* **absorb** (at every step's commit, whichever source won and whether this one drafted):
  the entries of positions ``[len - 1, len + n]`` pair the committed path's tokens (the
  init token, then the n accepted drafts) with the hidden states before them (the step's
  own ``DecodeState.hidden``, then the verify's at the path's nodes): n + 1 entries from the
  step's own arrays, no host read; the ones past a row's new length are junk above it;
* **propose**: the entry of ``len - 1`` from the init token and ``DraftContext.hidden``
  (the hidden state at the last cached token), whose output gives the first draft; each
  further draft's entry pairs it with the head's own output, as the model's MTP runs.

So the state after a step holds every committed position's entry but the last (which needs
the token after it): the source never falls behind (``covers`` is unbounded, no catch-up).
A prefill runs the target over the prompt once more for its hidden states (the session keeps
only the last one). Shapes: B rows, P path tokens, S slots, H hidden size.
"""

from __future__ import annotations

import mlx.core as mx

from ..core.footprint import StepMemory, module_bytes, own_cache_bytes
from ..core.tree import arange, cache_mask, chain_mask
from ..verifier.entries import Slots
from .heads.common import Target
from .heads.loading import check_fit, target_dims
from .heads.mtp import MtpHead, propose
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


class MtpSource(Source):
    """The MTP head's greedy chain of ``length`` tokens (init token first) per row."""

    source_id = register_source("mtp")
    stateful = True
    absorbs = True
    order = 30  # after an early-exit adapter and a draft model in the draft slot
    covers = NEVER_BEHIND

    def __init__(self, head: MtpHead, length: int = 0):
        self.head, self.length = head, length

    @property
    def modules(self) -> tuple:
        return (self.head,)

    def describe(self) -> str:
        return f"mtp ({len(self.head.layers)} MTP layer{'s' * (len(self.head.layers) > 1)})"

    def check(self, model) -> None:
        check_fit(self.head, target_dims(model))

    def for_step(self, shape, length: int, other: int) -> MtpSource:
        if length < 2:
            raise ValueError(f"an MTP chain needs >= 2 tokens, got {length}")
        sized = MtpSource(self.head, length)
        sized.other = other
        return sized

    def empty_state(self, model, batch: int, slots: int) -> tuple:
        return head_cache(*self.head.make_state(batch, slots, model.dtype))

    def memory(self, model, shape, batch: int, window: int):
        """Its weights and its K/V over the window (its chain's working set is a few
        one-token forwards of one layer: not counted)."""
        cache = own_cache_bytes(self) * batch * window
        return StepMemory(module_bytes(self.head), cache, 0)

    def make_cache(self, batch: int, slots: int, dtype=None) -> tuple:
        """Its state's entries (``footprint.own_cache_bytes`` reads their size)."""
        return head_cache(*self.head.make_state(batch, slots, dtype or mx.float32))

    def profile_counts(self) -> dict:
        return {"mtp_forwards": max(self.length - 1, 0)}

    def prefill(self, model, session, rows: slice) -> tuple:
        """The entries of each row's prompt but its last position: the target runs over the
        prompt on a scratch cache for its hidden states, chunk by chunk (host side, before
        the decode loop); each chunk's entries pair them with the next prompt tokens."""
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
            hidden, scratch = model(tokens, idx, mask, scratch, idx, counts=counts)
            ahead = mx.array([(r[begin : begin + T] + [0] * T)[:T] for r in nxt], mx.int32)
            H = model.hidden_size
            _, keys, values = self.head(
                model.embed(ahead), hidden[..., :H], idx, mask, keys, values, idx
            )
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
        H = model.hidden_size
        P = path.shape[1]
        hidden = before[:, None, :H]
        if P > 1:
            hidden = mx.concatenate([hidden, path_hidden[:, : P - 1, :H]], axis=1)
        keys, values = head_lists(own)
        S = keys[0].shape[2]
        start = lengths - 1
        slots = start[:, None] + arange(P)[None, :]
        mask = cache_mask(start, chain_mask(P), S)
        _, keys, values = self.head(model.embed(path), hidden, slots, mask, keys, values, slots)
        return head_cache(keys, values)

    def propose(self, ctx: DraftContext) -> Proposal:
        H = ctx.model.hidden_size
        state = head_lists(ctx.own)
        tokens = ctx.init_token[:, None].astype(mx.int32)
        hidden = ctx.hidden[:, None, :H]
        drafts, _, state = propose(
            self.head, target_of(ctx.model), state, tokens, hidden, ctx.lengths - 1,
            self.length - 1,
        )  # fmt: skip
        chain = mx.concatenate([tokens, drafts], axis=1)[:, None]  # (B, 1, L)
        return Proposal(chain, None, 1, head_cache(*state))


def head_source(folder, model, dtype=None) -> Source:
    """The draft source of the head in ``folder`` (a published head's config names its
    kind: ``heads/formats.py``), checked against ``model``; ``HeadMismatch`` in one line for
    a head that does not fit, or a kind that loads but does not draft yet."""
    from .heads.common import HeadMismatch
    from .heads.loading import load_head

    head = load_head(folder, dtype)
    check_fit(head, target_dims(model))
    if isinstance(head, MtpHead):
        return MtpSource(head)
    name = {"eagle3": "EAGLE-3", "block": "DFlash"}.get(head.kind, head.kind)
    raise HeadMismatch(
        f"{folder}: the {name} head loads and matches the model, but this version drafts "
        "with MTP heads only (EAGLE-3 and DFlash are next): pass an MTP head, a draft "
        "model or none"
    )
