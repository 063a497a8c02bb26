"""Running a command in-process and reading the one error line it ends with."""

from __future__ import annotations

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
