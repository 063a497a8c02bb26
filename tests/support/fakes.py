"""Fakes: a deterministic cost model and clock, to test the tuner with no engine and no
sleeping (tests/tuning/test_search.py; handy for trying the search in a REPL), and a
scheduler that answers every request with known token ids, to test what the server makes of
a model's text (tool calls, reasoning) that no tiny random model writes by itself.
"""

from __future__ import annotations

import random
from collections import Counter

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.rows import RowStats
from tuning.search import Measurement


class FakeClock:
    """A clock that only moves when the fake model says time passed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeChip:
    """Speculative decoding cost model of an imaginary chip.

    Step time grows with the packed tokens and doubles once W*L reaches ``knee`` (as on
    M1 Max / M2 Ultra); each draft token is accepted with probability ``accept`` per depth,
    and W beams give W chances. Samples carry a seeded multiplicative jitter of ``noise``.
    """

    def __init__(
        self,
        clock: FakeClock,
        *,
        base_step=0.020,
        per_token=0.0015,
        knee=16,
        accept=0.7,
        noise=0.01,
        warmup_overhead=0.5,
        samples_per_call=2,
        seed=0,
    ):
        self.clock = clock
        self.base_step = base_step
        self.per_token = per_token
        self.knee = knee
        self.accept = accept
        self.noise = noise
        self.warmup_overhead = warmup_overhead
        self.samples_per_call = samples_per_call
        self.rng = random.Random(seed)
        self.calls: Counter = Counter()
        self.tokens: Counter = Counter()

    def tokens_per_step(self, shape: BeamShape) -> float:
        """Expected tokens per step: 1 + sum over depths of P(some beam survives to it)."""
        total = 1.0
        for depth in range(1, shape.length):
            total += 1 - (1 - self.accept**depth) ** shape.width
        return total

    def step_time(self, shape: BeamShape) -> float:
        """Seconds per verification step."""
        packed = (
            shape.max_packed if shape.capacity is None else min(shape.capacity, shape.max_packed)
        )
        t = self.base_step + self.per_token * packed
        return 2 * t if shape.width * shape.length >= self.knee else t

    def tokens_per_s(self, shape: BeamShape) -> float:
        """True (noise-free) speed of ``shape``."""
        return self.tokens_per_step(shape) / self.step_time(shape)

    def __call__(self, shape: BeamShape, n_tokens: int) -> Measurement:
        """The measure function: advance the clock and return jittered samples."""
        first = self.calls[shape] == 0
        self.calls[shape] += 1
        self.tokens[shape] += n_tokens
        true = self.tokens_per_s(shape)
        self.clock.advance((self.warmup_overhead if first else 0.0) + n_tokens / true)
        samples = tuple(
            true * (1 + self.rng.uniform(-self.noise, self.noise))
            for _ in range(self.samples_per_call)
        )
        return Measurement(samples, (self.tokens_per_step(shape),) * len(samples))

    def best(self, shapes: list[BeamShape]) -> BeamShape:
        """The truly fastest of ``shapes``."""
        return max(shapes, key=self.tokens_per_s)


class ScriptedScheduler:
    """The server's scheduler, as ``create_app`` uses it, answering every request with
    ``answer`` (token ids) in steps of ``step`` tokens, then ``finish`` (or, with ``error``,
    an engine failure: status 500); ``requests`` holds the requests it was given (their
    prompts; ``cancelled``: the server ended one)."""

    branches = None

    def __init__(
        self, answer: list[int], step: int = 3, finish: str = "stop", error: str | None = None
    ):
        self.answer, self.step, self.finish, self.error = answer, step, finish, error
        self.requests: list = []

    def submit(self, request) -> None:
        from redrafter_mlx.serve.requests import Event

        self.requests.append(request)
        stats = RowStats(len(request.prompt))
        for i in range(0, len(self.answer), self.step):
            request.sink(Event(self.answer[i : i + self.step], stats))
        if self.error is not None:
            request.sink(Event([], stats, error=self.error, status=500))
        else:
            request.sink(Event([], stats, finish=self.finish))

    def start(self, *args, **kwargs) -> None:
        pass

    def begin_drain(self, grace: float) -> None:
        pass

    def stop(self) -> None:
        pass

    def health(self) -> dict:
        return {"failure": None, "draining": False}


class FakeGroup:
    """What the loader and the CLI ask of a group before any message is sent."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = lambda: size, lambda: rank
