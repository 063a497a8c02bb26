"""A chat never loses its history to a failed or interrupted turn: the turns dropped to fit
the context are dropped only once the turn has an answer, and Ctrl-C while a message is
being prepared (tokenised, fitted to the context) cancels that turn, not the chat."""

from __future__ import annotations

import pytest

from redrafter_mlx.cli.chat_ui import run_chat, settle_compiler_check
from tests.support.chat import MAX_TOKENS, interrupt_after, make_loop, output
from tests.support.cli import CONTEXT

LONG = "please explain " + "this " * 110  # ~113 tokens: two such turns exceed the context


def two_turns(engine):
    loop = make_loop(engine)
    loop.answer(LONG + "first")
    before = [dict(m) for m in loop.messages]
    assert len(before) == 2
    return loop, before


def test_a_message_too_long_keeps_the_turns_it_would_have_dropped(engine):
    loop, before = two_turns(engine)
    loop.answer("word " * (CONTEXT + 10))  # needs every earlier turn dropped, then refused
    assert "error: prompt of" in output(loop) and "conversation is unchanged" in output(loop)
    assert loop.messages == before
    assert loop.dropped_turns == 0
    assert "history: 2 messages" in loop.stats_text()


def test_ctrl_c_before_the_first_token_keeps_the_turns_it_would_have_dropped(engine):
    loop, before = two_turns(engine)
    loop.stream = interrupt_after(0)
    assert loop.answer(LONG + "second") == ""
    assert loop.messages == before and loop.dropped_turns == 0


def test_an_answered_turn_drops_the_oldest_turns(engine):
    loop, _ = two_turns(engine)
    loop.stream = interrupt_after(1)  # a partial answer is an answer: the drop is kept
    text = loop.answer(LONG + "second")
    assert text and loop.dropped_turns == 1
    assert [m["content"] for m in loop.messages] == [LONG + "second", text]


def test_ctrl_c_while_a_message_is_prepared_cancels_the_turn_not_the_chat(engine, monkeypatch):
    loop, before = two_turns(engine)
    real = engine.tokenizer.chat_prompt

    def slow_to_tokenise(messages, system=None):
        if any("interrupt me" in m["content"] for m in messages):
            raise KeyboardInterrupt  # Ctrl-C lands while the message is tokenised
        return real(messages, system=system)

    monkeypatch.setattr(engine.tokenizer, "chat_prompt", slow_to_tokenise)
    lines = iter(["interrupt me " * 50, "hi", "/quit"])
    try:
        run_chat(loop, lambda prompt: next(lines))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while a message was prepared ended the chat")
    assert "[interrupted; the conversation is unchanged]" in output(loop)
    assert loop.messages[:2] == before and len(loop.messages) == 4  # then "hi" was answered
    assert loop.messages[2]["content"] == "hi"


def test_compiler_check_runs_before_the_first_prompt(app, pair, monkeypatch):
    """``chat`` settles MLX's one-time compiler check (a ``system()`` call that ignores
    SIGINT) before it reads the first line, so no Ctrl-C in the first answer is lost."""
    from redrafter_mlx.cli import chat_ui
    from tests.support.cli import invoke, model_args

    events = []
    monkeypatch.setattr(chat_ui, "settle_compiler_check", lambda: events.append("settled"))

    def read(prompt=">> "):
        events.append("read")
        return None

    monkeypatch.setattr(chat_ui, "read_line", read)
    result = invoke(app, "chat", *model_args(pair), "-n", MAX_TOKENS)
    assert result.exit_code == 0, result.output
    assert events == ["settled", "read"]
    settle_compiler_check()  # and it runs on this backend
