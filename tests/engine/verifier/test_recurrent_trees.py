"""Trees over recurrent layers (``lm_cache.path_layer``): a hybrid or recurrent model verifies a
tree, its recurrent layers running the tree's root-to-leaf paths as batch rows while its
attention layers read the packed tree's mask, and the commit takes each row's state along
its accepted path. Tiny random models of mlx-lm's own classes (qwen3_5, qwen3_next, lfm2,
granitemoehybrid, mamba2; falcon_h1 keeps a ``CacheList`` and is refused at load):

* the load-time check passes, so the step verifies trees (no narrowing);
* every node of a packed tree, over several rows, gives its own sequence's logits;
* greedy W2xL3 and W4xL4+K2xL4 trees give plain decoding's tokens, solo and 3 rows batched,
  with drafts accepted on paths other than the first;
* seeded sampling over a tree passes a chi-square test (with a power check);
* a family whose layers cannot run a tree's paths keeps chains, and says so once.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.core.tree import arange, cache_mask, chain_mask, pack
from redrafter_mlx.engine.drafting.drafter import DrafterArgs
from redrafter_mlx.engine.verifier import lm_taps
from redrafter_mlx.engine.verifier.lm_model import LmModel
from tests.support.drafters import follows
from tests.support.mlx_lm_families import RECURRENT
from tests.support.models import run_decode
from tests.support.sampling import chi_square_pvalue, lm_joint

NAMES = ["qwen3_5", "qwen3_next", "lfm2", "granitemoehybrid", "mamba2"]
PROMPTS = [[1, 5, 9, 2, 7, 5, 9, 2, 7, 5], [3, 4, 4, 3, 8, 3, 4, 4, 3], [2]]
TOKENS = 16
SHAPES = ["W2xL3", "W4xL4+K2xL4"]


def build(config: dict) -> LmModel:
    cls, args = _get_classes(config)
    mx.random.seed(0)
    lm = cls(args.from_dict(config))
    lm.set_dtype(mx.float32)
    mx.eval(lm.parameters())
    return LmModel(lm, config)


@functools.cache
def family(name: str) -> LmModel:
    return build(RECURRENT[name])


class SecondGuessDrafter(nn.Module):
    """A drafter that knows the model's greedy continuation: after token t its best guess is
    the token that followed t in ``texts``, except for every ``wrong``-th id, where the best
    guess is off by one and the right token is the second best: so a W >= 2 tree accepts on
    its second path (a commit along a path other than the first) and chains get rejected."""

    def __init__(self, model, texts, wrong: int = 3):
        super().__init__()
        V = model.vocab_size
        right = follows(texts, V)
        best = [(r + (t % wrong == 0)) % V for t, r in enumerate(right)]
        eye = mx.eye(V)
        self.scores = 30.0 * eye[mx.array(best)] + 20.0 * eye[mx.array(right)]
        self.emb = model.embed(mx.arange(V))
        mx.eval(self.scores, self.emb)
        self.args = DrafterArgs(vocab_size=V, hidden_size=model.hidden_size, exit_dim=1)

    def next_state(self, state, token_emb):
        return token_emb

    def __call__(self, hidden, state):
        token = mx.argmax(state @ self.emb.T, axis=-1)
        return self.scores[token]


@pytest.mark.parametrize("name", NAMES)
def test_the_load_check_lets_a_recurrent_model_verify_trees(name):
    model = family(name)
    assert model.recurrent
    model.check_steps()
    assert model.verifies == "tree" and model.narrowing is None


# Two rows' trees: beams (W = 4, L = 4) sharing prefixes; the second row's differ.
BEAMS = [
    [[4, 11, 12, 13], [4, 11, 14, 15], [4, 16, 17, 18], [4, 11, 12, 19]],
    [[6, 21, 22, 23], [6, 24, 25, 26], [6, 21, 22, 27], [6, 21, 28, 29]],
]


@pytest.mark.parametrize("name", NAMES)
def test_every_tree_node_gives_its_own_sequence_logits(name):
    model = family(name)
    prompts = [PROMPTS[0], PROMPTS[0][::-1]]  # two rows of one length
    B, T, S = 2, len(PROMPTS[0]), 64
    idx = mx.broadcast_to(arange(T)[None], (B, T))
    zero = mx.zeros((B,), mx.int32)
    _, cache = model(
        mx.array(prompts), idx, cache_mask(zero, chain_mask(T), S), model.make_cache(B, S), idx
    )
    beams = mx.array(BEAMS)
    C = 12
    tree = pack(beams, C)
    lengths = zero + T
    positions = lengths[:, None] + tree.depth
    slots = lengths[:, None] + arange(C)[None]
    mask = cache_mask(lengths, tree.mask, S)
    hidden, _ = model(tree.tokens, positions, mask, cache, slots, paths=tree.unpacker)
    logits = model.logits(hidden)
    unpacker = tree.unpacker.tolist()
    checked = set()
    for b in range(B):
        for w, beam in enumerate(BEAMS[b]):
            for k in range(len(beam)):
                slot = unpacker[b][w][k]
                if slot >= C or (b, slot) in checked:
                    continue
                checked.add((b, slot))
                want = model.lm(mx.array([prompts[b] + beam[: k + 1]]))[0, -1]
                diff = mx.abs(logits[b, slot] - want).max().item()
                scale = max(1.0, mx.abs(want).max().item())
                assert diff <= 1e-5 * scale, f"{name} row {b} slot {slot}: {diff}"
    assert len(checked) == 20  # 10 nodes a row, and 2 padded slots


@functools.cache
def plain(name: str) -> list[list[int]]:
    out, _ = run_decode(
        family(name), None, PROMPTS, max_tokens=TOKENS, shape=BeamShape.autoregressive()
    )
    return out


@pytest.mark.parametrize("name", NAMES)
def test_greedy_trees_give_plain_decoding_tokens_solo_and_batched(name):
    model = family(name)
    want = plain(name)
    drafter = SecondGuessDrafter(model, [p + a for p, a in zip(PROMPTS, want)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no narrowing to a chain
        for label in SHAPES:
            shape = BeamShape.parse(label)
            got, stats = run_decode(model, drafter, PROMPTS, max_tokens=TOKENS, shape=shape)
            assert got == want, f"{name} {label} batched"
            assert stats["tokens_per_step"] > 1.5, f"{name} {label}"
            for prompt, row in zip(PROMPTS, want):
                solo, _ = run_decode(model, drafter, [prompt], max_tokens=TOKENS, shape=shape)
                assert solo[0] == row, f"{name} {label} solo"


def test_a_tree_accepts_on_a_path_other_than_the_first():
    """The drafter's second guess is right after every third id: a W2 tree takes in more
    tokens a step than its first beam alone (the W1 chain), so commits ran along the second
    path too, and the tokens are still plain decoding's."""
    model = family("qwen3_5")
    want = plain("qwen3_5")
    drafter = SecondGuessDrafter(model, [p + a for p, a in zip(PROMPTS, want)])
    rates = {}
    for label in ("W1xL3", "W2xL3"):
        got, stats = run_decode(
            model, drafter, PROMPTS, max_tokens=TOKENS, shape=BeamShape.parse(label)
        )
        assert got == want, label
        rates[label] = stats["tokens_per_step"]
    assert rates["W2xL3"] > rates["W1xL3"] + 0.1, rates


N = 1000  # samples of the chi-square test
SAMPLED = [1, 3, 2]


def test_seeded_sampling_over_a_tree_is_exact_on_a_hybrid():
    small = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2)
    config = {**RECURRENT["qwen3_5"], "vocab_size": 12, **small, "full_attention_interval": 2}
    model = build(config)
    scaled = [(k, v * 3.0) for k, v in tree_flatten(model.lm.parameters()) if "embed" in k]
    model.lm.load_weights(scaled, strict=False)
    mx.eval(model.parameters())
    hot, cool = SamplerConfig(temperature=1.0), SamplerConfig(temperature=0.5)
    greedy = run_decode(model, None, [SAMPLED], max_tokens=8, shape=BeamShape.autoregressive())
    drafter = SecondGuessDrafter(model, [SAMPLED + greedy[0][0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the tree runs as a tree
        out, stats = run_decode(
            model, drafter, [SAMPLED] * N, max_tokens=2, seed=5, sampler=hot,
            shape=BeamShape.parse("W2xL3"),
        )  # fmt: skip
    counts: dict = {}
    for row in out:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert stats["tokens_per_step"] > 1.1  # drafts were accepted and judged
    assert chi_square_pvalue(counts, lm_joint(model, hot, SAMPLED), N) > 1e-3
    assert chi_square_pvalue(counts, lm_joint(model, cool, SAMPLED), N) < 1e-3  # the test has power


def test_a_family_whose_layers_cannot_run_paths_keeps_chains_and_says_so_once(monkeypatch):
    def fails(layer, original, call, args, kwargs):
        raise TypeError("this layer takes one row per sequence")

    monkeypatch.setattr(lm_taps, "path_layer", fails)
    model = build(RECURRENT["lfm2"])
    model.check_steps()
    assert model.verifies == "chain"
    assert "lfm2" in model.narrowing and "TypeError" in model.narrowing
    want = run_decode(model, None, PROMPTS[:1], max_tokens=6, shape=BeamShape.autoregressive())
    drafter = SecondGuessDrafter(model, [PROMPTS[0] + want[0][0]])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(2):
            got, _ = run_decode(
                model, drafter, PROMPTS[:1], max_tokens=6, shape=BeamShape.parse("W2xL3")
            )
            assert got == want[0]
    notes = [str(w.message) for w in said if "lfm2" in str(w.message)]
    assert len(notes) == 1 and "W1×L3" in notes[0], notes
