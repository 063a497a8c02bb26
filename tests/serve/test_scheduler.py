"""The serving scheduler without HTTP: rows joining mid-generation equal solo runs."""

import random

import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.sources import LOOKUP
from redrafter_mlx.serve.scheduler import QueueFull, Request, Scheduler
from tests.support.models import run_decode, tiny_drafter, tiny_model
from tests.support.serving import Collector, drain


def solo(pair, prompt, max_tokens, shape, temperature=0.0, top_p=1.0, seed=None):
    model, drafter, tok = pair
    beam = dict(beam_width=shape.width, beam_length=shape.length) if shape else {}
    out, _ = run_decode(
        model,
        drafter if shape else None,
        [prompt],
        max_tokens=max_tokens,
        eos_token_ids=tok.eos_token_ids,
        sampler=SamplerConfig(temperature, top_p),
        seed=seed,
        **beam,
    )
    return out[0]


def test_rows_joining_mid_generation_equal_solo_runs(pair, prompts):
    """Three rows, six requests joining every few steps: slots are reused, outputs exact."""
    model, drafter, tok = pair
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=3)
    runs = []
    for i, prompt in enumerate(prompts):
        sink = Collector()
        sched.submit(Request(prompt, 20 + 12 * i, sink))
        runs.append((prompt, 20 + 12 * i, sink))
        for _ in range(2 + i % 3):
            sched.run_once()
    drain(sched)
    for prompt, max_tokens, sink in runs:
        assert sink.tokens == solo(pair, prompt, max_tokens, shape)
        assert sink.last.finish in ("stop", "length")
    assert sched.health()["max_rows_per_step"] == 3


def test_batch_grows_and_shrinks_with_rows_in_flight(pair, prompts):
    """Six requests at once (1 -> 2 -> 4 -> 8 rows), then only the long one is left: the
    batch shrinks to one row under it, and every output still equals its solo run."""
    model, drafter, tok = pair
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=8)
    lengths = [6, 6, 6, 6, 6, 70]
    sinks = [Collector() for _ in lengths]
    for prompt, n, sink in zip(prompts, lengths, sinks):
        sched.submit(Request(prompt, n, sink))
    sizes = []
    while sched.active_rows or sched.batch.pending is not None or sched.queue.qsize():
        sched.run_once()
        sizes.append(len(sched.rows))
    assert max(sizes) == 8 and 1 in sizes[sizes.index(8) :]
    for prompt, n, sink in zip(prompts, lengths, sinks):
        assert sink.tokens == solo(pair, prompt, n, shape)


@pytest.mark.parametrize("speculative", [True, False])
def test_mixed_sampling_rows_equal_seeded_solo_runs(pair, prompts, speculative):
    """Greedy and seeded sampled rows share steps; each equals its request alone."""
    model, drafter, tok = pair
    shape = BeamShape(2, 5) if speculative else None
    sched = Scheduler(model, drafter if speculative else None, shape, tok.eos_token_ids, 4)
    settings = [(0.0, 1.0), (0.8, 1.0), (1.0, 0.9), (0.7, 0.5)]
    runs = []
    for i, (temperature, top_p) in enumerate(settings):
        sink = Collector()
        sched.submit(Request(prompts[i], 40, sink, SamplerConfig(temperature, top_p, seed=100 + i)))
        runs.append((prompts[i], temperature, top_p, 100 + i, sink))
        sched.run_once()
    drain(sched)
    for prompt, temperature, top_p, seed, sink in runs:
        assert sink.tokens == solo(pair, prompt, 40, shape, temperature, top_p, seed)


def test_cancel_frees_the_row_and_the_next_request_is_exact(pair, prompts):
    model, drafter, tok = pair
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=1)
    first, second = Collector(), Collector()
    long = Request(prompts[0], 200, first)
    sched.submit(long)
    sched.submit(Request(prompts[1], 30, second))
    for _ in range(3):
        sched.run_once()
    assert sched.active_rows == 1 and sched.queue.qsize() == 1
    long.cancel()
    drain(sched)
    assert 0 < len(first.tokens) < 200 and first.last.finish is None
    assert second.tokens == solo(pair, prompts[1], 30, shape)
    assert sched.health()["requests_cancelled"] == 1


def test_queue_full_and_engine_failure(pair, prompts, monkeypatch):
    """A full queue refuses; an engine exception fails the rows in flight, not the queue."""
    model, drafter, tok = pair
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=1, max_queue=1)
    failed, queued = Collector(), Collector()
    sched.submit(Request(prompts[0], 50, failed))
    sched.run_once()  # joins row 0
    sched.submit(Request(prompts[1], 25, queued))
    with pytest.raises(QueueFull):
        sched.submit(Request(prompts[2], 5, Collector()))

    original = sched.batch.stepping.queue

    def boom(grants):
        monkeypatch.setattr(sched.batch.stepping, "queue", original)
        raise RuntimeError("injected")

    monkeypatch.setattr(sched.batch.stepping, "queue", boom)
    drain(sched)
    assert failed.last.error and "injected" in failed.last.error and failed.last.status == 500
    assert queued.tokens == solo(pair, prompts[1], 25, shape)
    assert sched.health()["engine_errors"] == 1


def test_long_prompt_prefills_a_chunk_per_step_while_rows_decode():
    """A 1100-token prompt (three chunks) joins while a row decodes: that row keeps getting
    tokens during the prefill, and both outputs equal their solo runs."""
    model = tiny_model(3, vocab=64, hidden=32)
    drafter = tiny_drafter(model, 4)
    shape = BeamShape(2, 3)
    rng = random.Random(0)
    short = [1] + [rng.randrange(64) for _ in range(10)]
    long = [1] + [rng.randrange(64) for _ in range(1100)]
    sched = Scheduler(model, drafter, shape, (), max_batch=2)
    a, b = Collector(), Collector()
    sched.submit(Request(short, 60, a))
    for _ in range(3):
        sched.run_once()
    sched.submit(Request(long, 20, b))
    during = []
    while not b.tokens:
        sched.run_once()
        during.append((len(a.tokens), sched.health()["prefilling"]))
    assert any(p for _, p in during) and during[-1][0] > during[0][0]
    drain(sched)
    beam = dict(beam_width=2, beam_length=3)
    assert a.tokens == run_decode(model, drafter, [short], max_tokens=60, **beam)[0][0]
    assert b.tokens == run_decode(model, drafter, [long], max_tokens=20, **beam)[0][0]


@pytest.mark.parametrize("with_drafter", [True, False], ids=["drafter+lookup", "lookup-alone"])
def test_rows_with_lookup_equal_solo_runs(pair, prompts, with_drafter):
    """Rows with different histories join and leave; each row's lookup reads its own text
    (its prompt from the join on), and greedy output equals plain decoding."""
    model, drafter, tok = pair
    shape = BeamShape(1, 3, None, 1, 6) if with_drafter else BeamShape.lookup_only(2, 5)
    sched = Scheduler(model, drafter if with_drafter else None, shape, tok.eos_token_ids, 3)
    runs = []
    for i, prompt in enumerate(prompts):
        sink = Collector()
        sched.submit(Request(prompt, 24 + 10 * i, sink))
        runs.append((prompt, 24 + 10 * i, sink))
        for _ in range(1 + i % 3):
            sched.run_once()
    drain(sched)
    for prompt, max_tokens, sink in runs:
        assert sink.tokens == solo(pair, prompt, max_tokens, None)
    stats = [sink.last.stats for _, _, sink in runs]
    assert sum(s.by_source[LOOKUP] for s in stats) > 0  # lookup chains were accepted
    spec = stats[0].to_dict()
    assert (
        spec["accepted_from_lookup"] + spec["accepted_from_drafter"]
        == spec["accepted_draft_tokens"]
    )
    drafted = stats[0].steps * (shape.longest - 1)  # every step ran the one shape
    assert spec["acceptance_rate"] == round(stats[0].accepted_drafts / drafted, 4)


def test_a_request_failing_on_its_own_ends_alone(pair, prompts, monkeypatch):
    """A queued request whose seed the engine cannot key (-1, past the door's check) and one
    whose prefill raises each get an error event; the rows around them equal solo runs."""
    import redrafter_mlx.engine.loop.prefilling as prompts_module

    model, drafter, tok = pair
    prefill = prompts_module.prefill_session

    def faulty(session, chunks):
        if chunks[0] == prompts[3]:
            raise RuntimeError("injected prefill fault")
        return prefill(session, chunks)

    monkeypatch.setattr(prompts_module, "prefill_session", faulty)
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=4)
    good = [Collector() for _ in range(3)]
    bad_seed, bad_prefill = Collector(), Collector()
    sched.submit(Request(prompts[0], 30, good[0]))
    sched.run_once()
    sched.queue.put(
        Request(prompts[1], 30, bad_seed, SamplerConfig(seed=-1))
    )  # as if check() missed it
    sched.submit(Request(prompts[2], 30, good[1]))
    sched.submit(Request(prompts[3], 30, bad_prefill))
    sched.submit(Request(prompts[4], 30, good[2]))
    drain(sched)
    for i, sink in enumerate(good):
        assert sink.last.finish in ("stop", "length"), sink.last
        assert sink.tokens == solo(pair, prompts[2 * i], 30, shape)
    for sink in (bad_seed, bad_prefill):
        assert sink.last.error and sink.last.status == 500 and sink.tokens == []
    health = sched.health()
    assert health["engine_errors"] == 0 and health["request_errors"] == 2


def test_a_batch_fault_answers_every_request_once(pair, prompts, monkeypatch):
    """A fault while a request joins the batch (after its first token) fails the batch:
    that request and the running row each get one error event; the queue goes on."""
    model, drafter, tok = pair
    shape = BeamShape(2, 4)
    sched = Scheduler(model, drafter, shape, tok.eos_token_ids, max_batch=2)
    running, joining, queued = Collector(), Collector(), Collector()
    events = []
    sched.submit(Request(prompts[0], 40, running))
    sched.run_once()
    sched.submit(Request(prompts[1], 40, lambda ev: (events.append(ev), joining(ev))))
    original = sched.batch.batch_state._place

    def boom(*args):
        monkeypatch.setattr(sched.batch.batch_state, "_place", original)
        raise RuntimeError("injected batch fault")

    monkeypatch.setattr(sched.batch.batch_state, "_place", boom)
    sched.run_once()
    sched.submit(Request(prompts[2], 20, queued))
    drain(sched)
    assert "injected" in running.last.error and "injected" in joining.last.error
    assert len(events) == 1  # one reply, not none and not two
    assert queued.tokens == solo(pair, prompts[2], 20, shape)
    assert sched.health()["engine_errors"] == 1


def test_scheduler_refuses_seeds_it_cannot_key(pair, prompts):
    model, drafter, tok = pair
    sched = Scheduler(model, drafter, BeamShape(2, 4), tok.eos_token_ids, max_batch=1)
    for seed in (-1, 2**64, 1e23, True):
        with pytest.raises(ValueError, match="seed"):
            sched.submit(Request(prompts[0], 5, Collector(), SamplerConfig(seed=seed)))
    sched.submit(Request(prompts[0], 5, Collector(), SamplerConfig(seed=2**64 - 1)))


def test_a_dead_engine_loop_answers_everyone_and_refuses_new_requests(monkeypatch):
    """A failure while recovering from a failure ends the loop: the request in flight and
    the queued one get an error event (none waits forever); new ones get ShuttingDown."""
    import threading

    from redrafter_mlx.engine.core import tree
    from redrafter_mlx.serve.scheduler import ShuttingDown

    tree._chain_mask.cache_clear()  # see the note in test_serve_hostile.server
    model = tiny_model(3, vocab=64, hidden=32)
    sched = Scheduler(model, None, None, (), max_batch=1)
    gate = threading.Event()

    def boom(grants):
        gate.wait(10)  # until both requests are in
        monkeypatch.setattr(sched, "_reset", lambda: 1 / 0)
        raise RuntimeError("injected step fault")

    monkeypatch.setattr(sched.batch.stepping, "queue", boom)
    sched.start()
    try:
        running, queued = Collector(), Collector()
        sched.submit(Request([1, 2, 3], 50, running))
        sched.submit(Request([1, 4, 5], 50, queued))
        gate.set()
        sched._thread.join(10)
        assert not sched._thread.is_alive() and "ZeroDivisionError" in sched.failure
        assert "injected" in running.last.error and "ZeroDivisionError" in queued.last.error
        with pytest.raises(ShuttingDown, match="engine stopped"):
            sched.submit(Request([1, 2], 5, Collector()))
        assert sched.health()["failure"] == sched.failure
    finally:
        gate.set()
        sched.stop()
        tree._chain_mask.cache_clear()
