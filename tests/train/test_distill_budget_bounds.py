"""``distill --budget N`` (answer positions) bounds the run: a budget below one batch of
answers (which the run writes whole) is refused up front, naming the batch and a budget that
fits; the training data is the first answers whose positions reach the budget."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.train.options import DistillOptions


@pytest.mark.parametrize("budget", ["1", "3k", "5119"])
def test_a_positions_budget_below_one_batch_is_refused(budget):
    with pytest.raises(ParamError) as e:
        DistillOptions(budget=budget).for_data(builtin=True)
    assert e.value.param == "budget"
    assert "one batch of answers (--gen-batch 32 x --answer-tokens 160 = up to 5,120" in str(
        e.value
    )
    assert "give --budget 6k or more" in str(e.value) and "(30m, 1h)" in str(e.value)


def test_a_budget_of_a_batch_or_a_smaller_batch_is_accepted():
    assert DistillOptions(budget="5120").for_data(builtin=True).budget == "5120"
    small = DistillOptions(budget="3k", gen_batch=16).for_data(builtin=True)  # 2,560 a batch
    assert small.budget == "3k"
    assert DistillOptions(budget="1m").for_data(builtin=True).budget == "1m"  # a time


def test_the_cli_refuses_it_before_loading_anything(cli_app, tmp_path):
    out = tmp_path / "out"
    args = ["distill", "--model", "demo", "--out", str(out), "--budget", "1", "--quiet"]
    result = CliRunner().invoke(cli_app, args)
    assert result.exit_code == 2, result.output
    assert "--budget 1 asks for 1 answer positions" in result.output
    assert not out.exists()
