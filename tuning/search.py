"""Budgeted search over beam shapes by successive halving.

The search never looks at an engine: it calls an injected ``measure(shape, n_tokens)``
that returns a :class:`Measurement` and reads time from an injected ``clock`` (seconds),
so it runs exactly the same against a deterministic fake cost model in tests.

Plan (all rounds also re-measure autoregressive decoding at the same token count, so
each speedup compares like with like):

0. warm up and measure autoregressive decoding (the baseline; always done);
1. one short run for every shape (each shape warmed up first);
2. longer runs for the best third;
3. repeats for the top few, interleaved with the baseline.

Token counts are chosen from cost estimates: the first round gets ``first_round_share``
of the budget, rounds 2 and 3 share the rest; a run only starts when its estimated cost
fits in what is left. With no budget given, it is sized once the baseline is measured: what
the three rounds need at their smallest token counts on this model and machine (a real
model on a CPU needs minutes, a toy seconds), within ``AUTO_BUDGET_S``. Speculation
is recommended only when the best shape beats the baseline beyond the noise: its lower
quartile above the baseline's upper quartile and a median speedup of ``min_speedup``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from redrafter_mlx.engine.base.errors import RedrafterError
from redrafter_mlx.engine.core.shape import BeamShape


@dataclass(frozen=True)
class Measurement:
    """What one ``measure`` call saw: one tokens/s sample per prompt (generation only,
    prompt processing excluded), and optionally tokens per step and mean packed tokens."""

    tokens_per_s: tuple[float, ...]
    tokens_per_step: tuple[float, ...] = ()
    mean_packed: float | None = None


MeasureFn = Callable[[BeamShape, int], Measurement]
Clock = Callable[[], float]


@dataclass(frozen=True)
class Spread:
    """Median, quartiles and range of a set of samples."""

    median: float
    q1: float
    q3: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of ``samples`` (quartiles by linear interpolation; one sample -> zero IQR)."""
        if not samples:
            raise ValueError("cannot summarise an empty list of samples")
        values = sorted(samples)
        if len(values) == 1:
            q1 = q3 = values[0]
        else:
            q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q1, q3, values[0], values[-1], len(values))

    def scaled(self, factor: float) -> Spread:
        """Every figure multiplied by ``factor`` (tokens/s -> speedup)."""
        return Spread(
            self.median * factor,
            self.q1 * factor,
            self.q3 * factor,
            self.low * factor,
            self.high * factor,
            self.n,
        )

    def to_dict(self) -> dict:
        """JSON-ready figures."""
        return {
            "median": self.median,
            "q1": self.q1,
            "q3": self.q3,
            "min": self.low,
            "max": self.high,
            "n": self.n,
        }


@dataclass
class ShapeResult:
    """Every sample taken for one shape, tagged by round and token count."""

    shape: BeamShape
    samples: list[tuple[int, int, float]] = field(default_factory=list)  # (round, n_tokens, tps)
    tokens_per_step: list[float] = field(default_factory=list)
    mean_packed: list[float] = field(default_factory=list)
    prompts: int = 0  # samples per measure call (one per prompt, in the same prompt order)
    runs: int = 0
    warmed_up: bool = False
    seconds: float = 0.0
    error: str | None = None

    @property
    def measured(self) -> bool:
        """True once at least one sample was taken."""
        return bool(self.samples)

    @property
    def last_round(self) -> int:
        """The latest round this shape took part in (-1 if never measured)."""
        return max((r for r, _, _ in self.samples), default=-1)

    @property
    def final_tokens(self) -> int:
        """Token count of its longest runs: its most reliable figures use this count."""
        return max(n for _, n, _ in self.samples)

    def runs_at(self, n_tokens: int) -> int:
        """Measured runs of ``n_tokens`` tokens (each gives one sample per prompt)."""
        return len(self.samples_at(n_tokens)) // max(self.prompts, 1)

    def samples_at(self, n_tokens: int) -> list[float]:
        """tokens/s samples taken with runs of ``n_tokens`` tokens."""
        return [tps for _, n, tps in self.samples if n == n_tokens]

    def samples_in(self, round_index: int) -> list[float]:
        """tokens/s samples of one round."""
        return [tps for r, _, tps in self.samples if r == round_index]

    def spread(self) -> Spread:
        """Spread of the samples at its longest token count."""
        return Spread.of(self.samples_at(self.final_tokens))


@dataclass(frozen=True)
class SearchPlan:
    """Knobs of the successive-halving search (defaults suit a 1-5 minute budget)."""

    warmup_tokens: int = 8
    min_tokens: int = 16
    short_tokens: int = 64
    long_tokens: int = 256
    keep_fraction: float = 1 / 3
    finalists: int = 3
    final_repeats: int = 3
    first_round_share: float = 0.4
    min_speedup: float = 1.03
    unknown_cost_factor: float = 2.0  # untried shape: assume this x the baseline's s/token


AUTO_BUDGET_S = (120.0, 600.0)  # floor and cap of the automatic budget, seconds
# Runs of the pick and of the baseline, each at the pick's token count, before the two can be
# ranked: one run each cannot tell a difference from run-to-run noise.
MIN_COMPARED_RUNS = 2


@dataclass
class SearchResult:
    """The outcome: the baseline, every shape's figures, and the recommendation."""

    autoregressive: ShapeResult
    results: list[ShapeResult]
    best: ShapeResult | None
    recommended: BeamShape
    speculation_wins: bool
    reason: str
    elapsed_s: float
    budget_s: float

    def speedup(self, result: ShapeResult) -> Spread:
        """``result``'s tokens/s over the baseline's median at the same token count."""
        n = result.final_tokens
        baseline = self.autoregressive.samples_at(n) or self.autoregressive.samples_at(
            self.autoregressive.final_tokens
        )
        return result.spread().scaled(1.0 / statistics.median(baseline))

    def evidence_gap(self) -> str | None:
        """Why the search measured too little to rank its pick against plain decoding, or
        None when it measured enough: the pick and the baseline each ``MIN_COMPARED_RUNS``
        runs at the pick's token count (the pick reached the repeats of the last rounds)."""
        reached = f"{sum(r.measured for r in self.results)} of {len(self.results)} shapes measured"
        if self.best is None:
            return f"no speculative shape was measured within {self.budget_s:g} s ({reached})"
        n = self.best.final_tokens
        pick, base = self.best.runs_at(n), self.autoregressive.runs_at(n)
        if min(pick, base) >= MIN_COMPARED_RUNS:
            return None
        return (
            f"too little was measured to rank the pick against plain decoding: at {n} tokens "
            f"{self.best.shape.label} ran {pick} time(s) and plain decoding {base}, "
            f"{MIN_COMPARED_RUNS} of each are needed ({reached} in {self.elapsed_s:.1f} s)"
        )

    @property
    def skipped(self) -> list[BeamShape]:
        """Shapes the budget did not reach (or that failed)."""
        return [r.shape for r in self.results if not r.measured]

    def to_dict(self) -> dict:
        """JSON-ready summary of the whole search."""
        rows = []
        for r in [self.autoregressive, *self.results]:
            row: dict = {
                **r.shape.to_dict(),
                "label": r.shape.label,
                "runs": r.runs,
                "rounds": r.last_round + 1,
                "error": r.error,
            }
            if r.measured:
                row["tokens_per_s"] = r.spread().to_dict()
                row["speedup"] = self.speedup(r).to_dict()
                row["n_tokens"] = r.final_tokens
                if r.tokens_per_step:
                    row["tokens_per_step"] = statistics.median(r.tokens_per_step)
            rows.append(row)
        return {
            "recommended": {**self.recommended.to_dict(), "label": self.recommended.label},
            "speculation_wins": self.speculation_wins,
            "reason": self.reason,
            "best": self.best.shape.label if self.best else None,
            "elapsed_s": self.elapsed_s,
            "budget_s": self.budget_s,
            "shapes": rows,
        }


class SearchError(RedrafterError, RuntimeError):
    """The search cannot produce a result (the baseline itself failed)."""


class BudgetExhausted(Exception):
    """Raised internally when the next run would not fit in the budget."""


class _Search:
    """One search run: owns the clock bookkeeping and per-shape cost estimates."""

    def __init__(
        self,
        measure: MeasureFn,
        budget_s: float,
        clock: Clock,
        plan: SearchPlan,
        log: Callable[[str], None] | None,
    ):
        self.measure = measure
        self.budget_s = float(budget_s)
        self.clock = clock
        self.plan = plan
        self.log = log or (lambda _msg: None)
        self.start = clock()
        self.seconds_per_token: dict[BeamShape, float] = {}
        self.warmup_seconds: list[float] = []

    # -- time
    def remaining(self) -> float:
        """Seconds left in the budget."""
        return self.budget_s - (self.clock() - self.start)

    def estimate(self, shape: BeamShape, n_tokens: int) -> float:
        """Expected seconds for ``n_tokens`` tokens of ``shape`` (pessimistic if untried)."""
        if shape in self.seconds_per_token:
            return self.seconds_per_token[shape] * n_tokens
        return self.untried_per_token() * n_tokens

    def untried_per_token(self) -> float:
        """Seconds per token assumed for an untried shape: ``unknown_cost_factor`` x the
        baseline's (0 before the baseline is measured)."""
        base = self.seconds_per_token.get(BeamShape.autoregressive(), 0.0)
        return base * self.plan.unknown_cost_factor

    def estimate_warmup(self) -> float:
        """Expected seconds of a warm-up: the longest warm-up seen so far."""
        return max(self.warmup_seconds, default=0.0)

    # -- runs
    def _timed(self, result: ShapeResult, n_tokens: int) -> tuple[Measurement, float]:
        """Call ``measure`` and book the time it took against the shape."""
        t0 = self.clock()
        measurement = self.measure(result.shape, n_tokens)
        dt = max(self.clock() - t0, 0.0)
        result.seconds += dt
        return measurement, dt

    def _fits(self, cost: float, force: bool) -> None:
        """Raise :class:`BudgetExhausted` when ``cost`` seconds do not fit (unless forced)."""
        if not force and cost > self.remaining():
            raise BudgetExhausted

    def run(self, result: ShapeResult, round_index: int, n_tokens: int, force: bool = False):
        """Warm ``result``'s shape up if needed, then take one measured run.

        Warm-ups are timed but never used as speed estimates (they include one-off
        compilation). Raises :class:`BudgetExhausted` (unless ``force``) when the run
        would not fit; a failing ``measure`` marks the shape with its error instead.
        """
        if result.error:
            return
        cost = self.estimate(result.shape, n_tokens)
        try:
            if not result.warmed_up:
                self._fits(cost + self.estimate_warmup(), force)
                _, dt = self._timed(result, self.plan.warmup_tokens)
                self.warmup_seconds.append(dt)
                result.warmed_up = True
            self._fits(cost, force)
            measurement, dt = self._timed(result, n_tokens)
        except BudgetExhausted:
            raise
        except Exception as e:
            result.error = f"{type(e).__name__}: {e}"
            self.log(f"{result.shape.label}: failed ({result.error})")
            return
        self.seconds_per_token[result.shape] = dt / max(n_tokens, 1)
        result.runs += 1
        result.samples.extend((round_index, n_tokens, float(t)) for t in measurement.tokens_per_s)
        result.prompts = len(measurement.tokens_per_s)
        result.tokens_per_step.extend(measurement.tokens_per_step)
        if measurement.mean_packed is not None:
            result.mean_packed.append(measurement.mean_packed)

    def per_token(self, shapes: Iterable[ShapeResult]) -> float:
        """Estimated seconds for one token of each of ``shapes``."""
        return sum(self.estimate(r.shape, 1) for r in shapes)

    @staticmethod
    def tokens_for(seconds: float, per_token: float, lo: int, hi: int) -> int:
        """Tokens per run so that runs costing ``per_token`` s/token fill ``seconds``."""
        if per_token <= 0:
            return hi
        return max(lo, min(hi, int(seconds / per_token)))


def _rank(results: Iterable[ShapeResult], round_index: int) -> list[ShapeResult]:
    """Measured results of ``round_index``, fastest median first (ties: grid order)."""
    scored = [r for r in results if r.samples_in(round_index) and not r.error]
    return sorted(scored, key=lambda r: -statistics.median(r.samples_in(round_index)))


def paired_ratios(ar: ShapeResult, best: ShapeResult, n_tokens: int) -> list[float] | None:
    """Per-prompt speedups: median tokens/s of ``best`` over the baseline's on the same prompt.

    Prompts differ far more from each other (how predictable each one is) than runs of one
    prompt do, so shapes are compared prompt by prompt. None when the samples do not pair.
    """
    P = best.prompts
    base, spec = ar.samples_at(n_tokens), best.samples_at(n_tokens)
    if P < 1 or ar.prompts != P or not base or not spec or len(base) % P or len(spec) % P:
        return None
    return [statistics.median(spec[p::P]) / statistics.median(base[p::P]) for p in range(P)]


def _decide(ar: ShapeResult, best: ShapeResult | None, plan: SearchPlan) -> tuple[bool, str]:
    """Does ``best`` beat autoregressive decoding beyond the noise? With a one-line reason.

    Paired by prompt when possible: the median per-prompt speedup must reach
    ``plan.min_speedup`` and the lower quartile of per-prompt speedups must exceed 1.
    Otherwise the unpaired quartiles of tokens/s must not overlap.
    """
    if best is None:
        return False, "no speculative shape could be measured within the budget"
    n = best.final_tokens
    base = Spread.of(ar.samples_at(n) or ar.samples_at(ar.final_tokens))
    spec = best.spread()
    speedup = spec.median / base.median
    ratios = paired_ratios(ar, best, n)
    if ratios is not None:
        paired = Spread.of(ratios)
        speedup = paired.median
    kind = "median per-prompt speedup" if ratios is not None else "speedup"
    summary = (
        f"{best.shape.label}: {spec.median:.1f} tok/s vs {base.median:.1f} autoregressive "
        f"({kind} {speedup:.2f}x)"
    )
    if speedup < plan.min_speedup:
        return False, f"speculation does not pay: best {summary}, below {plan.min_speedup:.2f}x"
    if ratios is not None:
        if paired.q1 <= 1.0:
            return False, (
                f"speculation within the noise: best {summary}, slower on some "
                f"prompts (per-prompt speedup q1 {paired.q1:.2f}x)"
            )
    elif spec.q1 <= base.q3:
        return False, f"speculation within the noise: best {summary}, quartiles overlap"
    return True, f"speculation wins: {summary}"


def successive_halving(
    measure: MeasureFn,
    shapes: Sequence[BeamShape],
    budget_s: float | None,
    clock: Clock = time.perf_counter,
    plan: SearchPlan | None = None,
    log: Callable[[str], None] | None = None,
) -> SearchResult:
    """Search ``shapes`` within ``budget_s`` seconds of ``clock`` and recommend a shape.

    ``budget_s=None`` sizes the budget from the baseline's speed (:func:`auto_budget`).
    ``shapes`` are measured in the given order in the first round, so put the likeliest
    (the chip's preset) first: if the budget runs out, it has been measured.
    """
    plan = plan or SearchPlan()
    auto = budget_s is None
    search = _Search(measure, AUTO_BUDGET_S[1] if auto else budget_s, clock, plan, log)
    ar = ShapeResult(BeamShape.autoregressive())
    results = [ShapeResult(s) for s in dict.fromkeys(shapes) if not s.is_autoregressive]
    try:
        _run_rounds(search, ar, results, plan, auto)
    except BudgetExhausted:
        search.log("budget spent; deciding on what was measured")
    return _finish(search, ar, results, plan)


def _kept(n_shapes: int, plan: SearchPlan) -> int:
    """Shapes of round 1 that go on to round 2: the best third, at least the finalists."""
    return max(min(plan.finalists, n_shapes), math.ceil(n_shapes * plan.keep_fraction))


def auto_budget(search: _Search, n_shapes: int, plan: SearchPlan) -> float:
    """Seconds (from the search's start) the three rounds need at their smallest token
    counts, judged from the measured baseline: every untried shape at ``unknown_cost_factor``
    times its seconds per token, one warm-up each as long as the baseline's; within
    ``AUTO_BUDGET_S``."""
    per_token = search.untried_per_token()
    keep = _kept(n_shapes, plan)
    first = n_shapes * (
        search.estimate_warmup() + per_token * (plan.warmup_tokens + plan.min_tokens)
    )
    later = (keep + 1 + plan.final_repeats * (min(plan.finalists, n_shapes) + 1)) * (
        per_token * plan.short_tokens
    )
    needed = search.clock() - search.start + max(first / plan.first_round_share, first + later)
    return min(max(needed, AUTO_BUDGET_S[0]), AUTO_BUDGET_S[1])


def _run_rounds(
    search: _Search, ar: ShapeResult, results: list[ShapeResult], plan: SearchPlan, auto: bool
) -> None:
    """The three rounds; raises :class:`BudgetExhausted` when time runs out."""
    # round 0: baseline, then one short run per shape
    search.run(ar, 0, plan.min_tokens, force=True)
    if not ar.measured:
        raise SearchError(
            f"autoregressive decoding (the baseline) failed: "
            f"{ar.error or 'no samples'}; fix that before tuning"
        )
    if auto:
        search.budget_s = auto_budget(search, len(results), plan)
        search.log(f"budget: {search.budget_s:.0f} s (sized from the baseline's speed)")
    n0 = search.tokens_for(
        search.remaining() * plan.first_round_share,
        search.per_token(results),
        plan.min_tokens,
        plan.short_tokens,
    )
    if n0 != plan.min_tokens:
        search.run(ar, 0, n0, force=True)
    search.log(f"round 1: {len(results)} shapes x {n0} tokens")
    for r in results:
        search.run(r, 0, n0)
    # round 1: the best third, longer; its token count also serves round 2's repeats
    ranked = _rank(results, 0)
    survivors = ranked[: _kept(len(ranked), plan)]
    if not survivors:
        return
    likely_finalists = [ar, *survivors[: plan.finalists]]
    per_token = search.per_token([ar, *survivors]) + plan.final_repeats * search.per_token(
        likely_finalists
    )
    n1 = search.tokens_for(search.remaining(), per_token, n0, plan.long_tokens)
    search.log(f"round 2: {len(survivors)} shapes x {n1} tokens")
    search.run(ar, 1, n1)
    for r in survivors:
        search.run(r, 1, n1)
    # round 2: repeats for the finalists, interleaved with the baseline
    finalists = _rank(survivors, 1)[: plan.finalists]
    search.log(f"round 3: {len(finalists)} finalists x {plan.final_repeats} repeats")
    for _ in range(plan.final_repeats):
        for r in [ar, *finalists]:
            search.run(r, 2, n1)


def _finish(
    search: _Search, ar: ShapeResult, results: list[ShapeResult], plan: SearchPlan
) -> SearchResult:
    """Pick the best shape among those that reached the furthest round, and decide."""
    best = None
    for round_index in (2, 1, 0):
        ranked = [r for r in _rank(results, round_index) if r.last_round == round_index]
        if ranked:
            best = max(ranked, key=lambda r: r.spread().median)
            break
    wins, reason = _decide(ar, best, plan)
    recommended = best.shape if (wins and best is not None) else BeamShape.autoregressive()
    return SearchResult(
        autoregressive=ar,
        results=results,
        best=best,
        recommended=recommended,
        speculation_wins=wins,
        reason=reason,
        elapsed_s=search.clock() - search.start,
        budget_s=search.budget_s,
    )
