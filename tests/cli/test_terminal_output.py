"""Model text reaches a terminal with its control characters shown, not obeyed
(``cli.terminal.visible``): ``generate``'s plain output and the chat's live view, with a model
pushed by a logit bias to emit ESC (byte token <0x1B>, id 30 in the Llama tokenizer)."""

from __future__ import annotations

import json

from redrafter_mlx.cli.terminal import visible
from tests.support.chat import make_loop, output
from tests.support.cli import invoke, model_args

ESC_ID = 30  # "<0x1B>"


def test_visible_shows_c0_c1_and_del_keeps_newline_tab_and_text():
    assert visible("\x1b]0;pwned\x07") == "^[]0;pwned^G"
    assert visible("a\r\nb\tc\x00\x7f") == "a^M\nb\tc^@^?"
    assert visible("\x9b2J\x85") == "\\x9b2J\\x85"
    assert visible("héllo — 世界 \u00a0") == "héllo — 世界 \u00a0"  # printable text unchanged
    for code in (*range(0x20), 0x7F, *range(0x80, 0xA0)):
        shown = visible(chr(code))
        assert shown == chr(code) if chr(code) in "\n\t" else shown.isprintable()


def test_generate_shows_escape_bytes_from_the_model(app, pair):
    args = [*model_args(pair), "-p", "hi", "-n", 4, "--logit-bias", f"{ESC_ID}:100", "--no-draft"]
    result = invoke(app, "generate", *args)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.stdout
    assert "^[^[^[^[" in result.stdout
    exact = invoke(app, "generate", *args, "--json")  # --json keeps the exact text
    assert json.loads(exact.stdout)["text"] == "\x1b" * 4


def test_chat_shows_escape_bytes_from_the_model(engine):
    from redrafter_mlx.engine.core.sampling import SamplerConfig

    for show_accepted in (False, True):
        loop = make_loop(engine, max_tokens=4, show_accepted=show_accepted)
        loop.sampling = SamplerConfig(logit_bias=((ESC_ID, 100.0),))
        text = loop.answer("hi")
        assert text == "\x1b" * 4  # the history keeps the exact text
        shown = output(loop)
        assert "^[^[^[^[" in shown and "\x1b" not in shown
