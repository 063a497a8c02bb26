"""Per-token positions through any mlx-lm rope module (``lm_model``'s rope tap).

mlx-lm's attention calls ``self.rope(x, offset=cache.offset)``; the tap ignores the offset
and rotates each token at its own position (``len + depth`` in a tree), read from the
current call. Every ``rope_utils`` variant keeps its frequencies and input scales:

* fused kernels (Metal, CUDA): the call's T tokens move into the batch axis, one
  ``mx.fast.rope`` offset each (``rope_rows``);
* the CPU backend: one cos/sin table per distinct rope and forward, the module's own kernel
  run on a unit vector (rotation is linear), then elementwise rotations (``rotate``).

Shapes: x (B, ..., T, D); positions (B, T).
"""

from __future__ import annotations

import mlx.core as mx

from .slots import fused_kernels


def rope_tap(self, original, x, *args, **kwargs):
    """Per-token positions for any rope module (the offset mlx-lm passes is ignored)."""
    owner = self._rd_owner
    call = owner.call
    if call is None:
        return original(self, x, *args, **kwargs)
    positions = call.positions
    rope = lambda rows, offsets: original(self, rows, offsets)
    if self._rd_layout is None or fused_kernels():
        return rope_rows(rope, x, positions)
    group = self._rd_group
    if group not in call.tables:
        call.tables[group] = _rope_table(rope, self._rd_layout, positions)
    cos, sin = call.tables[group]
    return rotate(x, cos, sin, *self._rd_layout)


def rope_at(module, x: mx.array, positions: mx.array, tables=None) -> mx.array:
    """Any rope module (not tapped: the early-exit adapter's own) at per-token positions:
    x (B, ..., T, D), positions (B, T). ``tables``: ``rope_tables(module, positions)``
    computed once for several calls (the CPU path); None: computed here."""
    layout = rope_layout(module)
    if layout is None or fused_kernels():
        return rope_rows(lambda rows, offsets: module(rows, offset=offsets), x, positions)
    cos, sin = tables if tables is not None else rope_tables(module, positions)
    return rotate(x, cos, sin, *layout)


def rope_tables(module, positions: mx.array):
    """(cos, sin) of an untapped rope module at ``positions`` (B, T), or None where the fused
    kernel runs (``rope_at`` then needs none)."""
    layout = rope_layout(module)
    if layout is None or fused_kernels():
        return None
    return _rope_table(lambda rows, offsets: module(rows, offset=offsets), layout, positions)


def rope_rows(rope, x: mx.array, positions: mx.array) -> mx.array:
    """``rope`` at per-token positions: x (B, ..., T, D), positions (B, T). The T tokens move
    into the batch axis, one offset each."""
    B, T, D = x.shape[0], x.shape[-2], x.shape[-1]
    moved = mx.moveaxis(x, -2, 1)  # (B, T, ..., D)
    mid = moved.shape[2:-1]
    rows = moved.reshape(B * T, -1, 1, D)
    out = rope(rows, positions.reshape(-1)).reshape(B, T, *mid, D)
    return mx.moveaxis(out, 1, -2)


def _rope_table(rope, layout: tuple[int, bool], positions: mx.array):
    """(cos, sin), (B, 1, T, dims/2) each, of ``rope(rows, offsets)`` (of ``layout``: rotated
    dims, traditional) at ``positions`` (B, T): the rope of a unit vector (rotation is
    linear, so any input scale it applies is in the table)."""
    dims, traditional = layout
    half = dims // 2
    if traditional:
        unit = mx.array([1.0, 0.0] * half, dtype=mx.float32)
    else:
        unit = mx.array([1.0] * half + [0.0] * half, dtype=mx.float32)
    B, T = positions.shape
    rows = mx.broadcast_to(unit, (B * T, 1, 1, dims))
    out = rope(rows, positions.reshape(-1)).reshape(B, 1, T, dims)
    if traditional:
        return out[..., 0::2], out[..., 1::2]
    return out[..., :half], out[..., half:]


def rotate(x, cos, sin, dims: int, traditional: bool) -> mx.array:
    """Rotate x (B, ..., T, D)'s first ``dims`` by tables (B, 1, T, dims/2); the rest passes."""
    half = dims // 2
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    if x.ndim != 4:
        cos = cos.reshape(cos.shape[0], *([1] * (x.ndim - 3)), *cos.shape[2:])
        sin = sin.reshape(cos.shape)
    rest = x[..., dims:]
    if traditional:
        pairs = x[..., :dims].reshape(*x.shape[:-1], half, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        rotated = mx.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
        rotated = rotated.reshape(*x.shape[:-1], dims)
    else:
        a, b = x[..., :half], x[..., half:dims]
        rotated = mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return mx.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated


def rope_layout(module) -> tuple[int, bool] | None:
    """(rotated dims, traditional) of a rope module, or None when it does not say."""
    dims = getattr(module, "dims", None) or getattr(module, "dim", None)
    traditional = getattr(module, "traditional", False)
    if not isinstance(dims, int) or dims % 2:
        return None
    return dims, bool(traditional)


def is_rope(module) -> bool:
    """Whether ``module`` is a rope: named so, and holding no modules of its own (phixtral's
    ``RoPEAttention`` is an attention layer, with projections, that holds a rope)."""
    name = type(module).__name__.lower()
    return ("rope" in name or "rotary" in name) and not module.children()


def rope_group(module, groups: list) -> int:
    """The index of the rope modules that rotate exactly like ``module`` (one cos/sin table
    per group and forward): compared on a probe of positions, once at load, before the
    module is tapped (``groups`` holds each group's class, as it was, and probe output)."""
    layout = rope_layout(module)
    cls = type(module)
    if layout is None:
        groups.append((cls, None))
        return len(groups) - 1
    probe = mx.ones((4, 1, 1, layout[0]))
    offsets = mx.array([0, 1, 7, 1000], dtype=mx.int32)
    try:
        out = cls.__call__(module, probe, offsets)
        mx.eval(out)
    except Exception:  # a rope that cannot rotate alone: a group of its own
        groups.append((cls, None))
        return len(groups) - 1
    for i, (other, seen) in enumerate(groups):
        same = seen is not None and other is cls and seen.shape == out.shape
        if same and bool(mx.array_equal(seen, out)):
            return i
    groups.append((cls, out))
    return len(groups) - 1
