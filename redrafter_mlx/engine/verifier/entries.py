"""What a model keeps between forwards: a cache is a tuple of entries, one type per kind.

* :class:`Slots`: an attention cache's keys (B, n_kv, S, Dk) and values (B, n_kv, S, Dv) in
  slot storage (committed tokens at ``[0, len)``; docs/design/kv-cache.md);
* :class:`State`: a recurrent layer's state (conv windows, SSM / delta-rule states), flat,
  (B, 1, F) float32 (``lm_cache.StateCache`` reads and writes its entries in it).

A verifier's cache (``Verifier.make_cache``) is its attention caches in order, then its
recurrent layers' states; a draft source's state (a draft model's, an early-exit adapter's)
is a cache of the same entries. Both are NamedTuples, so ``mx.compile`` takes them (and
gives them back) as trees, and each answers the loop's and the commit's questions itself:

* ``grow(slots)``: with ``slots`` cache slots (a recurrent state has no slot axis);
* ``rows(fn)``: every per-row array through ``fn`` ((B, ...) -> (b, ...)): the loop's re-lay
  of rows (take, resize);
* ``place(r, src, i)``: row ``i`` of another cache's entry written into row ``r`` (a row
  joining, a fork's copy);
* ``commit(verified, dst, count, path)``: after a verify, the accepted path kept.
  ``verified`` is what the verify left for the commit (an attention cache's new K/V, (B, C,
  n_kv, D) each; a recurrent layer's ``lm_cache.StateCommit``); ``dst`` (B, C) each verified
  slot's destination (None: the path already sits in order); ``count`` (B,) tokens kept per
  row; ``path`` (B, P) the accepted path's slots (None: the verified slots, in order).

Shapes: B rows, S cache slots, C verified slots, F a recurrent state's flat size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import mlx.core as mx

from .slots import write_slots


class Slots(NamedTuple):
    """An attention cache in slot storage: keys (B, n_kv, S, Dk), values (B, n_kv, S, Dv)."""

    keys: mx.array
    values: mx.array

    @property
    def slots(self) -> int:
        return self.keys.shape[2]

    def grow(self, slots: int) -> Slots:
        """Zero-extended to ``slots`` slots (a rare copy); as is when it has them."""
        pad = slots - self.slots
        if pad <= 0:
            return self
        return Slots(_extend(self.keys, pad), _extend(self.values, pad))

    def rows(self, fn: Callable[[mx.array], mx.array]) -> Slots:
        return Slots(fn(self.keys), fn(self.values))

    @property
    def rewinds(self) -> bool:
        """Its first n slots are the entry after n tokens (a prompt cache may cut it)."""
        return True

    def kept(self, n: int) -> Slots:
        """A copy holding the first ``n`` slots (a prompt cache's entry)."""
        return Slots(mx.array(self.keys[:, :, :n]), mx.array(self.values[:, :, :n]))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def place(self, r: int, src: Slots, i: int) -> Slots:
        """Row ``i`` of ``src`` (its slots, as many as it has) written into row ``r`` of
        this entry's arrays, in place (lazy updates); returns this entry."""
        S = src.slots
        self.keys[r : r + 1, :, :S] = src.keys[i : i + 1]
        self.values[r : r + 1, :, :S] = src.values[i : i + 1]
        return self

    def commit(
        self, verified: tuple | None, dst: mx.array | None, count: mx.array, path=None
    ) -> Slots:
        """Each of the C verified slots scattered at once to ``dst`` (``decode.
        slot_destinations``): one kernel per array, no gather. The path is read from the
        verify's own K/V (``verified``), not from this cache, so the cache is only written
        (in place): reading and writing it in one graph made MLX copy it every step.
        ``verified`` None: a cache a layer shares rather than writes (nothing to move)."""
        if dst is None or verified is None:
            return self
        return Slots(
            write_slots(self.keys, dst, verified[0]), write_slots(self.values, dst, verified[1])
        )


class State(NamedTuple):
    """A recurrent layer's state, flat: (B, 1, F) float32."""

    flat: mx.array

    def grow(self, slots: int) -> State:
        return self

    def rows(self, fn: Callable[[mx.array], mx.array]) -> State:
        return State(fn(self.flat))

    @property
    def rewinds(self) -> bool:
        """A recurrent state is the state after all its tokens: it cannot be cut."""
        return False

    def kept(self, n: int) -> State:
        """A copy (a recurrent state is kept only at the length it was taken at: the
        prompt cache checks that)."""
        return State(mx.array(self.flat))

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def place(self, r: int, src: State, i: int) -> State:
        """Row ``i`` of ``src`` written into row ``r``, in place; returns this entry."""
        self.flat[r : r + 1] = src.flat[i : i + 1]
        return self

    def commit(
        self, verified: Any, dst: mx.array | None, count: mx.array, path: mx.array | None = None
    ) -> State:
        """The state after the first ``count`` tokens of each row's accepted path (``path``
        (B, P) its slots; None: the verified tokens in order): ``verified`` is the layer's
        ``StateCommit``."""
        return State(verified.commit(count, path))


def _extend(a: mx.array, pad: int) -> mx.array:
    """(B, n, S, D) -> (B, n, S + pad, D), zeros after."""
    B, n, _, D = a.shape
    return mx.concatenate([a, mx.zeros((B, n, pad, D), a.dtype)], axis=2)


def cache_slots(cache: tuple) -> int:
    """A cache's slots: its first entry's (a verifier's first entry is always ``Slots``)."""
    return cache[0].slots


def grown(cache: tuple, slots: int) -> tuple:
    """``cache`` with at least ``slots`` slots in every attention entry."""
    return tuple(entry.grow(slots) for entry in cache)


def rows_of(cache: tuple, fn: Callable[[mx.array], mx.array]) -> tuple:
    """``cache`` with every per-row array through ``fn`` (a re-lay of rows)."""
    return tuple(entry.rows(fn) for entry in cache)


def place_row(cache: tuple, r: int, src: tuple, i: int) -> None:
    """Row ``i`` of ``src`` (a cache of the same entries) written into row ``r`` of
    ``cache``, entry by entry (in place: lazy updates of ``cache``'s arrays)."""
    for entry, other in zip(cache, src):
        entry.place(r, other, i)


def committed(
    cache: tuple, verified: list, dst: mx.array | None, count: mx.array, path=None
) -> tuple:
    """``cache`` after a verify's commit: each entry's own (``commit``); ``path`` (B, P): the
    accepted path's slots (None: the verified slots in order)."""
    return tuple(e.commit(v, dst, count, path) for e, v in zip(cache, verified))


def dtype_of(cache: tuple):
    """The dtype its first attention entry stores K/V in (the model's compute dtype)."""
    return cache[0].keys.dtype
