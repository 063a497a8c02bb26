"""The ReDrafter drafter: an RNN head over the LLM's last hidden state, and its beam search.

Weight and config names follow the reference trainer (docs/design/formats.md, "Drafter
checkpoints"), so reference-trained drafters load after conversion:

    input_proj.{weight,bias}          only when exit_dim != 2H
    lm_head.{i}.linear.{weight,bias}  residual blocks, i < num_draft_layers
    lm_head.{N}.weight                exit_dim -> V, no bias
    rnn_u.{weight,bias}, rnn_w.weight the recurrent state update (rnn=True)
    feature_proj.{weight,bias}        kH -> H, only with ``feature_layers`` (our extension)

Multi-layer features (EAGLE-3's idea, arXiv 2503.01840): a drafter whose config.json lists
``feature_layers`` (k layer indices) reads, instead of the final normed hidden state, the
residual stream entering each of those layers, each RMS-normalised (no weight) and
concatenated, through ``feature_proj`` (kH -> H). The model captures them in the same forward
(``Model.capture_features``); a drafter without the key reads the final normed state as before.

Shapes: B rows, W beams, L beam length (counts the init token), H hidden, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..core.footprint import StepMemory, head_bytes, module_bytes
from ..core.tree import arange
from .sources import ABSENT, DraftContext, Proposal, Source, register_source

# The reference inference keeps the drafter's top-50 logits and floors the rest.
DRAFT_TOP_K = 50
DRAFT_FLOOR = -50000.0


@dataclass
class DrafterArgs:
    vocab_size: int
    hidden_size: int
    exit_dim: int
    num_draft_layers: int = 2
    rnn: bool = True
    extra: dict[str, Any] | None = None
    draft_vocab: list[int] | None = None  # shortlist of K full-vocabulary ids, or None
    feature_layers: list[int] | None = None  # layers whose input residual it reads, or None

    @property
    def head_size(self) -> int:
        """Rows of the vocabulary head: K with a shortlist, else vocab_size."""
        return len(self.draft_vocab) if self.draft_vocab else self.vocab_size

    @classmethod
    def from_config(cls, config: dict) -> DrafterArgs:
        names = {
            "vocab_size",
            "hidden_size",
            "exit_dim",
            "num_draft_layers",
            "rnn",
            "draft_vocab",
            "feature_layers",
        }
        missing = [k for k in ("vocab_size", "hidden_size") if k not in config]
        if missing:
            raise ValueError(f"drafter config.json lacks {missing}")
        known = {k: v for k, v in config.items() if k in names}
        known.setdefault("exit_dim", 2 * config["hidden_size"])
        layers = known.get("feature_layers")
        if layers is not None:
            if not isinstance(layers, list) or not all(
                isinstance(i, int) and i >= 0 for i in layers
            ):
                raise ValueError(f"drafter feature_layers must be layer indices, got {layers!r}")
            known["feature_layers"] = list(layers) or None
        return cls(**known, extra={k: v for k, v in config.items() if k not in names})

    def to_config(self) -> dict:
        cfg = dict(self.extra or {})
        cfg.update(
            model_type="recurrent_drafting_drafter",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            exit_dim=self.exit_dim,
            num_draft_layers=self.num_draft_layers,
            rnn=self.rnn,
        )
        if self.draft_vocab:
            cfg["draft_vocab"] = [int(i) for i in self.draft_vocab]
        if self.feature_layers:
            cfg["feature_layers"] = [int(i) for i in self.feature_layers]
        return cfg


class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def __call__(self, x):
        return x + nn.silu(self.linear(x))


class Drafter(nn.Module):
    def __init__(self, args: DrafterArgs):
        super().__init__()
        self.args = args
        H, E = args.hidden_size, args.exit_dim
        if E != 2 * H:
            self.input_proj = nn.Linear(2 * H, E)
        self.lm_head = [ResBlock(E) for _ in range(args.num_draft_layers)] + [
            nn.Linear(E, args.head_size, bias=False)
        ]
        if args.draft_vocab:  # not a parameter (underscore): a constant of the drafter
            self._draft_ids = mx.array(args.draft_vocab, dtype=mx.int32)
        if args.rnn:
            self.rnn_u = nn.Linear(H, H, bias=True)
            self.rnn_w = nn.Linear(H, H, bias=False)
        if args.feature_layers:
            self.feature_proj = nn.Linear(len(args.feature_layers) * H, H)

    def as_source(self, part: str) -> DrafterSource:
        """This drafter as a draft source: its beams are the shape's W×L (``part``
        ``"beams"``: the drafter slot); ValueError in the draft slot."""
        if part != "beams":
            raise ValueError(
                "a recurrent drafter drafts beams from the model's hidden state: pass it as "
                "the drafter (--drafter), not as a draft model"
            )
        return DrafterSource(self)

    def first_state(self, token_emb: mx.array) -> mx.array:
        """``next_state(0, token_emb)`` without multiplying zeros: (..., H) -> (..., H)."""
        if self.args.rnn:
            return nn.silu(self.rnn_w(token_emb) + self.rnn_u.bias)
        return token_emb

    def next_state(self, state: mx.array, token_emb: mx.array) -> mx.array:
        """s_k = SiLU(W·E[t] + U·s_{k-1} + b) (rnn) or s_{k-1} + E[t]; (..., H) -> (..., H)."""
        if self.args.rnn:
            return nn.silu(self.rnn_w(token_emb) + self.rnn_u(state))
        return state + token_emb

    def full_ids(self, index: mx.array) -> mx.array:
        """Head indices (...,) -> full-vocabulary token ids (...,) (identity without shortlist)."""
        if "_draft_ids" in self:
            return self._draft_ids[index]
        return index

    def __call__(self, hidden: mx.array, state: mx.array) -> mx.array:
        """Plain logits for the next draft token: hidden, state (..., H) -> (..., V) float32.

        V is the head size: K shortlist entries (``full_ids`` maps them) or the vocabulary."""
        return self.head(self.hidden_part(hidden), state)

    def features(self, hidden: mx.array) -> mx.array:
        """The drafter's view of the LLM state: (..., H).

        ``hidden`` is the model's hidden output (..., (1 + k') * H): the final normed state,
        then k' captured residuals (``Model.capture_features``); training data may also hold
        the k residuals alone (..., kH). A drafter without ``feature_layers`` reads the first
        H values (the final normed state; no op when that is all there is); one with k
        feature layers reads the last kH, RMS-normalises each layer's H values and projects
        them with ``feature_proj``.
        """
        H, layers = self.args.hidden_size, self.args.feature_layers
        width = hidden.shape[-1]
        if not layers:
            return hidden if width == H else hidden[..., :H]
        k = len(layers)
        if width not in (k * H, (k + 1) * H):
            raise ValueError(
                f"this drafter reads feature layers {layers} ({k} x {H} values) but got hidden "
                f"states of width {width}: the model must capture them "
                "(Model.capture_features, done by engine.loading.load)"
            )
        x = hidden if width == k * H else hidden[..., H:]
        x = mx.fast.rms_norm(x.reshape(*x.shape[:-1], k, H), None, 1e-6)
        return self.feature_proj(x.reshape(*x.shape[:-2], k * H))

    def hidden_part(self, hidden: mx.array):
        """What a draft step needs from ``hidden``: ``features(hidden)`` (..., H).

        (Splitting ``input_proj`` into hidden and state halves to hoist the hidden half out
        of the draft steps was measured 3x slower on the CPU backend: a column slice of the
        weight is copied at every matmul. The split point stays for backends that gain.)
        """
        return self.features(hidden)

    def head(self, hidden_part, state: mx.array) -> mx.array:
        """Logits (..., V) float32 from ``hidden_part(hidden)`` and the state (..., H)."""
        hidden = mx.broadcast_to(hidden_part, (*state.shape[:-1], hidden_part.shape[-1]))
        x = mx.concatenate([hidden, state], axis=-1)
        if "input_proj" in self:
            x = self.input_proj(x)
        for block in self.lm_head:
            x = block(x)
        return x.astype(mx.float32)


def draft_log_probs(logits: mx.array) -> mx.array:
    """The reference inference's drafter log-probs: top-50 logits kept, others floored."""
    V = logits.shape[-1]
    logits = logits - mx.max(logits, axis=-1, keepdims=True)
    if V > DRAFT_TOP_K:
        kth = mx.min(mx.topk(logits, DRAFT_TOP_K, axis=-1), axis=-1, keepdims=True)
        logits = mx.where(logits >= kth, logits, DRAFT_FLOOR)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _take_beams(x: mx.array, parent: mx.array) -> mx.array:
    """Reorder beams by parent index: x (B, W, ...), parent (B, W) -> (B, W, ...)."""
    idx = parent.reshape(*parent.shape, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, idx, axis=1)


def top_draft_log_probs(logits: mx.array, width: int):
    """The drafter log-probs of the candidates a beam step can keep, without a full sort.

    logits: (..., V) -> (log_probs (..., K), token ids (..., K) or None for all V). With
    V > 50 and W <= 50 these are the 50 best tokens (one partition), normalised over them:
    the same values as ``draft_log_probs`` at those tokens (its floored tokens weigh
    exp(-50000) = 0), and a beam step never keeps a floored token while >= W others remain.
    """
    V = logits.shape[-1]
    if V <= DRAFT_TOP_K or width > DRAFT_TOP_K:
        return draft_log_probs(logits), None
    ids = mx.argpartition(logits, V - DRAFT_TOP_K, axis=-1)[..., V - DRAFT_TOP_K :]
    top = mx.take_along_axis(logits, ids, axis=-1)
    return top - mx.logsumexp(top, axis=-1, keepdims=True), ids


def _best(candidates: mx.array, ids: mx.array | None, width: int):
    """The ``width`` best of (B, N, K) candidate scores, best first.

    Returns (scores (B, W), parent index in N (B, W), token ids (B, W) int32).
    """
    B, N, K = candidates.shape
    flat = candidates.reshape(B, N * K)
    order = mx.argsort(flat, axis=-1)[:, ::-1][:, :width]  # descending
    scores = mx.take_along_axis(flat, order, axis=-1)
    token = order % K if ids is None else mx.take_along_axis(ids.reshape(B, N * K), order, -1)
    return scores, order // K, token.astype(mx.int32)


def _split_head(drafter, hidden: mx.array):
    """(hidden part, head) of a ``Drafter``; any other drafter-like object (tests' doubles:
    ``next_state`` and ``__call__(hidden, state)``) is called whole."""
    if isinstance(drafter, Drafter):
        return drafter.hidden_part(hidden), drafter.head

    def head(h, state):
        return drafter(mx.broadcast_to(h, (*state.shape[:-1], h.shape[-1])), state)

    return hidden, head


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    init_token: mx.array,
    width: int,
    length: int,
    frontiers: list | None = None,
):
    """Beam search of ``width`` beams of ``length`` tokens (init token included).

    hidden: (B, H) the LLM's last normed hidden state (wider with feature layers: the model's
    hidden output, ``Drafter.features``); init_token: (B,) the token the LLM
    produced at it; embed: the LLM's input embedding lookup.
    Returns beams (B, W, L) sorted by score (best first) with the init token at position 0,
    scores (B, W), and the drafter log-probs at each draft step (B, W, L-1, V), V being the
    head size (the shortlist's K for a shortlist drafter, whose beams still hold full ids).
    Requires W <= V (W distinct first tokens).

    A step ranks only each beam's 50 best tokens (``top_draft_log_probs``) and sorts the
    W*50 candidates; the full log-probs are computed only if the caller uses them (under
    ``mx.compile`` they are dead code for the decode step). W = 1 is greedy: one argmax.

    ``frontiers``: a list that receives, for W > 1, the W beams kept at each depth before
    the last, (B, W, d + 1) for d = 1 .. L-2 (``frontier_tree`` makes them candidates).
    """
    B = hidden.shape[0]  # hidden: (B, H), or wider with feature layers (``Drafter.features``)
    W = width
    if length < 2:
        beams = init_token[:, None, None].astype(mx.int32) * mx.ones((1, W, 1), mx.int32)
        return beams, mx.zeros((B, W)), mx.zeros((B, W, 0, drafter.args.head_size))
    hidden_part, head = _split_head(drafter, hidden[:, None])  # (B, 1, E or H), once
    # A shortlist head (FR-Spec) scores K ids: beams hold full-vocabulary ids.
    to_full = drafter.full_ids if isinstance(drafter, Drafter) else (lambda index: index)
    # First step: all beams are the init token, so run the drafter once and take the top W.
    first_emb = embed(init_token)[:, None]  # (B, 1, H)
    H = first_emb.shape[-1]
    if isinstance(drafter, Drafter):
        state = drafter.first_state(first_emb)  # (B, 1, H)
    else:
        state = drafter.next_state(mx.zeros((B, 1, H), hidden.dtype), first_emb)
    logits = head(hidden_part, state)  # (B, 1, V)
    V = logits.shape[-1]
    step_log_probs = [draft_log_probs(logits)]  # full log-probs: lazy, unused by the step
    scores = None
    if W == 1:
        index = mx.argmax(logits, axis=-1).astype(mx.int32)  # (B, 1) head index
        token = to_full(index)
    else:
        scores, _, index = _best(*top_draft_log_probs(logits, W), W)  # (B, W) best first
        token = to_full(index)
        state = mx.broadcast_to(state, (B, W, H))
        step_log_probs = [mx.broadcast_to(step_log_probs[0], (B, W, V))]
    first = mx.broadcast_to(init_token[:, None], (B, W)).astype(mx.int32)
    beams = mx.stack([first, token], axis=-1)
    greedy, greedy_index = [first, token], [index]  # W = 1: stacked once at the end
    for _ in range(length - 2):
        state = drafter.next_state(state, embed(token if W == 1 else beams[:, :, -1]))
        logits = head(hidden_part, state)  # (B, W, V)
        full = draft_log_probs(logits)
        if W == 1:
            index = mx.argmax(logits, axis=-1).astype(mx.int32)
            token = to_full(index)
            greedy.append(token)
            greedy_index.append(index)
            step_log_probs.append(full)
            continue
        if frontiers is not None:
            frontiers.append(beams)
        log_probs, ids = top_draft_log_probs(logits, W)
        scores, parent, index = _best(scores[:, :, None] + log_probs, ids, W)
        token = to_full(index)
        beams = mx.concatenate([_take_beams(beams, parent), token[:, :, None]], axis=-1)
        state = _take_beams(state, parent)
        step_log_probs = [_take_beams(lp, parent) for lp in step_log_probs]
        step_log_probs.append(_take_beams(full, parent))
    if W == 1:
        beams = mx.stack(greedy, axis=-1)
    step_log_probs = mx.stack(step_log_probs, axis=2)  # (B, W, L-1, V)
    if scores is None:  # greedy: the sum of the chosen tokens' log-probs (by head index)
        chosen = mx.stack(greedy_index, axis=-1)  # (B, 1, L-1)
        picked = mx.take_along_axis(step_log_probs, chosen[..., None], axis=-1)
        scores = picked[..., 0].sum(axis=-1)
    return beams, scores, step_log_probs


def frontier_tree(frontiers: list, length: int, absent: int):
    """The beams a search dropped on the way, as candidates beside its final beams.

    ``frontiers``: the W beams kept at each depth before the last (``beam_search``), (B, W,
    d + 1) for d = 1 .. L-2. Each is a node of the search's tree whose parent is one too, so
    with the final beams they make a tree of exactly 1 + W(L-1) nodes: the worst-case
    capacity, whose slots the final beams alone leave partly empty (their prefixes are
    shared). A beam dropped at depth d (its children lost to better ones) becomes a
    candidate of d + 1 tokens; a kept one is a prefix of a final beam and takes no slot
    (``tree.pack``).

    Returns (tokens (B, W(L-2), L) with ``absent`` past each end, present (B, W(L-2), L)
    bool), shallowest first: packed after the final beams, so a smaller capacity truncates
    the deepest of them first. None when there is no earlier depth (W = 1 or L <= 2).
    """
    if not frontiers:
        return None
    tokens, present = [], []
    for beams in frontiers:
        B, W, d = beams.shape
        pad = mx.full((B, W, length - d), absent, dtype=beams.dtype)
        tokens.append(mx.concatenate([beams, pad], axis=-1))
        present.append(mx.broadcast_to(arange(length) < d, (B, W, length)))
    return mx.concatenate(tokens, axis=1), mx.concatenate(present, axis=1)


class DrafterSource(Source):
    """The recurrent drafter's W beams of L tokens (beam search over its head: the shape's
    W×L), plus the beams the search dropped on the way as a tail (``frontier_tree``)."""

    source_id = register_source("drafter")
    part = "beams"

    def __init__(self, drafter, width: int = 0, length: int = 0):
        self.drafter, self.width, self.length = drafter, width, length

    @property
    def modules(self) -> tuple:
        return (self.drafter,)

    @property
    def feature_layers(self) -> tuple | None:
        return getattr(getattr(self.drafter, "args", None), "feature_layers", None)

    def check(self, model) -> None:
        args = getattr(self.drafter, "args", None)
        layers = tuple(getattr(args, "feature_layers", None) or ())
        if layers and layers != tuple(getattr(model, "feature_layers", ())):
            raise ValueError(
                f"the drafter reads feature layers {list(layers)} but the model captures "
                f"{list(getattr(model, 'feature_layers', ()))}: call "
                "engine.loading.attach(model, drafter) (load does)"
            )

    def memory(self, model, shape, batch: int, window: int):
        """Its weights, and one beam step's logits and their ranking (``head_bytes``)."""
        head = getattr(getattr(self.drafter, "args", None), "head_size", model.vocab_size)
        step = head_bytes(batch, shape.width, head) if shape.drafts else 0
        weights = module_bytes(self.drafter) if isinstance(self.drafter, nn.Module) else 0
        return StepMemory(weights, 0, step)

    def price(self, pricer):
        return pricer.drafter(self.drafter)

    def for_step(self, shape, length: int, other: int) -> DrafterSource:
        return DrafterSource(self.drafter, shape.width, length)

    def propose(self, ctx: DraftContext) -> Proposal:
        frontiers = []
        beams, _, _ = beam_search(
            self.drafter,
            ctx.model.embed,
            ctx.hidden,
            ctx.init_token,
            self.width,
            self.length,
            frontiers,
        )
        return Proposal(beams, None, 1, None, frontier_tree(frontiers, self.length, ABSENT))
