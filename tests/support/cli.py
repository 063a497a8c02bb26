"""Running a command in-process and reading the one error line it ends with."""

from __future__ import annotations

import json

from typer.testing import CliRunner


def invoke(app, *args, input=None):
    """Run ``redrafter-mlx ARGS`` in-process (stdout and stderr captured separately)."""
    return CliRunner().invoke(app, [str(a) for a in args], input=input, env={"COLUMNS": "200"})


def error_line(result, code: int) -> str:
    """The one ``error:`` line a failed command printed last (checked: exit ``code``)."""
    assert result.exit_code == code, result.output
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: "), result.stderr
    return line


CONTEXT = 256  # small, so "prompt over the context" is cheap to provoke


def model_args(pair, drafter=True):
    """``--model M [--drafter D]`` for the tiny pair."""
    model, drafter_dir, _ = pair
    return ["--model", model, *(["--drafter", drafter_dir] if drafter else [])]


def run_json(app, *args, input=None) -> dict:
    """Invoke with ``--json``; assert success; return the parsed object."""
    result = invoke(app, *args, "--json", input=input)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def generate_demo(app, *args):
    """``redrafter-mlx generate`` on the demo model, a 4-token answer: the result."""
    return invoke(app, "generate", "--model", "demo", "-p", "def f(", "-n", 4, *args)
