"""The `redrafter-mlx` command line: one typer app; each command lives in its own module.

Commands register here so that modules owned by different parts of the project
(engine, converter, tuner, trainer) never edit the same file.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="redrafter-mlx",
    help="Fast local LLM inference with ReDrafter speculative decoding (MLX).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register() -> None:
    """Attach every command module that is present."""
    import importlib

    for module_name, command_name in [
        ("redrafter_mlx.cli.chat", "chat"),
        ("redrafter_mlx.cli.generate", "generate"),
        ("redrafter_mlx.cli.bench", "bench"),
        ("redrafter_mlx.cli.convert", "convert"),
        ("redrafter_mlx.cli.distill", "distill"),
        ("redrafter_mlx.cli.tune", "tune"),
        ("redrafter_mlx.cli.serve", "serve"),
    ]:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and module_name.startswith(e.name):
                continue  # command not built yet
            raise
        app.command(command_name)(getattr(module, command_name))


def main() -> None:
    from redrafter_mlx.engine.platform import ensure_fast_blas

    ensure_fast_blas()
    _register()
    app()


if __name__ == "__main__":
    main()
