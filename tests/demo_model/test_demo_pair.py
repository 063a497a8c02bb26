"""The packaged demo pair: loads, is lossless against plain decoding, drafts for real, chats."""

import json

import pytest
from typer.testing import CliRunner

import redrafter_mlx
from redrafter_mlx.engine.base.bundled import demo_paths
from tests.support.models import run_decode

pytestmark = pytest.mark.slow  # make test-fast leaves these out


@pytest.fixture(scope="module")
def pair():
    base, drafter = demo_paths()
    assert drafter is not None, "the demo drafter is not built (make demo-model)"
    return redrafter_mlx.load(base, drafter)


@pytest.fixture(scope="module")
def prompts(pair):
    _, _, tok = pair
    base, _ = demo_paths()
    lines = (base.parent / "heldout_prompts.jsonl").read_text().splitlines()[:6]
    return [
        tok.chat_prompt([{"role": "user", "content": json.loads(line)["turns"][0]}])
        for line in lines
    ]


@pytest.mark.parametrize("width,length", [(1, 3), (2, 4), (4, 5)])
def test_demo_greedy_redrafter_equals_autoregressive(pair, prompts, width, length):
    model, drafter, tok = pair
    ar, _ = run_decode(model, None, prompts, max_tokens=48, eos_token_ids=tok.eos_token_ids)
    rd, stats = run_decode(
        model,
        drafter,
        prompts,
        max_tokens=48,
        eos_token_ids=tok.eos_token_ids,
        beam_width=width,
        beam_length=length,
    )
    assert rd == ar
    assert stats["tokens_per_step"] > 1.5  # the distilled drafter is really accepted


def test_demo_drafter_config_and_size():
    base, drafter = demo_paths()
    config = json.loads((drafter / "config.json").read_text())
    assert config["hidden_size"] == 256 and config["vocab_size"] == 4096
    assert config["predict_tokens"] >= 4
    total = sum(f.stat().st_size for d in (base, drafter) for f in d.iterdir())
    assert total <= 30e6


def test_chat_answers_one_message_on_the_demo(monkeypatch, tmp_path):
    from redrafter_mlx import cli

    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(tmp_path))
    cli._register()
    result = CliRunner().invoke(
        cli.app,
        ["chat", "--max-tokens", "24"],
        input="Write a Python function `add(a, b)`: Return the sum.\n/quit\n",
    )
    assert result.exit_code == 0, result.output
    assert "demo model" in result.output
    assert "tok/s" in result.output or "tokens" in result.output
