"""The `redrafter-mlx` command line: one typer app; each command lives in its own module.

Commands register here by module name (imported when the CLI starts; each module imports
its heavy dependencies only when its command runs). Help shows a metavar on every value option
(``--model MODEL``) and none on flags, and the program always names itself ``redrafter-mlx``
(also when the CLI re-executes itself with OpenBLAS preloaded).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

PROG_NAME = "redrafter-mlx"
COMMANDS = ("chat", "generate", "bench", "serve", "convert", "distill", "tune")

app = typer.Typer(
    name=PROG_NAME,
    help="Fast local LLM inference with ReDrafter speculative decoding (MLX).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _show_version(value: bool) -> None:
    if value:
        from redrafter_mlx import __version__

        print(f"{PROG_NAME} {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_show_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Fast local LLM inference with ReDrafter speculative decoding (MLX)."""


def _register() -> None:
    """Attach every command (each lives in its own module); a second call does nothing."""
    import importlib

    if app.registered_commands:
        return
    for name in COMMANDS:
        module = importlib.import_module(f"redrafter_mlx.cli.{name}")
        app.command(name)(getattr(module, name))


def get_command():
    """The click command behind the app: a metavar on value options (``--model MODEL``), none
    on flags (typer would show ``<str>``/``<bool>`` type tags)."""
    _register()
    root = typer.main.get_command(app)
    for command in [root, *getattr(root, "commands", {}).values()]:
        help_option = command.get_help_option(
            command.make_context(PROG_NAME, [], resilient_parsing=True)
        )
        for param in [*command.params, help_option]:
            if getattr(param, "param_type_name", "") == "option" and param.metavar is None:
                param.metavar = "" if param.is_flag else param.name.upper()
    return root


def main() -> None:
    """Entry point of the ``redrafter-mlx`` script."""
    try:
        from redrafter_mlx.cli.errors import one_line_warnings
        from redrafter_mlx.engine.base.platform import ensure_fast_blas

        ensure_fast_blas()
        one_line_warnings()
        get_command()(prog_name=PROG_NAME)
    except KeyboardInterrupt:  # Ctrl-C before a command's own error handling took over
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
