"""The slot cache's array rules, shared by the verifier's caches and the early-exit adapter:
writes at explicit slots, sliding-window masks, masked attention, and which kernels run.

Shapes: B batch rows, T new tokens, S cache slots, A attended slots (A <= S), D head dim.
"""

from __future__ import annotations

import mlx.core as mx

# Fused kernels (mx.fast rope with per-row offsets, scaled_dot_product_attention) on Metal and
# CUDA; composed ops on the CPU backend, where they measured several times faster. None picks
# by device; tests set True/False to run both paths on any backend.
FUSED_KERNELS: bool | None = None


def fused_kernels() -> bool:
    """Whether the engine's own ops use the fused kernels (see ``FUSED_KERNELS``)."""
    return mx.default_device() != mx.cpu if FUSED_KERNELS is None else FUSED_KERNELS


def write_slots(cache: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """cache (B, n_kv, S, D) with ``new`` (B, T, n_kv, D) written at ``slots`` (B, T).

    One ScatterAxis (in place under ``mx.compile``); advanced indexing would add an arange
    and broadcasts per call, ~10-20 us each on the CPU backend.
    """
    B, T, n_kv, D = new.shape
    idx = mx.broadcast_to(slots[:, None, :, None], (B, n_kv, T, D))
    return mx.put_along_axis(cache, idx, new.transpose(0, 2, 1, 3).astype(cache.dtype), axis=2)


def write_heads(cache: mx.array, slots: mx.array, new: mx.array) -> mx.array:
    """``write_slots`` for ``new`` in the heads-first layout attention computes it in,
    (B, n_kv, T, D): no transpose on the way in."""
    idx = mx.broadcast_to(slots[:, None, :, None], new.shape)
    return mx.put_along_axis(cache, idx, new.astype(cache.dtype), axis=2)


def window_mask(mask: mx.array, positions: mx.array, write_idx: mx.array, window: int):
    """``mask`` narrowed to keys less than ``window`` positions before each query.

    mask: (B or 1, 1, T, A) bool; positions, write_idx: (B, T) -> (B, 1, T, A) bool. A key's
    position is known without being stored: a slot this call writes holds the token at the
    ``positions`` entry written there, any other slot the token at position == slot
    (committed tokens sit at ``[0, len)``; docs/design/kv-cache.md).
    """
    B = positions.shape[0]
    A = mask.shape[-1]
    key_pos = mx.broadcast_to(mx.arange(A, dtype=mx.int32)[None], (B, A))
    key_pos = mx.put_along_axis(key_pos, write_idx, positions.astype(mx.int32), axis=1)
    near = key_pos[:, None, :] > positions[:, :, None] - window  # (B, T, A)
    return mask & near[:, None]


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """Masked attention with grouped K/V heads.

    q: (B, n_heads, T, D); k: (B, n_kv, A, D); v: (B, n_kv, A, Dv); mask: (B, 1, T, A) bool
    -> (B, n_heads, T, Dv).
    On Metal/CUDA the fused kernel; on the CPU backend two matmuls, several times faster
    there for multi-token (tree) queries.
    """
    if fused_kernels():
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    B, n_heads, T, D = q.shape
    n_kv = k.shape[1]
    q = (q * scale).reshape(B, n_kv, (n_heads // n_kv) * T, D)
    scores = (q @ k.transpose(0, 1, 3, 2)).reshape(B, n_kv, n_heads // n_kv, T, -1)
    scores = mx.where(mask[:, :, None], scores.astype(mx.float32), -mx.inf)
    probs = mx.softmax(scores, axis=-1).astype(v.dtype).reshape(B, n_kv, -1, k.shape[2])
    return (probs @ v).reshape(B, n_heads, T, v.shape[-1])  # MLA: values narrower than keys
