"""Adaptive beam shape: every few steps, run the precompiled shape with the best tokens/s.

The generation loop keeps a few compiled steps — always plain decoding (AR) and one or more
ReDrafter shapes. They all read and write the same ``DecodeState`` (init token, hidden state
at the last cached token, lengths, cache, rng), so switching between them at any step
boundary is exact: greedy output equals AR's whatever shape runs.

The choice uses only what the loop reads on the host anyway (tokens emitted per row by
finished steps, one step behind; no new device sync) and wall-clock time:

* cost per shape: an EMA of measured seconds per step (seeded by ``costs``, e.g. from a
  tuning profile, else by the first steps run with it); a time far above the EMA (a
  compile, a stall) is ignored once;
* tokens per step: acceptance is modelled per beam width as a chain in which each draft
  position is accepted with probability ``a`` when the previous one was. From the recent
  (decayed) steps of that width, censored at L-1, ``a = accepted / (accepted + misses)``;
  a shape of length L then emits ``sum(a**k for k < L)`` tokens per step. A width not
  measured lately borrows the latest estimate of any width.
* While AR runs nothing is drafted, so every ``probe`` AR steps one step of the best
  speculative shape re-measures acceptance; the interval doubles (up to ``max_probe``)
  while probes lose, and resets when one wins.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

AR = "AR"  # the key of plain decoding


@dataclass
class _Width:
    accepted: float = 0.0  # decayed accepted drafts
    misses: float = 0.0  # decayed steps that stopped before the end of their beam
    last_step: int = -(10**9)  # step index of the latest observation

    @property
    def accept(self) -> float | None:
        total = self.accepted + self.misses
        return None if total <= 0 else self.accepted / total


@dataclass
class ShapeChooser:
    """Chooses the next step's shape among ``shapes``: ``{key: (width, length)}`` with
    ``AR`` present (its width/length are ignored); ``start``: the first shape to run."""

    shapes: dict[Hashable, tuple[int, int]]
    start: Hashable | None = None
    costs: dict[Hashable, float] | None = None
    every: int = 4
    probe: int = 16
    max_probe: int = 256
    decay: float = 0.8  # weight of the past in acceptance counts, per observed step
    cost_ema: float = 0.25  # weight of a new step time in the cost EMA
    outlier: float = 3.0  # a step this many times the EMA is ignored once
    stale: int = 48  # steps after which a width's acceptance borrows the latest one
    switches: list = field(default_factory=list)  # (observed steps, from key, to key)
    current: Hashable = None

    def __post_init__(self):
        if AR not in self.shapes:
            raise ValueError("the adaptive shapes must include plain decoding (AR)")
        self.cost: dict[Hashable, float | None] = {k: None for k in self.shapes}
        for k, c in (self.costs or {}).items():
            if k in self.cost and c and c > 0:
                self.cost[k] = float(c)
        self.widths = {w: _Width() for k, (w, _) in self.shapes.items() if k != AR}
        self.current = self.start if self.start is not None else next(iter(self.shapes))
        self.steps = 0  # observed steps
        self._latest: _Width | None = None
        self._queued = 0  # steps queued since the last choice
        self._probe_every = self.probe
        self._ar_queued = 0
        self._probe: Hashable | None = None
        self._outlier_seen: set = set()

    # ------------------------------------------------------------------ estimates

    def acceptance(self, key: Hashable) -> float:
        """Per-position acceptance estimate for a speculative shape (0 when unknown)."""
        w = self.widths[self.shapes[key][0]]
        a = w.accept
        fresh = self.steps - w.last_step <= self.stale
        if (a is None or not fresh) and self._latest is not None:
            a = self._latest.accept
        return 0.0 if a is None else a

    def tokens_per_step(self, key: Hashable) -> float:
        """Expected tokens per step (1 for AR)."""
        if key == AR:
            return 1.0
        a = self.acceptance(key)
        return sum(a**k for k in range(self.shapes[key][1]))

    def rate(self, key: Hashable) -> float | None:
        """Expected tokens per second; None while the shape's cost is unknown."""
        cost = self.cost[key]
        return None if cost is None else self.tokens_per_step(key) / cost

    # ------------------------------------------------------------------ the loop's calls

    def next_shape(self) -> Hashable:
        """The shape of the next step to queue (call once per queued step)."""
        self._queued += 1
        if self._queued >= self.every:
            self._queued = 0
            self._choose()
        if self.current == AR and self._probe is None:
            self._ar_queued += 1
            if self._ar_queued >= self._probe_every:
                self._ar_queued = 0
                self._probe = self._best(speculative=True)
                if self._probe is not None:
                    return self._probe
        return self.current

    def observe(self, key: Hashable, counts: Sequence[int], seconds: float | None) -> None:
        """A finished step of shape ``key``: tokens it emitted per active row (accepted + 1)
        and its wall time (None when unknown)."""
        self.steps += 1
        self._observe_cost(key, seconds)
        if key != AR and counts:
            width, length = self.shapes[key]
            w = self.widths[width]
            w.accepted *= self.decay
            w.misses *= self.decay
            for c in counts:
                w.accepted += (c - 1) / len(counts)
                w.misses += (c - 1 < length - 1) / len(counts)
            w.last_step = self.steps
            self._latest = w
        if key == self._probe:  # the probe from AR is back: keep it if it wins
            self._probe = None
            ar, spec = self.rate(AR), self.rate(key)
            if spec is not None and (ar is None or spec > ar):
                self._switch(key)
                self._probe_every = self.probe
            else:
                self._probe_every = min(2 * self._probe_every, self.max_probe)

    # ------------------------------------------------------------------ internals

    def _observe_cost(self, key: Hashable, seconds: float | None) -> None:
        if seconds is None or seconds <= 0:
            return
        old = self.cost[key]
        if old is not None and seconds > self.outlier * old and key not in self._outlier_seen:
            self._outlier_seen.add(key)  # a compile or a stall: ignore it once
            return
        self._outlier_seen.discard(key)
        self.cost[key] = seconds if old is None else (1 - self.cost_ema) * old + (
            self.cost_ema * seconds
        )

    def _best(self, speculative: bool = False) -> Hashable | None:
        keys = [k for k in self.shapes if not (speculative and k == AR)]
        unknown = [k for k in keys if self.cost[k] is None]
        if unknown:  # a shape is measured before it is judged
            return unknown[0]
        return max(keys, key=lambda k: self.rate(k)) if keys else None

    def _choose(self) -> None:
        if self._probe is not None:
            return
        best = self._best()
        if best is not None and best != self.current:
            if self.current == AR:
                self._probe_every = self.probe
            self._switch(best)

    def _switch(self, key: Hashable) -> None:
        self.switches.append((self.steps, self.current, key))
        self.current = key
        self._ar_queued = 0
