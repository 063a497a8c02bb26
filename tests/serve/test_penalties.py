"""The server's sampling controls: OpenAI's logit_bias / presence_penalty / frequency_penalty
and mlx-lm's repetition_penalty per request, each row exact in a shared batch, and the
model's generation_config.json values for the fields a request leaves out."""

import pytest

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.protocol import ProtocolError, check_bias_ids, parse_completion
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.models import run_decode
from tests.support.serving import Collector, drain

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.0, repetition_penalty=1.8, repetition_context_size=8),
    dict(temperature=0.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias=((13, 3.0),)),
    dict(temperature=0.9, top_p=0.9, repetition_penalty=1.3, repetition_context_size=40),
    dict(temperature=0.0, logit_bias=((290, -100.0), (13, 2.0))),
]


def solo(pair, prompt, shape, settings, seed):
    model, drafter, tok = pair
    out, _ = run_decode(
        model,
        drafter if shape else None,
        [prompt],
        max_tokens=30,
        eos_token_ids=tok.eos_token_ids,
        sampler=SamplerConfig(**settings),
        seed=seed,
        shape=shape or BeamShape(1, 1),
        adapt=False,
    )
    return out[0]


@pytest.mark.parametrize("shape", [BeamShape(2, 4), BeamShape(1, 4, None, 1, 6), None], ids=str)
def test_rows_with_their_own_penalties_equal_solo_runs(pair, prompts, shape):
    model, drafter, tok = pair
    sched = Scheduler(model, drafter if shape else None, shape, tok.eos_token_ids, max_batch=4)
    runs = []
    for i, settings in enumerate(SETTINGS):
        sink = Collector()
        sched.submit(Request(prompts[i], 30, sink, SamplerConfig(**settings, seed=7 + i)))
        runs.append((prompts[i], settings, 7 + i, sink))
        sched.run_once()
    drain(sched)
    for prompt, settings, seed, sink in runs:
        assert sink.tokens == solo(pair, prompt, shape, settings, seed)
    plain = solo(pair, prompts[1], shape, dict(temperature=0.0), 8)
    assert runs[1][3].tokens != plain  # the penalty changed that row's text


def parse(**fields):
    return parse_completion({"prompt": "hi", **fields}, 100)


def test_openai_fields_are_parsed_and_checked():
    params = parse(presence_penalty=0.5, frequency_penalty=-1, logit_bias={"13": -100, "7": 2})
    sampler = params.sampling()
    assert sampler.presence_penalty == 0.5 and sampler.frequency_penalty == -1.0
    assert sampler.logit_bias == ((13, -100.0), (7, 2.0))
    for bad in (
        dict(presence_penalty=3),
        dict(frequency_penalty="x"),
        dict(logit_bias={"a": 1}),
        dict(logit_bias={"1": 101}),
        dict(logit_bias=[1]),
        dict(repetition_penalty=0),
        dict(repetition_context_size=0),
        dict(temperature=float("nan")),
    ):
        with pytest.raises(ProtocolError) as e:
            parse(**bad)
        assert e.value.status == 400 and e.value.param == next(iter(bad))
    with pytest.raises(ProtocolError, match="outside the vocabulary"):
        check_bias_ids(((50, 1.0),), 32)


def test_left_out_fields_take_the_models_defaults_then_openais():
    defaults = {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}
    sent = parse(temperature=0.0).sampling(defaults)
    assert sent.temperature == 0.0 and sent.top_p == 0.9
    assert sent.repetition_penalty == 1.1
    assert parse().sampling({}).temperature == 1.0 and parse().sampling({}).top_p == 1.0
