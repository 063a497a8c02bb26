"""The request fields other OpenAI-compatible servers honour, honoured here: ``ignore_eos``,
``stop_token_ids`` and ``min_tokens``; and every other field the server does not read
refused with a 400 naming it.

The demo model (with its drafter, W2×L4) rarely ends a text, so the server's "EOS" is a
token its greedy answer writes ``at`` tokens in. References come from the engine alone,
plain decoding, before the server starts (two threads never run MLX at once here); the
prompt is sent as token ids.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

import redrafter_mlx
from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.engine.loop.generation import generate_steps
from redrafter_mlx.serve.app import ServeConfig, create_app
from redrafter_mlx.serve.runner import make_server
from redrafter_mlx.serve.scheduler import Scheduler
from redrafter_mlx.serve.text import TextStream

MAX = 40
HELD = 6  # min_tokens holds the end back this many tokens past where it came


def plain(model, ids, eos=(), sampler=SamplerConfig()) -> list[int]:
    out = []
    for event in generate_steps(
        model, None, [ids], max_tokens=MAX, shape=AR, sampler=sampler, eos_token_ids=eos
    ):
        out += event.tokens[0]
    return out


def start_uvicorn(app, scheduler):
    """uvicorn on a thread on a free port: (its URL, a function that stops it)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = make_server(app, scheduler, "127.0.0.1", 0, "critical", 1.0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        assert time.time() < deadline, "the server did not start within 60 s"
        time.sleep(0.02)

    def close():
        server.should_exit = True
        thread.join(10)

    return url, close


def first_new(tokens: list[int], least: int) -> int:
    """The index of the first token at or past ``least`` not written before it."""
    return next(i for i, t in enumerate(tokens) if i >= least and t not in tokens[:i])


@pytest.fixture(scope="module")
def live():
    base, drafter_path = demo_paths()
    model, drafter, tok = redrafter_mlx.load(base, drafter_path)
    ids = tok.encode("def fibonacci(n):")
    free = plain(model, ids)
    at = first_new(free, 8)  # where the "EOS" comes
    end = free[at]
    stop_at = first_new(free, 3)  # a stop id before it
    assert stop_at < at
    held = SamplerConfig(min_length=len(ids) + at + HELD, end_ids=(end,))
    refs = dict(free=free, at=at, end=end, stop_at=stop_at, held=plain(model, ids, (end,), held))
    scheduler = Scheduler(model, drafter, BeamShape(2, 4), (end,), 4, 16)
    scheduler.start(warmup_prompt=ids)
    config = ServeConfig(tok, "demo", 64, model.max_context, model.vocab_size, {"beam_width": 2})
    url, close = start_uvicorn(create_app(scheduler, config), scheduler)
    yield url, ids, tok, refs
    close()


def text_of(tok, tokens: list[int]) -> str:
    """The text the server sends for ``tokens`` (its own decoder)."""
    stream = TextStream(tok, [])
    return stream.add(tokens)[0] + stream.finish()


def complete(url: str, ids: list[int], **fields) -> dict:
    body = dict(prompt=ids, max_tokens=MAX, temperature=0, **fields)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def answer(resp: dict) -> tuple[str, str, int]:
    choice = resp["choices"][0]
    return choice["text"], choice["finish_reason"], resp["usage"]["completion_tokens"]


def expected(live, case: str) -> tuple[str, str, int]:
    """(text, finish, completion tokens) each case must give, from the references."""
    _, _, tok, refs = live
    free, at, stop_at = refs["free"], refs["at"], refs["stop_at"]
    if case == "plain":  # ends at the "EOS"
        return text_of(tok, free[:at]), "stop", at
    if case == "ignore_eos":  # runs past it to max_tokens
        return text_of(tok, free), "length", MAX
    if case == "stop_token_ids":  # ends at the stop id, before the EOS
        return text_of(tok, free[:stop_at]), "stop", stop_at
    held = refs["held"]  # min_tokens: the EOS held back, as plain decoding holds it
    return text_of(tok, held), "stop" if len(held) < MAX else "length", len(held)


def fields_of(live, case: str) -> dict:
    refs = live[3]
    return {
        "plain": {},
        "ignore_eos": dict(ignore_eos=True),
        "stop_token_ids": dict(stop_token_ids=[refs["free"][refs["stop_at"]]], ignore_eos=True),
        "min_tokens": dict(min_tokens=refs["at"] + HELD),
    }[case]


CASES = ["plain", "ignore_eos", "stop_token_ids", "min_tokens"]


@pytest.mark.parametrize("case", CASES)
def test_each_field_is_honoured(live, case):
    url, ids = live[:2]
    assert answer(complete(url, ids, **fields_of(live, case))) == expected(live, case)


def test_min_tokens_decodes_past_the_end_as_plain_decoding(live):
    refs = live[3]
    held, at = refs["held"], refs["at"]
    assert held[:at] == refs["free"][:at] and refs["end"] not in held[: at + HELD]
    assert len(held) > at + HELD


def test_batched_rows_give_their_solo_answers(live):
    url, ids = live[:2]
    results = {}

    def ask(case):
        results[case] = answer(complete(url, ids, **fields_of(live, case)))

    threads = [threading.Thread(target=ask, args=(c,)) for c in CASES]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {case: expected(live, case) for case in CASES}


@pytest.mark.parametrize(
    "name,value",
    [
        ("max_kv_size", 64),
        ("beam_width", 1),
        ("lookup", 2),
        ("no_draft", True),
        ("draft-model", "x"),
        ("draft_model", "x"),
        ("branches", "off"),
        ("skip_special_tokens", False),
        ("top_a", 0.1),
        ("junk", None),
    ],
)
def test_a_field_the_server_does_not_read_is_a_400_naming_it(live, name, value):
    url, ids = live[:2]
    body = dict(prompt=ids, max_tokens=4, temperature=0, **{name: value})
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and f"'{name}'" in error["message"]


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(min_tokens=MAX + 1), "min_tokens"),
        (dict(min_tokens=-1), "min_tokens"),
        (dict(stop_token_ids=[10**6]), "stop_token_ids"),
        (dict(stop_token_ids=5), "stop_token_ids"),
        (dict(ignore_eos="yes"), "ignore_eos"),
        (dict(user=5), "user"),
    ],
)
def test_bad_values_of_the_extensions_are_400s(live, fields, param):
    url, ids = live[:2]
    body = dict(prompt=ids, max_tokens=MAX, temperature=0, **fields)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_openai_metadata_fields_and_extensions_go_through_the_openai_client(live):
    import openai

    url, ids = live[:2]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    resp = client.completions.create(
        model="demo",
        prompt=ids,
        max_tokens=MAX,
        temperature=0,
        user="someone",
        extra_body=fields_of(live, "min_tokens"),
    )
    choice = resp.choices[0]
    want = expected(live, "min_tokens")
    assert (choice.text, choice.finish_reason, resp.usage.completion_tokens) == want
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        user="someone",
        metadata={"k": "v"},
        store=False,
        stream_options=None,
    )
    assert chat.choices[0].message.content is not None
