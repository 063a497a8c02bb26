"""measure.near_tie judges the distribution a run decoded from (its logit bias and penalties,
``sampling.process_text``), not the raw logits: a token the settings ban or push down, drawn
where the raw logits tie, is an engine bug, in ``near_tie.check`` and in ``bench``.

Two tokens get equal raw logits, above every other, by giving them one head row (twice the
top token's, so they lead the rest); the lower id wins a raw argmax tie, so an engine that
skips the processing draws it."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.measure import near_tie
from tests.support.models import (
    VICUNA_TOKENIZER,
    save_drafter_dir,
    save_model_dir,
    tiny_drafter,
    tiny_model,
)

PREFIX = [3, 17, 5, 9, 22, 1, 30, 8, 12]


def raw_logits(model, prefix):
    logits, _ = near_tie.last_logits(model, prefix, 0, model.make_cache(1, len(prefix)))
    return logits


def tie_at_top(model, prefix, low: int, high: int) -> float:
    """Give ``low`` and ``high`` one head row, twice the top token's: equal raw logits after
    ``prefix``, above all others. Returns their logit (> 0)."""
    top = int(mx.argmax(raw_logits(model, prefix)).item())
    weight = mx.array(model.lm_head.weight)
    weight[low] = weight[high] = 2 * weight[top]
    model.lm_head.weight = weight
    logits = raw_logits(model, prefix)
    assert logits[low].item() == logits[high].item() == mx.max(logits).item() > 0
    return logits[low].item()


@pytest.fixture()
def tied():
    """(model, low, high, their raw logit): ``low`` = 8 is in PREFIX's last 3 tokens, ``high``
    = 20 is not in PREFIX (vocabulary 32)."""
    model = tiny_model(seed=3)
    value = tie_at_top(model, PREFIX, 8, 20)
    return model, 8, 20, value


def test_raw_tie_is_a_near_tie_without_settings(tied):
    model, low, high, _ = tied
    verdict = near_tie.check(model, PREFIX, high, low)
    assert verdict.lead == 0 and verdict.near_tie
    assert near_tie.check(model, PREFIX, high, low, SamplerConfig()).near_tie


def test_a_banned_token_is_a_bug(tied):
    """``--logit-bias low:-100``: plain decoding draws ``high``; a run that drew ``low``
    ignored the bias, which moved it by 100 logits."""
    model, low, high, _ = tied
    cfg = SamplerConfig(logit_bias=((low, -100.0),))
    verdict = near_tie.check(model, PREFIX, high, low, cfg)
    assert verdict.lead == pytest.approx(100.0) and verdict.noise < 1e-3
    assert not verdict.near_tie
    boosted = SamplerConfig(logit_bias=((high, 5.0),))
    assert near_tie.check(model, PREFIX, high, low, boosted).lead == pytest.approx(5.0)


def test_a_penalized_token_is_a_bug(tied):
    """``low`` is in the window: each penalty lowers it against ``high`` by its own rule."""
    model, low, high, value = tied
    cases = {
        SamplerConfig(repetition_penalty=1.5): value - value / 1.5,
        SamplerConfig(presence_penalty=0.5): 0.5,
        SamplerConfig(frequency_penalty=0.25): 0.25,  # low appears once in the window
    }
    for cfg, lead in cases.items():
        verdict = near_tie.check(model, PREFIX, high, low, cfg)
        assert verdict.lead == pytest.approx(lead, rel=1e-5), cfg
        assert not verdict.near_tie, cfg


def test_the_penalty_window_is_the_last_context_tokens(tied):
    """``low`` (PREFIX[-2]) lies in a window of 2 tokens, not in a window of 1: out of the
    window it is not penalized, and the raw tie stands."""
    model, low, high, _ = tied
    inside = SamplerConfig(presence_penalty=0.5, repetition_context_size=2)
    outside = SamplerConfig(presence_penalty=0.5, repetition_context_size=1)
    assert not near_tie.check(model, PREFIX, high, low, inside).near_tie
    verdict = near_tie.check(model, PREFIX, high, low, outside)
    assert verdict.lead == 0 and verdict.near_tie


def test_the_resolution_floor_follows_a_repetition_penalty():
    """Half precision: one unit in the last place of the raw logits, divided by the penalty
    for a positive logit the penalty divides (a bias or the other penalties keep it)."""
    model = tiny_model(seed=3)
    model.set_dtype(mx.float16)
    tie_at_top(model, PREFIX, 8, 20)
    value = raw_logits(model, PREFIX)[8].item()
    unit = near_tie.ulp(value, model)
    cfg = SamplerConfig(repetition_penalty=4.0)
    assert near_tie.resolution(raw_logits(model, PREFIX), (8,), PREFIX, cfg, model) == unit / 4
    biased = SamplerConfig(logit_bias=((8, -3.0),), presence_penalty=1.0)
    assert near_tie.resolution(raw_logits(model, PREFIX), (8,), PREFIX, biased, model) == unit
    assert near_tie.check(model, PREFIX, 20, 8).noise >= unit


# --------------------------------------------------------------------------- bench


@pytest.fixture(scope="module")
def tied_pair(tmp_path_factory):
    """(model dir, drafter dir, low, high): a tiny model whose ``low`` and ``high`` tie at the
    top after bench's first mt-bench prompt, ``low`` one of that prompt's last 20 tokens and
    ``high`` none of them."""
    from redrafter_mlx.engine.base.prompts import load_records
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer

    record = load_records("mt-bench", 1)[0]
    message = {"role": "user", "content": record.turns[0]}
    ids = load_tokenizer(VICUNA_TOKENIZER).chat_prompt([message])
    window = ids[-20:]
    low = min(t for t in window if t > 2)  # not a special token (Vicuna: 0-2)
    high = max(t for t in range(low + 1, 32000) if t not in ids)
    model = tiny_model(vocab=32000, hidden=32, max_position_embeddings=256)
    tie_at_top(model, ids, low, high)
    root = tmp_path_factory.mktemp("tied")
    save_model_dir(model, root / "model", VICUNA_TOKENIZER)
    save_drafter_dir(tiny_drafter(model), root / "drafter")
    return str(root / "model"), str(root / "drafter"), low, high


def unprocessed_speculation(monkeypatch) -> None:
    """A wrong engine: every ReDrafter run decodes from the raw logits, ignoring the bias and
    the penalties (AR keeps them)."""
    import redrafter_mlx.cli.bench_report as logic

    real = logic.run_engine

    def wrong(engine, config, ids, max_tokens, sampling, branches="auto"):
        if config.kind == "redrafter":
            sampling = SamplerConfig()
        return real(engine, config, ids, max_tokens, sampling, branches)

    monkeypatch.setattr(logic, "run_engine", wrong)


SETTINGS = {
    "ban": lambda low, high: ["--logit-bias", f"{low}:-100"],
    "boost": lambda low, high: ["--logit-bias", f"{high}:5"],
    "repetition": lambda low, high: ["--repetition-penalty", "1.5"],
    "both": lambda low, high: ["--logit-bias", f"{high}:0.5", "--repetition-penalty", "1.2"],
}


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_bench_fails_an_engine_that_skips_the_processing(cli_app, tied_pair, monkeypatch, setting):
    """With the raw logits tied, the wrong engine's token is no near-tie of the processed
    distribution: a red MISMATCH, ``ok`` false, exit 1."""
    model, drafter, low, high = tied_pair
    unprocessed_speculation(monkeypatch)
    args = ["bench", "--model", model, "--drafter", drafter, "--num-prompts", "1", "-n", "3"]
    args += SETTINGS[setting](low, high)
    result = CliRunner().invoke(cli_app, [*args, "--json"], env={"COLUMNS": "120"})
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    (m,) = data["mismatches"]
    assert m["position"] == 0 and m["near_tie"] is False and m["lead"] > 0.1
    assert data["ok"] is False
    assert "MISMATCH" in result.stderr and "near-tie" not in result.stderr


def test_bench_passes_the_right_engine_with_the_settings(cli_app, tied_pair):
    """The same model and settings with the engine as it is: AR's tokens, exit 0."""
    model, drafter, low, _ = tied_pair
    for extra in (["--logit-bias", f"{low}:-100"], ["--repetition-penalty", "1.5"]):
        args = ["bench", "--model", model, "--drafter", drafter, "--num-prompts", "1", "-n", "3"]
        result = CliRunner().invoke(cli_app, [*args, *extra, "--json"], env={"COLUMNS": "120"})
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["mismatches"] == []


@pytest.mark.parametrize("setting", ["none", *sorted(SETTINGS)])
def test_bench_fails_a_changed_token_in_every_setting(cli_app, tied_pair, monkeypatch, setting):
    """A wrong engine that changes each ReDrafter run's third token fails bench whatever the
    greedy run's bias and penalties."""
    import redrafter_mlx.cli.bench_report as logic

    model, drafter, low, high = tied_pair
    real = logic.run_engine

    def corrupt(engine, config, ids, max_tokens, sampling, branches="auto"):
        run = real(engine, config, ids, max_tokens, sampling, branches)
        if config.kind == "redrafter":
            run.tokens = run.tokens[:2] + [(run.tokens[2] + 1) % 32000] + run.tokens[3:]
        return run

    monkeypatch.setattr(logic, "run_engine", corrupt)
    args = ["bench", "--model", model, "--drafter", drafter, "--num-prompts", "1", "-n", "4"]
    args += SETTINGS[setting](low, high) if setting != "none" else []
    result = CliRunner().invoke(cli_app, [*args, "--json"], env={"COLUMNS": "120"})
    assert result.exit_code == 1, result.output
    (m,) = json.loads(result.stdout)["mismatches"]
    assert m["position"] == 2 and m["near_tie"] is False
