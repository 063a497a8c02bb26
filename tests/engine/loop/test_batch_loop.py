"""The engine's one loop (``batch.BatchGenerator``): any shape policy drives it through the
declared interface, and every client (generation, the server) reads and queues in the one
per-backend order."""

import pytest

from redrafter_mlx.engine.base.platform import READ_FIRST_ENV
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop import batch as batch_module
from redrafter_mlx.engine.loop.batch import BatchGenerator
from redrafter_mlx.engine.loop.prefilling import Prefill
from redrafter_mlx.engine.loop.rows import Row, RowStats
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.loop import Scripted
from tests.support.models import near_bigram_model, run_decode, tiny_drafter

PROMPT = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]


def test_any_policy_drives_the_batch_and_greedy_rows_stay_exact():
    """The batch asks its policy for every step's shape and tells it what each step gave,
    whatever its type (no ``None`` or type test inside): a cycle of plain decoding, a
    drafter tree and lookup chains gives the plain-decoding tokens of a row that joined."""
    model = near_bigram_model(seed=2, vocab=16)
    drafter = tiny_drafter(model, 3)
    cycle = [AR, BeamShape(2, 3), BeamShape.lookup_only(1, 4), BeamShape(1, 3, None, 1, 4)]
    policy = Scripted(cycle)
    batch = BatchGenerator(model, held_sources(drafter), policy, eos=(), max_batch=2)
    batch.reset()
    assert policy.resets == 1
    row = Row(SamplerConfig(), 30, len(PROMPT), RowStats(len(PROMPT)))
    batch.insert(Prefill([PROMPT], SamplerConfig(), 0, Session(model, 1), rows=[row]))
    turn = batch.next()  # prefilled, joined (its first token), step 1 queued
    assert [got.row for got in turn.joined] == [row] and not turn.stepped and not turn.failed
    out = turn.joined[0].new
    for _ in range(100):
        if row.finished:
            break
        out += [t for got in batch.next().stepped for t in got.new]
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=30, shape=AR, adapt=False)
    assert out == plain[0]
    ran = [shape for shape, _ in policy.told]
    assert ran == [cycle[i % len(cycle)] for i in range(len(ran))]  # each step as named
    counted = sum(sum(c) for _, c in policy.told)  # what each step gave (past the limit too)
    assert counted == row.stats.emitted_by_steps >= 29  # every token after the first
    assert len(ran) >= 4


@pytest.mark.parametrize("first", ["0", "1"])
def test_the_server_orders_its_reads_like_the_solo_loop(monkeypatch, first):
    """The server's batches follow the solo loop's per-backend rule: with the
    per-step choice (adaptive, lookup chains) step k+1 is queued before step k is read
    where ``REDRAFTER_MLX_READ_FIRST=0`` (a GPU's default). Before, the scheduler read
    first whenever shapes adapted, so the server never pipelined. Tokens stay exact."""
    monkeypatch.setenv(READ_FIRST_ENV, first)
    model = near_bigram_model(seed=2, vocab=16)
    drafter = tiny_drafter(model, 3)
    shape = BeamShape(1, 3, None, 1, 4)
    sched = Scheduler(model, drafter, shape, (), max_batch=2, adapt=True)
    assert sched.choice.each_step
    reads, real = [], batch_module.BatchGenerator.read

    def read(self, step):
        reads.append((self.stepping.inflight, len(self.active)))  # steps not read; rows held
        return real(self, step)

    monkeypatch.setattr(batch_module.BatchGenerator, "read", read)
    tokens = []
    sched.submit(Request(PROMPT, 40, lambda ev: tokens.extend(ev.tokens)))
    for _ in range(1000):
        if not (sched.active_rows or sched.batch.pending is not None or sched.queue.qsize()):
            break
        sched.run_once(0.0)
    busy = [n for n, rows in reads if rows]  # reads while a row still ran
    assert len(busy) > 10
    assert all(n == (1 if first == "1" else 2) for n in busy), reads
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=40, shape=AR, adapt=False)
    assert tokens == plain[0]
