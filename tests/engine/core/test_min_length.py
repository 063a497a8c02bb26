"""``SamplerConfig.min_length`` / ``end_ids``: the ids that end a text are never drawn below
the text length, at every node of a step, so every shape decodes what plain decoding does.

The demo model rarely ends a text, so its "EOS" here is a token its greedy answer writes
(``END_AT`` tokens in): plain decoding stops there, and with ``min_length`` past it goes on.
"""

from __future__ import annotations

import pytest

import redrafter_mlx
from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.generation import generate_steps

PROMPT = "def fibonacci(n):"
MAX = 40
SHAPES = [AR, BeamShape(2, 4), BeamShape(1, 5, lookup=1)]


@pytest.fixture(scope="module")
def demo():
    base, drafter = demo_paths()
    model, dr, tok = redrafter_mlx.load(base, drafter)
    return model, dr, tok.encode(PROMPT)


def decode(demo, shape, eos=(), sampler=SamplerConfig(), seed=None) -> list[int]:
    model, drafter, ids = demo
    out = []
    for event in generate_steps(
        model,
        drafter if shape.drafts else None,
        [ids],
        max_tokens=MAX,
        shape=shape,
        sampler=sampler,
        seed=seed,
        eos_token_ids=eos,
    ):
        out += event.tokens[0]
    return out


def an_end(tokens: list[int], least: int = 4) -> tuple[int, int]:
    """A token first written at index >= ``least`` of ``tokens``: (its id, that index)."""
    for i, t in enumerate(tokens):
        if i >= least and t not in tokens[:i]:
            return t, i
    raise AssertionError("no new token in the answer")


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_min_length_holds_the_end_back_exactly_as_plain_decoding(demo, shape):
    free = decode(demo, AR)
    end, at = an_end(free)
    assert decode(demo, shape, (end,)) == free[:at]  # it ends there
    prompt = len(demo[2])
    up_to = SamplerConfig(min_length=prompt + at, end_ids=(end,))  # the end's own position
    assert decode(demo, shape, (end,), up_to) == free[:at]
    banned = SamplerConfig(min_length=prompt + at + 6, end_ids=(end,))
    plain = decode(demo, AR, (end,), banned)
    assert plain[:at] == free[:at] and end not in plain[: at + 6] and len(plain) > at + 6
    assert decode(demo, shape, (end,), banned) == plain


def test_min_length_holds_with_sampling(demo):
    end, at = an_end(decode(demo, AR))
    prompt = len(demo[2])
    banned = SamplerConfig(temperature=1.0, min_length=prompt + at + 6, end_ids=(end,))
    for shape in SHAPES[:2]:
        out = decode(demo, shape, (end,), banned, seed=3)
        assert end not in out[: at + 6] and out == decode(demo, shape, (end,), banned, seed=3)


def test_end_ids_are_checked():
    with pytest.raises(ParamError, match="end_ids"):
        SamplerConfig(min_length=3, end_ids=(-1,)).validate()
    with pytest.raises(ParamError, match="outside the vocabulary"):
        SamplerConfig(min_length=3, end_ids=(10,)).validate(vocab_size=10)
    with pytest.raises(ParamError, match="min_length"):
        SamplerConfig(min_length=-1).validate()
