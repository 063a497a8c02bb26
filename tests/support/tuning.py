"""The tuner under test: a fake chip whose lookup chains are accepted; ``tune`` run in-process."""

from __future__ import annotations

from typer.testing import CliRunner

from redrafter_mlx.engine.core.shape import BeamShape
from tests.support.fakes import FakeChip


class LookupChip(FakeChip):
    """:class:`FakeChip` whose lookup chains are accepted with probability ``lookup_accept``
    per depth (the text repeats itself) beside the drafter's beams: a depth is reached when
    some beam or chain long enough survives to it."""

    def __init__(self, clock, *, lookup_accept=0.0, **kwargs):
        super().__init__(clock, **kwargs)
        self.lookup_accept = lookup_accept

    def tokens_per_step(self, shape: BeamShape) -> float:
        total = 1.0
        beams = shape.width if shape.drafts else 0
        for depth in range(1, shape.longest):
            miss = (1 - self.accept**depth) ** (beams if depth < shape.length else 0)
            chains = shape.lookup if depth < shape.chain_length else 0
            miss *= (1 - self.lookup_accept**depth) ** chains
            total += 1 - miss
        return total


def invoke(app, *args):
    prefix = ["tune"] if len(app.registered_commands) > 1 else []
    return CliRunner().invoke(app, [*prefix, *args], env={"COLUMNS": "200"})
