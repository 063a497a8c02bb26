"""The CLI as a new user meets it: one test per trap found by trying every command with bad
input (no silent state, errors that never leak internals, one set of flags)."""

from __future__ import annotations

import json
import re
import shutil
import socket

import pytest
from click.testing import CliRunner as ClickRunner

import redrafter_mlx.cli.tune
from tests.support.cli import invoke, model_args
from tests.support.fakes import FakeChip, FakeClock
from tests.support.models import VICUNA_TOKENIZER, run_decode, tiny_model


def error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


# --------------------------------------------------------------------------- 1. tune state


@pytest.mark.parametrize("budget", ["0", "-5"])
def test_tune_refuses_a_budget_that_cannot_measure(app, pair, budget):
    result = invoke(app, "tune", *model_args(pair), "--budget-seconds", budget)
    assert result.exit_code == 2 and "--budget-seconds" in error_lines(result)[0]


def test_tune_that_measured_nothing_saves_nothing(app, pair, home, monkeypatch):
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
    from redrafter_mlx.engine.loop.generation import generate_steps

    events = list(generate_steps(model, None, [[1] * 30], max_tokens=100))
    assert events[-1].finish == ["context"]
    events = list(generate_steps(model, None, [[1] * 30], max_tokens=5))
    assert events[-1].finish == ["length"]


def test_generate_json_says_the_context_ended_the_answer(app, pair):
    from redrafter_mlx.engine.base.tokenizer import load_tokenizer
    from tests.support.cli import CONTEXT

    tok = load_tokenizer(VICUNA_TOKENIZER)
    words = next(k for k in range(CONTEXT) if len(tok.encode("a" + " a" * k)) >= CONTEXT - 1)
    text = "a" + " a" * words
    assert len(tok.encode(text)) == CONTEXT - 1  # one token of room left
    result = invoke(app, "generate", *model_args(pair), "--raw", "--json", "-n", "50", "-p", text)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["finish_reason"] == "context" and len(data["tokens"]) == 1


# --------------------------------------------------------------------------- 3. the stats line


def test_the_acceptance_histogram_needs_no_explanation_and_help_gives_one():
    from redrafter_mlx.cli.chat_ui import HELP
    from redrafter_mlx.cli.stats import format_hist

    assert format_hist([2, 3, 142, 2]) == "steps emitting 1/2/3/4 tokens: 2/3/142/2"
    assert "steps emitting" in HELP and "tok/step" in HELP


def test_reset_clears_the_dropped_turns_count(app, pair):
    from redrafter_mlx.cli.chat_ui import ChatLoop
    from redrafter_mlx.cli.common import BeamFlags, ModelPaths, load_engine, plan_from_flags
    from redrafter_mlx.engine.core.sampling import SamplerConfig

    model, drafter, _ = pair
    engine = load_engine(ModelPaths(model, drafter), None)
    plan = plan_from_flags(engine.paths, None, BeamFlags(1, 3))
    loop = ChatLoop(engine, plan, SamplerConfig(), 4)
    loop.dropped_turns = 3
    loop.reset()
    assert loop.dropped_turns == 0


# --------------------------------------------------------------------------- 4. paths vs hub


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: a path must never become a Hub lookup."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("command", ["generate", "convert"])
def test_a_mistyped_local_path_is_not_found_at_once(
    app, tmp_path, monkeypatch, no_network, command
):
    (tmp_path / "models").mkdir()
    monkeypatch.chdir(tmp_path)
    args = ["-p", "hi"] if command == "generate" else ["--out", str(tmp_path / "out")]
    result = invoke(app, command, "--model", "models/vicuna", *args)
    assert result.exit_code == 1
    assert "directory not found" in error_lines(result)[0]
    assert "HF_HUB_OFFLINE" not in result.stderr


def test_an_unreachable_hub_fails_fast_naming_both_possibilities(app, monkeypatch, tmp_path):
    import redrafter_mlx.engine.base.hub as hub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "_hub_reachable", lambda: False)
    for command, extra in (("generate", ["-p", "hi"]), ("convert", ["--out", str(tmp_path / "o")])):
        result = invoke(app, command, "--model", "someone/some-model", *extra)
        line = error_lines(result)[0]
        assert result.exit_code == 1 and "unreachable" in line
        assert "local folder" in line and "hf download someone/some-model" in line


# --------------------------------------------------------------------------- 5. bad configs


@pytest.mark.parametrize(
    ("config", "needle"),
    [("[1, 2]", "holds a JSON list"), ('{"model_type": "llama"}', "lacks positive integer")],
)
def test_malformed_configs_get_the_same_clear_error_on_load_and_convert(
    app, tmp_path, config, needle
):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(config)
    (bad / "model.safetensors").write_bytes(b"")
    for command, extra in (("generate", ["-p", "hi"]), ("convert", ["--out", str(tmp_path / "o")])):
        result = invoke(app, command, "--model", bad, *extra)
        assert result.exit_code == 1, result.output
        assert needle in error_lines(result)[0] and "unexpected" not in result.stderr


def test_a_truncated_safetensors_file_is_reported_as_by_convert(app, pair, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(pair[0], model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    result = invoke(app, "generate", "--model", model, "-p", "hi")
    assert result.exit_code == 1
    line = error_lines(result)[0]
    assert "corrupt safetensors header" in line and "truncated download" in line


# --------------------------------------------------------------------------- 6. one set of flags


def test_short_flags_mean_one_thing_everywhere(app):
    from redrafter_mlx.cli import get_command

    meaning: dict[str, set[str]] = {}
    for command in get_command().commands.values():
        for param in command.params:
            longs = [o for o in param.opts if o.startswith("--")]
            for short in (o for o in param.opts if not o.startswith("--")):
                meaning.setdefault(short, set()).update(longs)
    assert {k: v for k, v in meaning.items() if len(v) > 1} == {}
    assert meaning["-m"] == {"--max-tokens"} and meaning["-d"] == {"--drafter"}
    assert meaning["-q"] == {"--quantize"} and meaning["-v"] == {"--verbose"}


def test_distill_names_flags_and_exits_2(app, pair, tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("hello world\n")
    result = invoke(
        app,
        "distill",
        "--model",
        pair[0],
        "--data",
        data,
        "--out",
        tmp_path / "o",
        "--batch-size",
        0,
    )
    assert result.exit_code == 2
    line = error_lines(result)[0]
    assert line.startswith("error: --batch-size") and "batch_size" not in line


def test_distill_takes_a_bundled_models_name(app, pair, tmp_path):
    from redrafter_mlx.engine.base.bundled import smollm2_path
    from tests.support.train import SHAREGPT

    out = tmp_path / "o"
    # not installed (an empty home): one line naming the model and the command that installs it
    result = invoke(app, "distill", "--model", "smollm2", "--data", SHAREGPT, "--out", out)
    assert result.exit_code == 1
    (line,) = error_lines(result)
    assert "smollm2 model is not installed" in line and "make smollm2" in line
    assert not out.exists()
    # installed (a tiny model where make smollm2 converts): distill trains on that folder, and
    # a drafter written into it is named with the folder (--model smollm2 means the packaged one)
    shutil.copytree(pair[0], smollm2_path())
    out = smollm2_path() / "drafter"
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text(json.dumps({"turns": ["Write a haiku about the sea."]}) + "\n")
    result = invoke(
        app,
        *("distill", "--model", "smollm2", "--data", SHAREGPT, "--out", out),
        *("--targets", "ground-truth", "--steps", "2", "--batch-size", "8", "--seq-len", "64"),
        *("--layers", "1", "--eval-data", eval_file, "--eval-max-tokens", "4"),
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 32
    assert f"--model {smollm2_path()} use it without --drafter" in " ".join(result.stderr.split())


def test_long_errors_are_one_line_off_a_terminal(app, pair, tmp_path):
    result = invoke(app, "tune", "--model", pair[0], "--drafter", pair[1], "--widths", "x" * 90)
    assert result.exit_code != 0
    (line,) = error_lines(result)
    assert len(line) > 80 and "x" * 90 in line


# --------------------------------------------------------------------------- 7. the program's name


def test_help_names_the_program_and_shows_no_type_tags():
    from redrafter_mlx.cli import PROG_NAME, get_command

    runner = ClickRunner()
    root = get_command()
    for args in (["--help"], *([name, "--help"] for name in root.commands)):
        out = runner.invoke(root, args, prog_name=PROG_NAME, env={"COLUMNS": "200"}).output
        assert "Usage: redrafter-mlx" in out and "python -m" not in out
        for tag in ("<str>", "<bool>", "<int>", "<float>", "<path>"):
            assert tag not in out, (args, tag)
        assert not re.search(r"\w \.(\s|$)", out), args  # a stray " ." after eaten markup
    version = runner.invoke(root, ["--version"], prog_name=PROG_NAME)
    assert version.exit_code == 0 and version.output.startswith("redrafter-mlx ")


# --------------------------------------------------------------------------- 8. smaller ones


def test_a_converted_models_own_drafter_is_found(app, pair, tmp_path):
    import shutil

    model = tmp_path / "converted"
    shutil.copytree(pair[0], model)
    shutil.copytree(pair[1], model / "drafter")
    result = invoke(app, "generate", "--model", model, "-p", "hi", "-n", 3, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["drafter"] == str(model / "drafter")
    assert "using the drafter converted with the model" in result.stderr


def test_drafter_messages_call_it_a_drafter(app, pair, tmp_path):
    result = invoke(app, "generate", "--model", pair[0], "--drafter", tmp_path / "nope", "-p", "hi")
    assert result.exit_code == 1 and "drafter directory not found" in error_lines(result)[0]


def test_a_beam_length_beyond_training_warns(app, pair, tmp_path):
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(pair[1], drafter)
    config = json.loads((drafter / "config.json").read_text())
    (drafter / "config.json").write_text(json.dumps({**config, "predict_tokens": 2}))
    args = ["--model", pair[0], "--drafter", drafter, "-p", "hi", "-n", 3]
    result = invoke(app, "generate", *args, "--beam-length", 5, "--beam-width", 1)
    assert result.exit_code == 0, result.output
    assert "warning: --beam-length 5 exceeds what the drafter was trained for" in result.stderr


def test_ctrl_c_at_start_up_exits_130_without_a_traceback(monkeypatch, capsys):
    import redrafter_mlx.cli as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "get_command", interrupted)
    monkeypatch.setenv("REDRAFTER_MLX_NO_REEXEC", "1")
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 130
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err


def test_no_demo_notice_before_a_usage_error(app):
    result = invoke(app, "generate", "-p", "hi", "--beam-length", "1")
    assert result.exit_code == 2 and "demo model" not in result.stderr
