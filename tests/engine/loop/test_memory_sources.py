"""The memory check counts what the loop really holds (``engine/loop/memory.py``, issue 49): the
early-exit adapter's own K/V cache and a draft model's, for every row as the batch grows,
and for a request with parallel branches the rows its branches can grow to."""

from __future__ import annotations

import mlx.core as mx
import pytest

import redrafter_mlx.engine.loop.memory as memory
from redrafter_mlx.engine.core.branches import BranchRules
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import (
    Session,
    ensure_slots,
    prefill_session,
    step_window,
    text_history,
)
from redrafter_mlx.engine.decoding.decode import DecodeState
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.draft_model import prefill as draft_prefill
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs
from redrafter_mlx.engine.drafting.early_exit_chain import prefill as early_exit_prefill
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.memory import (
    ShapeTooLarge,
    check_step_memory,
    run_memory,
)
from tests.support.models import run_decode, step_added_peak, tiny_model
from tests.support.sources import TOKENS, held_cache


def adapter_for(model, layers=1):
    args = EarlyExitArgs.for_target(model.args, 1)
    args.num_layers = layers
    return EarlyExitAdapter(args)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("source", ["early-exit", "early-exit-2", "draft", "self-draft"])
def test_the_estimate_counts_every_cache_the_loop_holds(source, rows):
    """The estimate's resident cache is what the loop allocates for that many rows: the
    early-exit adapter's cache (per adapter layer) and a draft model's, besides the
    target's; none of them left out as the batch grows."""
    model = tiny_model(3, vocab=48, layers=3)
    drafter = draft = None
    if source.startswith("early-exit"):
        drafter = adapter_for(model, 2 if source.endswith("2") else 1)
        shape = BeamShape.parse("W1xL4+K1xL4")
    else:
        draft = model if source == "self-draft" else tiny_model(4, vocab=48, layers=2, hidden=16)
        shape = BeamShape.parse("K1xL4+D1xL4")
    held = held_cache(model, drafter, shape, rows, draft)
    estimate = check_step_memory(model, held_sources(drafter, draft), shape, rows, TOKENS)
    assert held <= estimate.cache <= 1.01 * held, (held, estimate.cache)


def test_an_early_exit_shape_that_fits_alone_is_refused_for_its_adapter_cache():
    """A budget that holds the target's cache but not the adapter's beside it refuses the
    early-exit shape (it named no row count before: the adapter cache was left out)."""
    model = tiny_model(3, vocab=48, layers=2)
    adapter = adapter_for(model, 4)  # an adapter cache twice the target's
    shape = BeamShape.parse("W1xL4")
    without = check_step_memory(model, held_sources(), BeamShape.lookup_only(1, 4), 8, TOKENS)
    budget = (without.total + held_cache(model, None, AR, 8) // 2, "the test's budget")
    with pytest.raises(ShapeTooLarge, match="for 8 rows"):
        check_step_memory(model, held_sources(adapter), shape, 8, TOKENS, available=budget)


def test_branches_are_counted_as_the_rows_they_can_grow_to(monkeypatch):
    """A request with parallel branches can hold ``max_branches`` rows: a budget that fits
    one row but not eight refuses it before anything runs, and the same request without
    branches runs."""
    model = tiny_model(3, vocab=48, layers=2)
    rules = BranchRules(46, 47, max_branches=8)
    prompt, n = [1, 2, 3], 40
    one = check_step_memory(model, held_sources(), AR, 1, len(prompt) + n)
    eight = check_step_memory(model, held_sources(), AR, 8, len(prompt) + n)
    assert eight.total > one.total
    limit = (one.total + eight.total) // 2
    monkeypatch.setattr(memory, "available_memory", lambda: (limit, "the test's budget"))
    with pytest.raises(ShapeTooLarge, match="for 8 rows"):
        run_decode(model, None, [prompt], max_tokens=n, shape=AR, branches=rules)
    assert not model.__dict__.get("_batch_steps")  # refused before compiling
    tokens, _ = run_decode(model, None, [prompt], max_tokens=n, shape=AR)
    assert len(tokens[0]) == n


def step_peak(model, drafter, shape, batch, sampler, draft_model=None, prompt=40):
    """The peak memory one compiled step of ``shape`` adds (compiled and run once first),
    its draft sources' caches prefilled, and the attention window it used."""
    rows = [[(7 * i + r) % model.vocab_size for i in range(prompt)] for r in range(batch)]
    session = Session(model, batch)
    hidden = prefill_session(session, session.reuse(rows))
    window = step_window(prompt, 1, shape.longest, shape.slots)
    sources = ()
    if drafter is not None:
        sources += (early_exit_prefill(model, drafter, rows, session.slots),)
    if draft_model is not None:
        sources += (draft_prefill(draft_model, rows, session.slots),)
    history = text_history(rows, session.slots)
    init = mx.full((batch,), 3, mx.int32)
    state = DecodeState(init, hidden, session.lengths, session.cache, history, sources)
    state = ensure_slots(state, window)
    session.cache = None
    step = uniform_step(model, held_sources(drafter, draft_model), shape, sampler, batch)
    return step_added_peak(step, state, window), window


@pytest.mark.parametrize("label, batch", [("W1xL4", 4), ("W1xL7+K1xL8", 2), ("D1xL4", 4)])
def test_the_estimate_bounds_the_measured_step_of_each_source(label, batch):
    """The transient estimate is at least an early-exit or draft-model step's measured peak
    and at most 4x it (as ``test_guards`` checks for the drafter and lookup)."""
    model = tiny_model(vocab=4096, hidden=64, layers=3, heads=4, kv_heads=2)
    shape = BeamShape.parse(label)
    drafter = adapter_for(model) if shape.drafts else None
    draft = tiny_model(5, vocab=4096, hidden=64, layers=2) if shape.model_length else None
    sampler = SamplerConfig(temperature=0.8, top_p=0.9)
    peak, window = step_peak(model, drafter, shape, batch, sampler, draft)
    held = held_sources(drafter, draft)
    estimate = run_memory(model, held, shape, batch, window, sampling=True)
    assert peak > 0.3e6  # large enough for the bound to mean something
    assert peak <= estimate.step <= 4 * peak, (peak, estimate.step)
