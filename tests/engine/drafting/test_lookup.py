"""Context lookup: chains against a brute-force search, packing with absent tokens against a
trie, and losslessness with lookup in the tree (greedy identity, exact sampling)."""

import random

import mlx.core as mx
import pytest

from redrafter_mlx.engine.core.sampling import StepMode
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.core.tree import pack
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.step import batch_step
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.drafting.lookup import ABSENT, lookup_chains
from redrafter_mlx.engine.loop.adaptive import Adaptive
from redrafter_mlx.engine.loop.generation import generate_steps
from tests.support.lookup import phased_costs, repetitive_prompts
from tests.support.models import (
    OracleDrafter,
    near_bigram_model,
    run_decode,
    tiny_drafter,
    tiny_model,
)
from tests.support.tree import brute_force


def periodic(text, p, n):
    """The ``n`` tokens after position ``p``, the text continued past its end as a repetition
    of its part after ``p`` (one token at a time: each token past the end copies the token
    ``len(text) - 1 - p`` positions before it)."""
    out = list(text)
    period = len(text) - 1 - p
    while len(out) < p + 1 + n:
        out.append(out[-period])
    return out[p + 1 : p + 1 + n]


def brute_chains(text, chains, length, max_ngram=4):
    """Plain Python: rank earlier positions by (suffix match, position), distinct next tokens."""
    end = len(text) - 1  # the init token's position
    found = []
    for p in range(end):
        m = 0
        while m < max_ngram and p - m >= 0 and text[p - m] == text[end - m]:
            m += 1
        if m >= 1:
            found.append((m, p))
    found.sort(reverse=True)
    out, firsts = [], set()
    for m, p in found:
        if len(out) == chains:
            break
        if text[p + 1] in firsts:
            continue
        firsts.add(text[p + 1])
        out.append(([text[end]] + periodic(text, p, length - 1), m))
    while len(out) < chains:
        out.append(([text[end]] + [ABSENT] * (length - 1), 0))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_lookup_chains_match_brute_force(seed):
    rng = random.Random(seed)
    vocab = rng.choice([2, 3, 5, 12])
    B, K, Lk = rng.randint(1, 3), rng.randint(1, 3), rng.randint(2, 7)
    texts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 30))] for _ in range(B)]
    S = 40
    history = mx.array(
        [t[:-1] + [rng.randrange(vocab) for _ in range(S - len(t) + 1)] for t in texts]
    )
    lengths = mx.array([len(t) - 1 for t in texts])
    init = mx.array([t[-1] for t in texts])
    got = lookup_chains(history, lengths, init, K, Lk)
    for b, text in enumerate(texts):
        want = brute_chains(text, K, Lk)
        for k, (tokens, m) in enumerate(want):
            assert got.tokens[b, k].tolist() == tokens, (b, k, text)
            assert got.match[b, k].item() == m
            assert got.present[b, k].tolist() == [t != ABSENT for t in tokens]


@pytest.mark.parametrize("seed", range(20))
def test_pack_with_absent_tokens_matches_trie(seed):
    """Absent tokens take no slot: the tree equals the trie of the present prefixes."""
    rng = random.Random(seed)
    W, L = rng.randint(2, 6), rng.randint(2, 6)
    rows, present = [], []
    for _ in range(rng.randint(1, 3)):
        beams, keep = [], []
        for _ in range(W):
            n = rng.randint(1, L)
            beams.append([7] + [rng.randrange(3) for _ in range(n - 1)] + [ABSENT] * (L - n))
            keep.append([k < n for k in range(L)])
        rows.append(beams), present.append(keep)
    C = rng.randint(L, W * L)
    tree = pack(mx.array(rows), C, mx.array(present))
    for b, beams in enumerate(rows):
        # The trie of present tokens only: absent ones never own a prefix.
        trimmed = [[t for t in beam if t != ABSENT] for beam in beams]
        slots, tokens = {}, []
        for beam in trimmed:
            for k in range(len(beam)):
                if tuple(beam[: k + 1]) not in slots:
                    slots[tuple(beam[: k + 1])] = len(slots)
                    tokens.append(beam[k])
        n = min(len(tokens), C)
        assert tree.tokens[b, :n].tolist() == tokens[:n]
        assert tree.valid[b].tolist() == [True] * n + [False] * (C - n)
        for i, beam in enumerate(trimmed):
            for k in range(L):
                slot = tree.unpacker[b, i, k].item()
                if k >= len(beam):
                    assert slot == C  # absent: no slot, never matches
                elif slots[tuple(beam[: k + 1])] < C:
                    assert slot == slots[tuple(beam[: k + 1])]
    # With every token present the result is the plain pack's.
    full = [[[7] + [rng.randrange(3) for _ in range(L - 1)] for _ in range(W)]]
    a, b = pack(mx.array(full), C), pack(mx.array(full), C, mx.ones((1, W, L), mx.bool_))
    assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
    assert brute_force(full[0], C)[1] == a.tokens[0, : len(brute_force(full[0], C)[1])].tolist()


LOOKUP_SHAPES = [
    BeamShape(1, 3, None, 1, 5),
    BeamShape(2, 3, None, 2, 4),
    BeamShape(1, 4, 4, 1, 6),  # room for one chain: each row picks the beam or the chain
    BeamShape(1, 4, 6, 1, 8),  # capacity short: the ranking decides who keeps the slots
    BeamShape(2, 4, 5, 2, 8),
    BeamShape.lookup_only(1, 5),
    BeamShape.lookup_only(2, 4),
    BeamShape.lookup_only(1, 6, 4),
]


@pytest.mark.parametrize("seed", range(12))
def test_greedy_with_lookup_equals_autoregressive(seed):
    rng = random.Random(seed)
    vocab = rng.choice([12, 16, 32])
    bigram = seed % 3 != 0  # its answers cycle, so lookup chains get accepted
    if bigram:
        model = near_bigram_model(seed, attn_scale=0.005, vocab=vocab, hidden=32, layers=1)
        drafter = OracleDrafter(model, noise=1.0, seed=seed)
    else:
        model = tiny_model(seed, vocab=vocab, hidden=32, layers=rng.randint(1, 2))
        drafter = tiny_drafter(model, seed + 1)
    prompts = repetitive_prompts(rng, vocab, rng.randint(1, 3))
    max_tokens = rng.randint(16, 40)
    ar, _ = run_decode(model, None, prompts, max_tokens=max_tokens)
    eos = ()
    if seed % 2 == 0 and len(ar[0]) > 8:  # EOS inside the answer, often inside a run
        eos = (ar[0][rng.randrange(6, len(ar[0]))],)
        ar, _ = run_decode(model, None, prompts, max_tokens=max_tokens, eos_token_ids=eos)
    looked = 0
    for shape in LOOKUP_SHAPES:
        for d in (drafter, None):
            out, stats = run_decode(
                model,
                d,
                prompts,
                max_tokens=max_tokens,
                shape=shape,
                eos_token_ids=eos,
                adapt=False,
            )
            assert out == ar, f"case {seed}: {shape.label}, drafter={d is not None}"
            looked += stats["source_tokens"]["lookup"]
            assert stats["source_tokens"]["lookup"] <= stats["accepted_tokens"]
    assert looked > 0 or not bigram or eos  # lookup chains were accepted: the path is tested


def test_lookup_across_chat_turns_reusing_the_cache():
    """Turn 2 prefills only its new tokens; its history is the whole conversation."""
    model = near_bigram_model(3, attn_scale=0.005, vocab=16, hidden=32, layers=1)
    shape = BeamShape.lookup_only(2, 6)
    session = Session(model, 1)
    turn1 = [1, 4, 5, 6, 7, 4, 5]
    kw = dict(shape=shape, session=session, adapt=False)
    out1, _ = run_decode(model, None, [turn1], max_tokens=20, **kw)
    turn2 = turn1 + out1[0] + [2, 4, 5]
    assert len(session.cached[0]) > len(turn1)  # the cache holds turn 1's answer
    out2, stats = run_decode(model, None, [turn2], max_tokens=30, **kw)
    ar2, _ = run_decode(model, None, [turn2], max_tokens=30)
    assert out2 == ar2
    assert stats["prefilled_tokens"] < len(turn2)
    assert stats["source_tokens"]["lookup"] > 0


def test_adaptive_switching_with_lookup_is_lossless():
    """Costs that make every shape win for a while: the loop switches among AR, drafter
    and lookup shapes mid-answer, and the output stays AR's."""
    model = tiny_model(4, vocab=16, hidden=32, layers=1)
    drafter = tiny_drafter(model, 5)
    shapes = [BeamShape(1, 3), BeamShape(1, 3, None, 1, 6), BeamShape.lookup_only(1, 6)]
    cost = phased_costs([AR, *shapes], 6)
    prompts = repetitive_prompts(random.Random(4), 16, 2)
    ar, _ = run_decode(model, None, prompts, max_tokens=60)
    adapt = Adaptive(shapes=shapes, step_cost=cost, every=2, probe=2)
    out, _ = run_decode(model, drafter, prompts, max_tokens=60, shape=shapes[1], adapt=adapt)
    assert out == ar
    assert len(set(adapt.history)) >= 3  # it really switched


def test_lookup_step_compiles_once():
    model = tiny_model(0)
    shape = BeamShape.lookup_only(2, 5)
    for _ in generate_steps(
        model, None, [[1, 2, 3, 1, 2]], max_tokens=100, shape=shape, adapt=False
    ):
        pass
    step = batch_step(model, held_sources(), shape, StepMode())
    assert 1 <= step.counter["traces"] <= 2  # one per attention-window bucket


def brute_shadow(text, start, horizon, max_ngram=4):
    """(accepted, match): the chain lookup proposes at ``start`` (text[:start] read) scored
    against the rest, and the suffix tokens it matched."""
    seen = text[:start]
    best = None
    for p in range(len(seen) - 1):
        m = 0
        while m < max_ngram and p - m >= 0 and seen[p - m] == seen[len(seen) - 1 - m]:
            m += 1
        if m and (best is None or (m, p) >= best):
            best = (m, p)
    chain = [] if best is None else periodic(seen, best[1], horizon)
    n = 0
    while n < len(chain) and start + n < len(text) and chain[n] == text[start + n]:
        n += 1
    return n, (0 if best is None else best[0])


@pytest.mark.parametrize("seed", range(10))
def test_lookup_shadow_counts_what_the_first_chain_would_have_accepted(seed):
    rng = random.Random(seed)
    vocab = rng.choice([3, 5, 9])
    text = [rng.randrange(vocab) for _ in range(rng.randint(2, 60))]
    prompt = rng.randint(1, len(text) - 1)
    from redrafter_mlx.engine.drafting.lookup import LookupShadow

    horizon = rng.randint(1, 7)
    shadow = LookupShadow([text[:prompt]], horizon)
    starts, got, at = [], [], prompt
    while at < len(text):
        step = text[at : at + rng.randint(1, 4)]
        starts.append(at)
        got += shadow.step(0, step)
        at += len(step)
    got += shadow.finish(0)
    # (match, accepted) per step start; a short chain may resolve before an earlier long one
    want = [brute_shadow(text, s, horizon) for s in starts]
    assert sorted(got) == sorted((m, k) for k, m in want)


def test_the_shadow_resolves_a_missed_chain_at_the_miss():
    """A chain whose first draft is wrong is counted when that token is written, not when
    the text reaches the chain's length; a chain still matching waits."""
    from redrafter_mlx.engine.drafting.lookup import LookupShadow

    shadow = LookupShadow([[1, 2, 3, 4, 5, 1]], horizon=4)  # proposes 2, 3, 4, 5
    assert shadow.chain(0) == [2, 3, 4, 5]
    assert shadow.step(0, [9]) == [(1, 0)]  # missed at once: resolved now
    shadow = LookupShadow([[1, 2, 3, 4, 5, 1]], horizon=4)
    assert shadow.step(0, [2]) == []  # matches so far: pending
    assert shadow.step(0, [3]) == []
    # missed at its third draft; so were the chains of the two later step starts (matches
    # of 2 and 3 tokens, proposing 3, 4, ... and 4, 5, ...)
    assert shadow.step(0, [7]) == [(1, 2), (2, 1), (3, 0)]


def test_the_shadow_moves_a_run_from_plain_decoding_to_lookup():
    """Step costs where plain decoding wins until the text starts repeating: the chooser,
    running AR, sees through the shadow that a chain would be accepted, and switches."""
    from redrafter_mlx.engine.loop.adaptive import ShapeChooser

    lookup = BeamShape.lookup_only(1, 8)
    chooser = ShapeChooser([AR, lookup], start=AR, costs={AR: 1.0, lookup: 1.5})
    for _ in range(12):  # nothing repeats: the shadow sees no accepted chain
        chooser.next_shape()
        chooser.observe(AR, [1], 1.0)
        chooser.observe_lookup([(0, 0)])
    assert chooser.current == AR
    for _ in range(8):  # a repeated passage: chains of 7 would be accepted
        chooser.next_shape()
        chooser.observe(AR, [1], 1.0)
        chooser.observe_lookup([(4, 7)])
    assert chooser.tokens_per_step(lookup) > 5
    assert chooser.current == lookup


def test_adaptive_candidates_with_lookup():
    shape = BeamShape(1, 4, None, 1, 8)
    assert Adaptive().candidates(shape) == [
        AR,
        shape,
        BeamShape(1, 4),
        BeamShape(1, 3),
        BeamShape(1, 2),
        BeamShape.lookup_only(1, 8),
        BeamShape(1, 4, 4, 1, 8),  # room for one: the beam or the chain, per row
        BeamShape.lookup_only(1, 16),  # a passage being copied
    ]
    assert Adaptive().candidates(BeamShape.lookup_only(2, 6)) == [
        AR,
        BeamShape.lookup_only(2, 6),
        BeamShape.lookup_only(2, 12),
    ]


def test_history_grows_with_the_cache():
    """A prompt and answer past one 256-slot quantum: cache and history grow together."""
    model = near_bigram_model(8, attn_scale=0.005, vocab=16, hidden=32, layers=1)
    prompt = [[1, 2, 3, 4, 5, 6] * 40]
    ar, _ = run_decode(model, None, prompt, max_tokens=300)
    shape = BeamShape.lookup_only(1, 8)
    out, stats = run_decode(model, None, prompt, max_tokens=300, shape=shape, adapt=False)
    assert out == ar and stats["source_tokens"]["lookup"] > 0


def test_each_step_shape_follows_the_match_state():
    """Per-step choice: a long chain where a long match has been copied before, a short one
    where short matches pay a little, plain decoding where nothing matches, and a drafting
    probe every ``probe`` steps in which no model drafted, so the drafter's acceptance stays
    measured."""
    from redrafter_mlx.engine.loop.adaptive import ShapeChooser

    beam, k8, k16 = BeamShape(1, 4), BeamShape.lookup_only(1, 8), BeamShape.lookup_only(1, 16)
    costs = {AR: 1.0, beam: 1.5, k8: 1.6, k16: 2.2}
    chooser = ShapeChooser([AR, beam, k8, k16], start=AR, costs=costs, probe=4)
    chooser.observe(beam, [1], 1.5)  # the drafter is never right
    for _ in range(6):
        chooser.observe_lookup([(4, 15), (2, 3), (0, 0)])
    assert chooser.next_shape([4]) == k16  # 16 tokens for 2.2
    assert chooser.next_shape([2]) == k8  # 4 tokens for 1.6
    assert chooser.next_shape([4, 2]) == k16  # rows' expectations are averaged
    # The 4th step in which no model drafted (three chain steps, then this): a probe. The
    # count runs across the switches between chains and plain decoding (steady_probe).
    assert chooser.next_shape([0]) == beam
    chooser.observe(beam, [1], 1.5)  # it loses: the next probe comes 8 such steps later
    picks = [chooser.next_shape([0]) for _ in range(7)]
    assert picks == [AR] * 7
    assert chooser.next_shape([0]) == beam
    # The state-free estimate (block choices, a split model) mixes the states.
    assert chooser.tokens_per_step(k16) < chooser.tokens_per_step(k16, [4])


def test_each_step_choice_is_lossless_and_follows_the_text():
    """A prompt whose answer copies a passage: per-step choice runs the long chain while
    copying and something cheaper elsewhere, in one answer, with AR's output."""
    model = near_bigram_model(8, attn_scale=0.005, vocab=16, hidden=32, layers=1)
    prompt = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15] * 3 + [9, 3, 7]]
    ar, _ = run_decode(model, None, prompt, max_tokens=80)
    shape = BeamShape.lookup_only(1, 4)
    costs = {AR: 1.0, shape: 1.3, BeamShape.lookup_only(1, 8): 1.6}
    adapt = Adaptive(step_cost=lambda s: costs[s])
    out, _ = run_decode(model, None, prompt, max_tokens=80, shape=shape, adapt=adapt)
    assert out == ar
    assert adapt.chooser.shapes == [AR, shape, BeamShape.lookup_only(1, 8)]
    assert len(set(adapt.history)) >= 2


def test_split_model_each_step_takes_rank_0s_choice(monkeypatch):
    """Split across ranks, the per-step choice is rank 0's, sent before each step: rank 0
    asks its chooser with the rows' match states and sends the shape's index; another rank
    runs that index whatever its own chooser would say, and never asks it."""
    from redrafter_mlx.engine.loop import adaptive
    from redrafter_mlx.engine.loop.adaptive import ShapeChooser, SharedChoice
    from tests.support.fakes import FakeGroup

    k8, k16 = BeamShape.lookup_only(1, 8), BeamShape.lookup_only(1, 16)
    costs = {AR: 1.0, k8: 1.6, k16: 2.2}
    sent = []

    def rank0_sends(text, group):  # rank 0's text goes out; the others get what it sent
        if group.rank() == 0:
            sent.append(text)
            return text
        return sent.pop(0)

    monkeypatch.setattr(adaptive, "broadcast_text", rank0_sends)
    leader = ShapeChooser([AR, k8, k16], start=AR, costs=costs)
    follower = ShapeChooser([AR, k8, k16], start=AR, costs={AR: 1.0, k8: 9.0, k16: 9.0})
    for chooser in (leader, follower):
        for _ in range(6):
            chooser.observe_lookup([(4, 15), (0, 0)])
    rank0, rank1 = SharedChoice(leader, FakeGroup(2, 0)), SharedChoice(follower, FakeGroup(2, 1))
    for matches, want in (([4], k16), ([0], AR), ([4], k16)):
        assert rank0.next_shape(matches) == want
        assert rank1.next_shape(matches) == want  # its own chooser would say AR
    assert follower.switches == []  # never asked


def test_risk_discounts_dear_shapes_in_the_per_step_choice():
    """With ``risk``, a shape costing c AR steps is judged at rate / (1 + risk (c - 1)): a
    long chain a little ahead on its estimate loses to the short one, one far ahead wins."""
    from redrafter_mlx.engine.loop.adaptive import ShapeChooser

    k8, k16 = BeamShape.lookup_only(1, 8), BeamShape.lookup_only(1, 16)
    costs = {AR: 1.0, k8: 1.6, k16: 2.1}
    for risk, want_close in ((0.0, k16), (0.15, k8)):
        chooser = ShapeChooser([AR, k8, k16], start=AR, costs=costs)
        chooser.risk = risk
        for _ in range(6):  # state 3: 10 drafts (k8 holds 7: 8 tokens / 1.6; k16 11 / 2.1)
            chooser.observe_lookup([(3, 10), (4, 15)])
        assert chooser.next_shape([3]) == want_close
        assert chooser.next_shape([4]) == k16  # 16 tokens for 2.1: far ahead either way
