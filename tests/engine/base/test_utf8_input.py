"""Bytes that are not UTF-8 (in a prompt, a chat line, stdin, a profile or a prompt file)
never end a command: text reaches the model as U+FFFD, and a file is named with its fix."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from tests.support.cli import invoke


def test_the_tokenizer_reads_bytes_that_are_not_utf8_as_replacement_characters(tmp_path):
    """SentencePiece raised RuntimeError on a lone surrogate (what Python makes of such bytes
    in argv and stdin); an HF tokenizer with a chat template failed too."""
    from redrafter_mlx.engine.base.tokenizer import Tokenizer, valid_text
    from tests.support.models import FIXTURES

    assert valid_text("hi \udcff\udcfe é") == "hi \ufffd\ufffd é"
    sp = Tokenizer(demo_paths()[0])
    assert sp.encode("x\udcff y") == sp.encode("x\ufffd y")
    assert sp.chat_prompt([{"role": "user", "content": "\ud800"}], system="s\udcff")
    hf_dir = tmp_path / "hf"
    shutil.copytree(FIXTURES / "convert" / "tokenizer", hf_dir)
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    hf = Tokenizer(hf_dir)
    assert hf.encode("x\udcff y") == hf.encode("x\ufffd y")
    messages = [{"role": "user", "content": "hi \udcff"}]
    assert hf.chat_prompt(messages) == hf.chat_prompt([{"role": "user", "content": "hi \ufffd"}])


def test_chat_survives_a_line_that_is_not_utf8(app):
    """The issue's transcript: the second line ended the chat with a RuntimeError."""
    script = b"def f(x):\nhi \xff\xfe bytes\ndef g(y):\n"
    result = invoke(app, "chat", "--model", "demo", "-n", 4, input=script)
    assert result.exit_code == 0, result.output
    assert "error" not in result.output
    assert result.stdout.count("4 tokens") == 3  # three answers, each with its stats line


def test_generate_takes_a_prompt_that_is_not_utf8(app):
    for args, stdin in ((["-p", "x\udcff y"], None), (["-p", "-"], b"x\xff y")):
        result = invoke(app, "generate", "--model", "demo", "-n", 4, *args, input=stdin)
        assert result.exit_code == 0, result.output


def _random_bytes_profile(home) -> None:
    home.mkdir(parents=True, exist_ok=True)
    noise = random.Random(43).randbytes(499)
    (home / "profiles.json").write_bytes(b"\x91" + noise)


def test_a_profile_that_is_not_utf8_warns_and_falls_back(home, tmp_path):
    from tuning import resolve_beam_shape
    from tuning.profiles import ProfileStore

    _random_bytes_profile(home)
    warnings: list[str] = []
    assert ProfileStore(warn=warnings.append).load() == {}
    assert len(warnings) == 1 and str(home / "profiles.json") in warnings[0]
    assert "not UTF-8" in warnings[0] and "tune --clear" in warnings[0]
    model, drafter = tmp_path / "m", tmp_path / "d"
    for folder in (model, drafter):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    choice = resolve_beam_shape(str(model), str(drafter), None)
    assert choice.source.startswith("preset")


def test_tune_clear_removes_a_profile_that_is_not_utf8(app, home):
    _random_bytes_profile(home)
    result = invoke(app, "tune", "--clear")
    assert result.exit_code == 0, result.output
    assert "Removed the unreadable tuned-profile file" in result.stdout
    assert not (home / "profiles.json").exists()


def test_chat_runs_with_a_profile_that_is_not_utf8(app, home):
    _random_bytes_profile(home)
    result = invoke(app, "chat", "--model", "demo", "-n", 2, input="def f(x):\n")
    assert result.exit_code == 0, result.output
    assert "ignoring corrupt tuned-profile file" in result.stderr


def test_a_binary_prompt_file_is_named(tmp_path):
    from redrafter_mlx.engine.base.prompts import PromptSetError, load_prompts

    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xbc" + random.Random(1).randbytes(299))
    with pytest.raises(PromptSetError) as e:
        load_prompts(str(binary))
    assert str(binary) in str(e.value) and "not UTF-8" in str(e.value)
