"""Flag groups (``cli/options.py``): a command reads its options from dataclasses; typer
sees each group's options, nested groups' in place, in the fields' order, and the command
gets one value per group."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Annotated

import pytest
import typer
from typer.testing import CliRunner

from redrafter_mlx.cli.options import ModelFlags, flag_groups


@dataclass(frozen=True, kw_only=True)
class Inner:
    depth: Annotated[int, typer.Option("--depth", help="How deep.")] = 2


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: Annotated[str, typer.Option("--name", help="Required: no default.")]
    models: ModelFlags = field(default_factory=ModelFlags)
    inner: Inner = field(default_factory=Inner)
    loud: Annotated[bool, typer.Option("--loud", help="A flag.")] = False


def test_the_options_come_in_the_fields_order_nested_groups_in_place():
    @flag_groups
    def command(flags: Outer, verbose: bool = False):
        return flags, verbose

    params = list(inspect.signature(command).parameters)
    assert params == ["name", "model", "drafter", "draft_model", "depth", "loud", "verbose"]
    assert inspect.signature(command).parameters["name"].default is ...  # typer: required
    flags, verbose = command(name="x", depth=5, drafter="d", verbose=True)
    assert flags == Outer(name="x", models=ModelFlags(drafter="d"), inner=Inner(depth=5))
    assert verbose is True


def test_typer_parses_the_groups_and_requires_what_has_no_default():
    app = typer.Typer()

    @app.command()
    @flag_groups
    def command(flags: Outer):
        print(flags.name, flags.models.model, flags.inner.depth, flags.loud)

    runner = CliRunner()
    result = runner.invoke(app, ["--name", "n", "--model", "m", "--depth", "3", "--loud"])
    assert result.exit_code == 0, result.output
    assert result.stdout.split() == ["n", "m", "3", "True"]
    assert runner.invoke(app, []).exit_code == 2  # --name is required


def test_an_option_taken_twice_is_refused_at_import():
    with pytest.raises(TypeError, match="model clash with ModelFlags"):

        @flag_groups
        def twice(model: str = "", models: ModelFlags = ModelFlags()):
            return model
