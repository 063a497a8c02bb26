"""The server's scheduler with branching on: each request's branches are rows of the batch,
its events stream the rebuilt text in order, one finish event comes once every branch has,
and its stats count every branch's tokens."""

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.rows import Row
from redrafter_mlx.serve.app import _Run
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.branching import (
    EOS,
    PROMPT,
    RULES,
    Collector,
    drain,
    forking_sampler,
    model_and_drafter,
    run_batch,
)


def test_requests_stream_their_rebuilt_text_and_count_every_branch():
    model, drafter = model_and_drafter()
    shape = BeamShape(2, 3)
    sched = Scheduler(model, drafter, shape, [EOS], max_batch=64, branches=RULES)
    prompts = [PROMPT, [9, 8, 7, 6, 5], [4, 4, 2]]
    sinks = [Collector() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        sched.submit(Request(prompt, 10, sink, forking_sampler(seed=0)))
    drain(sched)
    for prompt, sink in zip(prompts, sinks):
        request = [(prompt, forking_sampler(), 0, 10, True)]
        roots, _, _ = run_batch(model, drafter, shape, request, budget=True)
        tree = roots[0].tree
        assert sink.tokens == tree.linear()
        finishes = [e.finish for e in sink.events if e.finish is not None]
        assert len(finishes) == 1 and sink.events[-1].finish is not None
        stats = sink.events[-1].stats
        assert stats.branches == len(tree.branches) > 1
        # every row's tokens, as the loop alone counts them (split tokens included; a child
        # stopped at the answer's end before its first step never drew its child token)
        emitted = sum(row.stats.generated for row in roots[0].family)
        assert stats.generated == emitted >= len(tree.linear())
        assert stats.to_dict()["branches"] == len(tree.branches)
    assert sched.batch.active == [] and sched.stats.requests_done == len(prompts)
    assert len(sched.batch.rows) <= 64


def test_usage_counts_every_branch_token():
    class Stats:
        branches, generated = 3, 40

    run = _Run.__new__(_Run)
    run.request = Request([1, 2, 3], 10, lambda e: None)
    run.tokens, run.stats = 25, Stats()
    assert run.usage()["completion_tokens"] == 40
    Stats.branches = 0
    assert run.usage()["completion_tokens"] == 25
    assert Row  # the batch row type the scheduler builds per branch


def test_a_full_batch_seats_every_fork_within_its_rows():
    """Three branching requests in four rows: forks wait for free rows (never past
    ``max_batch``, nor past requests admitted meanwhile), each request ends once."""
    model, drafter = model_and_drafter()
    sched = Scheduler(model, drafter, BeamShape(2, 3), [EOS], max_batch=4, branches=RULES)
    sinks = [Collector() for _ in range(3)]
    for prompt, sink in zip([PROMPT, [9, 8, 7, 6, 5], [4, 4, 2]], sinks):
        sched.submit(Request(prompt, 10, sink, forking_sampler(seed=0)))
    widest = 0
    for _ in range(2000):
        busy = sched.active_rows or sched.batch.pending is not None or sched.queue.qsize()
        if not busy and not sched.batch.prefills:
            break
        sched.run_once()
        widest = max(widest, len(sched.batch.rows))
    assert widest <= 4
    for sink in sinks:
        assert [e.finish is not None for e in sink.events].count(True) == 1
        assert 30 not in sink.tokens and 31 not in sink.tokens
    assert any(s.events[-1].stats.branches > 1 for s in sinks)
