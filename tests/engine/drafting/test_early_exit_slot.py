"""The early-exit adapter in the draft-model slot (``--draft-model <early-exit folder>``,
``draft_model=adapter``): its chain is the shape's ``D1×L``, beside the recurrent drafter's
beams and the lookup chains in one tree. Greedy output equals plain decoding (batched, solo,
switched off and on, adaptive, the server); the adapter cache equals a fresh prefill of the
committed text whichever source won; accepted drafts count for ``early_exit``; the memory
check and the profile count the adapter; the CLI loads the folder as the adapter; an
adapter in both slots is one clear error."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.footprint import head_bytes
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.step import uniform_step
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitSource,
    load_adapter,
    save_adapter,
)
from redrafter_mlx.engine.drafting.early_exit_chain import prefill as prefill_ee
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.sources import DRAFTER, EARLY_EXIT, LOOKUP, stateful
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.loading import LoadError, load
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
    transparent_pair,
)

# --------------------------------------------------------------------------- the sources


def test_the_draft_slot_takes_an_early_exit_chain():
    """``step_sources``: the adapter in the draft slot is an ``EarlyExitSource`` of the
    shape's ``model_length``, after the drafter's beams and the lookup chains, refreshed
    over the longest of them; its state is held as EARLY_EXIT (no DRAFT_MODEL state)."""
    model, adapter = random_pair()
    drafter = tiny_drafter(model, 12)
    sources = step_sources(BeamShape.parse("W2xL4+K1xL7+D1xL3"), drafter, adapter)
    assert [type(s).__name__ for s in sources] == ["DrafterSource", "LookupSource",
                                                   "EarlyExitSource"]  # fmt: skip
    chain = sources[-1]
    assert isinstance(chain, EarlyExitSource) and chain.adapter is adapter
    assert (chain.length, chain.refresh, chain.source_id) == (3, 7, EARLY_EXIT)
    assert step_sources(BeamShape.parse("D1xL4"), None, adapter)[0].refresh == 0
    assert step_sources(BeamShape.parse("W1xL4"), drafter, adapter)[0].source_id == DRAFTER

    def ids(held):
        return [s.source_id for s in stateful(held)]

    assert ids(held_sources(drafter, adapter)) == [EARLY_EXIT] == ids(held_sources(adapter, None))
    assert stateful(held_sources(drafter, adapter))[0].adapter is adapter
    assert [s.source_id for s in stateful(held_sources(drafter, model))] != [EARLY_EXIT]


def test_an_adapter_in_both_slots_is_one_clear_error():
    model, adapter = random_pair()
    shape = BeamShape.parse("W1xL3+D1xL3")
    for call in (
        lambda: step_sources(shape, adapter, adapter),
        lambda: BatchGenerator(model, held_sources(adapter, adapter), Scripted([AR])),
        lambda: run_decode(model, adapter, PROMPTS[:1], max_tokens=4, shape=shape,
                           draft_model=adapter),
    ):  # fmt: skip
        with pytest.raises(ValueError, match="both as the drafter and as the draft model"):
            call()


# --------------------------------------------------------------------------- greedy identity

SHAPES = ["W2xL3+D1xL4", "W1xL4+K1xL8+D1xL4", "W1xL3+K1xL5+D1xL3 C6"]


@pytest.mark.parametrize("label", SHAPES)
def test_greedy_output_equals_plain_decoding_batched_and_solo(label):
    """A recurrent drafter, lookup and the adapter's chain in one tree: every row equals
    plain decoding, batched and each row alone; the adapter's accepted drafts count for
    ``early_exit`` and every accepted draft for some source."""
    model, adapter = random_pair(3)
    drafter = tiny_drafter(model, 12)
    want = plain(model, PROMPTS)
    shape = BeamShape.parse(label)
    got, stats = run_decode(model, drafter, PROMPTS, max_tokens=24, shape=shape,
                            draft_model=adapter)  # fmt: skip
    assert got == want
    assert stats["source_tokens"]["early_exit"] > 0 and stats["source_tokens"]["draft_model"] == 0
    assert sum(stats["source_tokens"].values()) == stats["accepted_tokens"]
    for r, prompt in enumerate(PROMPTS[:2]):
        solo, _ = run_decode(model, drafter, [prompt], max_tokens=24, shape=shape,
                             draft_model=adapter)  # fmt: skip
        assert solo[0] == want[r]


def test_an_exact_chain_is_accepted_whole_beside_the_drafter():
    """On a target transparent past the exit (eta 0) the adapter's chain is the target's own
    greedy text: longer than the drafter's beams, it wins every step with its whole chain
    and every accepted draft counts for ``early_exit``."""
    model, adapter = transparent_pair()
    adapter.args.extra["eta"] = 0.0
    want = plain(model, PROMPTS, 30)
    shape = BeamShape.parse("W2xL3+D1xL4")
    got, stats = run_decode(model, tiny_drafter(model, 12), PROMPTS, max_tokens=30, shape=shape,
                            draft_model=adapter)  # fmt: skip
    assert got == want
    assert stats["source_tokens"]["early_exit"] == stats["accepted_tokens"]
    assert stats["tokens_per_step"] > 3.5  # 4 a step, except the last


def test_the_drafter_wins_where_its_beam_is_right_further():
    """An exact adapter chain of 3 tokens beside a near-exact drafter beam of 6 (a little
    noise: an exact one wins every tie, coming first): both win steps, each counted for its
    own source; output is plain decoding's."""
    model, adapter = transparent_bigram()
    prompts = [[1, 5, 9, 3], [2, 7, 7, 4, 1]]
    want = plain(model, prompts, 40)
    shape = BeamShape.parse("W1xL6+D1xL3")
    got, stats = run_decode(model, OracleDrafter(model, noise=0.1), prompts, max_tokens=40,
                            shape=shape, draft_model=adapter)  # fmt: skip
    assert got == want
    by = stats["source_tokens"]
    assert by["drafter"] > 0 and by["early_exit"] > 0
    assert by["drafter"] + by["early_exit"] == stats["accepted_tokens"]


# --------------------------------------------------------------------------- the adapter cache


def test_the_adapter_cache_holds_the_committed_text_whichever_source_won():
    """Steps of W1xL4+K1xL6+D1xL3 (the drafter, lookup and the adapter's chain): after each,
    the next draft's refresh leaves the adapter cache equal to a fresh prefill of the
    committed text; the drafter and lookup both win steps (their paths are longer than the
    chain: a refresh shorter than them fails this test)."""
    model, adapter = bigram_pair()
    drafter = OracleDrafter(model, noise=0.0)
    shape = BeamShape.parse("W1xL4+K1xL6+D1xL3")
    slots = 64
    own = [prefill_ee(model, adapter, [REPEATING], slots)]
    state = greedy_prefilled(model, REPEATING, slots, own)
    step = uniform_step(
        model, held_sources(drafter, adapter), shape, SamplerConfig(), 1, compiled=False
    )
    chain = step_sources(shape, drafter, adapter)[-1]
    assert chain.refresh == 6
    check = (chain, 0, lambda text: prefill_ee(model, adapter, text, slots))
    won = states_follow_the_text(model, step, state, slots, 10, [check])
    assert {DRAFTER, LOOKUP} <= won


# --------------------------------------------------------------------------- off and on

WD = BeamShape.parse("W1xL3+K1xL5+D1xL3")
W, D, K = BeamShape.parse("W1xL3"), BeamShape.parse("D1xL3"), BeamShape.parse("K1xL5")


@pytest.mark.parametrize("batched", [False, True], ids=["solo", "rows-joining"])
def test_the_adapter_in_the_draft_slot_switched_off_and_on(batched):
    """A script running the drafter with and without the adapter's chain, the chain alone,
    lookup and plain decoding for 1 to 9 steps: every row equals plain decoding (rows that
    joined while the chain was off included) and the adapter cache was caught up."""
    model, adapter = random_pair(3)
    drafter = tiny_drafter(model, 12)
    cycle = [WD, AR, W, D, AR, AR, AR, K, WD, *[AR] * 9, D, W, WD]
    batch = BatchGenerator(model, held_sources(drafter, adapter), Scripted(cycle), max_batch=4)
    assert [s.source_id for s in batch.batch_state.stateful] == [EARLY_EXIT]
    waves = [(PROMPTS[:1], 40)]
    if batched:
        waves += [(PROMPTS[1:2], 30), (PROMPTS[2:], 30)]
    _, got = drive(batch, waves, steps_between=4)
    assert_rows_plain(model, got, waves)
    assert batch.stepping.catch_ups >= 2


def test_after_the_catch_up_the_adapter_cache_equals_a_fresh_prefill():
    """After steps without the chain (the drafter alone, lookup, plain decoding) the
    catch-up queued before its next step leaves the adapter cache equal to a fresh prefill
    of the committed text; before it, it differs."""
    model, adapter = random_pair(3)
    drafter = tiny_drafter(model, 12)
    cycle = [WD, AR, W, K, AR, W]
    batch = BatchGenerator(model, held_sources(drafter, adapter), Scripted(cycle), max_batch=1)
    batch.reset()
    session = Session(model, 1)
    batch.insert(Prefill(PROMPTS[:1], SamplerConfig(), 0, session, rows=rows_of(PROMPTS[:1], 200)))
    for _ in cycle:
        batch.next()
    batch.settle()
    n = int(batch.state.lengths[0])
    text = batch.state.history[0, :n].tolist()
    slots = cache_slots(batch.state.cache)
    fresh = prefill_ee(model, adapter, [text], slots)[0][0][0]
    assert not mx.allclose(source_cache(batch, EARLY_EXIT, 0)[:, :n], fresh[:, :n], atol=1e-4)
    assert batch.batch_state.behind[state_slot(batch, EARLY_EXIT)] > WD.longest
    batch.stepping.catch_up(WD, slots)
    assert mx.allclose(source_cache(batch, EARLY_EXIT, 0)[:, :n], fresh[:, :n], atol=1e-4)


def test_adaptive_generation_with_the_drafter_and_the_adapter_slot():
    """An adaptive run chooses among shapes with and without the adapter's chain and the
    drafter's beams; greedy output stays plain decoding's."""
    model, adapter = transparent_pair()
    adapter.args.extra["eta"] = 0.0
    costs = {AR: 1.0}
    adapt = Adaptive(step_cost=lambda s: costs.get(s, 1.2), every=2, probe=3)
    got, stats = run_decode(model, tiny_drafter(model, 12), PROMPTS, max_tokens=40, shape=WD,
                            draft_model=adapter, adapt=adapt)  # fmt: skip
    assert got == plain(model, PROMPTS, 40)
    ran = set(adapt.history)
    assert any(s.model_length for s in ran) and any(s.drafts for s in ran)
    assert len(ran) >= 2 and stats["source_tokens"]["early_exit"] > 0


# --------------------------------------------------------------------------- the server


@pytest.mark.parametrize("transparent", [False, True], ids=["random", "transparent"])
def test_server_rows_with_the_adapter_slot_equal_solo_plain_decoding(transparent):
    """Rows join mid-way (more requests than rows): each row's output equals plain
    decoding; on a transparent target (shape pinned) every row's accepted drafts are the
    adapter's, whole chains; the random pair runs the adaptive choice."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    if transparent:
        model, adapter = transparent_pair()
        adapter.args.extra["eta"] = 0.0
    else:
        model, adapter = random_pair(5)
    drafter = tiny_drafter(model, 12)
    prompts = [[1, 5, 9, 3, 5, 9], [2, 7, 7, 4], [3, 3, 8, 1, 2, 3, 8, 1, 2], [4, 4]]
    shape = BeamShape.parse("W1xL3+D1xL4" if transparent else "W1xL3+K1xL5+D1xL3")
    sched = Scheduler(model, drafter, shape, (), max_batch=2, adapt=not transparent,
                      draft_model=adapter)  # fmt: skip
    assert [s.source_id for s in sched.batch.batch_state.stateful] == [EARLY_EXIT]
    sinks = staggered(sched, prompts, [16 + 4 * i for i in range(len(prompts))])
    for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
        want, _ = run_decode(model, None, [prompt], max_tokens=16 + 4 * i, shape=AR)
        assert sink.tokens == want[0], i
        if transparent:
            stats = sink.last.stats
            assert stats.by_source[EARLY_EXIT] == stats.accepted_drafts
            assert stats.accepted_drafts >= 3 * (stats.steps - 1), i


def test_the_server_loop_runs_the_adapter_slot_on_its_own_thread(tmp_path):
    """The engine loop runs on another thread than the one that loaded the adapter: the
    scheduler materializes the draft slot's arrays too (an adapter's lazy rope tables
    raised "There is no Stream(cpu, 0) in current thread" there)."""
    from redrafter_mlx.serve.scheduler import Scheduler
    from tests.support.serving import staggered

    model = tiny_model(5, vocab=48, layers=3)
    save_adapter(tmp_path / "ee", EE.new_adapter(model, 2, seed=0))
    adapter = load_adapter(tmp_path / "ee")  # as --draft-model loads it
    sched = Scheduler(model, tiny_drafter(model, 12), BeamShape.parse("W1xL3+D1xL3"), (),
                      max_batch=2, draft_model=adapter)  # fmt: skip
    done = {}

    def serve():
        try:
            done["sinks"] = staggered(sched, [[1, 5, 9], [2, 7]], [8, 8])
        except Exception as e:
            done["error"] = e

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join(120)
    assert "error" not in done and sched.failure is None, (done.get("error"), sched.failure)
    want = plain(model, [[1, 5, 9], [2, 7]], 8)
    assert [sink.tokens for sink in done["sinks"]] == want


# --------------------------------------------------------------------------- memory, profile


@pytest.mark.parametrize("rows", [1, 4])
def test_the_memory_check_counts_the_adapter_in_the_draft_slot(rows):
    """The adapter in the draft slot is counted as the early-exit drafter is: its cache (what
    the loop holds for that many rows), its weights, and one chain's draft-step logits."""
    model, adapter = random_pair(3)
    drafter = tiny_drafter(model, 12)
    shape = BeamShape.parse("W1xL4+K1xL4+D1xL4")
    held = held_cache(model, drafter, shape, rows, adapter)
    estimate = check_step_memory(model, held_sources(drafter, adapter), shape, rows, TOKENS)
    assert held <= estimate.cache <= 1.01 * held, (held, estimate.cache)
    alone = check_step_memory(
        model, held_sources(drafter), shape.runnable(True, False), rows, TOKENS
    )
    as_drafter = check_step_memory(
        model, held_sources(adapter), BeamShape.parse("W1xL4"), rows, TOKENS
    )
    plain_est = check_step_memory(model, held_sources(), AR, rows, TOKENS)
    assert estimate.weights - alone.weights == as_drafter.weights - plain_est.weights > 0
    assert estimate.cache > alone.cache
    in_slot = EarlyExitSource(adapter, part="chain").memory(model, shape, rows, 64)
    as_drafter = EarlyExitSource(adapter).memory(model, BeamShape.parse("W1xL4"), rows, 64)
    assert in_slot.step == head_bytes(rows, 1, model.vocab_size) and in_slot == as_drafter


def test_the_profile_prices_the_adapter_slot_as_the_early_exit_drafter():
    """``bench --profile``: the adapter in the draft slot has its state prefilled, its step
    profiled, and its reads priced by the early-exit drafter's rule (a forward of the first
    layers and the adapter, the head for each draft, and a refresh beside other sources)."""
    model, adapter = random_pair(3)
    drafter = tiny_drafter(model, 12)
    as_drafter = weight_bytes(model, held_sources(adapter), None)
    got = weight_bytes(model, held_sources(drafter, adapter), None)
    assert (got.chain_once, got.chain_step) == (as_drafter.drafter_once, as_drafter.drafter_step)
    assert replace(got, chain_once=0, chain_step=0) == weight_bytes(
        model, held_sources(drafter), None
    )
    # D1×L4: its first forward, three draft steps and a refresh
    expected = got.per_step(3) + 2 * got.chain_once + 3 * got.chain_step
    assert got.per_step(3, chain_steps=3, chain_refreshes=1) == expected
    shape = BeamShape.parse("W1xL3+D1xL4")
    sources = held_sources(drafter, adapter)
    data = profile_steps(model, sources, [shape], [1, 2, 3, 1, 2], repeats=1, loop_tokens=6,
                         loop_rounds=1)  # fmt: skip
    ar, row = data["rows"]
    assert row["step_kernels"] > ar["step_kernels"] > 0
    assert (row["chain_steps"], row["chain_refreshes"]) == (3, 1)
    assert "draft_model_forwards" not in row


# --------------------------------------------------------------------------- loading, CLI


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(model dir, recurrent drafter dir, early-exit adapter dir): a target transparent past
    layer 0 and an adapter with eta 0, so its chain drafts the target's greedy text."""
    root = tmp_path_factory.mktemp("ee_slot")
    model = tiny_model(seed=4, vocab=32000, hidden=32, layers=2)
    layer = model.model.layers[1]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    save_model_dir(model, root / "model", VICUNA_TOKENIZER)
    adapter = EE.new_adapter(model, 1, seed=0)
    adapter.args.extra["eta"] = 0.0
    save_adapter(root / "ee", adapter)
    save_drafter_dir(tiny_drafter(model, 12), root / "drafter")
    return str(root / "model"), str(root / "drafter"), str(root / "ee")


def test_load_takes_an_early_exit_folder_in_the_draft_slot(folders):
    model, drafter, ee = folders
    _, loaded_drafter, _, draft = load(model, drafter, draft_model=ee)
    assert isinstance(draft, EarlyExitAdapter) and draft.args.exit_layer == 1
    assert not isinstance(loaded_drafter, EarlyExitAdapter)
    with pytest.raises(LoadError, match="both as the drafter and as the draft model") as e:
        load(model, ee, draft_model=ee)
    assert ee in str(e.value)


def test_cli_generate_with_the_adapter_in_the_draft_slot(app, folders):
    model, drafter, ee = folders
    args = ["generate", "--model", model, "-p", "Hello there", "-n", 16, "--no-adapt"]
    plain_run = run_json(app, *args, "--no-draft")
    got = run_json(app, *args, "--drafter", drafter, "--draft-model", ee, "--no-lookup")
    assert got["tokens"] == plain_run["tokens"]
    assert got["beam"]["label"] == "W1×L4+D1×L4" and got["draft_model"] == ee
    stats = got["stats"]
    assert stats["source_tokens"]["early_exit"] > 0 and stats["source_tokens"]["draft_model"] == 0
    assert sum(stats["source_tokens"].values()) == stats["accepted_tokens"]
    merged = run_json(app, *args, "--drafter", drafter, "--draft-model", ee)
    assert merged["tokens"] == plain_run["tokens"]
    assert merged["beam"]["label"] == "W1×L4+K1×L8+D1×L4"
    both = invoke(app, *args, "--drafter", ee, "--draft-model", ee)
    assert both.exit_code != 0 and "both as the drafter and as the draft model" in both.output


def test_cli_chat_bench_and_serve_take_the_adapter_slot(app, folders, monkeypatch):
    """chat answers, bench measures (the chain's share reported) and serve loads the
    adapter into the draft slot and builds its server on it (stopped there: the test needs
    no server)."""
    from redrafter_mlx.cli import serve
    from redrafter_mlx.cli.bench_report import render_table
    from redrafter_mlx.cli.common import FlagError

    model, drafter, ee = folders
    slot = ["--model", model, "--drafter", drafter, "--draft-model", ee]
    chat = invoke(app, "chat", *slot, "-n", 8, input="hello\n")
    assert chat.exit_code == 0, chat.output
    assert "early exit" in chat.output
    data = run_json(app, "bench", *slot, "--configs", "W1xL4", "--num-prompts", 1,
                    "--max-tokens", 8)  # fmt: skip
    (row,) = [r for r in data["configs"] if r["config"] != "AR"]
    assert data["ok"] and row["config"] == "W1×L4+D1×L4"
    assert row["source_shares"]["early_exit"] > 0
    table = render_table(data["configs"], "bench")  # its share has a column of its own
    assert "exit" in [c.header for c in table.columns]
    lm = invoke(app, "bench", *slot, "--configs", "W1xL4", "--num-prompts", 1,
                "--max-tokens", 8, "--mlx-lm", "--json")  # fmt: skip
    assert lm.exit_code == 0, lm.output  # mlx-lm has no early-exit drafter: its plain run
    assert "mlx-lm has no early-exit drafter" in lm.output
    lm_rows = [r for r in json.loads(lm.stdout)["configs"] if r["config"] == "mlx-lm"]
    assert lm_rows and lm_rows[0]["tokens"] == 8
    assert "exit" not in [c.header for c in render_table(data["configs"][:1], "AR").columns]
    seen = []

    def build(engine, plan, *args, **kwargs):
        seen.append((type(engine.draft_model), plan.shape.label))
        raise FlagError("stopped before serving")

    monkeypatch.setattr(serve, "build", build)
    result = invoke(app, "serve", *slot, "--port", 0)
    assert "stopped before serving" in result.output
    assert seen and seen[0][0] is EarlyExitAdapter and seen[0][1].endswith("D1×L4")


def test_cli_tune_measures_the_adapter_slots_chain(app, folders, home):
    """``tune --draft-model <early-exit folder>``: the chain alone and beside the drafter's
    beams are measured (the adapter loaded into the draft slot), the chain alone drafting
    whole chains on the transparent target."""
    model, drafter, ee = folders
    data = run_json(app, "tune", "--model", model, "--drafter", drafter, "--draft-model", ee,
                    "--widths", 1, "--lengths", 3, "--draft-length", 3, "--no-lookup",
                    "--budget-seconds", 60, "--num-prompts", 1, "--max-tokens", 8,
                    "--prompts", "demo")  # fmt: skip
    rows = {row["label"]: row for row in data["shapes"]}
    assert {"D1×L3", "W1×L3+D1×L3"} <= set(rows)
    assert all(rows[label]["error"] is None for label in ("D1×L3", "W1×L3+D1×L3"))
    assert rows["D1×L3"]["tokens_per_step"] > 2.5
