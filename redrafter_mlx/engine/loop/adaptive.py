"""Adaptive beam shape: every few steps, run the precompiled shape with the best tokens/s.

The generation loop keeps a few compiled steps — always plain decoding (AR) and one or more
ReDrafter shapes. They all read and write the same ``DecodeState`` (init token, hidden state
at the last cached token, lengths, cache, rng), so switching between them at any step
boundary is exact: greedy output equals AR's whatever shape runs.

The choice uses only what the loop reads on the host anyway (tokens emitted per row by
finished steps, one step behind; no new device sync) and wall-clock time:

* cost per shape: the least of its last ``cost_window`` measured seconds per step (seeded by
  ``costs``, e.g. from a tuning profile, until its first step is timed). Noise in a step's
  wall time is one-sided (another process, a stall, a collection only add time), so the
  least recent time is the step's own cost; an average kept a noisy time for as long as
  the shape sat out, and a shape that ran once while the machine was busy stayed priced
  out (on MT-Bench's first turns plain decoding then ran 27-71% of the steps:
  docs/bench/chooser_cost_window.txt). The window follows slow
  changes (a growing context) within ``cost_window`` runs;
* tokens per step: a shape run lately is judged by its own decayed mean of tokens per step
  (``run_decay`` per step it runs: slow, so a few unlucky steps do not lock a working
  drafter out; context lookup makes acceptance bursty: long runs on text the model copies, none
  elsewhere, which no per-position rate describes). Other shapes use a chain model in which
  each draft position is accepted with probability ``a`` when the previous one was. From
  recent (decayed) steps, censored at the longest candidate, ``a = accepted / (accepted +
  misses)``; a shape whose longest candidate has L tokens then emits ``sum(a**k for k < L)``
  tokens per step. ``a`` is kept over all speculative steps and per family (beam width and
  lookup chains: shapes that differ only in length share it); a family not measured lately
  is estimated as the overall ``a`` times the ratio of its own ``a`` to the overall one when
  it last ran (never run: ratio 1).
* lookup shapes not run lately are judged by the lookup shadow (``lookup.LookupShadow``):
  at every step, whatever shape ran, what a lookup chain would have had accepted, read
  from the text once it is written (decayed by ``decay`` per step: faster, since the text
  moves between copying and writing anew within a few steps). A shape with drafter beams
  and chains is taken as the better of its two parts.
* While AR runs nothing is drafted, so every ``probe`` AR steps one step of the best
  speculative shape re-measures acceptance; the interval doubles (up to ``max_probe``)
  while probes lose, and resets when one wins (with ``reset_probe``, also when a new
  generation starts).

A model split across ranks (``mlx.launch``) must run the same shape on every rank, but each
rank times its own steps: there rank 0's chooser decides the shapes of the next ``every``
steps at once and broadcasts them (``SharedChoice``), so the decision points fall at the
same step on every rank and every rank switches together; with the per-step choice from
lookup match states, rank 0 decides and broadcasts each step's shape.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

from ..base.distributed import broadcast_text
from ..core.shape import AR, BeamShape
from ..drafting.held import sources_key


@dataclass
class _Width:
    """Decayed acceptance of one family of shapes (or of all speculative steps)."""

    accepted: float = 0.0  # decayed accepted drafts
    misses: float = 0.0  # decayed steps that stopped before the end of their beam
    emitted: float = 0.0  # decayed tokens per step (accepted + 1)
    weight: float = 0.0  # decayed steps observed
    last_step: int = -(10**9)  # step index of the latest observation
    ratio: float = 1.0  # own acceptance / overall acceptance, when it last ran

    @property
    def accept(self) -> float | None:
        total = self.accepted + self.misses
        return None if total <= 0 else self.accepted / total

    @property
    def mean(self) -> float | None:
        """Decayed mean tokens per step."""
        return None if self.weight <= 0 else self.emitted / self.weight

    def add(self, counts: Sequence[int], length: int, decay: float, step: int) -> None:
        self.accepted *= decay
        self.misses *= decay
        self.emitted *= decay
        self.weight *= decay
        for c in counts:
            self.accepted += (c - 1) / len(counts)
            self.misses += (c - 1 < length - 1) / len(counts)
            self.emitted += c / len(counts)
        self.weight += 1.0
        self.last_step = step


def family(shape: BeamShape) -> tuple[int, int, int, bool]:
    """Shapes whose acceptance is modelled together: same drafter width (an early-exit
    adapter's chain is its W1), lookup chains and whether a draft model's chain joins."""
    width = shape.width if shape.drafts else 0
    return (width, shape.lookup, shape.chain_length, drafting_model(shape))


def drafting_model(shape: BeamShape) -> bool:
    """Whether a draft model's chain is among ``shape``'s candidates."""
    return shape.model_length > 0


def drafts_any(shape: BeamShape) -> bool:
    """Whether a model drafts in ``shape`` (drafter beams, an early-exit chain or a draft
    model's chain), beside any lookup chains."""
    return shape.drafts or drafting_model(shape)


def drafted_part(shape: BeamShape) -> BeamShape:
    """``shape`` without its lookup chains: the drafter's beams and the draft model's chain
    (plain decoding when neither)."""
    if not drafts_any(shape):
        return AR
    width, length = (shape.width, shape.length) if shape.drafts else (0, 1)
    return BeamShape(width, length, None, 0, 0, shape.model_length)


LONG_CHAIN = 2  # adaptive runs also try lookup chains this many times the asked length
MIN_STATE_WEIGHT = 2.0  # decayed steps a match state needs before its own shadow counts


@dataclass
class ShapeChooser:
    """Chooses the next step's shape among ``shapes`` (``AR`` among them); ``start``: the
    first shape to run (default: the first speculative one)."""

    shapes: Sequence[BeamShape]
    start: Hashable | None = None
    costs: dict[Hashable, float] | None = None
    every: int = 4
    probe: int = 16
    max_probe: int = 128
    decay: float = 0.8  # weight of the past in the lookup shadow's counts, per step
    # ... and in the records of the steps that ran (their tokens per step and acceptance):
    # slower, since a few unlucky steps must not lock a working drafter out (see observe)
    run_decay: float = 0.9
    cost_window: int = 5  # a shape's cost: the least of its last this many step times
    # (0: an EMA of them, ``cost_ema``, ignoring once a time ``outlier`` times above it)
    cost_ema: float = 0.25  # weight of a new step time in the cost EMA (cost_window 0)
    outlier: float = 3.0  # a step this many times the EMA is ignored once (cost_window 0)
    steady_probe: bool = True  # per-step choice: the count to the next probe runs across
    # switches between plain decoding and lookup chains (False: restarts at each, as before)
    reset_probe: bool = False  # a new generation probes from ``probe`` again (``resume``;
    # not the default: same-run A/Bs did not show it helping, docs/bench/chooser_cost_window.txt)
    stale: int = 16  # steps after which a width's acceptance follows the overall one
    margin: float = 0.1  # switch only to a shape expected this much faster (hysteresis)
    risk: float = 0.0  # per-step choice: a shape costing c ARs is judged at rate/(1+risk(c-1))
    # (the server sets it, engine/loop/batch_choice.py; chat and generate judge by the rate alone)
    switches: list = field(default_factory=list)  # (observed steps, from key, to key)
    current: Hashable = None

    def __post_init__(self):
        self.shapes = list(dict.fromkeys(self.shapes))
        if AR not in self.shapes:
            raise ValueError("the adaptive shapes must include plain decoding (AR)")
        self.cost: dict[Hashable, float | None] = {k: None for k in self.shapes}
        for k, c in (self.costs or {}).items():
            if k in self.cost and c and c > 0:
                self.cost[k] = float(c)
        self.widths = {family(k): _Width() for k in self.shapes if k != AR}
        self.own = {k: _Width() for k in self.shapes if k != AR}  # each shape's own record
        spec = [k for k in self.shapes if k != AR]
        self.current = self.start if self.start is not None else (spec[0] if spec else AR)
        self.steps = 0  # observed steps
        self._all = _Width()  # over all speculative steps
        self._queued = 0  # steps queued since the last choice
        self._probe_every = self.probe
        self._quiet_steps = 0  # steps in which no model drafted, since the last probe
        self._probe: Hashable | None = None
        self._outlier_seen: set = set()
        # each shape's latest step times (a seed counts as the first), for ``cost_window``
        self._times: dict[Hashable, list] = {
            k: [] if c is None else [c] for k, c in self.cost.items()
        }
        # Decayed counts of the lookup drafts a chain would have had accepted (k -> weight):
        # over all steps (key None) and per match state (the suffix tokens matched when the
        # step started, ``LookupShadow.match``).
        self._shadow: dict[int | None, list[float]] = {}

    # ------------------------------------------------------------------ estimates

    def acceptance(self, key: Hashable) -> float:
        """Per-position acceptance estimate for a speculative shape (0 when unknown)."""
        w = self.widths[family(key)]
        if w.accept is not None and self.steps - w.last_step <= self.stale:
            return w.accept
        overall = self._all.accept
        return 0.0 if overall is None else min(overall * w.ratio, 0.999)

    def tokens_per_step(self, key: Hashable, matches: Sequence[int] | None = None) -> float:
        """Expected tokens per step (1 for AR); with ``matches`` (each active row's match
        state now), a shape with lookup chains is judged per row by that state's shadow."""
        if key == AR:
            return 1.0
        if matches and key.lookup:
            drafted = self._drafted(key) if drafts_any(key) else 0.0
            rows = [max(self.shadow_tokens_per_step(key, m) or 1.0, drafted) for m in matches]
            return sum(rows) / len(rows)
        own = self.own[key]
        if own.mean is not None and self.steps - own.last_step <= self.stale:
            return own.mean
        chain = sum(self.acceptance(key) ** k for k in range(key.longest))
        shadow = self.shadow_tokens_per_step(key)
        if shadow is None:
            return chain
        if not drafts_any(key):
            return shadow
        return max(shadow, self._drafted(key))  # the better of the beams and the chains

    def _drafted(self, key: Hashable) -> float:
        """Expected tokens per step of the drafting part of ``key`` alone (``drafted_part``:
        drafter beams and the draft model's chain)."""
        part = drafted_part(key)
        if part in self.own:
            return self.tokens_per_step(part)
        return sum(self.acceptance(key) ** k for k in range(part.longest))

    def shadow_tokens_per_step(self, key: Hashable, match: int | None = None) -> float | None:
        """Tokens per step a shape's lookup chain would give, from the shadow: of steps that
        started in match state ``match`` when enough were seen, else of all (None: no
        lookup in ``key``, or nothing observed yet)."""
        counts = self._shadow.get(match, [])
        if sum(counts) < MIN_STATE_WEIGHT:
            counts = self._shadow.get(None, [])
        total = sum(counts)
        if not key.lookup or total <= 0:
            return None
        room = min(key.chain_length, key.slots) - 1  # draft tokens the chain can hold
        return sum(w * (1 + min(k, room)) for k, w in enumerate(counts)) / total

    def rate(self, key: Hashable, matches: Sequence[int] | None = None) -> float | None:
        """Expected tokens per second; None while the shape's cost is unknown.

        A speculative step does at least an AR step's work (its verify forward), so its cost
        is taken as at least AR's: noise in step times never makes a step that drafts
        nothing useful look faster than plain decoding.
        """
        cost = self.cost[key]
        if cost is None:
            return None
        if key != AR and self.cost[AR] is not None:
            cost = max(cost, self.cost[AR])
        return self.tokens_per_step(key, matches) / cost

    # ------------------------------------------------------------------ the loop's calls

    def next_shape(self, matches: Sequence[int] | None = None) -> Hashable:
        """The shape of the next step to queue (call once per queued step). ``matches``:
        each active row's lookup match state now (``LookupShadow.match``), when the loop
        has read every earlier step: then each step gets the shape best for that state."""
        if matches is not None:
            return self._each_step(matches)
        self._queued += 1
        if self._queued >= self.every:
            self._queued = 0
            self._choose()
        if self.current == AR and self._probe is None:
            probe = self._probe_due(lambda: self._best(speculative=True))
            if probe is not None:
                return probe
        return self.current

    def _each_step(self, matches: Sequence[int]) -> Hashable:
        """The best shape for a step whose rows start in these match states.

        Acceptance of lookup is bursty and the match state predicts it (a long match is
        usually a passage being copied, none is fresh text), so the choice is made per step
        rather than every few. Shapes not timed yet run first; while no model drafts (plain
        decoding or lookup chains alone win), every ``probe`` such steps (doubling while
        probes lose) a drafting shape runs once so the drafter's acceptance stays measured
        (the shadow measures lookup for free). The count runs across switches between plain
        decoding and the chains: it used to restart at each, and on fresh text that flips
        with the match state every few steps, so the drafter was never probed again
        (plain decoding ran 49-71% of MT-Bench steps in such runs:
        docs/bench/chooser_cost_window.txt).
        """
        if self._probe is not None:  # a probe is in flight: nothing new to judge by
            return self.current
        unknown = [k for k in self.shapes if self.cost[k] is None]
        best = unknown[0] if unknown else max(self.shapes, key=lambda k: self._judged(k, matches))
        if best != self.current:
            self._switch(best, count=not self.steady_probe)
        quiet = not drafts_any(best) if self.steady_probe else best == AR
        if quiet and not unknown:  # (a probe is judged by rates: costs known)
            drafting = [k for k in self.shapes if k != AR and drafts_any(k)]
            probe = self._probe_due(
                lambda: max(drafting, key=lambda k: self.rate(k, matches)) if drafting else None
            )
            if probe is not None:
                return probe
        return best

    def _judged(self, key: Hashable, matches: Sequence[int]) -> float:
        """``rate`` discounted by ``risk`` for each AR step's worth of cost above one."""
        rate = self.rate(key, matches)
        if not self.risk or key == AR or not self.cost[AR]:
            return rate
        return rate / (1 + self.risk * max(self.cost[key] / self.cost[AR] - 1, 0))

    def _probe_due(self, choose: Callable[[], Hashable | None]) -> Hashable | None:
        """Count one plain-decoding step; every ``_probe_every`` of them, the shape
        ``choose()`` names runs once as a probe (kept in ``_probe`` until observed)."""
        self._quiet_steps += 1
        if self._quiet_steps < self._probe_every:
            return None
        self._quiet_steps = 0
        self._probe = choose()
        return self._probe

    def observe(self, key: Hashable, counts: Sequence[int], seconds: float | None) -> None:
        """A finished step of shape ``key``: tokens it emitted per active row (accepted + 1)
        and its wall time (None when unknown)."""
        self.steps += 1
        self._observe_cost(key, seconds)
        if drafts_any(key):  # a model drafted: the steps to the next probe count anew
            self._quiet_steps = 0
        if key != AR and counts:
            # A drafter shape that loses a few steps in a row is left for plain decoding and
            # comes back only by probes (spaced further while they lose), so its record must
            # not follow each step's luck: at 0.8 per step (the shadow's rate) a working
            # drafter spent 22-39% of MT-Bench turn-1 steps in plain decoding; at 0.9, 11%
            # (+4% tokens/s in an interleaved A/B), while a drafter that turns useless is
            # still left within ~30 steps (docs/bench/adaptive_run_decay.txt).
            w = self.widths[family(key)]
            w.add(counts, key.longest, self.run_decay, self.steps)
            self.own[key].add(counts, key.longest, self.run_decay, self.steps)
            self._all.add(counts, key.longest, self.run_decay, self.steps)
            if self._all.accept:
                w.ratio = w.accept / self._all.accept
        if key == self._probe:  # the probe from AR is back: keep it if it wins
            self._probe = None
            ar, spec = self.rate(AR), self.rate(key)
            if spec is not None and (ar is None or spec > ar * (1 + self.margin)):
                self._switch(key)
                self._probe_every = self.probe
            else:
                self._probe_every = min(2 * self._probe_every, self.max_probe)

    def observe_lookup(self, resolved: Sequence[tuple[int, int]]) -> None:
        """``(match, accepted)``: lookup drafts a chain would have had accepted at recent
        step starts, and the match state each started in (the shadow)."""
        for match, k in resolved:
            for state in (None, match):
                counts = [w * self.decay for w in self._shadow.get(state, [])]
                counts += [0.0] * (k + 1 - len(counts))
                counts[k] += 1.0
                self._shadow[state] = counts

    # ------------------------------------------------------------------ internals

    def _observe_cost(self, key: Hashable, seconds: float | None) -> None:
        if seconds is None or seconds <= 0:
            return
        if self.cost_window:
            times = self._times[key]
            times.append(seconds)
            del times[: -self.cost_window]
            self.cost[key] = min(times)
            return
        old = self.cost[key]
        if old is not None and seconds > self.outlier * old and key not in self._outlier_seen:
            self._outlier_seen.add(key)  # a compile or a stall: ignore it once
            return
        self._outlier_seen.discard(key)
        self.cost[key] = (
            seconds if old is None else (1 - self.cost_ema) * old + (self.cost_ema * seconds)
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
        if best is None or best == self.current:
            return
        now, new = self.rate(self.current), self.rate(best)
        if now is not None and new is not None and new <= now * (1 + self.margin):
            return  # not clearly better: noise in step times must not flip shapes
        if self.current == AR:
            self._probe_every = self.probe
        self._switch(best)

    def resume(self) -> None:
        """Start a new generation with what was learnt (costs, acceptance, the shape
        chosen); a probe still in flight is forgotten, and with ``reset_probe`` the probe
        back-off starts over (the text whose drafts lost is gone)."""
        self._probe = None
        self._queued = 0
        if self.reset_probe:
            self._probe_every = self.probe
            self._quiet_steps = 0

    def _switch(self, key: Hashable, count: bool = True) -> None:
        """Run ``key`` from now on; ``count``: restart the count of steps to the next probe
        (the per-step choice keeps it: it restarts when a model drafts, ``observe``)."""
        self.switches.append((self.steps, self.current, key))
        self.current = key
        if count:
            self._quiet_steps = 0


@dataclass
class Adaptive:
    """Settings of adaptive decoding, ``generate_steps(..., adapt=Adaptive(...))`` (or ``True``).

    ``shapes``: speculative candidates (default: the requested shape and the single beam
    of every shorter length, ``W1×L`` down to ``W1×L2``: where verifying more tokens costs
    nearly their full price, as on a CPU, a shorter beam can beat both plain decoding and
    the requested one); plain decoding is always one. ``costs``: seed seconds per step per shape
    (e.g. from a tuning profile). ``step_cost``: a function of the shape that replaces the
    measured wall time (tests inject costs for determinism). After a run, ``chooser``
    holds the decisions and ``history`` the shape of every step, in order.
    """

    shapes: Sequence[BeamShape] | None = None
    costs: dict[BeamShape, float] | None = None
    every: int = 4
    probe: int = 16
    max_probe: int = 128
    step_cost: Callable[[BeamShape], float] | None = None
    chooser: ShapeChooser | None = None
    history: list[BeamShape] = field(default_factory=list)

    def new_chooser(self, shapes: Sequence[BeamShape], start: Hashable | None) -> ShapeChooser:
        """A chooser among ``shapes`` with these settings, ``start`` running first."""
        return ShapeChooser(
            shapes,
            start=start,
            costs=self.costs,
            every=self.every,
            probe=self.probe,
            max_probe=self.max_probe,
        )

    def candidates(self, shape: BeamShape) -> list[BeamShape]:
        """The shapes a run with requested ``shape`` chooses among (AR first).

        By default: ``shape``; its drafter part alone and the shorter single beams; and with
        lookup chains, the chains alone (no drafter cost: where the text repeats itself
        they may beat every tree with drafter beams, and where it does not, AR wins),
        for one beam and one chain, room for one of them (each row verifies its beam or
        its chain, whichever the match says, at the cost of the beam alone), and chains
        ``LONG_CHAIN`` times as long alone (a passage being copied). An early-exit adapter
        as the drafter: its chains are the single beams. With a draft model's chain
        (``D1×Ld``): also that chain alone, with the lookup chains and with the drafter's
        beams, and all of the above without it (``model_choices``)."""
        if self.shapes:
            spec = list(self.shapes)
        elif shape.model_length:
            rest = replace(shape, model_length=0)
            spec = model_choices(shape)
            if rest.drafts or rest.lookup:
                spec += self.candidates(rest)[1:]
        elif shape.is_autoregressive:
            spec = []
        else:
            drafted = shape.without_lookup()
            spec = [shape, drafted, *single_beams(drafted.length)]
            if shape.lookup and shape.drafts:
                spec.append(BeamShape.lookup_only(shape.lookup, shape.chain_length))
                if shape.width == 1 and shape.lookup == 1:  # one chain, the drafter's cost
                    room = min(shape.length, shape.chain_length)
                    spec.append(BeamShape(1, shape.length, room, 1, shape.chain_length))
        if shape.lookup and not self.shapes and not shape.model_length:
            # a passage being copied: chains twice as long
            spec.append(BeamShape.lookup_only(shape.lookup, LONG_CHAIN * shape.chain_length))
        spec = [s for s in spec if not s.is_autoregressive]
        return [AR, *dict.fromkeys(spec)]


def model_choices(shape: BeamShape) -> list[BeamShape]:
    """The shapes with ``shape``'s draft-model chain an adaptive run tries: ``shape``
    itself, the chain alone, the chain with the lookup chains alone and with the drafter's
    beams alone (no capacity: every candidate's tokens)."""
    chain = BeamShape(0, 1, None, 0, 0, shape.model_length)
    spec = [shape, chain]
    if shape.lookup:
        spec.append(replace(chain, lookup=shape.lookup, lookup_length=shape.chain_length))
    if shape.drafts:
        spec.append(replace(chain, width=shape.width, length=shape.length))
    return spec


def single_beams(length: int) -> list[BeamShape]:
    """``W1×L`` for L = ``length`` down to 2: the shorter single beams an adaptive run tries."""
    return [BeamShape(1, n) for n in range(length, 1, -1)]


MAX_LEARNT = 16  # per model: (sources, shape, sampler) configurations remembered


def learnt(model, sources, shape: BeamShape, sampler) -> Adaptive:
    """The default ``Adaptive`` of this configuration (``sources``: the run's, keyed by
    ``held.sources_key``), kept on the model across calls, so a new generation (a chat
    turn, the next prompt) starts from the measured costs and acceptance instead of
    exploring again."""
    return remembered(model, "_adaptive", (sources_key(sources), shape, sampler), Adaptive)


def remembered(model, name: str, key, make):
    """``make()``, kept on ``model`` (in its store ``name``) under ``key`` across calls: at
    most ``MAX_LEARNT`` configurations per store, the oldest dropped first."""
    store = model.__dict__.setdefault(name, {})
    if key not in store:
        while len(store) >= MAX_LEARNT:
            store.pop(next(iter(store)))
        store[key] = make()
    return store[key]


class SharedChoice:
    """Rank 0's shapes on every rank of a split model (``group``).

    Each ``every`` queued steps (a count that is the same on every rank), rank 0 asks its
    chooser for the next ``every`` shapes and broadcasts their indices (one
    ``broadcast_text``, between steps); every rank then queues exactly those. With
    ``matches`` (the per-step choice from lookup match states, which every rank reads off
    the same text) rank 0 names each step's shape and broadcasts it before that step. Rank
    0's chooser still sees each step it ran (``observe``), so it decides from rank 0's
    timings; the others' choosers are never asked."""

    def __init__(self, chooser: ShapeChooser, group):
        self.chooser, self.group = chooser, group
        self._next: deque = deque()

    def next_shape(self, matches: Sequence[int] | None = None) -> Hashable:
        if matches is not None:
            mine = self.chooser.next_shape(matches) if self.group.rank() == 0 else None
            return rank0_shape(mine, self.chooser.shapes, self.group)
        if not self._next:
            shapes = self.chooser.shapes
            text = None
            if self.group.rank() == 0:
                picks = [self.chooser.next_shape() for _ in range(self.chooser.every)]
                text = ",".join(str(shapes.index(k)) for k in picks)
            text = broadcast_text(text, self.group)
            self._next.extend(shapes[int(i)] for i in text.split(","))
        return self._next.popleft()


def rank0_shape(shape: Hashable | None, shapes: Sequence[Hashable], group) -> Hashable:
    """Rank 0's ``shape`` (one of ``shapes``; others pass None) on every rank: its index,
    broadcast between steps."""
    index = None if shape is None else str(list(shapes).index(shape))
    return shapes[int(broadcast_text(index, group))]
