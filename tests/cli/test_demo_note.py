"""The demo model's note advises passing ``--model`` for a real model only when the demo was
chosen by default, not when ``--model demo`` asked for it."""

from __future__ import annotations

from typer.testing import CliRunner

from redrafter_mlx.cli.paths import asked_note, resolve_paths
from redrafter_mlx.engine.base.bundled import DEMO_NOTE, SMOLLM2_NOTE


def test_the_note_of_a_demo_chosen_by_default_or_by_name():
    assert resolve_paths(None, None).notes == (DEMO_NOTE,)  # no SmolLM2 in the test's home
    (asked,) = resolve_paths("demo", None).notes
    assert asked.startswith("Using the bundled demo model") and asked.endswith(".")
    assert "pass --model" not in asked
    assert asked_note(SMOLLM2_NOTE) == SMOLLM2_NOTE  # no advice to drop


def test_generate_with_model_demo_does_not_ask_for_model(cli_app):
    args = ["generate", "--prompt", "Hi", "-n", "1"]
    named = CliRunner().invoke(cli_app, [*args, "--model", "demo"])
    assert named.exit_code == 0, named.output
    assert "Using the bundled demo model" in named.stderr
    assert "pass --model for a real one" not in named.stderr
    default = CliRunner().invoke(cli_app, args)
    assert "pass --model for a real one" in default.stderr
