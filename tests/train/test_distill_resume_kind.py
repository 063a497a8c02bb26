"""``distill --resume`` on a folder that holds the other kind's run (a recurrent drafter's, an
early-exit adapter's) names the kind the folder holds and how to resume it, before loading
the model or the data."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from redrafter_mlx.train.checkpoints import checkpoint_root, resumed_state
from tests.support.models import SHAREGPT_SAMPLE


def fake_run(out, run: dict) -> None:
    """A checkpoint folder holding only ``training_state.json`` with ``run``."""
    step = checkpoint_root(out) / "step-00000002"
    step.mkdir(parents=True)
    (step / "training_state.json").write_text(json.dumps(dict(step=2, run=run)))


def test_the_resumed_state_names_the_kind_the_folder_holds(tmp_path):
    fake_run(tmp_path / "ee", dict(kind="early-exit", total_steps=2))
    fake_run(tmp_path / "rnn", dict(total_steps=2))  # a recurrent run records no kind
    with pytest.raises(ValueError, match="holds an early-exit adapter's run: resume it with "):
        resumed_state(tmp_path / "ee", "recurrent")
    with pytest.raises(ValueError, match="holds a recurrent drafter's run: resume it without "):
        resumed_state(tmp_path / "rnn", "early-exit")
    assert resumed_state(tmp_path / "ee", "early-exit")["step"] == 2
    assert resumed_state(tmp_path / "rnn", "recurrent")["run"] == dict(total_steps=2)
    assert resumed_state(tmp_path / "none", "recurrent") is None


@pytest.mark.parametrize("data", [[], ["--data", str(SHAREGPT_SAMPLE), "--seq-len", "64"]])
def test_resuming_an_early_exit_run_as_a_drafter_names_the_kind(cli_app, tmp_path, data):
    """A finished early-exit run, resumed without ``--kind``: the folder's kind, whatever
    the budget, with the built-in data or data files."""
    out = str(tmp_path / "ee")
    made = ["distill", "--model", "demo", "--data", str(SHAREGPT_SAMPLE), "--seq-len", "64"]
    made += ["--out", out, "--kind", "early-exit", "--steps", "1", "--quiet"]
    assert CliRunner().invoke(cli_app, made).exit_code == 0
    again = ["distill", "--model", "demo", "--out", out, "--resume", "--quiet", *data]
    for budget in ([], ["--budget", "200k"], ["--budget", "10m"]) if not data else ([],):
        result = CliRunner().invoke(cli_app, [*again, *budget])
        assert result.exit_code != 0
        assert f"{out} holds an early-exit adapter's run: resume it with --kind early-exit" in (
            result.output
        )
        assert "budget" not in result.output
