"""``--draft-model`` through the CLI, the server's scheduler, ``load`` and the memory check:
greedy output equal to plain decoding, the draft model's accepted share reported, clear
errors for a draft model that does not share the tokenizer."""

from __future__ import annotations

from dataclasses import replace

import pytest

from redrafter_mlx.engine.core.footprint import Dims, kv_bytes
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import DRAFT_MODEL
from redrafter_mlx.engine.loop.loading import LoadError, load
from redrafter_mlx.engine.loop.memory import check_step_memory
from redrafter_mlx.serve.scheduler import Scheduler
from tests.support.cli import invoke, run_json
from tests.support.models import VICUNA_TOKENIZER, run_decode, save_model_dir, tiny_model
from tests.support.serving import staggered


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(model dir, draft model dir, draft with another vocabulary) of tiny random models."""
    root = tmp_path_factory.mktemp("draft")
    save_model_dir(tiny_model(vocab=32000, hidden=32), root / "model", VICUNA_TOKENIZER)
    save_model_dir(tiny_model(3, vocab=32000, hidden=16, heads=2, kv_heads=1), root / "draft",
                   VICUNA_TOKENIZER)  # fmt: skip
    save_model_dir(tiny_model(4, vocab=320, hidden=16), root / "other", VICUNA_TOKENIZER)
    return str(root / "model"), str(root / "draft"), str(root / "other")


def test_generate_with_a_draft_model_equals_plain_decoding(app, dirs):
    model, draft, _ = dirs
    args = ["generate", "--model", model, "-p", "Hello there", "-n", 24, "--no-adapt"]
    plain = run_json(app, *args, "--no-draft")
    got = run_json(app, *args, "--draft-model", draft, "--no-lookup")
    assert got["tokens"] == plain["tokens"]
    assert got["beam"]["label"] == "D1×L4" and got["draft_model"] == draft
    assert sum(got["stats"]["source_tokens"].values()) == got["stats"]["accepted_tokens"]
    itself = run_json(app, *args, "--draft-model", model, "--no-lookup")
    assert itself["tokens"] == plain["tokens"]
    assert itself["stats"]["source_tokens"]["draft_model"] == itself["stats"]["accepted_tokens"]
    assert itself["stats"]["tokens_per_step"] > 3  # the model drafts its own tokens


def test_a_draft_model_with_another_vocabulary_is_one_clear_error(app, dirs):
    model, _, other = dirs
    result = invoke(app, "generate", "--model", model, "-p", "Hi", "--draft-model", other)
    assert result.exit_code != 0
    assert "same tokenizer" in result.output and "error" in result.output
    with pytest.raises(LoadError, match="same tokenizer"):
        load(model, draft_model=other)


def test_bench_rows_carry_the_draft_models_share(app, dirs):
    model, draft, _ = dirs
    data = run_json(app, "bench", "--model", model, "--draft-model", draft, "--configs",
                    "D1xL3,K1xL4+D1xL3", "--num-prompts", 1, "--max-tokens", 8)  # fmt: skip
    rows = {row["config"]: row for row in data["configs"]}
    assert data["ok"] and rows["D1×L3"]["draft_model_length"] == 3
    assert set(rows["K1×L4+D1×L3"]["source_shares"]) >= {"lookup", "draft_model"}
    result = invoke(app, "bench", "--model", model, "--configs", "D1xL3", "--json")
    assert result.exit_code == 2 and "--draft-model" in result.output


@pytest.mark.parametrize("itself", [False, True], ids=["small-draft", "self-draft"])
def test_server_rows_with_a_draft_model_equal_solo_plain_decoding(itself):
    """Rows join mid-way (more requests than rows: resizes, placements): each row's output
    equals plain decoding; as its own draft, the model's drafts on every row are all
    accepted, so each row's draft cache holds its own text exactly."""
    model = tiny_model(5, vocab=48, layers=2)
    draft = model if itself else tiny_model(9, vocab=48, layers=1)
    prompts = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2], [4, 4]]
    shape = BeamShape.parse("D1xL4" if itself else "K1xL5+D1xL4")
    sched = Scheduler(model, None, shape, (), max_batch=2, draft_model=draft)
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        want, _ = run_decode(model, None, [prompt], max_tokens=16 + 4 * i, shape=AR)
        assert sink.tokens == want[0], i
        if itself:
            stats = sink.last.stats
            assert stats.by_source[DRAFT_MODEL] == stats.accepted_drafts
            assert stats.accepted_drafts >= 3 * (stats.steps - 1), i  # all but a cut step


def test_memory_counts_the_draft_models_weights_and_cache():
    model = tiny_model(5, vocab=48)
    draft = tiny_model(6, vocab=48, layers=3)
    shape = BeamShape.parse("D1xL4")
    alone = check_step_memory(model, held_sources(), replace(shape, model_length=0, lookup=1,
                                                   lookup_length=4), tokens=128)  # fmt: skip
    with_draft = check_step_memory(model, held_sources(None, draft), shape, tokens=128)
    d = Dims.of(draft)
    assert with_draft.weights == alone.weights + d.weight_bytes
    assert with_draft.cache >= alone.cache + kv_bytes(d, 1, 128)
    itself = check_step_memory(model, held_sources(None, model), shape, tokens=128)
    assert itself.weights == alone.weights  # the model as its own draft: no second copy


@pytest.mark.parametrize("tuned", ["K1xL5+D1xL3", "K1xL5"], ids=["with-chain", "chain-off"])
def test_a_profile_tuned_with_the_draft_model_decides_its_chain(app, dirs, home, tuned):
    """A profile of ``tune --draft-model`` (keyed by the draft model) gives the run its whole
    shape: its chain's length, or no chain where the chain did not pay (the run leaves the
    draft model out); it wins over the profile of the model alone, and flags asking
    for a shape or lookup still win."""
    from redrafter_mlx.engine.base.chip import detect_chip
    from tuning.profiles import Profile, ProfileKey, ProfileStore, now_iso

    model, draft, _ = dirs
    chip = detect_chip().chip_id
    store = ProfileStore()
    key = ProfileKey.build(chip, model, None, None, draft_model_path=draft)
    shape = BeamShape.parse(tuned)
    store.put(Profile(key, shape, True, 1.5, 10.0, now_iso(), {}, True, ()))
    alone = ProfileKey.build(chip, model, None, None)  # the model without the draft model
    store.put(Profile(alone, BeamShape.parse("K2xL7"), True, 1.2, 9.0, now_iso(), {}, True, ()))
    args = ["generate", "--model", model, "-p", "Hello there", "-n", 16, "--no-adapt"]
    plain = run_json(app, *args, "--no-draft")
    got = run_json(app, *args, "--draft-model", draft)
    assert got["tokens"] == plain["tokens"]
    assert got["beam"]["label"] == shape.label and "with this draft model" in got["beam"]["source"]
    assert got["draft_model"] == (draft if shape.model_length else None)
    if not shape.model_length:
        assert "without the draft model" in got["beam"]["source"]
        assert got["stats"]["source_tokens"]["draft_model"] == 0
    flagged = run_json(app, *args, "--draft-model", draft, "--lookup", 1, "--lookup-length", 4)
    assert flagged["beam"]["label"] == "K1×L4+D1×L4"  # the flags' shape, the chain added
    assert run_json(app, *args)["beam"]["label"] == "K2×L7"  # no draft model: its own profile
