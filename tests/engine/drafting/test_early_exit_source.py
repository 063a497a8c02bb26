"""The early-exit adapter as a draft source (``early_exit.EarlyExitSource``): greedy output
equals plain decoding, alone and merged with lookup in one tree, solo and batched (rows of
different lengths); a target whose layers past the exit do nothing gets every draft
accepted; the accepted drafts are counted for the ``early_exit`` source; a shape of several
beams is a clear error; the adapter and a draft model in one tree."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitArgs,
    EarlyExitSource,
    save_adapter,
)
from redrafter_mlx.engine.drafting.early_exit_chain import prefill as prefill_ee
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import (
    DRAFT_MODEL,
    EARLY_EXIT,
    LOOKUP,
    SOURCE_NAMES,
)
from redrafter_mlx.engine.loop.loading import LoadError, load
from tests.support.cli import invoke, run_json
from tests.support.models import (
    VICUNA_TOKENIZER,
    _randomize,
    greedy_prefilled,
    near_bigram_model,
    run_decode,
    save_model_dir,
    step_sources,
    tiny_model,
)
from tests.support.sources import (
    PROMPTS,
    REPEATING,
    bigram_pair,
    plain,
    random_pair,
    states_follow_the_text,
    transparent_pair,
)


@pytest.mark.parametrize("label", ["W1xL4", "W1xL3+K1xL6", "W1xL5+K2xL4", "W1xL3+K1xL6 C5"])
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    model, adapter = random_pair(3)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, adapter, PROMPTS, max_tokens=24, shape=shape)
    assert got == want
    for r, prompt in enumerate(PROMPTS[:2]):  # each row alone: another row changes nothing
        solo, _ = run_decode(model, adapter, [prompt], max_tokens=24, shape=shape)
        assert solo[0] == want[r]
    assert set(stats["source_tokens"]) == set(SOURCE_NAMES)
    assert stats["source_tokens"]["drafter"] == 0  # the chain is the early-exit source's


def test_a_target_transparent_past_the_exit_accepts_every_draft():
    model, adapter = transparent_pair()
    want = plain(model, PROMPTS, 30)
    shape = BeamShape.parse("W1xL4")
    got, stats = run_decode(model, adapter, PROMPTS, max_tokens=30, shape=shape)
    assert got == want
    # eta cuts a chain whose drafts are unsure; with eta 0 every draft is proposed
    assert stats["source_tokens"]["early_exit"] == stats["accepted_tokens"] > 0
    model, adapter = transparent_pair()  # a new adapter: steps are compiled per adapter
    adapter.args.extra["eta"] = 0.0  # as an "eta" key in its config.json
    got, stats = run_decode(model, adapter, PROMPTS, max_tokens=30, shape=shape)
    assert got == want
    assert stats["tokens_per_step"] > 3.5  # 4 a step, except the last, cut steps
    assert stats["source_tokens"]["early_exit"] == stats["accepted_tokens"]


def test_sources_of_an_early_exit_shape():
    _, adapter = random_pair()
    sources = step_sources(BeamShape.parse("W1xL5+K1xL7"), adapter)
    assert [type(s).__name__ for s in sources] == ["EarlyExitSource", "LookupSource"]
    assert sources[0].length == 5 and sources[0].refresh == 7 and sources[0].eta == 0.6
    assert step_sources(BeamShape.parse("W1xL5"), adapter)[0].refresh == 0
    with pytest.raises(ValueError, match="beam-width 1"):
        step_sources(BeamShape.parse("W2xL4"), adapter)
    assert isinstance(sources[0], EarlyExitSource)


@pytest.mark.parametrize("label", ["W1xL3+K1xL6", "W1xL4"])
def test_adapter_cache_holds_the_committed_text_after_the_refresh(label):
    """After steps whose accepted path may be another source's (a lookup chain's), the next
    draft's refresh leaves the adapter cache equal to a fresh prefill of the committed text
    (no refresh, or a shorter one, fails this test once lookup wins a step)."""
    model, adapter = bigram_pair()
    shape = BeamShape.parse(label)
    slots = 64
    own = [prefill_ee(model, adapter, [REPEATING], slots)]
    state = greedy_prefilled(model, REPEATING, slots, own)
    step = uniform_step(model, held_sources(adapter), shape, SamplerConfig(), 1, compiled=False)
    source = step_sources(shape, adapter)[0]
    check = (source, 0, lambda text: prefill_ee(model, adapter, text, slots))
    won = states_follow_the_text(model, step, state, slots, 6, [check])
    if shape.lookup:
        assert LOOKUP in won


@pytest.mark.parametrize("transparent", [False, True], ids=["random", "transparent"])
def test_server_rows_with_an_early_exit_drafter_equal_solo_plain_decoding(transparent):
    """Rows join mid-way (more requests than rows: resizes, placements, each row's adapter
    cache from its own prefill): each row's output equals plain decoding; on a transparent
    target (shape pinned) every row's drafts are all accepted; the random pair runs the
    adaptive choice (the adapter's chain switched off and on, its cache caught up)."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    if transparent:
        model, adapter = transparent_pair()
        adapter.args.extra["eta"] = 0.0
    else:
        model, adapter = random_pair(5)
    prompts = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2], [4, 4]]
    shape = BeamShape.parse("W1xL4" if transparent else "W1xL4+K1xL5")
    sched = Scheduler(model, adapter, shape, (), max_batch=2, adapt=not transparent)
    assert (sched.choice is None) == transparent  # an early-exit drafter no longer pins
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        want, _ = run_decode(model, None, [prompt], max_tokens=16 + 4 * i, shape=AR)
        assert sink.tokens == want[0], i
        if transparent:
            stats = sink.last.stats
            assert stats.by_source[EARLY_EXIT] == stats.accepted_drafts
            assert stats.accepted_drafts >= 3 * (stats.steps - 1), i  # all but a cut step


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(model dir, early-exit adapter dir, an adapter for another model)."""
    root = tmp_path_factory.mktemp("ee")
    model = tiny_model(vocab=32000, hidden=32, layers=3)
    save_model_dir(model, root / "model", VICUNA_TOKENIZER)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 2))
    _randomize(adapter, 1, 1.0)
    save_adapter(root / "ee", adapter)
    other = EarlyExitAdapter(EarlyExitArgs.for_target(tiny_model(vocab=320, layers=3).args, 2))
    save_adapter(root / "other", other)
    return str(root / "model"), str(root / "ee"), str(root / "other")


W1XL4 = ("--beam-width", 1, "--beam-length", 4)


def test_cli_drafter_folder_of_kind_early_exit(app, folders):
    model, ee, other = folders
    args = ["generate", "--model", model, "-p", "Hello there", "-n", 16, "--no-adapt"]
    plain_run = run_json(app, *args, "--no-draft")
    got = run_json(app, *args, "--drafter", ee, "--no-lookup", *W1XL4)
    assert got["tokens"] == plain_run["tokens"]
    stats = got["stats"]
    assert sum(stats["source_tokens"].values()) == stats["accepted_tokens"]
    assert stats["source_tokens"]["drafter"] == 0
    merged = run_json(app, *args, "--drafter", ee, *W1XL4, "--lookup", 1, "--lookup-length", 5)
    assert merged["tokens"] == plain_run["tokens"]
    both = run_json(app, *args, "--drafter", ee, *W1XL4, "--draft-model", model)
    assert both["tokens"] == plain_run["tokens"]
    assert both["stats"]["source_tokens"]["draft_model"] > 0  # the target as its own draft
    wide = invoke(app, *args, "--drafter", ee, "--beam-width", 2, "--beam-length", 4)
    assert wide.exit_code != 0 and "--beam-width 1" in wide.output
    with pytest.raises(LoadError, match="adapter trained for this model"):
        load(model, other)
    loaded = load(model, ee)[1]
    assert isinstance(loaded, EarlyExitAdapter) and loaded.args.exit_layer == 2


ALL_STATEFUL = ["W1xL4+D1xL4", "W1xL3+K1xL6+D1xL4", "W1xL5+K2xL4+D1xL3"]


@pytest.mark.parametrize("label", ALL_STATEFUL)
def test_an_early_exit_adapter_and_a_draft_model_in_one_tree(label):
    """The adapter's chain, a draft model's chain (and lookup) in one tree: greedy output
    equals plain decoding, batched and solo, with another small model as the draft and with
    the target as its own draft. The target as its own draft proposes exactly the target's
    greedy tokens, so it wins every step with its whole chain: an adapter refresh or a draft
    catch-up that missed tokens another source committed would show here as rejected
    drafts."""
    model, adapter = random_pair(3)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    other = tiny_model(9, vocab=48, layers=1)
    got, stats = run_decode(model, adapter, PROMPTS, max_tokens=24, shape=shape, draft_model=other)
    assert got == want
    assert stats["source_tokens"]["early_exit"] > 0
    solo, _ = run_decode(model, adapter, PROMPTS[1:2], max_tokens=24, shape=shape,
                         draft_model=other)  # fmt: skip
    assert solo[0] == want[1]
    got, stats = run_decode(model, adapter, PROMPTS, max_tokens=24, shape=shape, draft_model=model)
    assert got == want
    assert stats["source_tokens"]["draft_model"] >= 0.9 * stats["accepted_tokens"]  # or lookup's
    assert stats["tokens_per_step"] > shape.model_length - 0.5  # whole chains, but cut ends


@pytest.mark.parametrize("itself", [True, False], ids=["target-as-draft", "other-draft"])
def test_both_caches_hold_the_committed_text_whichever_source_won(itself):
    """Steps of W1xL3+K1xL6+D1xL4 (adapter, lookup and a draft model in one tree): after
    each, the next draft's adapter refresh and the draft model's catch-up leave both caches
    equal to a fresh prefill of the committed text: with the target as its own draft
    lookup and the draft model win steps, with another model lookup and the adapter."""
    from redrafter_mlx.engine.drafting.draft_model import prefill as prefill_draft

    model, adapter = bigram_pair()
    draft = model if itself else near_bigram_model(5, vocab=32, layers=1)
    shape = BeamShape.parse("W1xL3+K1xL6+D1xL4")
    slots = 64
    own = [prefill_ee(model, adapter, [REPEATING], slots), prefill_draft(draft, [REPEATING], slots)]
    state = greedy_prefilled(model, REPEATING, slots, own)
    step = uniform_step(
        model, held_sources(adapter, draft), shape, SamplerConfig(), 1, compiled=False
    )
    sources = step_sources(shape, adapter, draft)
    assert [s.source_id for s in sources if s.stateful] == [EARLY_EXIT, DRAFT_MODEL]
    checks = [
        (sources[0], 0, lambda text: prefill_ee(model, adapter, text, slots)),
        (sources[-1], 1, lambda text: prefill_draft(draft, text, slots)),
    ]
    won = states_follow_the_text(model, step, state, slots, 8, checks)
    assert won == ({LOOKUP, DRAFT_MODEL} if itself else {LOOKUP, EARLY_EXIT})
