"""The server's OpenAI ``logprobs`` (issue 69, item 2): chat's ``choices[].logprobs.content``
and completions' ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``, well
formed (read by the ``openai`` client), streamed equal to whole, the engine's values; and
the limits are 400s naming the field."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from redrafter_mlx.serve.logprobs import MIN_LOGPROB, Trail, token_bytes
from tests.support.serving import Server, error_of

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def server():
    s = Server()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_chat_logprobs_are_well_formed_and_greedy_tokens_are_their_top_one(client):
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=3,
    )  # fmt: skip
    choice = r.choices[0]
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    for entry in content:
        assert -1e4 < entry.logprob <= 0 and entry.bytes and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].token == entry.token  # greedy: the most likely token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-6)
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        if "\ufffd" not in entry.token:
            assert bytes(entry.bytes) == entry.token.encode()


def test_streamed_chat_logprobs_equal_the_whole_answers(server, client):
    fields = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.9, seed=4,
                  logprobs=True, top_logprobs=2)  # fmt: skip
    whole = client.chat.completions.create(**fields).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **fields):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content
    assert [e.token for e in streamed] == [e.token for e in whole] and len(whole) == 12
    for a, b in zip(streamed, whole):
        assert math.isclose(a.logprob, b.logprob, abs_tol=1e-5)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_no_logprobs_asked_gives_null(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3)
    assert r.choices[0].logprobs is None


def test_completion_logprobs_are_well_formed_streamed_or_not(server):
    body = dict(model="tiny", prompt="alpha beta", max_tokens=8, temperature=0, logprobs=2)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 8
    for token, own, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert 1 <= len(top) <= 2 and math.isclose(max(top.values()), own, abs_tol=1e-6)
        assert top.get(token) is not None
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    streamed = []
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      timeout=60) as s:  # fmt: skip
        for line in s.iter_lines():
            if line.startswith("data: {"):
                got = json.loads(line[6:])["choices"][0]["logprobs"]
                streamed += got["token_logprobs"] if got else []
    assert streamed == pytest.approx(lp["token_logprobs"], abs=1e-5)


@pytest.mark.parametrize(
    "path,fields,param",
    [
        ("chat/completions", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        ("chat/completions", dict(top_logprobs=2), "top_logprobs"),
        ("chat/completions", dict(logprobs=3), "logprobs"),
        ("completions", dict(logprobs=21), "logprobs"),
        ("completions", dict(top_logprobs=2), "top_logprobs"),
    ],
    ids=["top>20", "top-without-logprobs", "chat-int", "completion>20", "completion-top"],
)
def test_logprob_limits_are_400s_naming_the_field(server, path, fields, param):
    body = dict(model="tiny", max_tokens=2, **fields)
    body.update(messages=MESSAGES) if path.startswith("chat") else body.update(prompt="a")
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    error = error_of(r, 400, param)
    if "21" in json.dumps(fields):
        assert "20" in error["message"]


class _Pieces:
    """A tokenizer of three pieces: a SentencePiece word, a byte piece, a byte-level token."""

    special_ids = frozenset({3})
    byte_level = True

    def piece(self, i):
        return {0: "\u2581hi", 1: "<0xE2>", 2: "\u0120there", 3: "<|end|>"}[i]


def test_token_bytes_and_a_filtered_tokens_floor():
    tok = _Pieces()
    assert [token_bytes(tok, i) for i in range(4)] == [b" hi", b"\xe2", b" there", b"<|end|>"]
    trail = Trail("chat", 1, tok)
    trail.add([(-0.5, ((0, -0.5),)), (-1.0, ((2, float("-inf")),))], 2)
    content = trail.take([0, 2])["content"]
    assert [e["token"] for e in content] == [" hi", " there"]
    assert content[1]["top_logprobs"][0]["logprob"] == MIN_LOGPROB
    assert trail.take([0, 2]) is None  # nothing new


def test_a_server_running_apar_branches_refuses_logprobs():
    """A branching answer is rebuilt from its branches' rows: no token order to report."""
    from redrafter_mlx.serve.app import _check_unbranched
    from redrafter_mlx.serve.protocol import ProtocolError, parse_chat

    params = parse_chat({"messages": MESSAGES, "logprobs": True}, 10)
    assert params.logprobs == 0
    with pytest.raises(ProtocolError, match="branches") as e:
        _check_unbranched(params)
    assert e.value.param == "logprobs"
    _check_unbranched(parse_chat({"messages": MESSAGES}, 10))  # none asked: fine
