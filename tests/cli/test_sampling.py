"""Sampling flags on the command line: bad values refused in one line, the model's own
``generation_config.json`` values as defaults (flags override), penalties and a logit bias
that change the text exactly as the engine's do."""

from __future__ import annotations

import json
import shutil

import pytest

from redrafter_mlx.cli.common import parse_logit_bias
from tests.support.cli import invoke, model_args, run_json


@pytest.fixture(scope="module")
def tuned_pair(pair, tmp_path_factory):
    """The tiny pair's model with a generation_config.json recommending sampling."""
    model, drafter, other = pair
    root = tmp_path_factory.mktemp("tuned")
    shutil.copytree(model, root / "model")
    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.3}
    (root / "model" / "generation_config.json").write_text(json.dumps(config))
    return str(root / "model"), drafter, other


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temp", "nan"], "--temp"),
        (["--temp", "inf"], "--temp"),
        (["--top-p", "nan"], "--top-p"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(2**64)], "--seed"),
        (["--repetition-penalty", "0"], "--repetition-penalty"),
        (["--repetition-penalty", "nan"], "--repetition-penalty"),
        (["--repetition-context-size", "0"], "--repetition-context-size"),
        (["--logit-bias", "5:oops"], "--logit-bias"),
        (["--logit-bias", "99999999:1"], "--logit-bias"),
    ],
)
@pytest.mark.parametrize("command", ["generate", "chat"])
def test_bad_sampling_values_are_one_line_errors(app, pair, command, flags, named):
    prompt = ["-p", "Hi"] if command == "generate" else []  # chat reads stdin
    result = invoke(app, command, *model_args(pair), *prompt, "-n", 2, *flags, input="hi\n")
    assert result.exit_code == 2, result.output
    assert named in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_seed_1e20_is_refused(app, pair):
    result = invoke(app, "generate", *model_args(pair), "-p", "Hi", "--seed", "1e20")
    assert result.exit_code == 2 and "--seed" in result.output


def test_logit_bias_forms():
    assert parse_logit_bias("13:-100, 42=2.5") == ((13, -100.0), (42, 2.5))
    assert parse_logit_bias('{"7": 1}') == ((7, 1.0),)
    assert parse_logit_bias(None) == ()


def test_model_generation_config_sets_the_defaults(app, tuned_pair):
    data = run_json(app, "generate", *model_args(tuned_pair), "-p", "Hi", "-n", 4, "--seed", 1)
    assert data["sampling"]["temperature"] == 0.7
    assert data["sampling"]["top_p"] == 0.8
    assert data["sampling"]["repetition_penalty"] == 1.3
    flagged = run_json(app, "generate", *model_args(tuned_pair), "-p", "Hi", "-n", 4, "--temp", 0)
    assert flagged["sampling"]["temperature"] == 0.0  # a flag wins
    assert flagged["sampling"]["repetition_penalty"] == 1.3  # the rest stays the model's


def test_bench_stays_greedy(app, tuned_pair):
    data = run_json(app, "bench", *model_args(tuned_pair), "--num-prompts", 1, "-n", 4)
    assert data["sampling"]["temperature"] == 0.0 and data["greedy"]


def test_chat_banner_says_which_sampling_and_whence(app, pair, tuned_pair):
    tuned = invoke(app, "chat", *model_args(tuned_pair), "-n", 2, input="/quit\n")
    assert tuned.exit_code == 0, tuned.output
    assert "sampling: temp 0.7 · top-p 0.8 · repetition penalty 1.3 over 20 tokens" in tuned.stdout
    assert "(model's generation_config.json)" in tuned.stdout
    plain = invoke(app, "chat", *model_args(pair), "-n", 2, "--temp", "0.5", input="/quit\n")
    assert "sampling: temp 0.5 (flags)" in plain.stdout
    default = invoke(app, "chat", *model_args(pair), "-n", 2, input="/quit\n")
    assert "sampling: greedy (default)" in default.stdout


def test_penalty_and_bias_change_greedy_text_as_the_engine_does(app, pair):
    base = ["generate", *model_args(pair), "-p", "Tell me a story", "-n", 12, "--raw"]
    plain = run_json(app, *base)["tokens"]
    banned = plain[0]
    biased = run_json(app, *base, "--logit-bias", f"{banned}:-100")["tokens"]
    assert biased[0] != banned
    penalised = run_json(app, *base, "--repetition-penalty", "3")
    ar = run_json(app, *base, "--repetition-penalty", "3", "--no-draft")
    assert penalised["tokens"] == ar["tokens"]  # speculation keeps the penalised text
