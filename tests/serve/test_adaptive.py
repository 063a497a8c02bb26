"""The server's adaptive beam shape (``engine/loop/batch_choice.py``): each batch step's shape
is chosen from measured step costs and the rows' lookup match states, and every row's output stays
what it is alone: plain decoding's for greedy rows, the asked shape's for seeded samples.

Step costs are injected (``Adaptive(step_cost=...)``) so the decisions are deterministic.
"""

import random

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.sources import LOOKUP
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.lookup import phased_costs, repetitive_prompts
from tests.support.models import near_bigram_model, run_decode, tiny_drafter, tiny_model
from tests.support.serving import Collector, drain


def plain(model, prompt, n):
    return run_decode(model, None, [prompt], max_tokens=n)[0][0]


def test_rows_equal_plain_decoding_while_the_batch_switches_shapes():
    """Costs that make each shape win in turn; five requests join a 3-row batch at different
    steps (batch sizes 1, 2 and 3, each with its own chooser): every row equals plain
    decoding and the batch ran plain decoding, drafter beams and lookup chains."""
    model = tiny_model(4, vocab=16, hidden=32, layers=1)
    drafter = tiny_drafter(model, 5)
    shapes = [BeamShape(1, 3), BeamShape(1, 3, None, 1, 6), BeamShape.lookup_only(1, 6)]
    cost = phased_costs([AR, *shapes], 5)
    adapt = Adaptive(shapes=shapes, step_cost=cost, every=2, probe=2)
    sched = Scheduler(model, drafter, shapes[1], (), max_batch=3, adapt=adapt)
    prompts = repetitive_prompts(random.Random(7), 16, 5)
    runs = []
    for i, prompt in enumerate(prompts):
        sink = Collector()
        sched.submit(Request(prompt, 30 + 7 * i, sink))
        runs.append((prompt, 30 + 7 * i, sink))
        for _ in range(2 + i):
            sched.run_once()
    drain(sched)
    for prompt, n, sink in runs:
        assert sink.last.finish == "length"
        assert sink.tokens == plain(model, prompt, n)
    ran = sched.choice.ran
    assert {AR, *shapes} <= set(ran), ran  # it really switched
    assert len(sched.choice.choosers) == 3  # one per batch size
    assert sum(sink.last.stats.by_source[LOOKUP] for *_, sink in runs) > 0
    health = sched.health()
    assert health["adaptive"] and sum(health["shape_steps"].values()) == sum(ran.values())
    assert set(health["step_ms"]) == {"1", "2", "3"}  # step costs learnt per batch size


def test_each_step_follows_its_rows_match_state():
    """Lookup alone (no drafter): a row copying a passage runs the long chain, fresh text
    runs plain decoding (they cost less there), and the output is plain decoding's."""
    model = near_bigram_model(8, attn_scale=0.005, vocab=16, hidden=32, layers=1)
    copying = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] * 3 + [9, 3, 7]
    shape = BeamShape.lookup_only(1, 4)
    long_chain = BeamShape.lookup_only(1, 8)
    costs = {AR: 1.0, shape: 1.3, long_chain: 1.45}
    adapt = Adaptive(step_cost=lambda s: costs[s])
    sched = Scheduler(model, None, shape, (), max_batch=1, adapt=adapt)
    assert sched.choice.shapes == [AR, shape, long_chain]
    sink = Collector()
    sched.submit(Request(copying, 80, sink))
    drain(sched)
    assert sink.tokens == plain(model, copying, 80)
    assert sched.choice.ran[long_chain] > 2 and sched.choice.ran[AR] > 2, sched.choice.ran
    assert sink.last.stats.by_source[LOOKUP] > 0


def test_a_seeded_sampled_row_runs_the_asked_shape():
    """Plain decoding costs least, so greedy rows run it; while a row samples with its own
    seed the batch runs the asked shape, whose step-by-step draws ``generate --seed`` gives
    (that row alone with the shape pinned; plain decoding would draw otherwise)."""
    model = tiny_model(6, vocab=32, hidden=32, layers=2)
    drafter = tiny_drafter(model, 7)
    shape = BeamShape(2, 3)
    costs = {AR: 1.0}
    adapt = Adaptive(step_cost=lambda s: costs.get(s, 5.0))
    sched = Scheduler(model, drafter, shape, (), max_batch=2, adapt=adapt)
    greedy_prompt, sampled_prompt = [1, 5, 9, 2, 7], [1, 3, 3, 8]
    greedy, sampled = Collector(), Collector()
    sched.submit(Request(greedy_prompt, 80, greedy))
    for _ in range(40):  # until every candidate has run and plain decoding won
        sched.run_once()
        if sched.choice.chooser(1).current == AR and len(sched.choice.ran) > 3:
            break
    assert sched.choice.chooser(1).current == AR and len(sched.choice.ran) > 3
    sched.submit(Request(sampled_prompt, 24, sampled, SamplerConfig(temperature=0.9, seed=5)))
    drain(sched)
    assert greedy.tokens == plain(model, greedy_prompt, 80)

    def alone(s):
        kw = dict(max_tokens=24, sampler=SamplerConfig(0.9), seed=5, shape=s, adapt=False)
        return run_decode(model, drafter if s.drafts else None, [sampled_prompt], **kw)[0][0]

    assert sampled.tokens == alone(shape)
    assert alone(AR) != alone(shape)  # the pin decides these draws: the check has power
