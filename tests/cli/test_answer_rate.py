"""An answer's decoding speed (``generation_tps``) is tokens/s after the first token: an answer
that ended at its first token timed no decoding step, so ``generate --json`` reports null
and the stats line says so, not a rate over a near-zero interval."""

from __future__ import annotations

import json
from types import SimpleNamespace

from typer.testing import CliRunner

from redrafter_mlx.cli.stats import generation_rate, rate_text


def generate(cli_app, *args) -> CliRunner:
    return CliRunner().invoke(cli_app, ["generate", "--model", "demo", "--prompt", "Hi", *args])


def test_a_one_token_answer_has_no_rate(cli_app):
    result = generate(cli_app, "-n", "1", "--json")
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["steps"] == 0 and stats["generation_tokens"] == 1
    assert stats["generation_tps"] is None
    line = generate(cli_app, "-n", "1").stderr.strip().splitlines()[-1]
    assert "1 tokens · no decoding step · TTFT" in line and "tok/s" not in line


def test_a_longer_answer_keeps_its_rate(cli_app):
    stats = json.loads(generate(cli_app, "-n", "4", "--json").stdout)["stats"]
    assert stats["steps"] >= 1 and stats["generation_tps"] > 0


def test_the_rate_of_a_response():
    assert generation_rate(SimpleNamespace(steps=0, generation_tps=218_000.0)) is None
    assert rate_text(SimpleNamespace(steps=0, generation_tps=218_000.0)) == "no decoding step"
    assert rate_text(SimpleNamespace(steps=3, generation_tps=41.26)) == "41.3 tok/s"
