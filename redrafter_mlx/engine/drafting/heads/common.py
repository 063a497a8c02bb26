"""What the three head kinds share: the target's embedding and head they borrow, their own
K/V state as explicit arrays, attention over it at explicit slots, and the refusal a head
that does not fit gets.

State: (keys, values), one (B, n_kv, S, D) array each per head layer; slot p holds the K/V
of the head's entry for text position p (each kind says which entry that is), slots past a
row's length hold junk until rewritten, as in the draft model's cache (``draft_model.py``).
Shapes: B rows, T new entries, S slots, A attended slots, H hidden size, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from ...base.errors import RedrafterError
from ...verifier.lm_rope import rope_at, rope_tables
from ...verifier.slots import attention, write_heads


class HeadMismatch(RedrafterError, ValueError):
    """A draft head that cannot pair with the target (or whose folder is not a head)."""


class Target(NamedTuple):
    """What a head borrows from its target: ``embed`` (B, T) ids -> (B, T, H), the input
    embedding (with any scale the family applies), and ``head`` (B, T, H) normed hidden
    states -> (B, T, V) float32 logits (the target's LM head)."""

    embed: Callable[[mx.array], mx.array]
    head: Callable[[mx.array], mx.array]


class TargetDims(NamedTuple):
    """The target's sizes a head is checked against (``loading.check_fit``)."""

    hidden_size: int
    vocab_size: int
    num_layers: int


def empty_state(layers: int, batch: int, slots: int, n_kv: int, head_dim: int, dtype) -> tuple:
    """(keys, values): ``layers`` zeroed (batch, n_kv, slots, head_dim) arrays each."""
    shape = (batch, n_kv, slots, head_dim)
    return [mx.zeros(shape, dtype) for _ in range(layers)], [
        mx.zeros(shape, dtype) for _ in range(layers)
    ]


def slot_attend(attn: nn.Module, q, k, v, positions, mask, keys, values, write_idx, tables=None):
    """Attention of new entries over a slot cache, after writing their K/V.

    q: (B, n_heads, T, D), k/v: (B, n_kv, T, D), before rope; positions, write_idx: (B, T);
    mask: (B, 1, T, A) bool over the first A slots (after the writes); keys/values:
    (B, n_kv, S, D); ``attn`` holds ``rope`` and ``scale``. Returns (out (B, T, n_heads*D),
    keys, values)."""
    if tables is None:
        tables = rope_tables(attn.rope, positions)
    q = rope_at(attn.rope, q, positions, tables)
    k = rope_at(attn.rope, k, positions, tables)
    keys = write_heads(keys, write_idx, k)
    values = write_heads(values, write_idx, v)
    A = mask.shape[-1]
    out = attention(q, keys[:, :, :A], values[:, :, :A], attn.scale, mask)
    B, _, T, _ = q.shape
    return out.transpose(0, 2, 1, 3).reshape(B, T, -1), keys, values


def heads_first(x: mx.array, n: int) -> mx.array:
    """(B, T, n*D) -> (B, n, T, D)."""
    B, T, _ = x.shape
    return x.reshape(B, T, n, -1).transpose(0, 2, 1, 3)
