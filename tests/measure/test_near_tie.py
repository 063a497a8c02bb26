"""measure.near_tie: a greedy mismatch's lead against the rounding noise of two forward
shapes, on a tiny float32 model (exact ties built by giving two tokens one head row)."""

import mlx.core as mx
import pytest

from redrafter_mlx.measure import near_tie
from tests.support.models import tiny_model

PREFIX = [3, 17, 5, 9, 22, 1, 30, 8, 12]


def ranked(model, prefix):
    """The next token's candidates, best first, from an independent full forward."""
    logits, _ = near_tie.last_logits(model, prefix, 0, model.make_cache(1, len(prefix)))
    return [int(t) for t in mx.argsort(-logits).tolist()]


def test_lead_and_noise_on_float32():
    model = tiny_model(seed=3)
    order = ranked(model, PREFIX)
    best, worst = order[0], order[-1]
    far = near_tie.check(model, PREFIX, best, worst)
    assert far.lead > 0.1 and far.noise < 1e-4  # the two shapes agree to float32 rounding
    assert not far.near_tie  # plain decoding's token far ahead: a wrong token is a bug
    back = near_tie.check(model, PREFIX, worst, best)
    assert back.lead == pytest.approx(-far.lead) and not back.near_tie
    same = near_tie.check(model, PREFIX, best, best)
    assert same.lead == 0 and same.near_tie
    assert same.to_dict() == dict(lead=0.0, noise=same.noise, near_tie=True)


def test_an_exact_tie_is_a_near_tie():
    """Two tokens with one head row: equal logits wherever they are read."""
    model = tiny_model(seed=4)
    order = ranked(model, PREFIX)
    a, b = order[0], order[1]
    head = model.lm_head if hasattr(model, "lm_head") else model.model.embed_tokens
    head.weight = head.weight.at[b].add(head.weight[a] - head.weight[b])
    verdict = near_tie.check(model, PREFIX, a, b)
    assert verdict.lead == 0 and verdict.near_tie


def test_noise_counts_against_the_lead():
    assert near_tie.TieCheck(lead=0.02, noise=0.01).near_tie
    assert near_tie.TieCheck(lead=-0.02, noise=0.01).near_tie
    assert not near_tie.TieCheck(lead=0.03, noise=0.01).near_tie


def test_prefix_too_short():
    with pytest.raises(ValueError, match="at least 2 tokens"):
        near_tie.check(tiny_model(), [1], 2, 3)


def test_noise_is_at_least_the_logits_resolution():
    """Half precision: a backend whose two shapes round alike (noise 0 measured) still counts
    one unit in the last place of the logits as rounding."""
    model = tiny_model(seed=3)
    model.set_dtype(mx.float16)
    order = ranked(model, PREFIX)
    verdict = near_tie.check(model, PREFIX, order[0], order[1])
    logits, _ = near_tie.last_logits(model, PREFIX, 0, model.make_cache(1, len(PREFIX)))
    biggest = max(abs(logits[order[0]].item()), abs(logits[order[1]].item()))
    assert verdict.noise >= near_tie.ulp(biggest, model) > 0
    assert near_tie.ulp(20.0, model) == 2.0**-10 * 16  # float16 at 20: 1/64
