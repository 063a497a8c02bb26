"""The server honours every sampling setting the CLI has: top-k and
min-p reach each row's draws exactly as ``generate`` applies them under speculation, bad
ranges are a 400 naming the field, and what the server does not implement is refused."""

import httpx
import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.protocol import ProtocolError, parse_chat, parse_completion
from redrafter_mlx.serve.scheduler import Scheduler
from redrafter_mlx.serve.tools import check_support
from tests.support.models import run_decode, tiny_drafter, tiny_model
from tests.support.serving import Server, error_of, staggered


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


def complete(server, **fields) -> str:
    body = dict(model="tiny", prompt="alpha beta gamma", max_tokens=24, **fields)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_top_k_1_and_min_p_near_1_give_the_greedy_text(server):
    """Before: top_k and min_p were dropped, so these sampled at temperature 1.5."""
    greedy = complete(server, temperature=0)
    assert complete(server, temperature=1.5, seed=2) != greedy  # the sample differs
    assert complete(server, temperature=1.5, seed=2, top_k=1) == greedy
    assert complete(server, temperature=1.5, seed=2, min_p=0.99) == greedy


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(top_k=-5), "top_k"),
        (dict(top_k=1.5), "top_k"),
        (dict(min_p=1.0), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(response_format={"type": "json_object"}), "response_format"),
        (dict(tool_choice="auto"), "tool_choice"),
    ],
    ids=["top_k<0", "top_k-float", "min_p=1", "min_p<0", "json_object", "tool_choice"],
)
def test_bad_or_unsupported_sampling_fields_are_400_naming_them(server, fields, param):
    body = dict(model="tiny", prompt="alpha", max_tokens=2, **fields)
    error_of(httpx.post(server.url + "/v1/completions", json=body, timeout=30), 400, param)


def test_plain_text_response_format_is_accepted():
    params = parse_completion({"prompt": "x", "response_format": {"type": "text"}}, 10)
    assert params.sampling().temperature == 1.0


def test_tool_calls_in_the_history_to_a_model_without_tool_support_are_a_400_saying_so():
    """The demo model (SentencePiece, Vicuna v1.1) has no template to show tool calls."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "and?"},
    ]
    params = parse_chat({"messages": messages}, 10)
    with pytest.raises(ProtocolError, match="no tool support") as e:
        check_support(params.tools, params.messages, load_tokenizer(demo_paths()[0]))
    assert e.value.param == "messages[1]" and "content must be" not in e.value.message


ROWS = [
    SamplerConfig(temperature=1.5, top_k=3, seed=11),
    SamplerConfig(temperature=1.0, min_p=0.3, seed=12),
    SamplerConfig(temperature=0.0),
    SamplerConfig(temperature=1.2, top_k=5, top_p=0.8, min_p=0.05, seed=13),
]


@pytest.mark.parametrize("shape", [BeamShape(2, 3), BeamShape(1, 3, None, 1, 4), None], ids=str)
def test_rows_with_top_k_and_min_p_equal_their_solo_runs(shape):
    """Each row of a shared batch draws with its own top-k / min-p exactly as it alone."""
    model = tiny_model(vocab=64, hidden=32, layers=2, seed=3)
    drafter = tiny_drafter(model) if shape is not None else None
    prompts = [[1, 5, 9, 2, 7], [1, 3, 3, 8], [2, 4, 6], [1, 1, 2, 3, 5, 8]]
    sched = Scheduler(model, drafter, shape, (), max_batch=4)
    sinks = staggered(sched, prompts, [20] * len(prompts), ROWS)
    for prompt, sampler, sink in zip(prompts, ROWS, sinks):
        alone, _ = run_decode(
            model,
            drafter,
            [prompt],
            max_tokens=20,
            sampler=sampler,
            seed=sampler.seed,
            shape=shape or BeamShape(1, 1),
            adapt=False,
        )
        assert sink.tokens == alone[0], sampler
