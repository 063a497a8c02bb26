"""A connection answered 413 no longer counts against ``--max-connections`` while the server
drops the rest of its body (issue 68, minor): before, for up to the read deadline, every
normal request got 503."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.base.tokenizer import load_tokenizer
from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.serve.app import ServeConfig, create_app
from redrafter_mlx.serve.runner import make_server
from redrafter_mlx.serve.scheduler import Scheduler
from tests.support.models import tiny_drafter, tiny_model

MAX_CONNECTIONS = 3
BODY_LIMIT = 1024


@pytest.fixture(scope="module")
def server():
    tok = load_tokenizer(demo_paths()[0])
    model = tiny_model(vocab=tok.vocab_size, hidden=32, layers=2)
    scheduler = Scheduler(model, tiny_drafter(model), BeamShape(2, 3), (), 4, 16)
    scheduler.start(warmup_prompt=[1, 2, 3])
    config = ServeConfig(tok, "org/tiny", 64, model.max_context, model.vocab_size, {}, ("t",))
    config.read_timeout_s, config.max_connections = 20.0, MAX_CONNECTIONS
    config.max_body_bytes = BODY_LIMIT
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = make_server(create_app(scheduler, config), scheduler, "127.0.0.1", port, "critical", 1.0)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    yield port
    uv.should_exit = True
    thread.join(10)


PIECE = b"%x\r\n%s\r\n" % (512, b"x" * 512)


def test_connections_answered_413_free_their_place_at_once(server):
    port = server
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n"
    )
    conns = []
    try:
        for _ in range(MAX_CONNECTIONS):  # past the limit, still sending: the rest is dropped
            conns.append(conn := socket.create_connection(("127.0.0.1", port)))
            conn.sendall(head + PIECE * 3)
            conn.settimeout(5.0)
            assert conn.recv(4096).startswith(b"HTTP/1.1 413")
        for _ in range(3):
            for conn in conns:
                conn.sendall(PIECE)  # the uploads go on (under the 1 s linger)
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5.0)
            assert r.status_code == 200, r.status_code
            time.sleep(0.3)
    finally:
        for conn in conns:
            conn.close()
