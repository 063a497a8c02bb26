"""One run builder (``engine/loop/run.py``) for ``generate_steps`` and the server's scheduler: the
same sources, policy and rows, so a server request ends as the same request run by
``generate_steps`` does, including why (``"context"`` when the model's context cuts it)."""

import asyncio

import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.batch_choice import BatchChoice, FixedShape, SoloChoice
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.rows import RowStats
from redrafter_mlx.engine.loop.run import Run, make_row
from redrafter_mlx.serve.app import _Run
from redrafter_mlx.serve.requests import Event
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.models import tiny_drafter, tiny_model

CONTEXT = 40
PROMPT = [1] * 30  # 10 tokens of room left in the context


class Collector:
    def __init__(self):
        self.tokens, self.last = [], None

    def __call__(self, event):
        self.tokens += event.tokens
        self.last = event


def solo(model, drafter, shape, max_tokens) -> tuple[list[int], str]:
    """(tokens, finish) of ``PROMPT`` run by ``generate_steps``."""
    out, finish = [], None
    for ev in generate_steps(model, drafter, [PROMPT], max_tokens=max_tokens, shape=shape):
        out += ev.tokens[0]
        finish = ev.finish[0]
    return out, finish


def served(model, drafter, shape, max_tokens) -> tuple[list[int], str]:
    """(tokens, finish) of ``PROMPT`` as one server request."""
    sched = Scheduler(model, drafter, shape, max_batch=2)
    sink = Collector()
    sched.submit(Request(PROMPT, max_tokens, sink))
    for _ in range(1000):
        if sink.last is not None and sink.last.done:
            return sink.tokens, sink.last.finish
        sched.run_once()
    raise AssertionError("the request did not finish")


@pytest.mark.parametrize("speculative", [False, True])
def test_a_server_request_cut_by_the_context_finishes_context_as_generate_steps_does(speculative):
    model = tiny_model(0, max_position_embeddings=CONTEXT)
    drafter = tiny_drafter(model) if speculative else None
    shape = BeamShape(2, 4) if speculative else BeamShape.autoregressive()
    for max_tokens, why in ((100, "context"), (10, "length"), (5, "length")):
        alone = solo(model, drafter, shape, max_tokens)
        assert alone[1] == why and len(alone[0]) == min(max_tokens, CONTEXT - len(PROMPT))
        assert served(model, drafter, shape if speculative else None, max_tokens) == alone


def test_a_row_stops_at_its_cap_for_the_reason_that_set_it():
    model = tiny_model(0, max_position_embeddings=CONTEXT)
    sampler = SamplerConfig()
    row = make_row(model, sampler, len(PROMPT), 100)
    assert (row.limit, row.at_limit, row.length, row.tree) == (10, "context", 30, None)
    row = make_row(model, sampler, len(PROMPT), 10, owner="mine")
    assert (row.limit, row.at_limit, row.owner) == (10, "length", "mine")


def test_both_clients_drop_a_drafter_their_shape_does_not_draft_with():
    model = tiny_model(0)
    drafter = tiny_drafter(model)
    lookup_only = BeamShape(0, 0, lookup=1, lookup_length=4)
    parts = [s.part for s in Run.of(model, drafter, None, lookup_only).sources]
    assert parts == ["lookup"]  # the drafter's beams dropped
    sched = Scheduler(model, drafter, lookup_only)
    assert [s.part for s in sched.batch.sources] == ["lookup"]
    drafting = Run.of(model, drafter, None, BeamShape(2, 4, lookup=1, lookup_length=4))
    assert [s.part for s in drafting.sources] == ["beams", "lookup"]  # kept where it drafts
    with pytest.raises(ValueError, match="a drafter needs a beam shape"):
        Run.of(model, drafter, None, None)


def test_the_policy_follows_how_the_rows_come_and_go():
    model = tiny_model(0)
    drafter = tiny_drafter(model)
    run = Run.of(model, drafter, None, BeamShape(2, 4))
    sampler = SamplerConfig()
    assert isinstance(run.policy(False, "requests"), FixedShape)
    assert isinstance(run.policy(True, "fixed", sampler), SoloChoice)
    assert isinstance(run.policy(True, "requests"), BatchChoice)
    mine = Adaptive()
    assert run.policy(mine, "branches", sampler).adapt is mine
    learnt = run.policy(True, "branches", sampler)
    assert run.policy(True, "branches", sampler) is learnt  # kept on the model
    plain = Run.of(model, None, None, None)
    assert isinstance(plain.policy(True, "requests"), FixedShape)
    with pytest.raises(ValueError, match="rows must be one of"):
        run.policy(True, "sometimes")


def test_the_wire_reports_a_context_cut_as_openai_length():
    """OpenAI's ``finish_reason`` has no ``"context"``: its ``"length"`` covers a cut by the
    model's context; the log keeps the engine's reason."""

    async def run():
        events = asyncio.Queue()
        events.put_nowait(Event([], RowStats(3), finish="context"))
        r = _Run(Request([1, 2, 3], 64, sink=lambda ev: None), events, _NoText(), None)
        got = [finish async for _, finish in r.pieces(None)]
        return got, r.finish

    assert asyncio.run(run()) == (["length"], "context")


class _NoText:
    """A text stream double: no stop strings, no text."""

    tokens = 0

    def add(self, tokens):
        return "", False

    def finish(self):
        return ""
