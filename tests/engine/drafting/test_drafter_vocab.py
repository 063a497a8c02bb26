"""A drafter trained before its model's vocabulary grew by added tokens (an APAR model's two
split tokens, ``weights_convert.smollm2_apar``) still serves it, losslessly; anything else
is another base model's drafter."""

from __future__ import annotations

import numpy as np
import pytest

from redrafter_mlx.engine.loop.loading import MAX_ADDED_TOKENS, LoadError, check_pair
from tests.support.models import run_decode, tiny_drafter, tiny_model


def test_a_drafter_of_the_vocabulary_before_added_tokens_is_lossless():
    model = tiny_model(seed=4, vocab=34)
    drafter = tiny_drafter(tiny_model(seed=4, vocab=32), seed=5)  # knows ids 0..31 only
    check_pair(model, drafter)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 34, n).tolist() for n in (3, 8)] + [[32, 33, 5]]  # added ids too
    ar, _ = run_decode(model, None, prompts, max_tokens=20)
    spec, stats = run_decode(model, drafter, prompts, max_tokens=20, beam_width=2, beam_length=4)
    assert spec == ar
    assert stats["accepted_tokens"] > 0  # the drafter's chains did take part


@pytest.mark.parametrize("model_vocab", [31, 32 + MAX_ADDED_TOKENS + 1])
def test_other_vocabularies_are_another_base_models(model_vocab):
    drafter = tiny_drafter(tiny_model(seed=4, vocab=32), seed=5)
    with pytest.raises(LoadError, match="another base model"):
        check_pair(tiny_model(seed=4, vocab=model_vocab), drafter)
