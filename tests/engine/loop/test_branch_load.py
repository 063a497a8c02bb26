"""A branching request's answer does not depend on what else the batch runs: a child with no
free row waits for one (its parent goes on, or hands it its own row on leaving), never a fork
refused for want of rows, so each request's text under load, in a small batch or a full
one, is the text it gives alone."""

import pytest

from redrafter_mlx.engine.base.platform import READ_FIRST_ENV
from redrafter_mlx.engine.core.branches import BranchTree
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.branch_rows import Branches
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.branching import (
    EOS,
    FORK,
    PROMPT,
    RULES,
    Collector,
    check_branches,
    drain,
    forking_sampler,
    model_and_drafter,
    run_batch,
)

PROMPTS = [PROMPT, [9, 8, 7, 6, 5], [4, 4, 2]]
SHAPE = BeamShape(2, 3)


def alone(model, drafter, prompt, sampler, seed=0, limit=12, shape=SHAPE) -> list[int]:
    """The request's answer decoded alone, with rows to spare for every branch."""
    request = [(prompt, sampler, seed, limit, True)]
    roots, _, _ = run_batch(model, drafter, shape, request, budget=True)
    assert len(roots[0].tree.branches) > 2, "the test needs forks"
    return roots[0].tree.linear()


def serve(model, drafter, requests, max_batch, limit=12) -> tuple[list[Collector], Scheduler]:
    """``requests`` [(prompt, sampler)] submitted at once to a scheduler of ``max_batch`` rows,
    run to the end; each request's events."""
    sched = Scheduler(model, drafter, SHAPE, [EOS], max_batch=max_batch, branches=RULES)
    sinks = [Collector() for _ in requests]
    for (prompt, sampler), sink in zip(requests, sinks):
        sched.submit(Request(prompt, limit, sink, sampler))
    drain(sched)
    assert not sched.batch.waiting and not sched.batch.active
    return sinks, sched


def waits(monkeypatch) -> list[int]:
    """Records, per ``Branches.seat``, how many children were waiting."""
    seen = []
    seat = Branches.seat

    def recording(self):
        seen.append(len(self.waiting))
        return seat(self)

    monkeypatch.setattr(Branches, "seat", recording)
    return seen


@pytest.mark.parametrize("read_first", ["1", "0"], ids=["read-first", "queue-ahead"])
def test_copies_of_a_request_in_a_full_batch_answer_as_it_does_alone(monkeypatch, read_first):
    """Four copies of each of three greedy list requests, twelve at once in four rows (the
    server's --max-batch 4): every answer is its request's alone."""
    monkeypatch.setenv(READ_FIRST_ENV, read_first)
    model, drafter = model_and_drafter()
    want = {tuple(p): alone(model, drafter, p, forking_sampler()) for p in PROMPTS}
    seen = waits(monkeypatch)
    requests = [(p, forking_sampler(seed=0)) for p in PROMPTS * 4]
    sinks, sched = serve(model, drafter, requests, 4)
    assert max(seen) > 0  # children did wait for rows
    for (prompt, _), sink in zip(requests, sinks):
        assert sink.tokens == want[tuple(prompt)], prompt
        assert [e.finish for e in sink.events if e.finish is not None] == ["length"]
    assert sched.stats.requests_done == len(requests)


def test_a_request_alone_in_a_small_batch_answers_as_in_a_large_one(monkeypatch):
    """One request in one, two and three rows: with fewer rows than branches its children
    wait (in one row each takes its parent's row as the parent leaves), and its answer
    and every branch equal those with rows to spare."""
    model, drafter = model_and_drafter()
    sampler = forking_sampler()
    want = alone(model, drafter, PROMPT, sampler)
    seen = waits(monkeypatch)
    for max_batch in (1, 2, 3):
        sinks, sched = serve(model, drafter, [(PROMPT, forking_sampler(seed=0))], max_batch)
        assert sinks[0].tokens == want, max_batch
        assert len(sched.batch.rows) <= max_batch
        assert sinks[0].events[-1].stats.branches > max_batch
    assert max(seen) > 1


@pytest.mark.parametrize("shape", [AR, SHAPE], ids=["ar", "drafter"])
def test_branches_that_waited_equal_plain_decoding_of_their_own_rows(shape):
    """Sampled with a repetition penalty, two rows for two requests: each branch, however
    long it waited, draws what its own row draws alone (the key, text and lengths of its
    fork, kept while it waited)."""
    model, drafter = model_and_drafter()
    sampler = forking_sampler(temperature=0.8, repetition_penalty=1.5, repetition_context_size=6)
    other = [9, 8, 7, 6, 5]
    requests = [(PROMPT, sampler, 7, 12, True), (other, sampler, 5, 12, True)]
    roots, _, batch = run_batch(model, drafter, shape, requests, max_batch=2)
    assert len(batch.rows) <= 2 and not batch.waiting
    reference_shape = shape if shape.drafts else None
    check_branches(model, drafter, reference_shape, roots[0], PROMPT, sampler, 7, 12)
    check_branches(model, drafter, reference_shape, roots[1], other, sampler, 5, 12)
    for root, (prompt, _, seed, limit, _) in zip(roots, requests):
        solo, _, _ = run_batch(model, drafter, shape, [(prompt, sampler, seed, limit, True)])
        assert root.tree.linear() == solo[0].tree.linear()


def test_a_cancelled_request_leaves_no_waiting_child(monkeypatch):
    """A request cancelled while two of its children wait for rows (the one that would take
    its parent's row, and one that would wait on that one): none runs, its rows free, and
    the request beside it answers as it does alone."""
    model, drafter = model_and_drafter()
    want = alone(model, drafter, [4, 4, 2], forking_sampler())
    sched = Scheduler(model, drafter, SHAPE, [EOS], max_batch=2, branches=RULES)
    cancelled, kept = Collector(), Collector()
    doomed = Request(PROMPT, 12, cancelled, forking_sampler(seed=0))
    sched.submit(doomed)
    sched.submit(Request([4, 4, 2], 12, kept, forking_sampler(seed=0)))
    for _ in range(200):
        sched.run_once()
        if sum(w.row.owner.request is doomed for w in sched.batch.waiting) > 1:
            break
    else:
        raise AssertionError("no two children of the request waited")
    doomed.cancelled.set()
    drain(sched)
    assert not sched.batch.waiting and not sched.batch.active
    assert kept.tokens == want
    assert sched.stats.requests_cancelled == 1


def test_an_answer_that_reached_its_budget_finishes_length_however_its_branches_stopped():
    """Under load a detail past the answer's end may run to its EOS before the budget
    stops it (its start known too late): every branch then stops at EOS, yet the answer
    is cut at its budget as alone, so it finishes ``"length"``, as alone."""
    tree = BranchTree(RULES, budget=3)
    root = Row(forking_sampler(), 20, 3, RowStats(3), tree=tree)
    child = Row(forking_sampler(), 20, 3, RowStats(3), tree=tree, branch=1, family=root.family)
    root.family.append(child)
    assert tree.extend(0, [5, FORK]).fork is not None
    tree.extend(0, [6])
    tree.extend(1, [7, 8])
    for row in root.family:
        tree.finish(row.branch)
        row.finished, row.finish = True, "stop"
    assert tree.linear() == [5, 7, 8]  # of [5, 7, 8, 6]
    assert root.request_finish == "length"
    tree.budget = 4
    assert root.request_finish == "length"  # exactly its budget, as a plain answer's
    tree.budget = 5
    assert root.request_finish == "stop"
