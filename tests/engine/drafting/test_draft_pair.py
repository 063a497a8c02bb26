"""Every draft source in one tree (issue 49): the draft slot holding a draft model and an
early-exit adapter at once (the draft slot as ``(M, EE)``, ``--draft-model M --draft-model EE``),
each proposing its own chain of the shape's ``D1×L`` length beside the recurrent drafter's
beams and the lookup chains. Greedy output equals plain decoding (batched, solo, switched
off and on, adaptive); both held states equal a fresh prefill of the committed text
whichever source won; sampling stays exact (chi-square, with its power check); the memory
check, the profile, ``load`` and the CLI take the pair; two adapters, two draft models or an
adapter in both slots are clear errors."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import mlx.core as mx
import pytest

import redrafter_mlx.engine.decoding.decode as decode
from redrafter_mlx.engine.core.footprint import Dims, commit_bytes, pack_bytes, step_memory
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.draft_model import DraftModelSource
from redrafter_mlx.engine.drafting.draft_model import prefill as prefill_draft
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitSource, save_adapter
from redrafter_mlx.engine.drafting.early_exit_chain import prefill as prefill_ee
from redrafter_mlx.engine.drafting.held import held_sources, slot_modules
from redrafter_mlx.engine.drafting.sources import (
    DRAFT_MODEL,
    DRAFTER,
    EARLY_EXIT,
    LOOKUP,
    SOURCE_NAMES,
    stateful,
)
from redrafter_mlx.engine.drafting.sources import step_candidates as held_candidates
from redrafter_mlx.engine.drafting.sources import step_capacity as held_capacity
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.loading import LoadError, draft_slot_paths, load
from redrafter_mlx.engine.loop.memory import check_step_memory
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.verifier.entries import cache_slots
from redrafter_mlx.measure.profile import profile_steps, weight_bytes
from redrafter_mlx.train import early_exit as EE
from tests.support.cli import invoke, run_json
from tests.support.loop import Scripted
from tests.support.models import (
    VICUNA_TOKENIZER,
    OracleDrafter,
    greedy_prefilled,
    near_bigram_model,
    run_decode,
    save_drafter_dir,
    save_model_dir,
    state_slot,
    step_sources,
    tiny_drafter,
    tiny_model,
)
from tests.support.sources import (
    PROMPTS,
    REPEATING,
    TOKENS,
    assert_rows_plain,
    bigram_pair,
    drive,
    held_cache,
    plain,
    random_pair,
    rows_of,
    source_cache,
    states_follow_the_text,
    transparent_bigram,
)


def other_draft(vocab=48):
    """A small draft model over the target's vocabulary (not the target)."""
    return tiny_model(9, vocab=vocab, layers=1)


def a_pair(itself: bool):
    """(target, recurrent drafter, the draft pair): a random target and adapter, the draft
    model the target itself or another small model."""
    model, adapter = random_pair(3)
    draft = model if itself else other_draft()
    return model, tiny_drafter(model, 12), (draft, adapter)


# --------------------------------------------------------------------------- the slot


def step_capacity(shape, draft, drafter=None) -> int:
    return held_capacity(shape, held_sources(drafter, draft))


def step_candidates(shape, draft, drafter=None) -> int:
    return held_candidates(shape, held_sources(drafter, draft))


def ids(held) -> list[int]:
    return [s.source_id for s in stateful(held)]


def test_what_the_draft_slot_holds():
    """The draft slot holds a draft model and an adapter in either order; the loop holds
    the adapter's state, then the draft model's; ``slot_modules`` reads every kind of slot;
    two adapters, or an adapter as the drafter beside one in the slot, are the both-slots
    error."""
    model, adapter = random_pair()
    other, drafter = other_draft(), tiny_drafter(model, 12)
    pair = (other, adapter)
    assert [m is p for m, p in zip(slot_modules(pair), (other, adapter))] == [True, True]
    assert len(slot_modules(adapter)) == 1 and slot_modules(None) == ()
    held = stateful(held_sources(drafter, pair))
    assert held[0].adapter is adapter and held[1].draft is other
    assert ids(held_sources(drafter, (adapter, other))) == ids(held_sources(drafter, pair))
    with pytest.raises(ValueError, match="both as the drafter and as the draft model"):
        held_sources(None, (adapter, adapter))
    with pytest.raises(ValueError, match="both as the drafter and as the draft model"):
        held_sources(adapter, pair)
    assert ids(held_sources(drafter, pair)) == [EARLY_EXIT, DRAFT_MODEL]
    assert ids(held_sources(None, pair)) == [EARLY_EXIT, DRAFT_MODEL]
    assert ids(held_sources(drafter, other)) == [DRAFT_MODEL]
    assert ids(held_sources(drafter, adapter)) == [EARLY_EXIT]


def kinds(sources):
    return [(type(s).__name__, s.length, getattr(s, "refresh", getattr(s, "catchup", 0)))
            for s in sources]  # fmt: skip


def test_the_sources_of_a_pair():
    """``step_sources``: after the drafter's beams and the lookup chains, the adapter's chain
    (refreshed over the longest other candidate, the draft model's chain included), then
    the draft model's (caught up over every source before it, the adapter's chain
    included), both of the shape's ``model_length``; a shape without ``D1×L`` runs neither.
    Every other slot builds what it built before the pair."""
    model, adapter = random_pair()
    other, drafter = other_draft(), tiny_drafter(model, 12)
    pair = (other, adapter)
    shape = BeamShape.parse("W1xL4+K1xL6+D1xL3")
    sources = step_sources(shape, drafter, pair)
    assert kinds(sources) == [("DrafterSource", 4, 0), ("LookupSource", 6, 0),
                              ("EarlyExitSource", 3, 6), ("DraftModelSource", 3, 6)]  # fmt: skip
    assert sources[2].adapter is adapter and sources[3].draft is other
    assert [s.source_id for s in sources if s.stateful] == [EARLY_EXIT, DRAFT_MODEL]
    alone = step_sources(BeamShape.parse("D1xL4"), None, pair)
    assert kinds(alone) == [("EarlyExitSource", 4, 4), ("DraftModelSource", 4, 4)]
    assert not [s for s in step_sources(BeamShape.parse("W1xL4+K1xL6"), drafter, pair)
                if s.stateful]  # fmt: skip
    # the other slots, as before the pair
    assert kinds(step_sources(shape, drafter, adapter))[-1] == ("EarlyExitSource", 3, 6)
    assert kinds(step_sources(shape, drafter, other))[-1] == ("DraftModelSource", 3, 6)
    both = step_sources(BeamShape.parse("W1xL4+K1xL6+D1xL3"), adapter, other)
    assert kinds(both) == [("EarlyExitSource", 4, 6), ("LookupSource", 6, 0),
                           ("DraftModelSource", 3, 6)]  # fmt: skip


def test_a_pairs_step_has_room_for_both_chains():
    """``step_capacity``: a pair's step packs both D chains (``max_packed`` counts one), an
    asked capacity stands, and any other slot packs the shape's own slots."""
    _, adapter = random_pair()
    pair = (other_draft(), adapter)
    shape = BeamShape.parse("W1xL4+K1xL6+D1xL3")
    assert step_capacity(shape, pair) == shape.max_packed + 2 == 1 + 3 + 5 + 2 + 2
    assert step_capacity(shape, adapter) == step_capacity(shape, None) == shape.slots
    assert step_capacity(BeamShape.parse("W1xL4+K1xL6+D1xL3 C6"), pair) == 6
    assert step_capacity(BeamShape.parse("W1xL4+K1xL6"), pair) == 1 + 3 + 5


# --------------------------------------------------------------------------- greedy identity

SHAPES = ["W1xL4+K1xL6+D1xL4", "W2xL3+D1xL4", "D1xL3", "W1xL3+K1xL5+D1xL3 C6"]


@pytest.mark.parametrize("itself", [False, True], ids=["other-draft", "target-as-draft"])
@pytest.mark.parametrize("label", SHAPES)
def test_greedy_output_equals_plain_decoding_batched_and_solo(label, itself):
    """A recurrent drafter, lookup, the adapter's chain and the draft model's chain in one
    tree: every row equals plain decoding, batched and each row alone, and every accepted
    draft counts for some source. The target as its own draft proposes the target's greedy
    text: it is accepted whole (both chains get their slots: without the pair's room the
    ``D1×L3`` tree verified the adapter's chain alone), whatever the adapter drafts."""
    model, drafter, pair = a_pair(itself)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=24, shape=shape,
                            draft_model=pair, adapt=False)  # fmt: skip
    assert got == want
    by = stats["source_tokens"]
    assert set(by) == set(SOURCE_NAMES) and sum(by.values()) == stats["accepted_tokens"]
    if itself:
        assert by["draft_model"] >= 0.85 * stats["accepted_tokens"] > 0
        if shape.capacity is None:  # whole chains but for the cut ends
            assert stats["tokens_per_step"] > shape.model_length - 0.5
    else:
        assert by["early_exit"] > 0
    for r, prompt in enumerate(PROMPTS[:2]):
        solo, _ = run_decode(model, drafter, [prompt], max_tokens=24, shape=shape,
                             draft_model=pair, adapt=False)  # fmt: skip
        assert solo[0] == want[r]


def test_the_drafter_and_the_target_as_its_own_draft_both_win_steps():
    """A near-exact drafter beam of 6 tokens beside the target as its own draft (an exact
    chain of 3) and a random adapter's chain: the drafter wins the steps where it is right
    further, the draft model the others; output is plain decoding's."""
    model, adapter = bigram_pair()
    prompts = [[1, 5, 9, 3], [2, 7, 7, 4, 1]]
    want = plain(model, prompts, 40)
    shape = BeamShape.parse("W1xL6+K1xL6+D1xL3")
    got, stats = run_decode(model, OracleDrafter(model, noise=0.1), prompts, max_tokens=40,
                            shape=shape, draft_model=(model, adapter),
                            adapt=False)  # fmt: skip
    assert got == want
    by = stats["source_tokens"]
    assert by["drafter"] > 0 and by["draft_model"] > 0
    assert sum(by.values()) == stats["accepted_tokens"]


def test_an_exact_adapter_wins_beside_another_draft_model():
    """A target transparent past the exit with an eta-0 adapter (its chain is the target's
    greedy text) beside another draft model and a near-exact drafter beam of 6: the
    adapter's and the drafter's drafts are accepted, each counted for its own source."""
    model, adapter = transparent_bigram()
    prompts = [[1, 5, 9, 3], [2, 7, 7, 4, 1]]
    want = plain(model, prompts, 40)
    pair = (near_bigram_model(5, vocab=32, layers=1), adapter)
    got, stats = run_decode(model, OracleDrafter(model, noise=0.1), prompts, max_tokens=40,
                            shape=BeamShape.parse("W1xL6+D1xL3"), draft_model=pair,
                            adapt=False)  # fmt: skip
    assert got == want
    by = stats["source_tokens"]
    assert by["early_exit"] > 0 and by["drafter"] > 0
    assert sum(by.values()) == stats["accepted_tokens"]


# --------------------------------------------------------------------------- the held states


@pytest.mark.parametrize(
    "label, kind",
    [
        ("W1xL4+K1xL6+D1xL3", "other"),
        ("W1xL4+K1xL6+D1xL3", "itself"),
        ("D1xL4", "itself"),
        ("D1xL4", "exact-adapter"),
    ],
)
def test_both_states_hold_the_committed_text_whichever_source_won(label, kind):
    """Steps of the pair (with the drafter and lookup, or its two chains alone): after
    each, the next draft's adapter refresh and the draft model's catch-up leave both states
    equal to a fresh prefill of the committed text, whichever source's path was accepted:
    several sources win steps; in D1×L4 the target as its own draft wins them all (the
    adapter's refresh must cover the draft model's chain), or an exact adapter does (the
    draft model's catch-up must cover the adapter's chain)."""
    model, adapter = transparent_bigram() if kind == "exact-adapter" else bigram_pair()
    draft = model if kind == "itself" else near_bigram_model(5, vocab=32, layers=1)
    pair = (draft, adapter)
    shape = BeamShape.parse(label)
    drafter = OracleDrafter(model, noise=0.0) if shape.drafts else None
    slots = 128
    own = [prefill_ee(model, adapter, [REPEATING], slots), prefill_draft(draft, [REPEATING], slots)]
    state = greedy_prefilled(model, REPEATING, slots, own)
    step = uniform_step(
        model, held_sources(drafter, pair), shape, SamplerConfig(), 1, compiled=False
    )
    sources = step_sources(shape, drafter, pair)
    ee, dm = sources[-2], sources[-1]
    assert isinstance(ee, EarlyExitSource) and isinstance(dm, DraftModelSource)
    checks = [
        (ee, 0, lambda text: prefill_ee(model, adapter, text, slots)),
        (dm, 1, lambda text: prefill_draft(draft, text, slots)),
    ]
    won = states_follow_the_text(model, step, state, slots, 10, checks)
    if shape.drafts:
        assert len(won) >= 2 and won & {DRAFTER, LOOKUP}, won
    assert {"itself": DRAFT_MODEL, "exact-adapter": EARLY_EXIT}.get(kind, DRAFTER) in won


WD = BeamShape.parse("W1xL3+K1xL5+D1xL3")
W, D, K = BeamShape.parse("W1xL3"), BeamShape.parse("D1xL3"), BeamShape.parse("K1xL5")
CYCLE = [WD, AR, W, D, AR, AR, AR, K, WD, *[AR] * 9, D, W, WD]


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "rows-joining"])
def test_the_pair_switched_off_and_on(batched):
    """A script running the drafter with and without the pair's chains, the chains alone,
    lookup and plain decoding for 1 to 9 steps: every row equals plain decoding (rows that
    joined while the chains were off included); the target as its own draft accepts its
    whole chain on the steps that run it (a state left behind would not), and both states
    were caught up."""
    model, drafter, pair = a_pair(itself=True)
    policy = Scripted(CYCLE)
    batch = BatchGenerator(model, held_sources(drafter, pair), policy, max_batch=4)
    assert (
        ids(batch.sources) == [EARLY_EXIT, DRAFT_MODEL]
        and batch.batch_state.stateful[1].draft is model
    )
    waves = [(PROMPTS[:1], 40)]
    if batched:
        waves += [(PROMPTS[1:2], 30), (PROMPTS[2:], 30)]
    rows, got = drive(batch, waves, steps_between=4)
    assert_rows_plain(model, got, waves)
    chained = [c for shape, counts in policy.told if shape.model_length for c in counts]
    assert chained and sum(c >= 3 for c in chained) >= len(chained) - 2 * len(rows)
    assert batch.stepping.catch_ups >= 4  # both states, at least twice each


def test_after_the_catch_up_both_states_equal_a_fresh_prefill():
    """After steps without the pair's chains (the drafter alone, lookup, plain decoding)
    the catch-up queued before their next step leaves the adapter's and the draft model's
    states equal to a fresh prefill of the committed text; before it, both differ."""
    model, drafter, pair = a_pair(itself=False)
    cycle = [WD, AR, W, K, AR, W]
    batch = BatchGenerator(model, held_sources(drafter, pair), Scripted(cycle), max_batch=1)
    batch.reset()
    session = Session(model, 1)
    batch.insert(Prefill(PROMPTS[:1], SamplerConfig(), 0, session, rows=rows_of(PROMPTS[:1], 200)))
    for _ in cycle:
        batch.next()
    batch.settle()
    n = int(batch.state.lengths[0])
    text = batch.state.history[0, :n].tolist()
    slots = cache_slots(batch.state.cache)
    fresh = {
        EARLY_EXIT: prefill_ee(model, pair[1], [text], slots)[0][0][0],
        DRAFT_MODEL: prefill_draft(pair[0], [text], slots)[0][0][0],
    }
    for sid, want in fresh.items():
        assert not mx.allclose(source_cache(batch, sid, 0)[:, :n], want[:, :n], atol=1e-4)
        assert batch.batch_state.behind[state_slot(batch, sid)] > WD.longest
    batch.stepping.catch_up(WD, slots)
    for sid, want in fresh.items():
        assert mx.allclose(source_cache(batch, sid, 0)[:, :n], want[:, :n], atol=1e-4), sid


def test_adaptive_generation_with_the_pair():
    """An adaptive run chooses among shapes with and without the pair's chains and the
    drafter's beams; greedy output stays plain decoding's and the draft model's chain is
    accepted."""
    model, drafter, pair = a_pair(itself=True)
    costs = {AR: 1.0}
    adapt = Adaptive(step_cost=lambda s: costs.get(s, 1.2), every=2, probe=3)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=40, shape=WD, draft_model=pair,
                            adapt=adapt)  # fmt: skip
    assert got == plain(model, PROMPTS, 40)
    ran = set(adapt.history)
    assert any(s.model_length for s in ran) and any(not s.model_length for s in ran)
    assert stats["source_tokens"]["draft_model"] > 0


def test_the_server_takes_the_pair():
    """Rows join mid-way (more requests than rows, adaptive): each equals plain decoding."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    model, drafter, pair = a_pair(itself=False)
    prompts = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2], [4, 4]]
    sched = Scheduler(model, drafter, WD, (), max_batch=2, adapt=True, draft_model=pair)
    assert ids(sched.batch.sources) == [EARLY_EXIT, DRAFT_MODEL]
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        assert sink.tokens == plain(model, [prompt], 16 + 4 * i)[0], i


# --------------------------------------------------------------------------- sampling


@pytest.mark.slow
def test_four_sources_in_one_tree_sampling_is_exact(monkeypatch):
    """The recurrent drafter's beam, a lookup chain, the adapter's chain and a draft model's
    chain in one tree (``tests/engine/drafting/test_sources_exact.py``'s chi-square of the
    first 3 tokens, 3,000 rows): exact; and the same rows are rejected when the verifier trusts
    the first candidate's first draft (the test's power against a source-shaped bias)."""
    from tests.support.sampling import chi_square_pvalue, exact_joint, sample_counts
    from tests.support.sources import HOT, N, draft_model_for, early_exit_pair

    model, adapter = early_exit_pair()
    pair = (draft_model_for(model), adapter)
    shape = BeamShape.parse("W1xL3+K1xL3+D1xL4")
    drafter = OracleDrafter(model, noise=0.2)

    def sample():
        return sample_counts(model, drafter, HOT, N, seed=59, shape=shape, adapt=False,
                             draft_model=pair)  # fmt: skip

    counts, stats = sample()
    by = stats["source_tokens"]
    for name in ("drafter", "early_exit", "draft_model"):
        assert by[name] > 0.05 * N, (name, by)  # each source's drafts are really tested
    assert chi_square_pvalue(counts, exact_joint(model, HOT), N) > 1e-3
    real = decode.accept_phase

    def trusting(beams, target, unpacker, capacity):
        target = mx.concatenate([beams[:, 0, 1:2], target[:, 1:]], axis=1)
        return real(beams, target, unpacker, capacity)

    monkeypatch.setattr(decode, "accept_phase", trusting)
    model.__dict__.pop("_batch_steps", None)  # the compiled steps hold the real verifier
    counts, _ = sample()
    assert chi_square_pvalue(counts, exact_joint(model, HOT), N) < 1e-3


# --------------------------------------------------------------------------- memory, profile


@pytest.mark.parametrize("rows", [1, 4])
def test_the_memory_check_counts_both(rows):
    """The pair costs what its two parts cost: the adapter's weights and cache as the
    adapter alone in the slot, the draft model's as the draft model alone (no second copy
    of the target as its own draft); the estimate's cache is what the loop holds."""
    model, adapter = random_pair(3)
    drafter, other = tiny_drafter(model, 12), tiny_model(4, vocab=48, layers=2, hidden=16)
    pair = (other, adapter)
    shape = BeamShape.parse("W1xL4+K1xL4+D1xL4")
    held = held_cache(model, drafter, shape, rows, pair)
    estimate = check_step_memory(model, held_sources(drafter, pair), shape, rows, TOKENS)
    assert held <= estimate.cache <= 1.01 * held, (held, estimate.cache)
    alone = check_step_memory(
        model, held_sources(drafter), shape.runnable(True, False), rows, TOKENS
    )
    with_adapter = check_step_memory(model, held_sources(drafter, adapter), shape, rows, TOKENS)
    with_model = check_step_memory(model, held_sources(drafter, other), shape, rows, TOKENS)
    added = (with_adapter.weights - alone.weights) + (with_model.weights - alone.weights)
    assert estimate.weights - alone.weights == added > with_adapter.weights - alone.weights > 0
    assert estimate.cache > max(with_adapter.cache, with_model.cache)
    itself = check_step_memory(model, held_sources(drafter, (model, adapter)), shape, rows, TOKENS)
    assert itself.weights == with_adapter.weights


def test_the_step_estimate_packs_and_commits_both_chains():
    """A pair's step packs two D chains (``step_candidates``): the packing's working set and
    the commit's margin count the second, which ``BeamShape.beams`` does not; a chain alone
    (``D1×L4`` with one source in the slot) commits in place, a pair's two chains do not."""
    model, adapter = random_pair(3)
    other = tiny_model(4, vocab=48, layers=2, hidden=16)
    pair = (other, adapter)
    tree = BeamShape.parse("W2xL4+K1xL4+D1xL4")
    assert step_candidates(tree, pair) == tree.beams + 1 == 5
    assert step_candidates(tree, other) == step_candidates(tree, adapter) == tree.beams
    assert step_candidates(tree.runnable(True, False), pair) == 3  # no D chain: none added
    d = Dims.of(model)
    for shape in (tree, BeamShape.parse("D1xL4")):
        s, n = replace(shape, capacity=step_capacity(shape, pair)), step_candidates(shape, pair)
        assert pack_bytes(s, 2, n) >= pack_bytes(s, 2), shape.label
    chain = BeamShape.parse("D1xL4")  # one chain packs as is; the pair's two are a tree
    s, n = replace(chain, capacity=step_capacity(chain, pair)), step_candidates(chain, pair)
    assert pack_bytes(s, 2) == 0 < pack_bytes(s, 2, n)
    assert step_memory(d, s, 2, 64, candidates=n).step > step_memory(d, s, 2, 64).step
    assert commit_bytes(d, chain, 2, 64) == 0
    assert commit_bytes(d, chain, 2, 64, step_candidates(chain, pair)) > 0


def test_the_profile_prices_and_prefills_both():
    """``bench --profile``: both states prefilled and the step profiled with both chains
    packed; the adapter priced as in the slot alone, the draft model as alone."""
    model, adapter = random_pair(3)
    drafter, other = tiny_drafter(model, 12), other_draft()
    pair = (other, adapter)
    got = weight_bytes(model, held_sources(drafter, pair), None)
    as_adapter = weight_bytes(model, held_sources(drafter, adapter), None)
    as_model = weight_bytes(model, held_sources(drafter, other), None)
    assert (got.chain_once, got.chain_step) == (as_adapter.chain_once, as_adapter.chain_step)
    assert got.draft_model == as_model.draft_model > 0
    shape = BeamShape.parse("W1xL3+D1xL4")
    sources = held_sources(drafter, pair)
    data = profile_steps(model, sources, [shape], [1, 2, 3, 1, 2], repeats=1, loop_tokens=6,
                         loop_rounds=1)  # fmt: skip
    ar, row = data["rows"]
    assert row["step_kernels"] > ar["step_kernels"] > 0
    assert (row["chain_steps"], row["chain_refreshes"], row["draft_model_forwards"]) == (3, 1, 3)
    assert row["capacity"] == 1 + 2 + 3 + 3  # both chains packed


# --------------------------------------------------------------------------- loading, CLI


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{model, drafter, ee, ee2, other}: a random target, its recurrent drafter, two
    early-exit adapters and another draft model sharing its tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    model = tiny_model(seed=4, vocab=32000, hidden=32, layers=2)
    save_model_dir(model, root / "model", VICUNA_TOKENIZER)
    save_model_dir(tiny_model(seed=6, vocab=32000, hidden=16, layers=1), root / "other",
                   VICUNA_TOKENIZER)  # fmt: skip
    save_adapter(root / "ee", EE.new_adapter(model, 1, seed=0))
    shutil.copytree(root / "ee", root / "ee2")
    save_drafter_dir(tiny_drafter(model, 12), root / "drafter")
    return {name: str(root / name) for name in ("model", "drafter", "ee", "ee2", "other")}


def test_load_takes_a_pair_in_either_order(folders):
    f = folders
    for given in ([f["ee"], f["model"]], (f["model"], f["ee"])):
        model, drafter, _, draft = load(f["model"], f["drafter"], draft_model=given)
        assert isinstance(draft, tuple) and draft[0] is model  # the target itself
        assert isinstance(draft[1], EarlyExitAdapter)
        assert not isinstance(drafter, EarlyExitAdapter)
    _, _, _, draft = load(f["model"], None, draft_model=[f["other"], f["ee"]])
    assert isinstance(draft, tuple) and draft[0].args.hidden_size == 16
    one = load(f["model"], None, draft_model=[f["ee"]])[3]  # one value: as a plain path
    assert isinstance(one, EarlyExitAdapter)
    assert draft_slot_paths([f["ee"], f["other"]]) == (f["other"], f["ee"])
    assert draft_slot_paths(f["ee"]) == (None, f["ee"])


def test_the_python_api_takes_the_pair(folders):
    """``redrafter_mlx.load(..., draft_model=[M, EE])`` then ``generate`` /
    ``batch_generate`` with ``draft_model=`` the pair: plain decoding's text and tokens."""
    import redrafter_mlx

    f = folders
    model, drafter, tokenizer, pair = redrafter_mlx.load(
        f["model"], f["drafter"], draft_model=[f["model"], f["ee"]]
    )
    assert isinstance(pair, tuple) and isinstance(pair[1], EarlyExitAdapter)
    ar = redrafter_mlx.BeamShape.autoregressive()
    want = redrafter_mlx.generate(model, None, tokenizer, "Hello there", max_tokens=12, shape=ar)
    got = redrafter_mlx.generate(model, drafter, tokenizer, "Hello there", max_tokens=12,
                                 shape="W1xL4+K1xL8+D1xL4", draft_model=pair)  # fmt: skip
    assert got == want
    prompts = ["Hello there", "Once upon a time, there"]
    plain_ids = redrafter_mlx.batch_generate(model, None, tokenizer, prompts, max_tokens=10,
                                             shape=ar)  # fmt: skip
    ids = redrafter_mlx.batch_generate(model, drafter, tokenizer, prompts, max_tokens=10,
                                       shape="W1xL4+D1xL3", draft_model=pair)  # fmt: skip
    assert ids == plain_ids


def test_loading_refuses_what_the_slot_cannot_hold(folders):
    f = folders
    cases = [
        ([f["ee"], f["ee2"]], None, "two early-exit adapters"),
        ([f["model"], f["other"]], None, "two draft models"),
        ([f["other"], f["ee"], f["model"]], None, "one or two paths"),
        ([f["other"], f["ee"]], f["ee2"], "both as the drafter and as the draft model"),
    ]
    for given, drafter, message in cases:
        with pytest.raises(LoadError, match=message):
            load(f["model"], drafter, draft_model=given)


def test_cli_generate_with_the_pair(app, folders):
    """``generate --json --drafter R --draft-model M --draft-model EE`` equals plain
    decoding (the flags in either order), reports every source in its stats (the target as
    its own draft accepted) and names both folders."""
    f = folders
    args = ["generate", "--model", f["model"], "-p", "Hello there", "-n", 16, "--no-adapt"]
    plain_run = run_json(app, *args, "--no-draft")
    slot = ["--drafter", f["drafter"], "--draft-model", f["model"], "--draft-model", f["ee"]]
    got = run_json(app, *args, *slot)
    assert got["tokens"] == plain_run["tokens"]
    assert got["beam"]["label"] == "W1×L4+K1×L8+D1×L4"
    assert got["draft_model"] == [f["model"], f["ee"]]
    stats = got["stats"]
    assert set(stats["source_tokens"]) == set(SOURCE_NAMES)
    assert stats["source_tokens"]["draft_model"] > 0
    assert sum(stats["source_tokens"].values()) == stats["accepted_tokens"]
    swapped = ["--drafter", f["drafter"], "--draft-model", f["ee"], "--draft-model", f["model"]]
    again = run_json(app, *args, *swapped)
    assert again["tokens"] == plain_run["tokens"] and again["draft_model"] == got["draft_model"]


def test_cli_errors_name_the_fix(app, folders):
    f = folders
    args = ["generate", "--model", f["model"], "-p", "Hello", "-n", 4]
    cases = [
        (["--draft-model", f["ee"], "--draft-model", f["ee2"]], "two early-exit adapters"),
        (["--draft-model", f["model"], "--draft-model", f["other"]], "two draft models"),
        (["--drafter", f["ee"], "--draft-model", f["model"], "--draft-model", f["ee2"]],
         "both as the drafter and as the draft model"),
    ]  # fmt: skip
    for flags, message in cases:
        result = invoke(app, *args, *flags)
        assert result.exit_code != 0 and message in result.output, result.output


def test_cli_chat_bench_and_serve_take_the_pair(app, folders, monkeypatch):
    """chat answers (its stats line counts the draft model's drafts), bench measures the
    four-source tree (both shares reported; mlx-lm drafts with the draft model alone) and
    serve builds its server on the pair (stopped there)."""
    from redrafter_mlx.cli import serve
    from redrafter_mlx.cli.common import FlagError

    f = folders
    slot = ["--model", f["model"], "--drafter", f["drafter"], "--draft-model", f["ee"],
            "--draft-model", f["model"]]  # fmt: skip
    chat = invoke(app, "chat", *slot, "-n", 8, input="hello\n")
    assert chat.exit_code == 0 and "draft model" in chat.output, chat.output
    result = invoke(app, "bench", *slot, "--configs", "W1xL4", "--num-prompts", 1,
                    "--max-tokens", 8, "--mlx-lm", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "drafts with the draft model alone" in result.output
    data = json.loads(result.stdout)
    (row,) = [r for r in data["configs"] if r["config"] not in ("AR", "mlx-lm")]
    assert data["ok"] and row["config"] == "W1×L4+D1×L4"
    assert {"early_exit", "draft_model"} <= set(row["source_shares"])
    assert [r["tokens"] for r in data["configs"] if r["config"] == "mlx-lm"] == [8]
    seen = []

    def build(engine, plan, *args, **kwargs):
        seen.append((engine.draft_model, plan.shape.label))
        raise FlagError("stopped before serving")

    monkeypatch.setattr(serve, "build", build)
    result = invoke(app, "serve", *slot, "--port", 0)
    assert "stopped before serving" in result.output
    assert isinstance(seen[0][0], tuple) and seen[0][1].endswith("D1×L4")


def test_cli_tune_keys_the_profile_by_the_pair(app, model_dir, home, tmp_path, monkeypatch):
    """``tune --draft-model M --draft-model EE``: the pair is loaded for the D1×Ld shapes,
    the profile is keyed by both folders and names both chains among its sources."""
    from tests.support.sources import fake_draft_measure
    from tuning.profiles import ProfileStore

    ee = tmp_path / "ee"  # the measure is faked: the folder need only say its kind
    ee.mkdir()
    (ee / "config.json").write_text('{"kind": "early-exit"}')
    loaded = fake_draft_measure(monkeypatch)
    result = invoke(app, "tune", "--model", model_dir, "--draft-model", str(ee), "--draft-model",
                    model_dir, "--draft-length", "3", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert loaded == [(model_dir, str(ee))] and data["draft_model"] == [model_dir, str(ee)]
    recommended = BeamShape.parse(data["recommended"]["label"])
    assert recommended.model_length
    assert {"early_exit", "draft_model"} <= set(data["sources"])
    (profile,) = ProfileStore().load().values()
    assert "+" in profile.key.draft_model and str(ee.resolve()) in profile.key.draft_model
