"""Adaptive beam shape: switching shapes mid-generation stays exact, and the chooser goes to
plain decoding when drafts stop being accepted and back when they are accepted again.

Step costs are injected (``Adaptive(step_cost=...)``) so the decisions are deterministic.
"""

import random
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import pytest

from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.drafting.drafter import DrafterArgs
from redrafter_mlx.engine.loop.adaptive import Adaptive, ShapeChooser
from redrafter_mlx.engine.loop.generation import generate_steps
from tests.support.models import near_bigram_model, run_decode, tiny_drafter, tiny_model


class NoisyOracle(nn.Module):
    """An oracle drafter (the model's attention-free next token) plus ``noise``, as a module:
    the compiled step reads ``noise`` at every call, so a test can change it mid-generation."""

    def __init__(self, model, noise: float, seed: int = 3):
        super().__init__()
        self.args = DrafterArgs(model.vocab_size, model.hidden_size, 2 * model.hidden_size)
        self.noise = noise * mx.random.normal(
            (model.hidden_size, model.vocab_size), key=mx.random.key(seed)
        )

        def oracle(state):
            x = state
            for layer in model.model.layers:
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            return model.model.norm(x)

        self._oracle = oracle
        self._logits = model.logits

    def next_state(self, state, token_emb):
        return token_emb

    def __call__(self, hidden, state):
        h = self._oracle(state)
        return self._logits(h) + h @ self.noise


def toggling_costs(period: int):
    """Step costs that flip every ``period`` observed steps between 'AR cheap' and
    'speculation cheap', so an adaptive run keeps switching."""
    calls = {"n": 0}

    def cost(shape):
        calls["n"] += 1
        ar_cheap = (calls["n"] // period) % 2 == 0
        if shape.is_autoregressive:
            return 0.2 if ar_cheap else 1.0
        return 5.0 if ar_cheap else 0.3

    return cost


@pytest.mark.parametrize("seed", range(8))
def test_switching_mid_generation_equals_autoregressive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([16, 32, 64])
    if seed % 2:
        model = tiny_model(seed, vocab=vocab, hidden=32, layers=2, kv_heads=rng.choice([1, 2]))
        drafter = tiny_drafter(model, seed + 100, layers=1)
    else:
        model = near_bigram_model(seed, attn_scale=0.005, vocab=vocab, hidden=32)
        drafter = NoisyOracle(model, noise=rng.choice([0.0, 0.3]), seed=seed)
    B = rng.randint(1, 3)
    prompts = [[1] + [rng.randrange(vocab) for _ in range(rng.randint(0, 10))] for _ in range(B)]
    W, L = rng.randint(1, 4), rng.randint(2, 5)
    adapt = Adaptive(every=1, probe=2, step_cost=toggling_costs(3))
    ar, _ = run_decode(model, None, prompts, max_tokens=40)
    rd, _ = run_decode(model, drafter, prompts, max_tokens=40, shape=BeamShape(W, L), adapt=adapt)
    assert rd == ar, f"case {seed}: W{W} L{L} B={B}"
    ran = set(adapt.history)
    assert AR in ran and ran - {AR}, adapt.history  # it really switched mid-generation


def test_batch_rows_equal_rows_alone_while_switching():
    model = near_bigram_model(4, attn_scale=0.005, vocab=32, hidden=32)
    drafter = NoisyOracle(model, noise=0.3)
    prompts = [[1, 4, 5, 6, 7, 8, 9], [1], [1, 3, 3]]
    kw = dict(max_tokens=30, shape=BeamShape(3, 4))
    together, _ = run_decode(
        model, drafter, prompts, adapt=Adaptive(every=1, probe=2, step_cost=toggling_costs(2)), **kw
    )
    for p, row in zip(prompts, together):
        alone, _ = run_decode(model, None, [p], max_tokens=30)
        assert alone[0] == row


def test_goes_to_plain_decoding_when_drafts_fail_and_back_when_they_return():
    """Drafts turn useless (huge noise) mid-generation, then good again (no noise)."""
    model = near_bigram_model(2, attn_scale=0.005, vocab=32, hidden=32)
    drafter = NoisyOracle(model, noise=0.0)
    good = drafter.noise
    # A speculative step costs 1.5 AR steps: it pays with >= 2 tokens/step, not with 1.
    adapt = Adaptive(
        every=2, probe=4, max_probe=8, step_cost=lambda s: 1.0 if s.is_autoregressive else 1.5
    )
    prompt = [[1] + list(range(2, 12))]
    tokens, phases = [], []
    events = generate_steps(
        model, drafter, prompt, max_tokens=260, shape=BeamShape(2, 4), adapt=adapt
    )
    for i, ev in enumerate(events):
        tokens += ev.tokens[0]
        if i == 20:  # unpredictable from here on
            drafter.noise = 50.0 * mx.random.normal(good.shape, key=mx.random.key(7))
            phases.append(len(adapt.history))
        if i == 80:  # predictable again
            drafter.noise = good
            phases.append(len(adapt.history))
    ar, _ = run_decode(model, None, prompt, max_tokens=260)
    assert tokens == ar[0]
    h = adapt.history
    first, bad, back = h[: phases[0]], h[phases[0] + 4 : phases[1]], h[phases[1] + 4 :]
    assert first.count(AR) <= 2  # good drafts: speculating (AR measured once at most)
    assert bad[-20:].count(AR) >= 15  # useless drafts: mostly plain decoding (with probes)
    assert back[-20:].count(AR) <= 2  # drafts are good again: back to speculating
    moves = [(a.is_autoregressive, b.is_autoregressive) for _, a, b in adapt.chooser.switches]
    assert (False, True) in moves and (True, False) in moves


def test_chooser_prefers_the_best_expected_rate():
    W1L4, W2L4 = BeamShape(1, 4), BeamShape(2, 4)
    c = ShapeChooser([AR, W2L4, W1L4], costs={AR: 1.0, W2L4: 2.0, W1L4: 1.5}, every=1)
    assert c.current == W2L4
    for _ in range(10):  # every W2L4 step accepts its whole beam: a -> 1, 4 tokens/step
        c.observe(W2L4, [4], 2.0)
    assert c.tokens_per_step(W2L4) == pytest.approx(4.0, rel=0.01)
    # W1L4 borrows the estimate (same length, unseen width): 4 / 1.5 beats 4 / 2.
    assert c.next_shape() == W1L4
    for _ in range(20):  # nothing accepted any more: AR (1 / 1.0) is best
        c.observe(W1L4, [1], 1.5)
    assert c.next_shape() == AR


def test_default_candidates_are_the_shape_and_every_shorter_single_beam():
    W2L4 = BeamShape(2, 4)
    assert Adaptive().candidates(W2L4) == [
        AR,
        W2L4,
        BeamShape(1, 4),
        BeamShape(1, 3),
        BeamShape(1, 2),
    ]
    assert Adaptive().candidates(BeamShape(1, 2)) == [AR, BeamShape(1, 2)]
    assert Adaptive().candidates(AR) == [AR]


def test_chooser_takes_a_shorter_beam_when_verifying_more_tokens_costs_their_price():
    """CPU-like costs: each verified token adds ~20% of an AR step. With 40% acceptance
    W1xL4 (1.62 tokens / 1.6) barely beats AR, W1xL2 (1.4 tokens / 1.2) clearly does."""
    W1L4, W1L2 = BeamShape(1, 4), BeamShape(1, 2)
    c = ShapeChooser([AR, W1L4, W1L2], costs={AR: 1.0, W1L4: 1.6, W1L2: 1.2}, every=1)
    rng = random.Random(0)
    for _ in range(40):  # each draft position accepted with probability 0.4 (a chain)
        n = 1
        while n < 4 and rng.random() < 0.4:
            n += 1
        c.observe(W1L4, [n], 1.6)
    assert 0.3 < c.acceptance(W1L2) < 0.5
    assert c.next_shape() == W1L2


def test_a_working_drafter_is_not_locked_out_by_a_few_unlucky_steps():
    """Each-step choice (the loop with lookup, every row unmatched): a drafter whose W1xL2
    makes 1.45 tokens per 1.2-AR-step beats plain decoding by 21% on average, but its steps
    emit 1 or 2 tokens at random. A record that follows the last few steps drops below AR
    after a short unlucky run, and then only probes bring it back: with records decayed at
    0.8 per step (the lookup shadow's rate) this spent 81% of 600 steps in plain decoding
    over these seeds; the records of shapes that ran now decay slower (``run_decay``)."""
    W1L2, W1L3 = BeamShape(1, 2), BeamShape(1, 3)
    plain = []
    for seed in range(10):
        c = ShapeChooser([AR, W1L3, W1L2], costs={AR: 1.0, W1L3: 1.35, W1L2: 1.2})
        rng, ar = random.Random(seed), 0
        for _ in range(600):
            shape = c.next_shape([0])
            tokens = 1
            if shape == AR:
                ar += 1
            while tokens < shape.length and rng.random() < 0.45:
                tokens += 1
            c.observe(shape, [tokens], c.cost[shape])
        plain.append(ar / 600)
    assert sum(plain) / len(plain) < 0.6  # 0.445 at run_decay 0.9 (0.81 at 0.8)


def test_a_shapes_first_call_is_not_timed_as_a_step():
    """The loop keeps one step in flight: it queues a step, then reads the one before it. A
    shape's first call compiles it inside that interval, which is no step time of the shape
    being read."""
    import time

    from redrafter_mlx.engine.loop.batch_choice import SoloChoice

    W1L2 = BeamShape(1, 2)
    plan = SoloChoice(object(), object(), W1L2, None, Adaptive(shapes=[W1L2], every=10**6))
    queued = [plan.next(1, [], False)]
    for _ in range(4):  # W1L2 steps of ~10 ms
        queued.append(plan.next(1, [], False))
        time.sleep(0.01)
        plan.finished(1, queued.pop(0), [1], None)
    before = plan.chooser.cost[W1L2]
    assert before is not None and before < 0.03
    plan.chooser._switch(AR)
    queued.append(plan.next(1, [], False))  # AR's first call "compiles" for 25 ms before the last
    time.sleep(0.025)  # W1L2 step is read
    plan.finished(1, queued.pop(0), [1], None)
    assert plan.chooser.cost[W1L2] == before
    queued.append(plan.next(1, []))
    time.sleep(0.01)
    plan.finished(1, queued.pop(0), [1], None)  # AR's own step is timed
    assert plan.chooser.cost[AR] is not None and plan.chooser.cost[AR] < 0.03


def busy_steps(chooser, shape, tokens: list[int], seconds: list[float]) -> None:
    """``chooser`` observes steps of ``shape`` emitting ``tokens`` in ``seconds`` each."""
    for n, s in zip(tokens, seconds):
        chooser.observe(shape, [n], s)


@pytest.mark.parametrize("window", [5, 0])
def test_a_busy_moment_does_not_price_a_working_drafter_out(window):
    """Noise in a step's wall time only adds time (another process, a stall). W1xL2 makes 1.5
    tokens per 1.2-AR-step (1.25x plain decoding); three of its steps run while the machine
    is busy (2.5x their time, under the outlier rule's 3x). The least of the recent times
    (``cost_window``) keeps its price, so it keeps running; an average of them (window 0,
    the rule before) priced it below plain decoding and left it."""
    W1L2 = BeamShape(1, 2)
    c = ShapeChooser([AR, W1L2], costs={AR: 1.0, W1L2: 1.2}, every=1, cost_window=window)
    busy_steps(c, W1L2, [1, 2] * 5, [1.2] * 10)
    assert c.next_shape() == W1L2
    busy_steps(c, W1L2, [2, 1, 2], [3.0] * 3)
    if window:
        assert c.cost[W1L2] == pytest.approx(1.2)
        assert c.next_shape() == W1L2
    else:
        assert c.cost[W1L2] > 2.0
        assert c.next_shape() == AR


def test_the_cost_window_follows_a_lasting_change():
    """A step that really became dearer (a longer context) is priced at its new time once
    ``cost_window`` steps have run at it; a cheaper one at once."""
    W1L2 = BeamShape(1, 2)
    c = ShapeChooser([AR, W1L2], costs={AR: 1.0, W1L2: 1.2}, cost_window=3)
    busy_steps(c, W1L2, [2, 2], [2.0, 2.0])
    assert c.cost[W1L2] == pytest.approx(1.2)  # the seed is still among the last three
    busy_steps(c, W1L2, [2], [2.0])
    assert c.cost[W1L2] == pytest.approx(2.0)
    busy_steps(c, W1L2, [2], [0.9])
    assert c.cost[W1L2] == pytest.approx(0.9)


def ar_steps_to_probe(c: ShapeChooser, limit: int = 100) -> int:
    """Plain-decoding steps the chooser queues before its next probe (which loses: one
    token), observed one by one."""
    for n in range(limit):
        shape = c.next_shape()
        c.observe(shape, [1], c.cost[shape])
        if shape != AR:
            return n
    return limit


@pytest.mark.parametrize("reset", [True, False])
def test_a_new_generation_probes_from_the_start_again(reset):
    """Probes that lose space out (2, 4, 8 plain steps here); the next generation (a new
    answer, a chat's next turn) starts the spacing over with ``reset_probe``, instead of
    leaving the drafter unmeasured for ``max_probe`` steps of text it has not seen."""
    W1L2 = BeamShape(1, 2)
    c = ShapeChooser(
        [AR, W1L2], costs={AR: 1.0, W1L2: 2.0}, every=1, probe=2, max_probe=8, start=AR
    )
    c.reset_probe = reset
    assert [ar_steps_to_probe(c) for _ in range(4)] == [1, 3, 7, 7]
    c.resume()
    assert ar_steps_to_probe(c) == (1 if reset else 7)


@pytest.mark.parametrize("steady", [True, False])
def test_a_drafter_is_probed_while_plain_decoding_and_chains_take_turns(steady):
    """Fresh text with a match now and then: the per-step choice runs lookup chains on a
    match and plain decoding elsewhere, switching every few steps. A drafter that looked
    useless after an unlucky start (it really emits 2 tokens per 1.2-AR-step) must still be
    probed. The count to the next probe used to restart at every switch, so it never came
    due: the drafter ran once in 300 steps (``steady_probe`` False, the rule before); it
    now counts every step no model drafted, and the drafter is back within a probe."""
    W1L2, chains = BeamShape(1, 2), BeamShape.lookup_only(1, 8)
    c = ShapeChooser(
        [AR, chains, W1L2], costs={AR: 1.0, chains: 1.4, W1L2: 1.2}, steady_probe=steady
    )
    for _ in range(6):
        c.observe_lookup([(2, 4), (0, 0)])  # a 2-token match: 4 drafts accepted; none: 0
    for _ in range(8):
        c.observe(W1L2, [1], 1.2)
    ran = Counter()
    for i in range(300):
        match = 2 if i % 3 == 2 else 0
        shape = c.next_shape([match])
        ran[shape] += 1
        tokens = {AR: 1, W1L2: 2, chains: 5 if match == 2 else 1}[shape]
        c.observe(shape, [tokens], c.cost[shape])
        c.observe_lookup([(match, 4 if match == 2 else 0)])
    if steady:
        assert ran[W1L2] > 150 and ran[AR] < 50
    else:
        assert ran[W1L2] <= 2 and ran[AR] > 150
