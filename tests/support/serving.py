"""Serving without a network: a live server on a thread (``Server``), request sinks, draining a
scheduler, staggered submissions, and tool-call answers for the tool parsers."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.app import ServeConfig, create_app
from redrafter_mlx.serve.runner import make_server
from redrafter_mlx.serve.scheduler import Request, Scheduler
from tests.support.models import tiny_drafter, tiny_model

LIMIT = 64


BODY_LIMIT = 64 << 10  # 64 KiB for these tests


class Server:
    """The app and uvicorn on a thread, on a pre-bound free localhost port."""

    def __init__(self):
        tok = load_tokenizer(demo_paths()[0])
        model = tiny_model(vocab=tok.vocab_size, hidden=32, layers=2)
        shape = BeamShape(2, 3)
        self.scheduler = Scheduler(model, tiny_drafter(model), shape, (), 8, 64)
        self.scheduler.start(warmup_prompt=[1, 2, 3])
        beam = dict(beam_width=2, beam_length=3, capacity=shape.slots)
        config = ServeConfig(
            tok, "tiny", LIMIT, model.max_context, model.vocab_size, beam, ("tiny-alias",)
        )
        config.max_body_bytes = BODY_LIMIT
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = create_app(self.scheduler, config)
        self.server = make_server(app, self.scheduler, "127.0.0.1", 0, "critical", 1.0)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start within 60 s"
            time.sleep(0.02)

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=10)

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            health = self.health().json()
            if not (health["active_rows"] or health["queued"] or health["prefilling"]):
                return health
            time.sleep(0.02)
        raise AssertionError(f"the server did not go idle: {health}")

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


async def stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, str, str]:
    """(status, text, finish_reason) of one streaming request read to ``[DONE]``."""
    body = dict(body)
    kind = body.pop("kind")
    async with client.stream("POST", f"{url}/v1/{kind}", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, ""
        text, finish, done = "", "", False
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            piece = choice["delta"].get("content") if kind != "completions" else choice["text"]
            text += piece or ""
            finish = choice["finish_reason"] or finish
        assert done, "the stream ended without [DONE]"
        return 200, text, finish


def error_of(r: httpx.Response, status: int, param=None, code=None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code), error
    return error


class Collector:
    """A request sink gathering tokens and the final event."""

    def __init__(self):
        self.tokens, self.last = [], None

    def __call__(self, event):
        self.tokens += event.tokens
        self.last = event


def drain(sched):
    """Run the loop until nothing is queued, active or in flight."""
    for _ in range(10_000):
        if not (sched.active_rows or sched.batch.pending is not None or sched.queue.qsize()):
            return
        sched.run_once()
    raise AssertionError("scheduler did not finish")


def staggered(sched, prompts, max_tokens, samplers=None, turn=True) -> list:
    """Each prompt submitted with its ``max_tokens`` (a list) and sampler (``samplers``, else
    the scheduler's), one loop turn after each when ``turn`` (the later ones join a running
    batch), then drained: each request's ``Collector``."""
    sinks = []
    for prompt, limit, sampler in zip(prompts, max_tokens, samplers or [None] * len(prompts)):
        sinks.append(Collector())
        own = () if sampler is None else (sampler,)  # else the Request's default
        sched.submit(Request(prompt, limit, sinks[-1], *own))
        if turn:
            sched.run_once()
    drain(sched)
    return sinks


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


# (kind, the answer as the model writes it, the text of each call in it)
THINK = "<think>\nLet me think.\n</think>\n\n"


QWEN3_TWO = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n'
    "</tool_call>"
)


ANSWERS = {
    "qwen3": THINK + "I will look.\n" + QWEN3_TWO,
    "qwen3_coder": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>"
    ),
    "mistral": 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome", "unit": "c"}',
}


def mlx_lm_calls(tok, text: str) -> list[dict]:
    """The calls mlx-lm's parser reads from ``text``: each span between the format's markers
    (Mistral's: everything after its first marker) parsed as mlx-lm's server parses it."""
    start, end = tok.markers.tool
    spans = [text.split(start, 1)[1]] if not end else []
    if end:
        spans = [s.split(end, 1)[0] for s in text.split(start)[1:]]
    out = []
    for span in spans:
        parsed = tok.markers.parse_tool(span, [WEATHER])
        out += parsed if isinstance(parsed, list) else [parsed]
    return out
