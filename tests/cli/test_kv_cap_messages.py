"""A prompt over ``--max-kv-size`` is refused naming that cap (and raising it as a fix), not
"the model's context"; without a cap, or with one above the model's context, the model's
context is named."""

from __future__ import annotations

from typer.testing import CliRunner

LONG = "Write a long story about a dragon who lives in a castle near the sea and reads " * 2


def run(cli_app, *args, input=None):
    return CliRunner().invoke(cli_app, [*args], input=input, env={"COLUMNS": "300"})


def test_generate_names_the_cap(cli_app):
    result = run(
        cli_app, "generate", "--model", "demo", "-n", "4", "--max-kv-size", "71", "-p", LONG
    )
    assert result.exit_code == 1
    assert "does not fit the --max-kv-size cap of 71 tokens; raise --max-kv-size" in result.output
    assert "model's context of 71" not in result.output


def test_generate_names_the_models_context_without_a_binding_cap(cli_app):
    prompt = "word " * 600
    for cap in ([], ["--max-kv-size", "4096"]):
        result = run(cli_app, "generate", "--model", "demo", "-n", "4", *cap, "-p", prompt)
        assert result.exit_code == 1
        assert "does not fit the model's context of 512 tokens; shorten the prompt" in result.output


def test_chat_names_the_cap(cli_app):
    result = run(
        cli_app,
        "chat",
        "--model",
        "demo",
        "-n",
        "4",
        "--max-kv-size",
        "71",
        input=f"{LONG}\n/quit\n",
    )
    assert "does not fit the --max-kv-size cap of 71 tokens" in result.output
    assert "(the conversation is unchanged)" in result.output
    system = "You are a helpful assistant who answers questions. " * 6
    result = run(
        cli_app,
        "chat",
        "--model",
        "demo",
        "--max-kv-size",
        "71",
        input=f"/system {system}\n/quit\n",
    )
    assert "no room for a message and an answer in the --max-kv-size cap of 71 tokens" in (
        result.output
    )
