"""The loop's parts, each built and run alone (``engine/loop/batch.py``'s module docstring):
the batch's state (``BatchState``), prompt processing (``PromptProcessing``), stepping
(``Stepping``) and the optional branching part (``Branches``), and the orchestrator that
composes them holding no branching part while no row may branch. Sources are resolved
once (``held.held_sources``) and the compiled step is found again from sources resolved
anew (``held.sources_key``)."""

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.branches import BranchRules, BranchTree, Fork
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.drafting.held import held_sources, sources_key
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.batch_choice import FixedShape
from redrafter_mlx.engine.loop.batch_state import BatchState
from redrafter_mlx.engine.loop.branch_rows import Branches
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.engine.loop.prefilling import Prefill, PromptProcessing
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.engine.loop.stepping import Stepping
from redrafter_mlx.engine.verifier.entries import cache_slots
from tests.support.models import tiny_drafter, tiny_model

PROMPTS = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4]]


def rows_of(prompts, limit=16, tree=None):
    return [Row(SamplerConfig(), limit, len(p), RowStats(len(p)), tree=tree) for p in prompts]


def prefilled(model, prompts, rows):
    """A ``Prefill`` run to its end: (job, first tokens, next keys)."""
    job = Prefill(prompts, SamplerConfig(), 0, Session(model, len(prompts)), rows=rows)
    while not job.complete:
        job.advance()
    return (job, *job.first_token(model))


def joined_state(model, prompts, max_batch=4, adopt=False):
    """A ``BatchState`` alone with ``prompts``' rows joined (placed, or adopted)."""
    state = BatchState(model, held_sources(), max_batch)
    if not adopt:
        state.reset()
    rows = rows_of(prompts)
    job, first, keys = prefilled(model, prompts, rows)
    state.join(rows, job.session, job.hidden, first, keys, adopt=adopt)
    return state, rows, first


# ------------------------------------------------------------------------ the batch state


def test_the_batch_state_places_rows_and_keeps_their_parameters_until_invalidated():
    model = tiny_model(0)
    state, rows, _ = joined_state(model, PROMPTS)
    assert [r.slot for r in rows] == [0, 1] and state.rows[:2] == rows and len(state.rows) == 2
    assert state.state.lengths.tolist() == [len(p) for p in PROMPTS]
    grants = [False] * len(state.rows)
    params = state.row_params(grants)
    assert state.row_params(grants) is params  # kept
    state.invalidate()
    again = state.row_params(grants)
    assert again is not params and again[1].tolist() == params[1].tolist()


def test_the_batch_state_adopts_a_session_and_frees_and_regrows_rows():
    model = tiny_model(0)
    state, rows, _ = joined_state(model, PROMPTS, adopt=True)
    keys = [e.keys[1:2] for e in state.state.cache]  # row 1's cache before the re-lays
    mx.eval(keys)
    state.free(rows[0])
    assert state.rows[0] is None and state.state.lengths.tolist() == [0, len(PROMPTS[1])]
    assert state.cache_slot(rows[0]) == 0  # no step written since it left
    state.fit()  # a quarter or less in use: not yet (1 of 2)
    assert len(state.rows) == 2
    state.resize(1)  # the active row first
    assert state.rows == [rows[1]] and rows[1].slot == 0 and state.cache_slot(rows[0]) is None
    assert all(
        mx.array_equal(k[0:1], want).item()
        for k, want in zip((e.keys for e in state.state.cache), keys)
    )
    slot = state.free_slot()  # none free: grown to the next bucket
    assert slot == 1 and len(state.rows) == 2 and state.resizes == 2


def test_the_batch_state_seats_a_copy_of_a_row():
    model = tiny_model(0)
    state, rows, _ = joined_state(model, PROMPTS[:1])
    parent = rows[0]
    child = rows_of([PROMPTS[0]])[0]
    c = state.free_slot()
    state.seat(child, c, parent, state.end_of(parent))
    assert child.slot == c != parent.slot and state.rows[c] is child
    lengths = state.state.lengths.tolist()
    assert lengths[c] == lengths[parent.slot] == len(PROMPTS[0])
    n = len(PROMPTS[0])
    for k in (e.keys for e in state.state.cache):
        assert mx.array_equal(k[c, :, :n], k[parent.slot, :, :n]).item()


# ------------------------------------------------------------------------ prompt processing


def test_prompt_processing_yields_each_complete_prefill_and_fails_one_alone():
    model = tiny_model(0)
    state = BatchState(model, held_sources(), 4)
    state.reset()
    prompts = PromptProcessing(model, state)
    good = Prefill(PROMPTS[:1], SamplerConfig(), 0, Session(model, 1), rows=rows_of(PROMPTS[:1]))
    bad = Prefill(PROMPTS[1:], SamplerConfig(), 0, Session(model, 1), rows=rows_of(PROMPTS[1:]))

    def broken():
        raise RuntimeError("this prefill's own fault")

    bad.advance = broken
    prompts.insert(bad)
    prompts.insert(good)
    assert prompts.rows_waiting == 2 and state._params is None  # an admission invalidates
    failed = []
    ready = list(prompts.ready(None, failed))
    assert [job for job, _ in ready] == [good] and prompts.prefills == []
    assert [job for job, _ in failed] == [bad] and "own fault" in str(failed[0][1])
    first, keys = ready[0][1]
    assert len(first) == 1 and keys.shape == (1, 2)


def test_a_prefill_whose_join_raises_stays_queued():
    model = tiny_model(0)
    state = BatchState(model, held_sources(), 4)
    prompts = PromptProcessing(model, state)
    job = Prefill(PROMPTS[:1], SamplerConfig(), 0, Session(model, 1), rows=rows_of(PROMPTS[:1]))
    prompts.insert(job)
    for got, _ in prompts.ready(None, []):
        assert got is job
        break  # the caller's join raised: the prefill is not taken off the queue
    assert prompts.prefills == [job]


# ------------------------------------------------------------------------ stepping


def test_stepping_queues_and_reads_a_step_over_the_batch_state():
    model = tiny_model(0)
    state, _, first = joined_state(model, PROMPTS)
    stepping = Stepping(state, FixedShape(AR))
    queued = stepping.queue([False] * len(state.rows))
    assert stepping.inflight == 1 and queued.owners == tuple(state.rows) and queued.shape is None
    got = stepping.read(queued)
    assert stepping.inflight == 0 and got.counts == [1, 1]
    # the same rows decoded by the whole loop give the same next token
    batch = BatchGenerator(model, held_sources(), FixedShape(AR), max_batch=4)
    batch.reset()
    batch.insert(Prefill(PROMPTS, SamplerConfig(), 0, Session(model, 2), rows=rows_of(PROMPTS)))
    turn = batch.next(budget=None)
    assert [g.new for g in turn.joined] == [[t] for t in first]
    stepped = batch.next().stepped
    assert [g.new[0] for g in stepped] == [t[0] for t in got.tokens]


def test_the_catch_up_bound_is_the_batch_states():
    """A stateful source (the model as its own draft) left out of a step falls behind by
    that step's tokens in ``BatchState.behind``; stepping reads and writes it there."""
    model = tiny_model(5, vocab=48, layers=2)
    state = BatchState(model, held_sources(None, model), 1)
    state.reset()
    stepping = Stepping(state, FixedShape(AR))
    window = cache_slots(state.state.cache)
    stepping.catch_up(None, window)
    stepping.catch_up(BeamShape.lookup_only(1, 5), window)
    assert state.behind == [1 + 5] and stepping.catch_ups == 0


def test_sources_resolved_again_find_the_compiled_step():
    """A second generation (a chat turn) resolves its sources anew from the same modules:
    the same ``sources_key``, the same compiled step, no tracing."""
    model = tiny_model(0)
    drafter = tiny_drafter(model)
    assert held_sources(drafter) is not held_sources(drafter)
    assert sources_key(held_sources(drafter)) == sources_key(held_sources(drafter))
    assert sources_key(held_sources(drafter)) != sources_key(held_sources(tiny_drafter(model)))
    shape = BeamShape(2, 3)

    def generate():
        return list(generate_steps(model, drafter, [PROMPTS[0]], max_tokens=12, shape=shape))

    generate()
    steps = list(model._batch_steps.values())
    traces = [step.counter["traces"] for step in steps]
    assert sum(traces) > 0
    generate()
    assert list(model._batch_steps.values()) == steps  # none compiled anew
    assert [step.counter["traces"] for step in steps] == traces  # none retraced


def test_below_the_boundary_a_drafter_is_refused_with_the_fix():
    model = tiny_model(0)
    with pytest.raises(TypeError, match=r"held\.held_sources\(drafter, draft_model\)"):
        BatchGenerator(model, tiny_drafter(model), FixedShape(AR))


# ------------------------------------------------------------------------ branching


def test_a_loop_without_a_branching_row_holds_no_branching_part(monkeypatch):
    model = tiny_model(0)
    for name in ("grow", "past_budget", "fork_grants", "queue_ahead", "seat"):
        monkeypatch.setattr(Branches, name, lambda *a, **k: pytest.fail("branching called"))
    batch = BatchGenerator(model, held_sources(), FixedShape(AR), max_batch=2)
    batch.reset()
    batch.insert(Prefill(PROMPTS, SamplerConfig(), 0, Session(model, 2), rows=rows_of(PROMPTS)))
    while batch.active or batch.prefills:
        batch.next()
    assert batch.branches is None and batch.waiting == [] and batch.reserved == 0


def test_a_branching_row_brings_the_branching_part_in():
    model = tiny_model(0)
    batch = BatchGenerator(model, held_sources(), FixedShape(AR), max_batch=2)
    batch.reset()
    tree = BranchTree(BranchRules(30, 31))
    rows = rows_of(PROMPTS[:1], tree=tree)
    batch.insert(Prefill(PROMPTS[:1], SamplerConfig(), 0, Session(model, 1), rows=rows))
    assert isinstance(batch.branches, Branches)


def test_the_branching_part_alone_forks_a_row_into_a_free_slot():
    model = tiny_model(0)
    rules = BranchRules(30, 31, max_branches=2)
    state = BatchState(model, held_sources(), 2)
    state.reset()
    tree = BranchTree(rules)
    rows = rows_of(PROMPTS[:1], tree=tree)
    job, first, keys = prefilled(model, PROMPTS[:1], rows)
    state.join(rows, job.session, job.hidden, first, keys, adopt=False)
    branches = Branches(state, PromptProcessing(model, state))
    parent = rows[0]
    assert branches.fork_grants(state.rows, None) == [True]  # the root may fork
    child = branches.fork(parent, Fork(parent=0, child=1, prefix_len=1))
    assert child in state.rows and child.slot != parent.slot and child.forced == 31
    assert parent.family == [parent, child] and branches.waiting == []
    assert state.state.lengths.tolist()[child.slot] == len(PROMPTS[0])
    assert branches.stop_waiting(child) is False and branches.reserved(None) == 0
