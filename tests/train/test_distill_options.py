"""``distill`` refuses impossible numbers, and a drafter with non-finite weights is never
trained on silently, saved, or loaded: every float option is checked (NaN, infinities, out of
range), a run whose loss or weights go non-finite stops with the step and what was kept, saving
refuses such weights, and loading them is a clear error."""

from __future__ import annotations

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.loop.loading import LoadError, load_drafter
from redrafter_mlx.train import distill as D
from redrafter_mlx.train.checkpoints import list_checkpoints, write_drafter_files
from tests.support.models import SHAREGPT_SAMPLE, save_drafter_dir, tiny_drafter, tiny_model
from tests.support.train import RUN


def cli_distill(model_dir, out, *extra, steps=("--steps", "2")):
    from redrafter_mlx.cli import _register, app

    _register()
    args = ["distill", "--model", model_dir, "--data", SHAREGPT_SAMPLE, "--out", out, "--quiet"]
    args += [*steps, "--predict-tokens", "2", "--batch-size", "32", "--seq-len", "128"]
    args += ["--eval-prompts", "1", "--eval-max-tokens", "4", *extra]
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "-1"),
        ("--lr", "0"),
        ("--weight-decay", "nan"),
        ("--weight-decay", "-0.1"),
        ("--weight-decay", "2000"),  # lr 1e-3 x 2000 >= 1: AdamW flips the weights' sign
        ("--warmup", "inf"),
        ("--warmup", "nan"),
        ("--epochs", "inf"),
        ("--epochs", "nan"),
        ("--gen-temp", "nan"),
    ],
)
def test_impossible_float_options_are_refused_before_anything_runs(
    model_dir,
    tmp_path,
    flag,
    value,
):
    steps = () if flag == "--epochs" else ("--steps", "2")  # the two exclude each other
    result = cli_distill(model_dir, tmp_path / "out", flag, value, steps=steps)
    assert result.exit_code == 2, result.output
    assert f"error: {flag}:" in result.output
    assert "finite number" in result.output or "below 1/lr" in result.output
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_saving_refuses_non_finite_weights_and_loading_names_them(tmp_path):
    from mlx.utils import tree_flatten, tree_unflatten

    drafter = tiny_drafter(tiny_model(vocab=64, hidden=16), layers=1)
    good = tmp_path / "good"
    save_drafter_dir(drafter, good)
    load_drafter(good)  # finite: loads
    name, value = tree_flatten(drafter.parameters())[0]
    drafter.update(tree_unflatten([(name, mx.full(value.shape, float("nan"), value.dtype))]))
    out = tmp_path / "refused"
    out.mkdir()
    with pytest.raises(ValueError, match=f"non-finite weights .*{name}.*training diverged"):
        write_drafter_files(out, drafter, {})
    assert list(out.iterdir()) == []  # nothing written

    # a NaN drafter written by other means (an older version, another tool)
    bad = tmp_path / "bad"
    save_drafter_dir(drafter, bad)
    with pytest.raises(LoadError, match=f"non-finite weights .*{name}.*lower --lr"):
        load_drafter(bad)


def test_a_run_that_diverges_stops_and_keeps_the_last_good_checkpoint(
    model_dir,
    tmp_path,
    monkeypatch,
):
    """NaN enters at step 3 (a poisoned micro-batch): the run stops naming step 3, step 2's
    checkpoint and the published drafter stay, and they load."""
    real = D.training_batch

    def poisoned(ctx, opts, micro, head_index):
        batch = real(ctx, opts, micro, head_index)
        if micro == 2:  # step 3
            hidden = batch[0] * float("nan")
            batch = (hidden, *batch[1:])
        return batch

    monkeypatch.setattr(D, "training_batch", poisoned)
    out = tmp_path / "out"
    run = dict(RUN, steps=5, save_every=1, targets="ground-truth")  # no rollouts: fast
    with pytest.raises(D.TrainingDiverged, match="diverged at step 3: the loss is nan") as e:
        D.distill(model_dir, [SHAREGPT_SAMPLE], out, **run)
    message = str(e.value)
    assert "finite weights, " in message and "step-00000002" in message and "lower --lr" in message
    assert [p.name for p in list_checkpoints(out)] == ["step-00000001", "step-00000002"]
    load_drafter(out)
    load_drafter(list_checkpoints(out)[-1])


@pytest.mark.slow
def test_an_impossible_learning_rate_is_stopped_not_saved(model_dir, tmp_path):
    """A finite learning rate far too large: the weights overflow, the command fails with
    exit 1 and no drafter is saved (before: a NaN drafter and exit 0)."""
    out = tmp_path / "out"
    flags = ["--lr", "1e38", "--weight-decay", "0", "--warmup", "0", "--save-every", "0"]
    result = cli_distill(model_dir, out, *flags, "--targets", "ground-truth")
    assert result.exit_code == 1, result.output
    assert "training diverged at step" in result.output
    assert "no checkpoint had been saved" in result.output
    assert not (out / "model.safetensors").exists()
