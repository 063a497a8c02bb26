"""Stateful draft sources under a changing shape (``engine/drafting/sources.py``, "Sources that
sit out steps"): a draft model's or an early-exit adapter's cache is caught up on the committed text
of the steps that did not run it, so the loop may switch them off and on mid-answer (the
adaptive chooser, ``engine/loop/adaptive.py``), solo and batched, with rows joining while the
source is off; greedy output stays plain decoding's."""

import json

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.drafting import early_exit
from redrafter_mlx.engine.drafting.draft_model import prefill as draft_prefill
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import DRAFT_MODEL, EARLY_EXIT, catch_up_chunk
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.verifier.entries import cache_slots
from tests.support.loop import Scripted
from tests.support.models import run_decode, state_slot, tiny_model
from tests.support.sources import (
    assert_rows_plain,
    drive,
    fake_draft_measure,
    plain,
    random_pair,
    rows_of,
    source_cache,
    transparent_pair,
)
from tests.support.tuning import invoke
from tuning import tuned_choice
from tuning.profiles import ProfileStore

PROMPTS = [[1, 5, 9, 3, 5, 9, 1, 5], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2]]
D = BeamShape.parse("D1xL4")
# the source off for 1, then 3, then 9 steps (9 > a catch-up chunk of 8), and on beside
# lookup and alone
CYCLE = [D, AR, D, AR, AR, AR, BeamShape.parse("K1xL5"), D, *[AR] * 9, D, D]


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "rows-joining"])
def test_the_target_as_its_own_draft_accepts_everything_whenever_it_is_back(batched):
    """The target as its own draft, switched off and on by a scripted policy: every step of
    it accepts all its drafts (a draft cache left behind by the steps without it would
    draft wrong tokens: without the catch-up this fails), and every row equals plain
    decoding, rows that joined while it was off included."""
    model = tiny_model(5, vocab=48, layers=2)
    policy = Scripted(CYCLE)
    batch = BatchGenerator(model, held_sources(None, model), policy, max_batch=4)
    waves = [(PROMPTS[:1], 40)]
    if batched:
        waves += [(PROMPTS[1:2], 30), (PROMPTS[2:], 30)]
    rows, got = drive(batch, waves, steps_between=4)
    assert_rows_plain(model, got, waves)
    full = [c for shape, counts in policy.told if shape == D for c in counts]
    assert len(full) >= 5 and sum(c == 4 for c in full) >= len(full) - len(rows)  # a cut last
    assert batch.stepping.catch_ups >= 3


def test_without_the_catch_up_the_draft_falls_behind(monkeypatch):
    """The control: with the loop's catch-up switched off, the same script loses drafts
    (so the test above can fail)."""
    model = tiny_model(5, vocab=48, layers=2)
    policy = Scripted(CYCLE)
    batch = BatchGenerator(model, held_sources(None, model), policy, max_batch=1)
    monkeypatch.setattr(batch.stepping, "catch_up", lambda shape, window: None)
    drive(batch, [(PROMPTS[:1], 40)])
    full = [c for shape, counts in policy.told if shape == D for c in counts]
    assert sum(c < 4 for c in full) >= 2


@pytest.mark.parametrize("kind", ["draft-model", "early-exit"])
def test_after_the_catch_up_the_cache_equals_a_fresh_prefill(kind):
    """After steps without the source (plain decoding, lookup), the catch-up queued before
    its next step leaves its cache equal, at every committed slot, to a fresh prefill of
    the committed text; before it, it differs."""
    if kind == "draft-model":
        model = tiny_model(5, vocab=48, layers=2)
        draft, drafter, on = tiny_model(9, vocab=48, layers=1), None, D
        sid = DRAFT_MODEL
    else:
        model, drafter = random_pair(3)
        draft, on, sid = None, BeamShape.parse("W1xL4"), EARLY_EXIT
    cycle = [on, AR, AR, BeamShape.parse("K1xL5"), AR, AR]
    batch = BatchGenerator(model, held_sources(drafter, draft), Scripted(cycle), max_batch=1)
    batch.reset()
    batch.insert(
        Prefill(PROMPTS[:1], SamplerConfig(), 0, Session(model, 1), rows=rows_of(PROMPTS[:1], 200))
    )
    for _ in cycle:  # each step of the cycle queued once, the last ones without the source
        batch.next()
    batch.settle()
    n = int(batch.state.lengths[0])
    text = batch.state.history[0, :n].tolist()
    slots = cache_slots(batch.state.cache)
    if kind == "draft-model":
        fresh = draft_prefill(draft, [text], slots)[0][0][0]
    else:
        fresh = early_exit.prefill(model, drafter, [text], slots)[0][0][0]
    assert not mx.allclose(source_cache(batch, sid, 0)[:, :n], fresh[:, :n], atol=1e-4).item()
    assert batch.batch_state.behind[state_slot(batch, sid)] > 5
    batch.stepping.catch_up(on, slots)
    assert mx.allclose(source_cache(batch, sid, 0)[:, :n], fresh[:, :n], atol=1e-4).item()


def test_the_behind_bound_follows_the_shapes_queued():
    """The host's bound: a step of the source leaves its ``covers``; a step without adds its
    longest candidate (plain decoding: 1); a catch-up runs only above ``covers``."""
    model = tiny_model(5, vocab=48, layers=2)
    lookup = BeamShape.parse("K1xL5")
    batch = BatchGenerator(model, held_sources(None, model), Scripted([D]), max_batch=1)
    drive(batch, [(PROMPTS[:1], 6)])
    batch.batch_state.behind[state_slot(batch, DRAFT_MODEL)] = 0
    window = cache_slots(batch.state.cache)
    batch.stepping.catch_up(D, window)  # D1xL4 alone re-runs 1 committed token itself
    assert (
        batch.batch_state.behind[state_slot(batch, DRAFT_MODEL)] == 1
        and batch.stepping.catch_ups == 0
    )
    batch.stepping.catch_up(None, window)
    batch.stepping.catch_up(lookup, window)
    assert batch.batch_state.behind[state_slot(batch, DRAFT_MODEL)] == 1 + 1 + 5
    batch.stepping.catch_up(D, window)
    assert (
        batch.stepping.catch_ups == 1
        and batch.batch_state.behind[state_slot(batch, DRAFT_MODEL)] == 1
    )
    assert [catch_up_chunk(n) for n in (1, 5, 8, 9, 100)] == [4, 8, 8, 16, 64]


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "rows-joining"])
def test_an_early_exit_source_switched_off_and_on_keeps_greedy_output(batched):
    """An early-exit adapter as the drafter under a script that leaves it out for 1 to 9
    steps: every row equals plain decoding (random adapter), rows joining while it is off
    included."""
    model, adapter = random_pair(3)
    on, both = BeamShape.parse("W1xL4"), BeamShape.parse("W1xL3+K1xL6")
    cycle = [on, AR, both, AR, AR, AR, BeamShape.parse("K1xL5"), on, *[AR] * 9, on]
    batch = BatchGenerator(model, held_sources(adapter), Scripted(cycle), max_batch=4)
    waves = [(PROMPTS[:1], 40)]
    if batched:
        waves += [(PROMPTS[1:], 30)]
    _, got = drive(batch, waves, steps_between=4)
    assert_rows_plain(model, got, waves)
    assert batch.stepping.catch_ups >= 2


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "rows-joining"])
def test_an_early_exit_adapter_and_a_draft_model_switched_off_and_on(batched):
    """Both stateful sources held at once (the adapter's state, then the draft model's),
    a script running each alone, both, neither and lookup for 1 to 9 steps: every row
    equals plain decoding; the target as its own draft accepts its whole chain on every
    step that runs it (a state left behind by steps without it would not), and both
    sources were caught up."""
    model, adapter = random_pair(3)
    E, ED = BeamShape.parse("W1xL3"), BeamShape.parse("W1xL3+K1xL5+D1xL4")
    cycle = [ED, AR, E, D, AR, AR, AR, BeamShape.parse("K1xL5"), ED, *[AR] * 9, D, E, ED]
    policy = Scripted(cycle)
    batch = BatchGenerator(model, held_sources(adapter, model), policy, max_batch=4)
    assert [s.source_id for s in batch.batch_state.stateful] == [EARLY_EXIT, DRAFT_MODEL]
    waves = [(PROMPTS[:1], 40)]
    if batched:
        waves += [(PROMPTS[1:2], 30), (PROMPTS[2:], 30)]
    rows, got = drive(batch, waves, steps_between=4)
    assert_rows_plain(model, got, waves)
    chained = [c for shape, counts in policy.told if shape.model_length for c in counts]
    assert chained and sum(c >= 4 for c in chained) >= len(chained) - 2 * len(rows)
    assert batch.stepping.catch_ups >= 2


def test_adaptive_generation_chooses_among_a_draft_models_shapes():
    """``generate_steps`` with a draft model adapts (no pin): its candidates include the
    draft model's chain alone and merged, and also shapes without it; the run switches
    between them and greedy output stays plain decoding's."""
    model = tiny_model(5, vocab=48, layers=2)
    shape = BeamShape.parse("K1xL5+D1xL3")
    costs = {AR: 1.0}
    adapt = Adaptive(step_cost=lambda s: costs.get(s, 1.5), every=2, probe=3)
    got, _ = run_decode(
        model, None, PROMPTS, max_tokens=40, shape=shape, draft_model=model, adapt=adapt
    )
    assert got == plain(model, PROMPTS, 40)
    shapes = adapt.chooser.shapes
    assert {s.label for s in shapes} >= {"AR", "K1×L5+D1×L3", "D1×L3", "K1×L5"}
    ran = set(adapt.history)
    assert any(s.model_length for s in ran) and AR in ran


def test_adaptive_generation_with_an_early_exit_adapter_is_not_pinned():
    model, adapter = transparent_pair()
    adapt = Adaptive(step_cost=lambda s: 1.0 if s == AR else 1.2, every=2, probe=3)
    got, _ = run_decode(
        model, adapter, PROMPTS, max_tokens=40, shape=BeamShape.parse("W1xL4+K1xL5"), adapt=adapt
    )
    assert got == plain(model, PROMPTS, 40)
    assert len(set(adapt.history)) >= 2 and AR in adapt.chooser.shapes


def test_adaptive_generation_with_an_early_exit_adapter_and_a_draft_model():
    """Both stateful sources in an adaptive run: the chooser switches among shapes with
    either, both and neither; greedy output stays plain decoding's."""
    model, adapter = random_pair(3)
    costs = {AR: 1.0}
    adapt = Adaptive(step_cost=lambda s: costs.get(s, 1.2), every=2, probe=3)
    shape = BeamShape.parse("W1xL3+K1xL5+D1xL3")
    got, stats = run_decode(
        model, adapter, PROMPTS, max_tokens=40, shape=shape, draft_model=model, adapt=adapt
    )
    assert got == plain(model, PROMPTS, 40)
    ran = set(adapt.history)
    assert any(s.model_length for s in ran) and any(s.drafts for s in ran)
    assert stats["source_tokens"]["draft_model"] > 0


def test_the_chooser_offers_the_draft_models_shapes():
    labels = [s.label for s in Adaptive().candidates(BeamShape.parse("W1xL4+K1xL8+D1xL4"))]
    assert labels[:5] == ["AR", "W1×L4+K1×L8+D1×L4", "D1×L4", "K1×L8+D1×L4", "W1×L4+D1×L4"]
    assert "W1×L4+K1×L8" in labels and "K1×L8" in labels  # and without the draft model
    assert [s.label for s in Adaptive().candidates(D)] == ["AR", "D1×L4"]


# --------------------------------------------------------------------------- tune


def test_the_tune_grid_holds_the_draft_models_chains():
    from redrafter_mlx.cli.tune import grid_for

    shapes, _ = grid_for("1-2", "3", None, "drafter", False, None, [1], [8], [3, 4])
    labels = [s.label for s in shapes]
    assert labels[:2] == ["D1×L3", "D1×L4"]  # the chain alone first
    for base in ("K1×L8", "W1×L3", "W2×L3+K1×L8"):
        assert {base, f"{base}+D1×L3", f"{base}+D1×L4"} <= set(labels)
    assert len(labels) == len(set(labels)) == 2 + 3 * 5
    lookup_alone, _ = grid_for("1", "3", None, None, False, None, [1], [8], [4])
    assert [s.label for s in lookup_alone] == ["D1×L4", "K1×L8", "K1×L8+D1×L4"]
    one_chain, note = grid_for("1-3", "3-4", None, "d", False, None, [], [], [], early_exit=True)
    assert {s.width for s in one_chain} == {1} and "one chain" in note


def test_tune_with_a_draft_model_lists_and_picks_its_shapes(cli_app, home, model_dir, monkeypatch):
    """``tune --draft-model``: the chain alone and beside the lookup chains are measured and
    listed; where the draft model drafts well the profile (keyed by the draft model) holds
    a shape with its chain and names the sources it runs."""
    loaded = fake_draft_measure(monkeypatch)
    args = ("--model", model_dir, "--draft-model", model_dir, "--draft-length", "3-4", "--json")
    result = invoke(cli_app, *args)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    labels = {row["label"] for row in data["shapes"]}
    assert {"AR", "D1×L3", "D1×L4", "K1×L8+D1×L4", "K1×L4"} <= labels
    assert loaded == [data["draft_model"]] and data["draft_model"]
    recommended = BeamShape.parse(data["recommended"]["label"])
    assert recommended.model_length and "draft_model" in data["sources"]
    store = ProfileStore().load()
    (profile,) = store.values()
    assert profile.shape == recommended and "draft_model" in profile.sources
    assert profile.key.draft_model != "none"
    assert tuned_choice(model_dir, None, None) is None  # not the profile of the model alone
    bad = invoke(cli_app, "--model", model_dir, "--draft-model", model_dir, "--draft-length", "1")
    assert bad.exit_code == 2 and "--draft-length" in bad.stderr


def test_the_server_adapts_with_a_draft_model():
    """The scheduler no longer pins a draft model's shape: its batches choose among shapes
    with and without the chain (rows joining mid-way), every row equal to plain decoding."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    model = tiny_model(5, vocab=48, layers=2)
    draft = tiny_model(9, vocab=48, layers=1)
    adapt = Adaptive(step_cost=lambda s: 1.0 if s == AR else 1.3, every=2, probe=3)
    shape = BeamShape.parse("K1xL5+D1xL3")
    sched = Scheduler(model, None, shape, (), max_batch=2, adapt=adapt, draft_model=draft)
    assert sched.choice is not None
    prompts = [*PROMPTS, [4, 4, 4]]
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        assert sink.tokens == plain(model, [prompt], 16 + 4 * i)[0], i
    ran = set(sched.choice.ran)
    assert any(s.model_length for s in ran) and len(ran) >= 2


def test_a_long_catch_up_runs_in_chunks_and_rebuilds_the_whole_cache():
    """A catch-up longer than one chunk (80 missed tokens: two chunks of 64, the second
    mostly padding past the length) from an empty draft cache equals a fresh prefill; the
    positions are each row's last ``count`` from 0 in a shorter row."""
    from redrafter_mlx.engine.drafting.draft_model import DraftModelSource
    from redrafter_mlx.engine.drafting.sources import DraftContext, catch_up_positions

    lengths = mx.array([80, 30], mx.int32)
    chunks = catch_up_positions(lengths, 80)
    assert [c.shape for c in chunks] == [(2, 64), (2, 64)]
    assert chunks[0][:, 0].tolist() == [0, 0] and chunks[1][:, 0].tolist() == [64, 64]
    assert catch_up_positions(mx.array([50]), 8)[0].tolist() == [list(range(42, 50))]
    model = tiny_model(5, vocab=48, layers=2)
    draft = tiny_model(9, vocab=48, layers=1)
    text = [(7 * i + 3) % 48 for i in range(80)]
    slots = 256
    history = mx.array([text + [0] * (slots - 80)], mx.int32)
    empty = draft.make_cache(1, slots)
    ctx = DraftContext(model, None, mx.array([1]), mx.array([80]), history, slots, own=empty)
    state, cache = DraftModelSource(draft, 4, 2).catch_up(ctx, 80)
    fresh = draft_prefill(draft, [text], slots)[0]
    assert cache is None
    assert mx.allclose(state[0].keys[:, :, :80], fresh.keys[:, :, :80], atol=1e-4).item()
