"""mlx-lm's cache protocol over the engine's storage, for one forward of ``LmModel``.

mlx-lm's layers read and write their caches through the objects they are handed; these
answer with the engine's arrays (docs/design/any-model.md):

* ``SlotCache``: an attention layer's keys and values at the call's slots in its
  ``entries.Slots`` (preallocated (B, n_kv, S, D) storage), and the engine's mask (a tree's,
  a sliding window's);
* ``StateCache``: a recurrent layer's ``ArraysCache`` entries over its ``entries.State``
  (flat, (B, 1, F)), with mlx-lm's right-padding ``lengths`` hook;
* ``StateCommit``: that state at each row's accepted length, computed at the commit;
* ``path_layer``: a recurrent layer over a tree, each root-to-leaf path a batch row of its
  own (the attention layers keep the packed tree and its mask);
* ``ProbeCache`` / ``ProbeState``: record what a lazy load-time forward writes (shapes).

Shapes: B rows, T new tokens, S cache slots, A attended slots (A <= S); a tree's P paths
of up to Lp tokens each.
"""

from __future__ import annotations

import math

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..core.tree import arange
from .entries import Slots
from .slots import window_mask, write_heads


class LmCall:
    """The engine's arrays for one forward, read by the caches and taps during it.

    ``cache``: the entries in the engine's order (``LmModel.order``): ``Slots`` per
    attention cache, then ``State`` per recurrent layer (``entries.py``); the call replaces
    each entry it writes. ``counts`` (B,): tokens of this call that count per row (a
    right-padded prefill, a commit's accepted path); None: all T. ``paths`` (B or 1, P, Lp):
    a tree's root-to-leaf paths, each position's slot among the T tokens (>= T: past the
    path's end), which the recurrent layers run as batch rows (``path_layer``); None: the T
    tokens are one chain per row.
    """

    def __init__(self, model, positions, mask, cache, write_idx, counts=None, paths=None):
        self.model = model
        self.positions = positions  # (B, T) int32
        # (B,) each row's first position: mlx-lm's ``cache.offset``, one object per call, so
        # a family that hands it to ``mx.fast.rope`` itself is found (``lm_model``'s taps)
        self.offset = positions[:, 0]
        self.mask = mask  # (B, 1, T, A) bool
        self.cache = list(cache)
        self.write_idx = write_idx  # (B, T)
        self.counts = counts
        self.paths = paths
        self._path_rows = None
        self.fresh: dict[int, tuple] = {}  # attention cache -> its new (K, V), (B, T, n, D)
        self.set_states: dict[int, dict] = {}  # recurrent cache -> {entry: new array}
        self.windows: dict[int, mx.array] = {}  # sliding masks by window size
        self.tables: dict[int, tuple] = {}  # rope group -> (cos, sin)
        self.features: dict[int, mx.array] = {}  # layer -> its input
        self.recorded: dict[int, tuple] = {}  # recurrent cache -> (layer, args, kwargs)
        self.hidden: mx.array | None = None
        self.stop: int | None = None  # an early exit: the layer not run (``run_to``)
        self.exit: mx.array | None = None  # the residual entering it
        self._ssm_mask = None

    def window(self, size: int) -> mx.array:
        """The mask narrowed to keys within ``size`` positions of each query."""
        if size not in self.windows:
            self.windows[size] = window_mask(self.mask, self.positions, self.write_idx, size)
        return self.windows[size]

    def ssm_mask(self) -> mx.array:
        """(B, T) bool: the tokens a recurrent layer takes in (all of them unless
        ``counts``). One object per call, so a commit can find it among a layer's
        arguments (``StateCommit``)."""
        if self._ssm_mask is None:
            B, T = self.positions.shape
            if self.counts is None:
                self._ssm_mask = mx.ones((B, T), dtype=mx.bool_)
            else:
                self._ssm_mask = arange(T)[None, :] < self.counts[:, None]
        return self._ssm_mask

    def path_rows(self):
        """The tree's paths as rows (``paths`` set): (index (B, P * Lp) each path position's
        slot, clamped into [0, T); counts (B * P,) tokens per path; source (B, T) the flat
        path position each slot's output is read from: its first path's)."""
        if self._path_rows is None:
            B, T = self.positions.shape
            _, P, Lp = self.paths.shape
            paths = mx.broadcast_to(self.paths, (B, P, Lp))
            inside = paths < T  # a prefix of each path
            counts = inside.sum(axis=-1).astype(mx.int32).reshape(B * P)
            index = mx.minimum(paths, T - 1).reshape(B, P * Lp)
            hits = (paths[..., None] == arange(T)) & inside[..., None]  # (B, P, Lp, T)
            # a slot on no path (padding) reads the first row's root: any finite value
            source = mx.argmax(hits.reshape(B, P * Lp, T), axis=1).astype(mx.int32)
            self._path_rows = index, counts, source
        return self._path_rows


def path_layer(layer, original, call: LmCall, args: tuple, kwargs: dict):
    """A recurrent layer's call over the tree of ``call`` (``call.paths``), each path a batch
    row: every (B, T, ...) argument (its input, its padding mask) gathered into (B * P, Lp,
    ...) along the paths, the layer run from each row's state repeated per path, taking in
    each path's own tokens (mlx-lm's ``lengths``), and its output (B * P, Lp, D) read back to
    the T slots, each from the first path holding it (every path through a node gives it the
    same output: the state after its own ancestors). The layer's state after the call is
    left as it was: the commit takes it along the accepted path (``StateCommit``)."""
    B, T = call.positions.shape
    _, P, Lp = call.paths.shape
    index, counts, source = call.path_rows()

    def gather(a: mx.array) -> mx.array:  # (B, T, ...) -> (B * P, Lp, ...)
        idx = index.reshape(B, P * Lp, *([1] * (a.ndim - 2)))
        return mx.take_along_axis(a, idx, axis=1).reshape(B * P, Lp, *a.shape[2:])

    rows = LmCall(call.model, gather(call.positions), None, (), None, counts)
    old_mask = call._ssm_mask

    def swap(value):
        if isinstance(value, StateCache):
            start = mx.repeat(value.start, P, axis=0)  # (B * P, 1, F)
            return StateCache(rows, value.index, value.layout, start)
        if old_mask is not None and value is old_mask:
            return rows.ssm_mask()
        if isinstance(value, mx.array) and value.shape[:2] == (B, T):
            return gather(value)
        return value

    out = original(layer, *[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    flat = out.reshape(B, P * Lp, *out.shape[2:])
    idx = source.reshape(B, T, *([1] * (out.ndim - 2)))
    return mx.take_along_axis(flat, idx, axis=1)


class SlotCache:
    """One attention cache of mlx-lm's protocol over the engine's slot storage."""

    def __init__(self, call: LmCall, index: int):
        self.call = call
        self.index = index  # the engine's

    @property
    def offset(self) -> mx.array:
        """(B,) the position of each row's first new token (mlx-lm's batched offset)."""
        return self.call.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """keys/values (B, n_kv, T, D) written at the call's slots; returns the buffers over
        the attention window, (B, n_kv, A, D) each."""
        call, i = self.call, self.index
        # the commit reads them (B, T, n_kv, D); a call whose commit does not stays lazy
        call.fresh[i] = (keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3))
        old = call.cache[i]
        call.cache[i] = Slots(
            write_heads(old.keys, call.write_idx, keys),
            write_heads(old.values, call.write_idx, values),
        )
        return self.keys_and_values()

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """The engine's (B, 1, T, A) mask; within ``window_size`` positions when given."""
        return self.call.mask if window_size is None else self.call.window(window_size)

    def keys_and_values(self):
        """The buffers over the attention window (a layer sharing this cache reads them)."""
        A = self.call.mask.shape[-1]
        entry = self.call.cache[self.index]
        return entry.keys[:, :, :A], entry.values[:, :, :A]

    @property
    def state(self):
        return self.keys_and_values()

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class StateCache(ArraysCache):
    """One recurrent layer's cache of mlx-lm's ``ArraysCache`` protocol (conv windows, SSM
    and delta-rule states) over the engine's flat (B, 1, F) storage; an ``ArraysCache``
    (its own storage unused), as a family that writes only such a cache checks (mamba).

    ``lengths`` is mlx-lm's right-padding hook: a layer takes in only each row's first
    ``lengths`` tokens and leaves its state there, which is how a commit keeps the accepted
    path alone (``StateCommit``).
    """

    def __init__(self, call: LmCall, index: int, layout: list, start: mx.array):
        self.call = call
        self.index = index  # the engine's
        self.layout = layout  # per entry: (shape, dtype, offset, size) or None
        self.start = start  # (B, 1, F) the state before this call
        self.left_padding = None

    @property
    def lengths(self):
        return self.call.counts

    def __getitem__(self, j: int):
        entry = self.layout[j]
        if entry is None:
            return None
        shape, dtype, at, size = entry
        B = self.start.shape[0]
        return self.start[:, 0, at : at + size].reshape(B, *shape).astype(dtype)

    def __setitem__(self, j: int, value: mx.array) -> None:
        self.call.set_states.setdefault(self.index, {})[j] = value

    def advance(self, N: int) -> None:
        pass

    def make_mask(self, N: int, *args, **kwargs):
        return self.call.ssm_mask()

    def empty(self) -> bool:
        return False

    def flat(self) -> mx.array:
        """The state after the call, (B, 1, F) float32 (entries not set keep theirs)."""
        new = self.call.set_states.get(self.index, {})
        B = self.start.shape[0]
        parts = []
        for j, entry in enumerate(self.layout):
            if entry is None:
                continue
            _, _, at, size = entry
            if j in new:
                parts.append(new[j].astype(mx.float32).reshape(B, 1, size))
            else:
                parts.append(self.start[:, :, at : at + size])
        return mx.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]


class StateCommit:
    """A recurrent layer's state at each row's accepted length, computed at the commit: the
    layer runs again over the verified tokens from its state before the step, taking in
    only the first ``count`` of them (mlx-lm's ``lengths``; its outputs are never read, so
    only the state's share of the layer is computed). After a tree's verify (``call.paths``)
    it runs over the accepted path's tokens alone, gathered by their slots. Its inputs are
    the verify's own, so ``mx.compile`` shares what both compute, unless
    ``model.commit_apart``."""

    def __init__(self, call: LmCall, index: int, layout: list, start: mx.array):
        self.call, self.index, self.layout, self.start = call, index, layout, start

    def commit(self, count: mx.array, path: mx.array | None = None) -> mx.array:
        """count (B,) tokens kept per row -> the flat state (B, 1, F) after them; ``path``
        (B, P): the accepted path's slots (read after a tree's verify; else the verified
        tokens are the path, in order)."""
        call = self.call
        layer, args, kwargs = call.recorded[self.index]
        B, T = call.positions.shape
        along = call.paths is not None and path is not None

        def gather(a: mx.array) -> mx.array:  # (B, T, ...) -> (B, P, ...)
            idx = path.reshape(B, path.shape[1], *([1] * (a.ndim - 2)))
            return mx.take_along_axis(a, idx, axis=1)

        positions = gather(call.positions) if along else call.positions
        again = LmCall(call.model, positions, call.mask, (), call.write_idx, count)
        cache = StateCache(again, self.index, self.layout, self.start)
        old_mask = call._ssm_mask  # the verify's (B, T) mask object, if a layer asked

        def swap(value):
            if isinstance(value, StateCache):
                return cache
            if old_mask is not None and value is old_mask:
                return again.ssm_mask()
            if along and isinstance(value, mx.array) and value.shape[:2] == (B, T):
                value = gather(value)
            if call.model.commit_apart and isinstance(value, mx.array):
                return mx.contiguous(value)  # nothing shared with the verify (lm_checks)
            return value

        args = [swap(a) for a in args]
        kwargs = {k: swap(v) for k, v in kwargs.items()}
        type(layer).__call__(layer, *args, **kwargs)
        return cache.flat()


class ProbeCache:
    """Records the K/V shapes an attention cache is given (one lazy forward at load)."""

    def __init__(self, shapes: dict, index: int):
        self.shapes = shapes
        self.index = index
        self.offset = 0

    def update_and_fetch(self, keys, values):
        self.shapes[self.index] = (keys.shape[1], keys.shape[3], values.shape[3])
        self.kv = keys, values
        return keys, values

    def keys_and_values(self):
        return self.kv

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        return None

    def empty(self) -> bool:
        return True


class ProbeState(ArraysCache):
    """Records the arrays a recurrent layer keeps in its ``ArraysCache`` (one itself, as a
    family that writes only such a cache checks: mamba)."""

    def __init__(self, size: int):
        self.entries: list = [None] * size
        self.lengths = None
        self.left_padding = None

    def __getitem__(self, j: int):
        return self.entries[j]

    def __setitem__(self, j: int, value) -> None:
        self.entries[j] = value

    def advance(self, N: int) -> None:
        pass

    def make_mask(self, N: int, *args, **kwargs):
        return None

    def empty(self) -> bool:
        return True

    def layout(self) -> list:
        """Per entry (shape after the batch axis, dtype, offset, size) in the flat state."""
        out, at = [], 0
        for value in self.entries:
            if value is None:
                out.append(None)
                continue
            size = math.prod(value.shape[1:])
            out.append((tuple(value.shape[1:]), value.dtype, at, size))
            at += size
        return out
