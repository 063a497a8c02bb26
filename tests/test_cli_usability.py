"""The CLI as a new user meets it: one test per trap found by trying every command with bad
input (no silent state, errors that never leak internals, one set of flags)."""

from __future__ import annotations

import json

import pytest

import redrafter_mlx.cli.tune
from tests.fakes import FakeChip, FakeClock
from tests.helpers import VICUNA_TOKENIZER, run_decode, tiny_model
from tests.test_cli import app, invoke, model_args, pair  # noqa: F401 (fixtures)


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- 1. tune state


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_tune_refuses_a_budget_that_cannot_measure(app, pair, budget):  # noqa: F811
    result = invoke(app, "tune", *model_args(pair), "--budget-seconds", budget)
    assert result.exit_code == 2 and "--budget-seconds" in error_lines(result)[0]


def test_tune_that_measured_nothing_saves_nothing(app, pair, home, monkeypatch):  # noqa: F811
    from tuning.profiles import ProfileStore

    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.5)  # every speculative run is over the budget
    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (chip, clock))
    result = invoke(app, "tune", *model_args(pair), "--budget-seconds", "1")
    assert result.exit_code == 1
    assert "no profile was saved" in error_lines(result)[0]
    assert ProfileStore().load() == {}


# --------------------------------------------------------------------------- 2. answer length


def test_chat_default_answer_leaves_room_for_a_conversation():
    from redrafter_mlx.cli.chat import answer_budget

    assert answer_budget(512) == 128 and answer_budget(8192) == 1024 and answer_budget(None)


def test_a_full_context_is_reported_as_such():
    model = tiny_model(0, max_position_embeddings=40)
    out, _ = run_decode(model, None, [[1] * 30], max_tokens=100)
    assert len(out[0]) == 10
    from redrafter_mlx.engine.generation import decode

    events = list(decode(model, None, [[1] * 30], max_tokens=100))
    assert events[-1].finish == ["context"]
    events = list(decode(model, None, [[1] * 30], max_tokens=5))
    assert events[-1].finish == ["length"]


def test_generate_json_says_the_context_ended_the_answer(app, pair):  # noqa: F811
    from redrafter_mlx.engine.tokenizer import load_tokenizer
    from tests.test_cli import CONTEXT

    tok = load_tokenizer(VICUNA_TOKENIZER)
    words = next(k for k in range(CONTEXT) if len(tok.encode("a" + " a" * k)) >= CONTEXT - 1)
    text = "a" + " a" * words
    assert len(tok.encode(text)) == CONTEXT - 1  # one token of room left
    result = invoke(app, "generate", *model_args(pair), "--raw", "--json", "-n", "50", "-p", text)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "context" and len(data["tokens"]) == 1
