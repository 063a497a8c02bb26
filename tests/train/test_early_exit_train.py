"""``distill --kind early-exit`` (train/early_exit.py) on the shipped demo model: the loss falls,
a resumed run equals an uninterrupted one, the folder loads; and the chain score is exact on
a target whose layers past the exit do nothing."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.drafting.early_exit import check_pair, is_early_exit, load_adapter
from redrafter_mlx.engine.loop.loading import load_model
from redrafter_mlx.train import early_exit as EE
from redrafter_mlx.train.data import Sequence
from tests.support.early_exit import DEMO, RUN
from tests.support.models import SHAREGPT_SAMPLE, tiny_model


def _weights(path: Path) -> dict:
    return {k: np.array(v) for k, v in mx.load(str(path / "model.safetensors")).items()}


@pytest.mark.slow  # ~10 s
def test_training_lowers_the_loss_and_the_folder_loads(tmp_path):
    out = tmp_path / "ee"
    summary = EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], out, steps=30, **RUN)
    losses = [h["loss"] for h in summary["history"]]
    assert len(losses) == 30 and summary["exit_layer"] == 1  # 4 layers: about 4 / 15 -> 1
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3, losses
    assert is_early_exit(out) and (out / "eval.json").exists()
    model, _ = load_model(DEMO)
    adapter = load_adapter(out)
    check_pair(model, adapter)
    assert summary["eval"]["held_out"]["top1_agreement"] > 0


@pytest.mark.slow  # ~12 s
def test_resume_gives_the_same_weights_as_an_uninterrupted_run(tmp_path, monkeypatch):
    run = dict(RUN, steps=6, exit_layer=2)
    full = EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], tmp_path / "full", **run)
    real_save = EE.save_checkpoint

    def save_then_crash(out, trainer, step, config, run):
        real_save(out, trainer, step, config, run)
        raise KeyboardInterrupt(f"killed after step {step}")

    monkeypatch.setattr(EE, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt, match="after step 3"):
        EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], tmp_path / "split", **run)
    monkeypatch.setattr(EE, "save_checkpoint", real_save)
    with pytest.raises(ValueError, match="--exit-layer 2"):
        EE.distill_early_exit(
            DEMO, [SHAREGPT_SAMPLE], tmp_path / "split", resume=True, **dict(run, exit_layer=1)
        )
    resumed = EE.distill_early_exit(DEMO, [SHAREGPT_SAMPLE], tmp_path / "split", resume=True, **run)
    assert resumed["resumed_from"] == 3
    assert [h["step"] for h in resumed["history"]] == [4, 5, 6]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in full["history"][3:]]
    a, b = _weights(tmp_path / "full"), _weights(tmp_path / "split")
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_cli_trains_an_adapter_and_checks_its_flags(tmp_path):
    from redrafter_mlx.cli import _register, app

    _register()
    base = ["distill", "--model", "demo", "--data", str(SHAREGPT_SAMPLE), "--seq-len", "64"]
    out = tmp_path / "ee"
    args = [*base, "--out", str(out), "--kind", "early-exit", "--exit-layer", "2", "--steps", "2"]
    result = CliRunner().invoke(app, [*args, "--quiet"])
    assert result.exit_code == 0, result.output
    assert "exit layer 2" in result.output and load_adapter(out).args.exit_layer == 2
    bad = CliRunner().invoke(app, [*base, "--out", str(tmp_path / "x"), "--exit-layer", "2"])
    assert bad.exit_code != 0 and "--exit-layer needs --kind early-exit" in bad.output
    deep = [*base, "--out", str(tmp_path / "y"), "--kind", "early-exit", "--exit-layer", "4"]
    bad = CliRunner().invoke(app, deep)
    assert bad.exit_code != 0 and "between 1 and 3" in bad.output


def test_chain_score_is_exact_when_the_layers_past_the_exit_do_nothing():
    """Layer 1 of a 2-layer target adds nothing (zero o_proj and down_proj), so the fresh
    adapter (zero o_proj, the target's final norm) computes the target's own final state:
    every draft of a greedy sequence is accepted."""
    model = tiny_model(seed=4, layers=2)
    layer = model.model.layers[1]
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    seq = [3, 7]
    for _ in range(20):  # greedy continuation, from scratch each token
        ex = EE.sequence_features(model, Sequence(seq, [True] * len(seq)), 1)
        seq.append(int(mx.argmax(model.logits(ex.finals[-1]))))
    example = EE.sequence_features(model, Sequence(seq, [False, False] + [True] * 20), 1)
    adapter = EE.new_adapter(model, 1, seed=0)
    score = EE.chain_score(model, adapter, [example], gamma=4, eta=0.0)
    assert score["chains"] > 1 and score["mean_accepted"] == 4.0
    moved = EE.new_adapter(model, 1, seed=0)  # a different adapter accepts less
    moved.norm.weight = -moved.norm.weight + 0.5
    assert EE.chain_score(model, moved, [example], gamma=4, eta=0.0)["mean_accepted"] < 4.0


def test_a_positions_budget_trains_on_that_many_answer_positions():
    """``--budget 100k`` on a self-data folder that a larger run filled: the first answers
    whose positions reach the budget, not every answer the folder holds."""
    from redrafter_mlx.train.builtin import within_positions

    rows = [{"response_ids": [1] * n} for n in (40, 30, 50, 20)]
    assert within_positions(rows, 60) == rows[:2]  # 40, then 70 >= 60
    assert within_positions(rows, 70) == rows[:2]
    assert within_positions(rows, 71) == rows[:3]
    assert within_positions(rows, 10**6) == rows
    assert within_positions([], 5) == []
