"""Choosing each step's beam shape: one interface (``ShapePolicy``), three policies.

``batch.BatchGenerator`` asks its policy for the shape of every step it queues and tells it what
each read step gave; it never looks at which policy it holds. The policies:

* ``FixedShape``: one shape, every step (``--no-adapt``, a server without ``--adapt``);
* ``SoloChoice``: a generation call's rows (``generation.generate_steps``): the ``Adaptive``
  learnt on the model across calls (each chat turn starts from what the last one measured), the
  chooser's plain rates, steps timed from read to read, and split across ranks rank 0's
  shapes (``adaptive.SharedChoice``);
* ``BatchChoice``: a server's batch, whose rows come and go:

  - one chooser per batch size (the scheduler's row buckets): verifying C tokens for 8 rows
    costs a different multiple of an AR step than for one, so each size learns its own step
    costs and acceptance;
  - rows come and go, so each row keeps its own ``LookupShadow`` (made when it joins); every
    step's shape is chosen from the match states of the rows it runs (with lookup among the
    candidates), and what a lookup chain would have had accepted at each row's steps feeds
    every chooser;
  - a row sampling with its own seed pins the asked shape (its draws follow the shape of
    every step, so it runs what ``generate --seed`` runs);
  - a step is timed from its queueing to its read; a step whose compiled function was new
    (traced and compiled in that call) is not timed.

All shapes of a policy run over the same ``DecodeState``, so any may run at any step
boundary and every row's output stays exact (``engine/loop/adaptive.py``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

from ..core.shape import BeamShape
from ..drafting.held import sources_key
from ..drafting.lookup import LookupShadow
from .adaptive import Adaptive, ShapeChooser, SharedChoice, learnt, remembered

# Each step's choice discounts a shape costing c AR steps by 1 + RISK (c - 1): the per-state
# estimates are noisy and taking the best of several noisy estimates overrates it, the more
# so for dear shapes (a B=4 lookup chain costs 2.5 AR steps). Measured interleaved in process
# (scripts.bench_scheduler, edit, SmolLM2 with its drafter), RISK 0 vs 0.15: N=4 1.20x vs
# 1.23x plain decoding (steady; ahead in each of 3 rounds), N=1 1.55x vs 1.63x (steady).
RISK = 0.15


class ShapePolicy(Protocol):
    """How a batch chooses each step's shape (``batch.BatchGenerator`` calls only this).

    ``shapes``: every shape it may name (plain decoding, ``AR``, among them when adapting);
    ``per_step`` / ``slots``: the most tokens a step of any of them adds to a row / the most
    cache slots it writes past a row; ``each_step``: each step's shape is chosen from its rows'
    lookup match states (``next``'s ``matches``), so a step read before the next is queued
    gives a fresher choice (the loop's read order, ``platform.read_first``).
    """

    shapes: list[BeamShape]
    per_step: int
    slots: int
    each_step: bool

    def shadow(self, text: list[int]) -> LookupShadow | None:
        """A joining row's lookup shadow over its text so far (None: none needed)."""

    def next(self, rows: int, matches: Sequence[int], seeded: bool) -> BeamShape:
        """The shape of the step queued now (``AR``: plain decoding) for a batch of ``rows``
        rows whose running rows start in lookup match states ``matches``; ``seeded``: a
        running row samples with its own seed."""

    def finished(
        self, rows: int, shape: BeamShape, counts: Sequence[int], seconds: float | None
    ) -> None:
        """A step of ``shape`` was read: tokens per running row, and its time from queueing
        to reading (None: not a step time, e.g. it compiled)."""

    def lookup_seen(self, resolved: Sequence[tuple[int, int]]) -> None:
        """``(match, accepted)`` of lookup chains the rows' shadows resolved."""

    def reset(self) -> None:
        """The batch starts over: forget steps in flight."""


def _reach(shapes: Sequence[BeamShape]) -> tuple[int, int, int]:
    """(per_step, slots, shadow horizon) of a set of shapes: the most tokens a step adds to
    a row, the most slots it writes, draft tokens of the longest lookup chain (0: none)."""
    horizon = max((s.chain_length - 1 for s in shapes if s.lookup), default=0)
    return max(s.longest for s in shapes), max(s.slots for s in shapes), horizon


class FixedShape:
    """One shape for every step (``AR``: plain decoding); a ``ShapePolicy``."""

    each_step = False

    def __init__(self, shape: BeamShape):
        self.shape = shape
        self.shapes = [shape]
        self.per_step, self.slots, _ = _reach(self.shapes)

    def shadow(self, text: list[int]) -> None:
        return None

    def next(self, rows: int, matches: Sequence[int], seeded: bool) -> BeamShape:
        return self.shape

    def finished(self, rows, shape, counts, seconds) -> None:
        pass

    def lookup_seen(self, resolved) -> None:
        pass

    def reset(self) -> None:
        pass


class SoloChoice:
    """The shapes of one generation call's rows (``generation.generate_steps``), adaptive among the
    candidates of ``adapt`` (``True``: the ``Adaptive`` learnt on the model for this
    configuration); a ``ShapePolicy``.

    With lookup among the candidates each step's shape is chosen from the rows' match
    states (``each_step``). A step is timed from the previous read to its own (the loop keeps
    one step in flight); the interval in which a shape was first queued (compiled) is none.
    A seeded sample is the caller's to pin (``generate_steps`` passes a fixed shape then).
    """

    def __init__(self, model, sources, shape: BeamShape, sampler, adapt: Adaptive | bool):
        if adapt is True:
            adapt = learnt(model, sources, shape, sampler)
        self.adapt, self.shape = adapt, shape
        self.shapes = adapt.candidates(shape)
        self.per_step, self.slots, self.horizon = _reach(self.shapes)
        previous = adapt.chooser
        if previous is not None and previous.shapes == self.shapes:
            self.chooser = previous
            previous.resume()
        else:
            start = shape if shape in self.shapes else None
            self.chooser = adapt.new_chooser(self.shapes, start)
            adapt.chooser = self.chooser
        adapt.history = []
        self.choice = self.chooser  # what names the next shape
        group = getattr(model, "group", None)
        if group is not None:
            self.choice = SharedChoice(self.chooser, group)
        self._last_read: float | None = None
        self._queued_once: set = set()
        self.each_step = self.horizon > 0

    def shadow(self, text: list[int]) -> LookupShadow | None:
        return LookupShadow([text], self.horizon) if self.horizon else None

    def next(self, rows: int, matches: Sequence[int], seeded: bool = False) -> BeamShape:
        """A shape's first call compiles it, in the interval that ends at the next read (the
        loop queues a step, then reads the one before it): that interval is no step time."""
        if self.each_step:
            shape = self.choice.next_shape(list(matches))
        else:
            shape = self.choice.next_shape()
        if shape not in self._queued_once:
            self._queued_once.add(shape)
            self._last_read = None
        return shape

    def finished(self, rows, shape, counts, seconds) -> None:
        """Its time is the interval since the previous read (the batch's ``seconds`` are
        not used)."""
        now = time.perf_counter()
        self.adapt.history.append(shape)
        if self.adapt.step_cost is not None:
            seconds = self.adapt.step_cost(shape)
        else:
            seconds = None if self._last_read is None else now - self._last_read
        self._last_read = now
        self.chooser.observe(shape, counts, seconds)

    def lookup_seen(self, resolved) -> None:
        if resolved:
            self.chooser.observe_lookup(resolved)

    def reset(self) -> None:
        """Nothing in flight to forget (the loop ends with its generation)."""


class BatchChoice:
    """Adaptive shapes for a server's batch that asked for ``shape`` (``adapt``: the settings;
    its ``shapes``, ``costs``, ``every``, ``probe``, ``max_probe`` and ``step_cost`` apply); a
    ``ShapePolicy``."""

    def __init__(self, shape: BeamShape, adapt: Adaptive):
        self.shape, self.adapt = shape, adapt
        self.shapes = adapt.candidates(shape)  # plain decoding first
        self.per_step, self.slots, self.horizon = _reach(self.shapes)
        self.each_step = self.horizon > 0
        self.choosers: dict[int, ShapeChooser] = {}
        self.ran: Counter = Counter()  # steps run per shape

    def chooser(self, rows: int) -> ShapeChooser:
        """The chooser of batches of ``rows`` rows (made on first use)."""
        if rows not in self.choosers:
            chooser = self.adapt.new_chooser(self.shapes, self.shape)
            chooser.risk = RISK
            self.choosers[rows] = chooser
        return self.choosers[rows]

    def shadow(self, text: list[int]) -> LookupShadow | None:
        """A joining row's shadow over its text so far (prompt and first token)."""
        return LookupShadow([text], self.horizon) if self.horizon else None

    def next(self, rows: int, matches: Sequence[int], seeded: bool) -> BeamShape:
        """The shape of the next step of a ``rows``-row batch whose active rows start in
        these lookup match states (call once per queued step): the asked shape while a row
        samples with its own seed."""
        if seeded:
            return self.shape
        return self.chooser(rows).next_shape(list(matches) if self.horizon else None)

    def finished(
        self, rows: int, shape: BeamShape, counts: Sequence[int], seconds: float | None
    ) -> None:
        """A step was read: tokens per active row and its time (None: not a step time)."""
        if self.adapt.step_cost is not None:
            seconds = self.adapt.step_cost(shape)
        self.ran[shape] += 1
        self.chooser(rows).observe(shape, counts, seconds)

    def lookup_seen(self, resolved: Sequence[tuple[int, int]]) -> None:
        """``(match, accepted)`` of lookup chains the shadows resolved: every size's."""
        if resolved:
            for chooser in self.choosers.values():
                chooser.observe_lookup(resolved)

    def steps_run(self) -> dict[str, int]:
        """Steps run per shape (``/health``; read from another thread: copied first)."""
        return {k.label: n for k, n in list(self.ran.items())}

    def step_ms(self) -> dict[str, dict[str, float]]:
        """Measured milliseconds per step, per batch size and shape (``/health``)."""
        return {
            str(rows): {k.label: round(1000 * c, 1) for k, c in list(chooser.cost.items()) if c}
            for rows, chooser in sorted(list(self.choosers.items()))
        }

    def reset(self) -> None:
        """The batch started over (an engine failure): forget steps in flight."""
        for chooser in self.choosers.values():
            chooser.resume()


def learnt_batch(model, sources, shape: BeamShape, sampler) -> BatchChoice:
    """The ``BatchChoice`` of this configuration kept on the model across calls (as
    ``adaptive.learnt`` keeps a solo run's), so a branching answer's choosers per batch
    size start from what the earlier answers measured instead of exploring again: an
    answer that never forks then runs as a solo answer does (docs/bench/apar.txt)."""
    key = (sources_key(sources), shape, sampler)
    return remembered(model, "_batch_choice", key, lambda: BatchChoice(shape, Adaptive()))
