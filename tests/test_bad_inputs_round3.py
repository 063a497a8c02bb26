"""The third bad-input round (issue 43): nothing unbounded, no input that ends a chat,
nothing silently ignored, and one line that names the problem and its fix.

Each test here failed before its fix: an unbounded lookup width was built for minutes, bytes
that are not UTF-8 reached the tokenizer, a profile that is not UTF-8 broke every command,
``tune`` threw its measurement away when it could not save, and the messages named the wrong
flag or no file.
"""

from __future__ import annotations

import errno
import io
import json
import random
import shutil

import pytest
from rich.console import Console
from typer.testing import CliRunner

from redrafter_mlx.engine.bundled import demo_paths
from redrafter_mlx.engine.shape import BeamShape, ShapeError

GIB = 2**30


@pytest.fixture(scope="module")
def app(cli_app):
    return cli_app


def invoke(app, *args, input=None):
    """Run ``redrafter-mlx ARGS`` in-process (stdout and stderr captured separately)."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input, env={"COLUMNS": "200"})


def error_line(result, code: int) -> str:
    """The one ``error:`` line a failed command printed last (checked: exit ``code``)."""
    assert result.exit_code == code, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), result.stderr
    return line


# --------------------------------------------------------------------------- 1. shape bounds


def test_a_tree_larger_than_the_context_is_refused_before_compiling():
    """``--lookup 1000`` on a 512-token model: 7,004 tree slots, which fit in memory but
    never in the context; building that step took minutes. Refused, naming the chains."""
    from redrafter_mlx.engine.memory import ShapeTooLarge, check_step_memory
    from tests.helpers import tiny_drafter, tiny_model

    model = tiny_model(vocab=256, hidden=32, max_position_embeddings=512)
    drafter = tiny_drafter(model)
    plenty = (64 * GIB, "the test's budget")
    shape = BeamShape(1, 4, None, 1000, 8)
    with pytest.raises(ShapeTooLarge) as e:
        check_step_memory(model, drafter, shape, available=plenty)
    message = str(e.value)
    assert e.value.param == "lookup" and "\n" not in message
    assert "7,004 tree tokens" in message and "context holds 512 tokens" in message
    best = BeamShape.parse(message.rsplit("the largest that fits is ", 1)[1])
    assert (best.width, best.length, best.chain_length) == (1, 4, 8)
    assert best.tree_tokens < 512 <= BeamShape(1, 4, None, best.lookup + 1, 8).tree_tokens
    check_step_memory(model, drafter, best, available=plenty)  # the suggestion is accepted
    with pytest.raises(ShapeTooLarge, match="--|context"):  # every dimension is bounded
        check_step_memory(model, drafter, BeamShape(200, 4), available=plenty)


def test_the_cli_refuses_an_unbounded_lookup_width_at_once(app):
    result = invoke(app, "generate", "--model", "demo", "-p", "def is_even(n):", "-n", 16,
                    "--lookup", 1000)  # fmt: skip
    line = error_line(result, 2)
    assert line.startswith("error: --lookup: beam shape W1×L4+K1000×L8 puts 7,004 tree tokens")
    assert "context holds 512 tokens; the largest that fits is W1×L4+K" in line


def test_tune_refuses_a_grid_shape_larger_than_the_context_before_measuring():
    """``tune --lookup 1000`` measured nothing of those shapes and said only that some
    "failed"; now the grid is checked once the model is loaded."""
    from redrafter_mlx.cli.tune import build_measure
    from redrafter_mlx.engine.memory import ShapeTooLarge

    model, drafter = (str(p) for p in demo_paths())
    huge = BeamShape(1, 2, None, 1000, 8)
    with pytest.raises(ShapeTooLarge, match="context holds 512 tokens") as e:
        build_measure(model, drafter, None, "demo", 1, [BeamShape(1, 2), huge])
    assert e.value.param == "lookup"
    measure, _clock = build_measure(model, drafter, None, "demo", 1, [BeamShape(1, 2)])
    assert measure is not None


def test_a_too_long_lookup_chain_blames_lookup_length(app):
    """The memory guard used to blame --beam-width for ``--lookup-length 100000``."""
    result = invoke(app, "generate", "--model", "demo", "-p", "def f", "--lookup-length", 100000)
    line = error_line(result, 2)
    assert line.startswith("error: --lookup-length: beam shape W1×L4+K1×L100000")
    assert "largest that fits is W1×L4+K1×L" in line


@pytest.mark.parametrize(
    "shape, part",
    [
        (BeamShape(4096, 50), "width"),
        (BeamShape(1, 2000), "length"),
        (BeamShape(1, 4, None, 1000, 8), "lookup"),
        (BeamShape(1, 4, None, 1, 100000), "lookup_length"),
        (BeamShape.lookup_only(50000, 50), "lookup"),
    ],
)
def test_the_largest_part_of_a_shape_names_the_flag_raised(shape, part):
    assert shape.largest_part == part


def test_a_lookup_chain_of_length_zero_is_refused_as_zero():
    """``K1xL0`` said "got 1" (0 meant "the drafter's length"); ``W1xL4+K1xL0`` became
    ``W1xL4+K1xL4`` without a word."""
    for label in ("K1xL0", "W1xL4+K1xL0"):
        with pytest.raises(ShapeError, match="got 0") as e:
            BeamShape.parse(label)
        assert e.value.param == "lookup_length"


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--grid", "0x4", "error: --grid 0x4: beam width must be >= 1, got 0"),
        ("--grid", "1x-3", "error: --grid 1x-3: beam length must be >= 2"),
        ("--configs", "K1xL0", "error: --configs 'K1xL0': lookup chain length must be >= 2"),
    ],
)
def test_bench_shape_errors_name_the_flag_typed(app, flag, value, expected):
    line = error_line(invoke(app, "bench", "--model", "demo", flag, value), 2)
    assert line.startswith(expected)
    assert "--beam-width" not in line and "--beam-length" not in line
    assert "got 1" not in line


# --------------------------------------------------------------------------- 2. bad UTF-8


def test_the_tokenizer_reads_bytes_that_are_not_utf8_as_replacement_characters(tmp_path):
    """SentencePiece raised RuntimeError on a lone surrogate (what Python makes of such bytes
    in argv and stdin); an HF tokenizer with a chat template failed too."""
    from redrafter_mlx.engine.tokenizer import Tokenizer, valid_text
    from tests.helpers import FIXTURES

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


# --------------------------------------------------------------------------- chat


@pytest.fixture(scope="module")
def demo_engine():
    from redrafter_mlx.cli.common import ModelPaths, load_engine

    model, drafter = demo_paths()
    return load_engine(ModelPaths(str(model), str(drafter)), None)


def make_loop(engine):
    from redrafter_mlx.cli.chat_ui import ChatLoop
    from redrafter_mlx.engine.sampling import SamplerConfig
    from tuning import ShapeChoice

    console = Console(file=io.StringIO(), width=300, highlight=False, soft_wrap=True)
    return ChatLoop(
        engine, ShapeChoice(BeamShape(1, 3), "test"), SamplerConfig(), 4, console=console
    )


def test_a_failing_turn_reports_and_the_chat_goes_on(demo_engine):
    loop = make_loop(demo_engine)
    real = loop.stream

    def broken(*args, **kwargs):
        raise RuntimeError("the backend fell over")

    loop.stream = broken
    assert loop.answer("first") == ""
    assert "error: unexpected RuntimeError: the backend fell over" in loop.console.file.getvalue()
    assert loop.messages == []  # the conversation is as it was
    loop.stream = real
    assert loop.answer("def f(x):")
    assert [m["role"] for m in loop.messages] == ["user", "assistant"]


def test_a_double_slash_sends_a_line_that_begins_with_a_slash(demo_engine):
    from redrafter_mlx.cli.chat_ui import HELP, run_chat

    loop = make_loop(demo_engine)
    lines = iter(["//etc/hosts is a file", "/help", None])
    run_chat(loop, read=lambda _prompt: next(lines))
    assert loop.messages[0] == {"role": "user", "content": "/etc/hosts is a file"}
    assert "//text" in HELP and "sends /text" in loop.console.file.getvalue()


def test_a_system_prompt_longer_than_the_context_is_refused_at_once(demo_engine):
    loop = make_loop(demo_engine)
    loop.command("/system " + "word " * 600)
    out = loop.console.file.getvalue()
    assert "error: /system: the system prompt takes" in out and "512" in out
    assert loop.system is None  # unchanged: the next turn still works
    assert loop.answer("def f(x):")
    loop.command("/system You write Python.")
    assert loop.system == "You write Python."


def test_a_too_long_system_prompt_flag_is_refused(app):
    line = error_line(
        invoke(app, "chat", "--model", "demo", "--system-prompt", "word " * 600, input=""), 2
    )
    assert line.startswith("error: --system-prompt: the system prompt takes")


# --------------------------------------------------------------------------- 4. profiles


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


# --------------------------------------------------------------------------- 5. tune saving


@pytest.fixture()
def fake_tune(monkeypatch, tmp_path):
    """A model/drafter pair and a fake measurement; returns (args, measured shapes)."""
    import redrafter_mlx.cli.tune
    from tests.fakes import FakeChip, FakeClock

    model, drafter = tmp_path / "model", tmp_path / "drafter"
    for folder, config in ((model, {"model_type": "llama"}), (drafter, {"predict_tokens": 4})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    measured: list = []

    def measure(shape, n_tokens):
        measured.append(shape)
        return chip(shape, n_tokens)

    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (measure, clock))
    args = ["tune", "--model", model, "--drafter", drafter, "--budget-seconds", 60,
            "--widths", "1-2", "--lengths", "2-3"]  # fmt: skip
    return args, measured


def test_tune_refuses_an_unwritable_home_before_measuring(app, fake_tune, monkeypatch, tmp_path):
    args, measured = fake_tune
    not_a_folder = tmp_path / "home-is-a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(not_a_folder))
    line = error_line(invoke(app, *args), 1)
    assert f"cannot save tuned profiles in {not_a_folder}" in line
    assert "it is a file, not a folder" in line and "REDRAFTER_MLX_HOME" in line
    assert measured == []  # nothing was measured


def test_tune_shows_its_measurement_when_saving_fails(app, home, fake_tune, monkeypatch):
    from tuning.profiles import ProfileStore

    def cannot_save(self, profiles):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ProfileStore, "save", cannot_save)
    args, measured = fake_tune
    result = invoke(app, *args)
    assert measured
    assert "recommended:" in result.stdout and "W=2" in result.stdout  # the pick and the table
    assert "not saved" in result.stdout
    assert "No space left on device" in error_line(result, 1)


# --------------------------------------------------------------------------- messages


def test_a_binary_prompt_file_is_named(tmp_path):
    from redrafter_mlx.engine.prompts import PromptSetError, load_prompts

    binary = tmp_path / "prompts.bin"
    binary.write_bytes(b"\xbc" + random.Random(1).randbytes(299))
    with pytest.raises(PromptSetError) as e:
        load_prompts(str(binary))
    assert str(binary) in str(e.value) and "not UTF-8" in str(e.value)


@pytest.mark.parametrize(
    "value, used",
    [("0", "ignoring it"), ("-3", "ignoring it"), ("abc", "ignoring it"), ("99999", "using 4")],
)
def test_a_bad_blas_thread_count_is_said_once(monkeypatch, capsys, value, used):
    from redrafter_mlx.engine import platform

    monkeypatch.setattr(platform.os, "cpu_count", lambda: 4)
    monkeypatch.setenv(platform._THREADS_WARNED_ENV, "")
    monkeypatch.setenv(platform.THREADS_ENV, value)
    first = platform.blas_threads()
    assert platform.blas_threads() == first == (4 if value == "99999" else 3)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {platform.THREADS_ENV}=")
    assert used in warnings[0]
    monkeypatch.setenv(platform._THREADS_WARNED_ENV, "")
    monkeypatch.setenv(platform.THREADS_ENV, "2")
    assert platform.blas_threads() == 2 and capsys.readouterr().err == ""
