"""``redrafter-mlx serve`` end to end: the official openai client against a live server.

The server runs in this process (uvicorn on a thread, the engine on its own thread) on a
free 127.0.0.1 port with the demo model. Reference outputs are computed before the server
starts, with the engine alone, so two threads never run MLX at the same time here.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

import redrafter_mlx
from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.app import ServeConfig, create_app
from redrafter_mlx.serve.runner import make_server
from redrafter_mlx.serve.scheduler import Request, Scheduler

W, L = 2, 4
LIMIT = 256


def questions(n):
    lines = (demo_paths()[0].parent / "heldout_prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["turns"][0] for line in lines[:n]]


# (kind, content, max_tokens): 8 different prompts and lengths, chat and completion
CASES = [("chat", q, 24 + 9 * i) for i, q in enumerate(questions(6))] + [
    ("completion", "def fibonacci(n):", 40),
    ("completion", "import os\n\n\ndef walk(path):", 64),
]
SAMPLED = dict(max_tokens=40, temperature=0.8, top_p=0.95, seed=1234)


def chat_messages(content):
    return [{"role": "user", "content": content}]


@pytest.fixture(scope="module")
def pair():
    base, drafter = demo_paths()
    return redrafter_mlx.load(base, drafter)


@pytest.fixture(scope="module")
def references(pair):
    """Each case decoded alone with the engine: (text, tokens generated)."""
    model, drafter, tok = pair
    refs = {}
    for kind, content, max_tokens in CASES:
        ids = tok.chat_prompt(chat_messages(content)) if kind == "chat" else tok.encode(content)
        text, n = "", 0
        for r in redrafter_mlx.stream_generate(
            model, drafter, tok, ids, max_tokens=max_tokens, shape=BeamShape(W, L)
        ):
            text, n = text + r.text, n + len(r.tokens)
        refs[(kind, content, max_tokens)] = (text, n, len(ids))
    ids = tok.chat_prompt(chat_messages(CASES[1][1]))
    refs["sampled"] = redrafter_mlx.generate(
        model,
        drafter,
        tok,
        ids,
        max_tokens=SAMPLED["max_tokens"],
        shape=BeamShape(W, L),
        sampler=SamplerConfig(SAMPLED["temperature"], SAMPLED["top_p"]),
        seed=SAMPLED["seed"],
    )
    return refs


class LiveServer:
    """uvicorn on a thread, serving ``app`` on a pre-bound free port."""

    def __init__(self, pair, max_batch, max_queue):
        model, drafter, tok = pair
        self.scheduler = Scheduler(
            model, drafter, BeamShape(W, L), tok.eos_token_ids, max_batch, max_queue
        )
        self.scheduler.start(warmup_prompt=tok.chat_prompt(chat_messages("Hello")))
        beam = dict(beam_width=W, beam_length=L, capacity=BeamShape(W, L).slots)
        config = ServeConfig(tok, "demo", LIMIT, model.max_context, model.vocab_size, beam)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = make_server(
            create_app(self.scheduler, config), self.scheduler, "127.0.0.1", 0, "warning", 2.0
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]})
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            assert time.time() < deadline, "the server did not start within 60 s"
            time.sleep(0.02)
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)

    def health(self):
        return httpx.get(self.url + "/health").json()

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def live(pair, references):
    server = LiveServer(pair, max_batch=8, max_queue=32)
    yield server
    server.close()


def ask(client, kind, content, max_tokens, stream=False, **kw):
    """(text, finish_reason, usage or None, speculation) of one greedy request."""
    common = dict(model="demo", max_tokens=max_tokens, temperature=0, stream=stream, **kw)
    if kind == "chat":
        resp = client.chat.completions.create(messages=chat_messages(content), **common)
    else:
        resp = client.completions.create(prompt=content, **common)
    if not stream:
        choice = resp.choices[0]
        text = choice.message.content if kind == "chat" else choice.text
        return text, choice.finish_reason, resp.usage, resp.model_extra["speculation"]
    text, finish, usage, spec = "", None, None, None
    for chunk in resp:
        if chunk.choices:
            c = chunk.choices[0]
            text += (c.delta.content or "") if kind == "chat" else c.text
            finish = c.finish_reason or finish
        if chunk.usage is not None:
            usage, spec = chunk.usage, chunk.model_extra["speculation"]
    return text, finish, usage, spec


def wait_idle(server, timeout=10.0):
    """Until no row is active (rows cut by a stop string leave at the next step)."""
    deadline = time.time() + timeout
    while time.time() < deadline and server.health()["active_rows"]:
        time.sleep(0.02)
    return server.health()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=["chat", "completion"])
def test_single_request_equals_engine_alone(live, references, case, stream):
    text, n, prompt_tokens = references[case]
    options = dict(stream_options={"include_usage": True}) if stream else {}
    got, finish, usage, spec = ask(live.client, *case, stream=stream, **options)
    assert got == text
    assert finish == ("length" if n == case[2] else "stop")
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, n)
    assert usage.total_tokens == prompt_tokens + n
    assert spec["enabled"] and spec["beam_width"] == W and spec["tokens_per_step"] >= 1.0


def test_seeded_sampling_equals_the_engine_alone(live, references):
    resp = live.client.chat.completions.create(
        model="demo", messages=chat_messages(CASES[1][1]), **SAMPLED
    )
    assert resp.choices[0].message.content == references["sampled"]


def test_eight_concurrent_requests_each_equal_alone(live, references):
    before = live.health()["steps"]
    results = [None] * len(CASES)

    def worker(i):
        results[i] = ask(live.client, *CASES[i], stream=i % 2 == 1)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(CASES))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for case, result in zip(CASES, results):
        assert result is not None and result[0] == references[case][0], case
    health = wait_idle(live)
    assert health["steps"] > before and health["max_rows_per_step"] > 1
    assert health["active_rows"] == 0


def test_stop_strings_cut_the_text(live, references):
    case = CASES[7]
    text = references[case][0]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    before = wait_idle(live)
    got, finish, usage, _ = ask(live.client, *case, stop=[stop, "\u2603 never"])
    assert got == text[: text.index(stop)] and finish == "stop"
    assert 0 < usage.completion_tokens <= references[case][1]
    streamed = ask(live.client, *case, stream=True, stop=stop)
    assert streamed[:2] == (got, "stop")
    health = wait_idle(live)  # a stop string's answer is complete: done, not cancelled
    assert health["requests_cancelled"] == before["requests_cancelled"]
    assert health["requests_done"] == before["requests_done"] + 2


def test_client_disconnect_mid_stream_frees_its_row(live, references):
    cancelled = wait_idle(live)["requests_cancelled"]
    body = dict(prompt="class Parser:", max_tokens=LIMIT, temperature=0, stream=True)
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    health = wait_idle(live)
    assert health["active_rows"] == 0 and health["requests_cancelled"] == cancelled + 1
    assert ask(live.client, *CASES[6])[0] == references[CASES[6]][0]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("chat/completions", "{not json", None),
        ("chat/completions", {"model": "demo", "messages": "hi"}, "messages"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
        ("completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ("completions", {"prompt": "x", "max_tokens": LIMIT + 1}, "max_tokens"),
        ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
        ("completions", {"prompt": "x " * 600}, "prompt"),
        ("completions", {"prompt": "x", "stop": [1]}, "stop"),
    ],
)
def test_malformed_requests_get_400(live, path, body, param):
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{live.url}/v1/{path}", content=content)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert error["type"] == "invalid_request_error" and error["message"]


def test_engine_failure_is_a_500_and_the_server_keeps_serving(live, references, monkeypatch):
    original = live.scheduler.batch.stepping.queue

    def boom(grants):
        monkeypatch.setattr(live.scheduler.batch.stepping, "queue", original)
        raise RuntimeError("injected engine fault")

    monkeypatch.setattr(live.scheduler.batch.stepping, "queue", boom)
    with pytest.raises(openai.InternalServerError, match="injected engine fault"):
        ask(live.client, *CASES[0])
    assert ask(live.client, *CASES[0])[0] == references[CASES[0]][0]


def test_models_and_health(live):
    models = live.client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    health = live.health()
    assert health["status"] == "ok" and health["max_batch"] == 8


def test_full_queue_is_a_429(pair, monkeypatch):
    """With admission held, a request waiting in the queue (size 1) makes the next one a 429;
    once admission resumes, the queued request is answered and the server keeps serving."""
    server = LiveServer(pair, max_batch=1, max_queue=1)
    gate, holding = threading.Event(), threading.Event()
    admit = server.scheduler._admit

    def held(*args):
        if gate.is_set():
            return admit(*args)
        holding.set()
        time.sleep(0.01)
        return []

    monkeypatch.setattr(server.scheduler, "_admit", held)
    try:
        # the engine thread may still be inside the original _admit, waiting on the queue:
        # the queue is closed once it has come round to the held one
        assert holding.wait(30)
        events = []
        tok = pair[2]
        server.scheduler.submit(Request(tok.encode("def fibonacci(n):"), 8, events.append))
        assert server.health()["queued"] == 1
        with pytest.raises(openai.RateLimitError):
            ask(server.client, *CASES[6])
        gate.set()
        deadline = time.time() + 60
        while not (events and events[-1].finish):
            assert time.time() < deadline, "the queued request was not answered"
            time.sleep(0.02)
        assert ask(server.client, *CASES[6])[1] in ("stop", "length")
    finally:
        gate.set()
        server.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_drains_and_exits_zero(tmp_path, sig):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, REDRAFTER_MLX_HOME=str(tmp_path))
    cmd = [sys.executable, "-m", "redrafter_mlx.cli", "serve", "--port", str(port)]
    cmd += ["--max-batch", "2", "--beam-width", "2", "--beam-length", "4", "--shutdown-grace", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = dict(prompt="class Parser:", max_tokens=LIMIT, temperature=0, stream=True)
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(sig)
            tail = list(lines)  # the stream ends: finished or cut at the grace period
        assert proc.wait(15) == 0
        assert any(line.startswith("data: ") for line in tail)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_gives_one_beam_and_one_chain_room_for_one():
    """Serve has no adaptive loop: the default beam + chain verifies one of them per row."""
    from redrafter_mlx.cli.serve import serving_plan
    from redrafter_mlx.engine.core.shape import BeamShape
    from tuning import ShapeChoice

    plan = serving_plan(ShapeChoice(BeamShape(1, 4, None, 1, 8), "preset"))
    assert (
        plan.shape == BeamShape(1, 4, 4, 1, 8) and "room for the beam or the chain" in plan.source
    )
    for kept in (BeamShape(1, 4, 11, 1, 8), BeamShape(2, 4, None, 1, 8), BeamShape(1, 4)):
        assert serving_plan(ShapeChoice(kept, "flags")).shape == kept


@pytest.mark.parametrize(
    "flag,value,message",
    [
        ("--shutdown-grace", "-5", "--shutdown-grace must be a finite number of seconds >= 0"),
        ("--shutdown-grace", "nan", "--shutdown-grace must be a finite number of seconds >= 0"),
        ("--max-body-bytes", "0", "--max-body-bytes must be >= 1"),
    ],
)
def test_bad_serve_flags_are_one_line_errors(cli_app, flag, value, message):
    from typer.testing import CliRunner

    result = CliRunner().invoke(cli_app, ["serve", "--model", "demo", f"{flag}={value}"])
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(errors) == 1 and message in errors[0], result.stderr


def test_model_aliases_name_the_loaded_model():
    from redrafter_mlx.cli.common import ModelPaths
    from redrafter_mlx.cli.serve import model_aliases, model_id

    demo = ModelPaths(str(demo_paths()[0]), None, demo=True)
    assert (model_id(demo), model_aliases("demo", demo)) == (
        "redrafter-mlx-demo",
        ("demo", "default"),
    )
    repo = ModelPaths("HuggingFaceTB/SmolLM2-135M-Instruct", None)
    assert model_aliases(repo.model, repo) == ("SmolLM2-135M-Instruct", "default")
