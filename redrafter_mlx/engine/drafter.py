"""The ReDrafter drafter: an RNN head over the LLM's last hidden state, and its beam search.

Weight and config names follow the reference trainer (docs/design.md, "Formats"), so
reference-trained drafters load after conversion:

    input_proj.{weight,bias}          only when exit_dim != 2H
    lm_head.{i}.linear.{weight,bias}  residual blocks, i < num_draft_layers
    lm_head.{N}.weight                exit_dim -> V, no bias
    rnn_u.{weight,bias}, rnn_w.weight the recurrent state update (rnn=True)

Optional shortlist vocabulary (FR-Spec, 2025): config ``draft_vocab`` lists K token ids (the
most frequent ones of the training responses); the head is then exit_dim -> K and the beam
search drafts over those K ids only, mapping them back to full ids. Verification still uses
the LLM's full vocabulary, so output is unchanged; only drafts outside the list are impossible.
Without ``draft_vocab`` the head covers the full vocabulary (the reference format).

Shapes: B rows, W beams, L beam length (counts the init token), H hidden, V vocabulary
(the drafter's own: K with a shortlist).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

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

    @property
    def head_size(self) -> int:
        """Rows of the vocabulary head: K with a shortlist, else vocab_size."""
        return len(self.draft_vocab) if self.draft_vocab else self.vocab_size

    @classmethod
    def from_config(cls, config: dict) -> DrafterArgs:
        names = {"vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn", "draft_vocab"}
        missing = [k for k in ("vocab_size", "hidden_size") if k not in config]
        if missing:
            raise ValueError(f"drafter config.json lacks {missing}")
        known = {k: v for k, v in config.items() if k in names}
        known.setdefault("exit_dim", 2 * config["hidden_size"])
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


def _full_ids(drafter, index: mx.array) -> mx.array:
    """Head indices -> full ids; drafters without a shortlist (or ``full_ids``) are identity."""
    to_full = getattr(drafter, "full_ids", None)
    return to_full(index) if to_full is not None else index


def _take_beams(x: mx.array, parent: mx.array) -> mx.array:
    """Reorder beams by parent index: x (B, W, ...), parent (B, W) -> (B, W, ...)."""
    idx = parent.reshape(*parent.shape, *([1] * (x.ndim - 2)))
    return mx.take_along_axis(x, idx, axis=1)


def beam_search(
    drafter: Drafter,
    embed: Callable[[mx.array], mx.array],
    hidden: mx.array,
    init_token: mx.array,
    width: int,
    length: int,
):
    """Beam search of ``width`` beams of ``length`` tokens (init token included).

    hidden: (B, H) the LLM's last normed hidden state; init_token: (B,) the token the LLM
    produced at it; embed: the LLM's input embedding lookup.
    Returns beams (B, W, L) of full-vocabulary ids sorted by score (best first) with the init
    token at position 0, scores (B, W), and the drafter log-probs at each draft step
    (B, W, L-1, V) over the drafter's head (V = K entries of its shortlist when it has one).
    Requires W <= V (W distinct first tokens).
    """
    B, H = hidden.shape
    W = width
    if length < 2:
        beams = init_token[:, None, None].astype(mx.int32) * mx.ones((1, W, 1), mx.int32)
        return beams, mx.zeros((B, W)), mx.zeros((B, W, 0, drafter.args.head_size))
    # First step: all beams are the init token, so run the drafter once and take the top W.
    state = drafter.next_state(mx.zeros((B, 1, H), dtype=hidden.dtype), embed(init_token)[:, None])
    log_probs = draft_log_probs(drafter(hidden[:, None], state))  # (B, 1, V)
    V = log_probs.shape[-1]
    token = mx.argsort(-log_probs[:, 0], axis=-1)[:, :W].astype(mx.int32)  # (B, W) best first
    scores = mx.take_along_axis(log_probs[:, 0], token, axis=-1)
    token = _full_ids(drafter, token)
    beams = mx.stack([mx.broadcast_to(init_token[:, None], (B, W)).astype(mx.int32), token], -1)
    state = mx.broadcast_to(state, (B, W, H))
    step_log_probs = [mx.broadcast_to(log_probs, (B, W, V))]
    hidden_w = mx.broadcast_to(hidden[:, None, :], (B, W, H))
    for _ in range(length - 2):
        state = drafter.next_state(state, embed(beams[:, :, -1]))
        log_probs = draft_log_probs(drafter(hidden_w, state))  # (B, W, V)
        candidates = (scores[:, :, None] + log_probs).reshape(B, W * V)
        top = mx.argpartition(-candidates, W - 1, axis=-1)[:, :W]
        top_scores = mx.take_along_axis(candidates, top, axis=-1)
        order = mx.argsort(-top_scores, axis=-1)
        top = mx.take_along_axis(top, order, axis=-1)
        scores = mx.take_along_axis(top_scores, order, axis=-1)
        parent, token = top // V, _full_ids(drafter, (top % V).astype(mx.int32))
        beams = mx.concatenate([_take_beams(beams, parent), token[:, :, None]], axis=-1)
        state = _take_beams(state, parent)
        step_log_probs = [_take_beams(lp, parent) for lp in step_log_probs]
        step_log_probs.append(_take_beams(log_probs, parent))
    return beams, scores, mx.stack(step_log_probs, axis=2)
