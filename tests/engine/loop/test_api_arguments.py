"""The Python API's loose arguments, normalised once at its entry
(``engine/loop/arguments.py``). Before: a bytes prompt was read as token ids, ``max_tokens=None``
or ``"8"`` raised ``'<' not supported``, ``logit_bias={5: 1.0}`` failed to unpack, a shape
label or a dict sampler raised ``AttributeError``, and a string given to ``batch_generate``
was decoded as one prompt per character."""

from __future__ import annotations

import numpy as np
import pytest

from redrafter_mlx import BeamShape, SamplerConfig, batch_generate, generate, load
from redrafter_mlx.engine.base.bundled import demo_paths

PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def demo():
    model, drafter, tokenizer = load(*demo_paths())
    return model, tokenizer, drafter


def run(demo, prompt=PROMPT, **kw):
    model, tokenizer, drafter = demo  # a shape's W part needs the drafter
    return generate(model, drafter, tokenizer, prompt, **{"max_tokens": 6, **kw})


def test_unambiguous_forms_run_as_their_canonical_ones(demo):
    tokenizer = demo[1]
    want = run(demo, shape=BeamShape(1, 4))
    assert run(demo, shape="W1xL4") == want
    assert run(demo, shape={"width": 1, "length": 4}) == want
    assert run(demo, shape=BeamShape(1, 4), max_tokens=np.int64(6)) == want
    ids = tokenizer.encode(PROMPT)
    assert run(demo, np.array(ids), shape="W1xL4") == want
    sampled = dict(temperature=0.8, top_k=5)
    assert run(demo, sampler=sampled, seed=3) == run(
        demo, sampler=SamplerConfig(**sampled), seed=np.uint32(3)
    )


def test_logit_bias_as_a_mapping(demo):
    model, tokenizer, _ = demo
    token = tokenizer.encode(" zzz", add_bos=False)[0]
    for bias in ({token: 100.0}, {str(token): 100.0}, ((token, 100.0),)):
        for sampler in (SamplerConfig(logit_bias=bias), {"logit_bias": bias}):
            ids = batch_generate(model, None, tokenizer, [PROMPT], max_tokens=3, sampler=sampler)
            assert ids == [[token] * 3], bias


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(prompt=b"def f"), "prompt is bytes"),
        (dict(prompt=[1, "x"]), "prompt must be a string or a list of integer token ids"),
        (dict(max_tokens=None), "max_tokens must be a positive integer"),
        (dict(max_tokens="8"), "max_tokens must be a positive integer"),
        (dict(max_tokens=8.0), "max_tokens must be a positive integer"),
        (dict(max_tokens=True), "max_tokens must be a positive integer"),
        (dict(seed="1"), "seed must be an integer"),
        (dict(shape=4), "shape must be a BeamShape"),
        (dict(shape={"width": 1, "depth": 4}), "shape has unknown fields ['depth']"),
        (dict(sampler="greedy"), "sampler must be a SamplerConfig"),
        (dict(sampler={"temp": 0.5}), "sampler has unknown fields ['temp']"),
        (dict(sampler=SamplerConfig(logit_bias=5)), "logit_bias must be a {token id: bias}"),
        (dict(session="s"), "session must be a redrafter_mlx.Session"),
    ],
)
def test_ambiguous_arguments_are_a_type_error_naming_them(demo, kw, names):
    prompt = kw.pop("prompt", PROMPT)
    with pytest.raises(TypeError) as e:
        run(demo, prompt, **kw)
    assert names in str(e.value)


def test_bad_values_still_name_the_argument(demo):
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        run(demo, max_tokens=0)
    with pytest.raises(ValueError, match="W1xL4"):  # BeamShape.parse's refusal
        run(demo, shape="wide")


def test_batch_generate_takes_a_list_of_prompts(demo):
    model, tokenizer, _ = demo
    with pytest.raises(TypeError, match="prompts must be a list of prompts"):
        batch_generate(model, None, tokenizer, PROMPT, max_tokens=2)
    with pytest.raises(TypeError, match=r"prompts\[0\] is a string but tokenizer is None"):
        batch_generate(model, None, None, [PROMPT], max_tokens=2)
    ids = tokenizer.encode(PROMPT)
    assert batch_generate(model, None, None, [np.array(ids)], max_tokens=3) == batch_generate(
        model, None, None, [ids], max_tokens=3
    )
