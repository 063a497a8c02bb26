"""``tune`` checks that the home folder can hold a profile before it measures, and shows its
table and pick even when saving then fails."""

from __future__ import annotations

import errno
import json

import pytest

from tests.support.cli import error_line, invoke


@pytest.fixture()
def fake_tune(monkeypatch, tmp_path):
    """A model/drafter pair and a fake measurement; returns (args, measured shapes)."""
    import redrafter_mlx.cli.tune
    from tests.support.fakes import FakeChip, FakeClock

    model, drafter = tmp_path / "model", tmp_path / "drafter"
    for folder, config in ((model, {"model_type": "llama"}), (drafter, {"predict_tokens": 4})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    measured: list = []

    def measure(shape, n_tokens):
        measured.append(shape)
        return chip(shape, n_tokens)

    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (measure, clock))
    args = ["tune", "--model", model, "--drafter", drafter, "--budget-seconds", 60,
            "--widths", "1-2", "--lengths", "2-3"]  # fmt: skip
    return args, measured


def test_tune_refuses_an_unwritable_home_before_measuring(app, fake_tune, monkeypatch, tmp_path):
    args, measured = fake_tune
    not_a_folder = tmp_path / "home-is-a-file"
    not_a_folder.write_text("")
    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(not_a_folder))
    line = error_line(invoke(app, *args), 1)
    assert f"cannot save tuned profiles in {not_a_folder}" in line
    assert "it is a file, not a folder" in line and "REDRAFTER_MLX_HOME" in line
    assert measured == []  # nothing was measured


def test_tune_shows_its_measurement_when_saving_fails(app, home, fake_tune, monkeypatch):
    from tuning.profiles import ProfileStore

    def cannot_save(self, profiles):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ProfileStore, "save", cannot_save)
    args, measured = fake_tune
    result = invoke(app, *args)
    assert measured
    assert "recommended:" in result.stdout and "W=2" in result.stdout  # the pick and the table
    assert "not saved" in result.stdout
    assert "No space left on device" in error_line(result, 1)
