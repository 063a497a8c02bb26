"""Families whose code takes token positions from somewhere other than the rope modules the
verifier taps decode plain decoding's tokens under trees too (issue: trees that gave wrong
tokens with exit 0):

* GPT-2 indexes learned position embeddings from the cache offset (``offset + arange``):
  the position embedding is tapped and reads each token's own position;
* nanochat and talkie call ``mx.fast.rope`` with ``cache.offset`` themselves: the offset
  object the caches hand out is known, and that call rotates each token at its own position;
* whatever a family does, the load checks a small tree's and a chain's node logits against
  plain decoding's (``LmModel.check_steps``): a family that fails runs chains, or plain
  decoding, and says so once; it never decodes a different token.
"""

from __future__ import annotations

import warnings

import mlx.core as mx
import pytest
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.loading import materialize
from redrafter_mlx.engine.verifier import lm_model
from redrafter_mlx.engine.verifier.lm_model import LmModel
from tests.support.models import _randomize, run_decode

TINY = dict(vocab_size=64, max_position_embeddings=256)
CONFIGS = {
    "gpt2": dict(
        model_type="gpt2", n_ctx=256, n_embd=32, n_head=4, n_layer=2, n_positions=256,
        layer_norm_epsilon=1e-5, vocab_size=64,
    ),
    "nanochat": dict(
        TINY, model_type="nanochat", hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
    ),
    "talkie": dict(
        TINY, model_type="talkie", hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        head_dim=8, intermediate_size=64,
    ),
}  # fmt: skip
PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 7, 3, 9, 4, 2]  # repeats: lookup proposes chains


def built(name: str, seed: int = 0) -> LmModel:
    """mlx-lm's class for the family, random weights peaked enough to matter, checked as at
    load (``check_steps``)."""
    config = CONFIGS[name]
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    lm.set_dtype(mx.float32)
    _randomize(lm, seed, 2.0)
    materialize(lm)  # as the loader does: every array a module holds (nanochat's frequencies)
    model = LmModel(lm, config)
    model.check_steps()
    return model


def tree_logits_off(model: LmModel) -> float:
    """How far a two-branch tree's node logits are from plain decoding's (the check's own
    measure, without its verdict)."""
    S = 16
    cache = model.make_cache(1, S)
    from redrafter_mlx.engine.core.tree import arange, cache_mask, chain_mask

    idx = arange(5)[None]
    mask = cache_mask(mx.zeros((1,), mx.int32), chain_mask(5), S)
    _, cache = model(mx.array([PROMPT[:5]]), idx, mask, cache, idx)
    a, b, c = 3, 9, 11
    plain = [model._stepped(cache, 5, p, S)[0] for p in ([a], [a, b], [a, c])]
    ancestors = mx.array([[[True, False, False], [True, True, False], [True, False, True]]])
    tree = model._verified(cache, 5, [a, b, c], [0, 1, 1], ancestors, S)
    return max(float(mx.abs(t - p).max()) for t, p in zip(tree, plain))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_each_tree_node_gets_its_own_position(name):
    model = built(name)
    assert tree_logits_off(model) < 1e-4
    assert model.verifies == "tree", model.narrowing


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("shape", ["K1xL6", "K2xL5"])
def test_speculation_decodes_plain_decodings_tokens(name, shape):
    model = built(name, seed=1)
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=24)
    fast, stats = run_decode(
        model, None, [PROMPT], max_tokens=24, shape=BeamShape.parse(shape), adapt=False
    )
    assert fast == plain, name
    assert stats["accepted_tokens"] > 0  # drafts were verified and kept
    fast, _ = run_decode(model, None, [PROMPT], max_tokens=24, draft_model=model)
    assert fast == plain, name


def test_without_the_position_taps_the_load_check_narrows_to_what_is_exact(monkeypatch):
    """The check is not vacuous: with GPT-2's position tap undone (the embedding reads the
    offset-based ids again) its trees are wrong, found at load, so steps verify chains,
    said once, and the tokens stay plain decoding's."""
    monkeypatch.setattr(lm_model, "POSITION_EMBEDDINGS", ())
    model = built("gpt2", seed=1)
    assert tree_logits_off(model) > 1e-3
    assert model.verifies == "chain" and "positions" in model.narrowing
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=24)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        fast, _ = run_decode(
            model, None, [PROMPT], max_tokens=24, shape=BeamShape.parse("K2xL5"),
            adapt=False,
        )  # fmt: skip
    assert fast == plain
    assert sum("runs as" in str(w.message) for w in said) == 1


def test_a_family_whose_chains_differ_runs_plain_decoding(monkeypatch):
    """Where even a chain differs from plain decoding, every step verifies one token."""
    model = built("nanochat")
    original = LmModel._verified

    def shifted(self, *args, **kwargs):  # a family whose multi-token calls go wrong
        return [x + 1.0 for x in original(self, *args, **kwargs)]

    monkeypatch.setattr(LmModel, "_verified", shifted)
    model.check_steps()
    assert model.verifies == "token" and "chain" in model.narrowing
    monkeypatch.undo()
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fast, stats = run_decode(
            model, None, [PROMPT], max_tokens=16, shape=BeamShape.parse("K2xL5"),
            adapt=False,
        )  # fmt: skip
    assert fast == plain
    assert stats["accepted_tokens"] == 0  # no draft was verified
