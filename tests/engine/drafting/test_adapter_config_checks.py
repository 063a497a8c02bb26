"""A damaged early-exit adapter folder: a real-valued key of its config.json out of its range
or not a number (``eta``, ``rope_theta``, ``rms_norm_eps``), or weights holding a NaN, is one
LoadError naming the folder, the key and what it accepts, before the adapter runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting.early_exit import (
    EarlyExitAdapter,
    EarlyExitArgs,
    adapter_eta,
    load_adapter,
    save_adapter,
)
from redrafter_mlx.engine.loop.loading import LoadError, load, load_model
from tests.support.cli import error_line, invoke

DEMO = demo_paths()[0]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory) -> Path:
    """A (random) early-exit adapter for the demo model, exit layer 1."""
    model, _ = load_model(DEMO)
    folder = tmp_path_factory.mktemp("ee") / "ee"
    save_adapter(folder, EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 1)))
    return folder


def damaged(adapter_dir: Path, tmp_path: Path, **config) -> Path:
    """A copy of the adapter folder with ``config`` keys set."""
    folder = tmp_path / "damaged"
    shutil.copytree(adapter_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **config}))  # NaN as JSON's NaN
    return folder


@pytest.mark.parametrize(
    "key, value, accepts",
    [
        ("eta", "abc", "in [0, 1]"),
        ("eta", 5, "in [0, 1]"),
        ("eta", -1, "in [0, 1]"),
        ("eta", float("nan"), "in [0, 1]"),
        ("eta", True, "in [0, 1]"),
        ("rope_theta", "x", "> 0"),
        ("rope_theta", 0, "> 0"),
        ("rms_norm_eps", -1, "> 0"),
        ("rms_norm_eps", float("inf"), "> 0"),
    ],
)
def test_a_real_valued_key_out_of_range_is_named(adapter_dir, tmp_path, key, value, accepts):
    folder = damaged(adapter_dir, tmp_path, **{key: value})
    for slot in ("drafter_path", "draft_model"):
        with pytest.raises(LoadError) as e:
            load(DEMO, **{slot: folder})
        message = str(e.value)
        assert str(folder) in message and "config.json" in message
        assert f"gives {key} {value!r}, not a finite number {accepts}" in message
        assert "train or convert the adapter again" in message


@pytest.mark.parametrize("eta", [0, 0.25, 1])
def test_an_eta_in_range_is_used(adapter_dir, tmp_path, eta):
    folder = damaged(adapter_dir, tmp_path, eta=eta)
    assert adapter_eta(load_adapter(folder)) == eta


def test_non_finite_adapter_weights_are_refused(cli_app, adapter_dir, tmp_path):
    folder = damaged(adapter_dir, tmp_path)
    weights = dict(tree_flatten(load_adapter(folder).parameters()))
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = mx.where(
        mx.arange(weights[name].size).reshape(weights[name].shape) == 3, mx.nan, weights[name]
    )
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    line = error_line(
        invoke(cli_app, "generate", "--model", "demo", "-p", "x", "--drafter", folder), 1
    )
    assert "holds non-finite weights (NaN or infinity in " + name in line
    assert str(folder) in line and "Train it again" in line
