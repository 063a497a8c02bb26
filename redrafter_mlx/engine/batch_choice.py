"""A batch's adaptive beam shape: each batch step's shape, chosen from what was measured.

The batch runs one compiled step per shape, all over the same ``DecodeState``, so any shape
may run at any step boundary and every row's output stays exact (``engine/adaptive.py``).
The choice is the engine's own (``ShapeChooser``) with two differences a server needs:

* one chooser per batch size (the scheduler's row buckets): verifying C tokens for 8 rows
  costs a different multiple of an AR step than for one, so each size learns its own step
  costs and acceptance;
* rows come and go, so each row keeps its own ``LookupShadow`` (made when it joins); every
  step's shape is chosen from the match states of the rows it runs (with lookup among the
  candidates), and what a lookup chain would have had accepted at each row's steps feeds
  every chooser.

The batch (``engine/batch.py``) reads each step before it queues the next while this runs
(the choice needs the text so far) and times a step from its queueing to its read; a step
whose compiled function was new (traced and compiled in that call) is not timed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .adaptive import Adaptive, ShapeChooser
from .lookup import LookupShadow
from .shape import BeamShape

# Each step's choice discounts a shape costing c AR steps by 1 + RISK (c - 1): the per-state
# estimates are noisy and taking the best of several noisy estimates overrates it, the more
# so for dear shapes (a B=4 lookup chain costs 2.5 AR steps). Measured interleaved in process
# (scripts.bench_scheduler, edit, SmolLM2 with its drafter), RISK 0 vs 0.15: N=4 1.20x vs
# 1.23x plain decoding (steady; ahead in each of 3 rounds), N=1 1.55x vs 1.63x (steady).
RISK = 0.15


class BatchChoice:
    """Adaptive shapes for a batch that asked for ``shape`` (``adapt``: the settings; its
    ``shapes``, ``costs``, ``every``, ``probe``, ``max_probe`` and ``step_cost`` apply)."""

    def __init__(self, shape: BeamShape, adapt: Adaptive):
        self.shape, self.adapt = shape, adapt
        self.shapes = adapt.candidates(shape)  # plain decoding first
        self.per_step = max(s.longest for s in self.shapes)  # most tokens a step adds to a row
        self.slots = max(s.slots for s in self.shapes)  # most slots a step writes past a row
        # Draft tokens of the longest lookup chain: each row's shadow horizon (0: no lookup).
        self.horizon = max((s.chain_length - 1 for s in self.shapes if s.lookup), default=0)
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

    def next(self, rows: int, matches: Sequence[int]) -> BeamShape:
        """The shape of the next step of a ``rows``-row batch whose active rows start in
        these lookup match states (call once per queued step)."""
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
