"""The chat banner names every draft model the chat loads: the drafter, a ``--draft-model``
and an early-exit adapter (``--draft-model`` given twice)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs, save_adapter
from redrafter_mlx.engine.loop.loading import load_model

DEMO, DRAFTER = demo_paths()


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    """A (random) early-exit adapter for the demo model, exit layer 1."""
    model, _ = load_model(DEMO)
    folder = tmp_path_factory.mktemp("ee") / "ee"
    save_adapter(folder, EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 1)))
    return folder


def banner(cli_app, *args) -> str:
    result = CliRunner().invoke(
        cli_app,
        ["chat", "--model", "demo", "-n", "2", *args],
        input="/quit\n",
        env={"COLUMNS": "400"},
    )
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()[0]


def test_the_banner_names_the_drafter_and_the_draft_models(cli_app, adapter_dir):
    assert banner(cli_app) == f"redrafter-mlx chat · {DEMO} + drafter {DRAFTER} (float32)"
    line = banner(cli_app, "--draft-model", "demo", "--draft-model", str(adapter_dir))
    assert f" + drafter {DRAFTER} + draft model {DEMO} + early-exit adapter {adapter_dir} " in line
    alone = banner(cli_app, "--draft-model", str(adapter_dir))
    assert alone.endswith(f" + early-exit adapter {adapter_dir} (float32)")
    refused = CliRunner().invoke(  # plain decoding loads no draft model: one of them goes
        cli_app, ["chat", "--model", "demo", "--no-draft", "--draft-model", "demo"], input="/quit\n"
    )
    assert refused.exit_code == 2 and "drop --draft-model" in refused.stderr
