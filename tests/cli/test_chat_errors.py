"""The chat loop goes on after a failing turn, sends ``//text`` as ``/text``, and refuses a
system prompt longer than the context at once (as ``/system`` and as ``--system-prompt``)."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from tests.support.chat import make_short_loop
from tests.support.cli import error_line, invoke


@pytest.fixture(scope="module")
def demo_engine():
    from redrafter_mlx.cli.common import ModelPaths, load_engine

    model, drafter = demo_paths()
    return load_engine(ModelPaths(str(model), str(drafter)), None)


def test_a_failing_turn_reports_and_the_chat_goes_on(demo_engine):
    loop = make_short_loop(demo_engine)
    real = loop.stream

    def broken(*args, **kwargs):
        raise RuntimeError("the backend fell over")

    loop.stream = broken
    assert loop.answer("first") == ""
    assert "error: unexpected RuntimeError: the backend fell over" in loop.console.file.getvalue()
    assert loop.messages == []  # the conversation is as it was
    loop.stream = real
    assert loop.answer("def f(x):")
    assert [m["role"] for m in loop.messages] == ["user", "assistant"]


def test_a_double_slash_sends_a_line_that_begins_with_a_slash(demo_engine):
    from redrafter_mlx.cli.chat_ui import HELP, run_chat

    loop = make_short_loop(demo_engine)
    lines = iter(["//etc/hosts is a file", "/help", None])
    run_chat(loop, read=lambda _prompt: next(lines))
    assert loop.messages[0] == {"role": "user", "content": "/etc/hosts is a file"}
    assert "//text" in HELP and "sends /text" in loop.console.file.getvalue()


def test_a_system_prompt_longer_than_the_context_is_refused_at_once(demo_engine):
    loop = make_short_loop(demo_engine)
    loop.command("/system " + "word " * 600)
    out = loop.console.file.getvalue()
    assert "error: /system: the system prompt takes" in out and "512" in out
    assert loop.system is None  # unchanged: the next turn still works
    assert loop.answer("def f(x):")
    loop.command("/system You write Python.")
    assert loop.system == "You write Python."


def test_a_too_long_system_prompt_flag_is_refused(app):
    line = error_line(
        invoke(app, "chat", "--model", "demo", "--system-prompt", "word " * 600, input=""), 2
    )
    assert line.startswith("error: --system-prompt: the system prompt takes")
