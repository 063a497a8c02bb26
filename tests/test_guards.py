"""Guards that turn a wrong input into one clear line (issue 22): an unwritable ``convert
--out``, a base model given as ``--drafter``, an unknown ``--model`` name, a beam shape that
cannot fit in memory, and a ``tune`` that measured too little to save a profile."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.bundled import demo_paths
from redrafter_mlx.engine.loading import LoadError, load_drafter

FIXTURES = Path(__file__).parent / "fixtures" / "convert"


@pytest.fixture(scope="module")
def app(cli_app):
    return cli_app


def invoke(app, *args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


# --------------------------------------------------------------------------- convert --out


def test_convert_into_a_read_only_folder_names_it(app, tmp_path, monkeypatch):
    """A read-only file system (EROFS, even for root) is reported with the folder and a fix,
    not as a raw ``[Errno 30]``."""
    import weights_convert.conversion as conversion

    def read_only(prefix="", dir=None, **_):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(dir, prefix + "x"))

    monkeypatch.setattr(conversion.tempfile, "mkdtemp", read_only)
    out = tmp_path / "ro" / "model"
    result = invoke(
        app, "convert", "--model", str(FIXTURES / "llama_bin_sharded"), "--out", str(out)
    )
    assert result.exit_code == 1
    assert "Errno" not in result.output
    assert f"cannot write to {out.parent}" in result.output
    assert "read-only file system" in result.output and "writable --out" in result.output
    assert not (tmp_path / "ro").exists()  # the parent it created is removed again


def test_convert_to_an_unwritable_parent_fails_before_converting(app, tmp_path, monkeypatch):
    import weights_convert.conversion as conversion

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        conversion.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
    )
    result = invoke(
        app,
        "convert",
        "--model",
        str(FIXTURES / "llama_bin_sharded"),
        "--out",
        str(locked / "a" / "b"),
    )
    assert result.exit_code == 1
    assert f"cannot write to {locked} (not writable)" in result.output
    assert f"chmod u+w {locked}" in result.output
    assert list(locked.iterdir()) == []


# --------------------------------------------------------------------------- --drafter MODEL


def test_a_model_folder_given_as_drafter_is_named_as_such():
    base, _ = demo_paths()
    with pytest.raises(LoadError) as e:
        load_drafter(base)
    message = str(e.value)
    assert "is a model, not a drafter" in message and "\n" not in message
    assert "embed_tokens" not in message  # not the 38 unexpected tensor names


def test_generate_with_a_model_as_drafter(app):
    base, _ = demo_paths()
    result = invoke(app, "generate", "--model", "demo", "--drafter", str(base), "--prompt", "x")
    assert result.exit_code == 1
    assert "is a model, not a drafter" in result.output


# --------------------------------------------------------------------------- --model NAME


def test_an_unknown_model_name_lists_the_bundled_ones(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(app, "generate", "--model", "llama99", "--prompt", "x")
    assert result.exit_code == 1
    assert "'llama99'" in result.output
    assert "smollm2" in result.output and "demo" in result.output


def test_a_missing_path_or_repo_id_is_not_called_a_name(tmp_path):
    from redrafter_mlx.engine.bundled import unknown_name_error

    assert unknown_name_error(str(tmp_path / "nope")) is None  # a path: "not found" elsewhere
    assert unknown_name_error("owner/model") is None  # a repo id: looked up on the Hub
    assert unknown_name_error("demo") is None
    (tmp_path / "here").mkdir()
    assert unknown_name_error(str(tmp_path / "here")) is None


# --------------------------------------------------------------------------- tune's profile


@pytest.fixture()
def tune_pair(tmp_path, monkeypatch):
    """A model and drafter folder for ``tune``, measured by the fake cost model."""
    import redrafter_mlx.cli.tune
    from tests.fakes import FakeChip, FakeClock

    model, drafter = tmp_path / "model", tmp_path / "drafter"
    model.mkdir()
    drafter.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (drafter / "config.json").write_text('{"predict_tokens": 4}')
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (chip, clock))
    return str(model), str(drafter)


def _tune(app, pair, budget: str, *more: str):
    return invoke(
        app, "tune", "--model", pair[0], "--drafter", pair[1], "--budget-seconds", budget, *more
    )


def test_a_one_second_tune_keeps_the_old_profile(app, tune_pair):
    from tuning import resolve_beam_shape
    from tuning.profiles import ProfileStore

    saved = _tune(app, tune_pair, "120")
    assert saved.exit_code == 0, saved.output
    assert "saved to" in saved.output
    store = ProfileStore().path
    before = store.read_bytes()
    choice = resolve_beam_shape(tune_pair[0], tune_pair[1], None)

    quick = _tune(app, tune_pair, "3")  # a few shapes once each, none repeated
    assert quick.exit_code == 1
    assert "no profile was saved" in quick.stderr and "too little was measured" in quick.stderr
    assert "ran 1 time(s)" in quick.stderr
    assert "earlier profile is unchanged" in quick.stderr and "--budget-seconds" in quick.stderr
    assert "saved to" not in quick.stdout
    assert store.read_bytes() == before
    assert resolve_beam_shape(tune_pair[0], tune_pair[1], None) == choice


def test_a_one_second_tune_saves_nothing_and_says_so_in_json(app, tune_pair):
    from tuning.profiles import ProfileStore

    quick = _tune(app, tune_pair, "1", "--json")  # not even one shape
    assert quick.exit_code == 1
    data = json.loads(quick.stdout)
    assert data["saved"] is False and data["profile_path"] is None
    assert "no speculative shape was measured" in quick.stderr
    assert not ProfileStore().path.exists()


def test_evidence_needs_repeated_runs_of_the_pick_and_the_baseline():
    from tests.fakes import FakeChip, FakeClock
    from tuning.grid import build_grid
    from tuning.search import MIN_COMPARED_RUNS, successive_halving

    grid = build_grid([1, 2, 3, 4], [2, 3, 4, 5], [None])
    for budget, enough in ((1.0, False), (12.0, False), (120.0, True)):
        clock = FakeClock()
        result = successive_halving(FakeChip(clock, per_token=0.004), grid, budget, clock=clock)
        gap = result.evidence_gap()
        assert (gap is None) == enough, (budget, gap)
        if enough:
            n = result.best.final_tokens
            assert result.best.runs_at(n) >= MIN_COMPARED_RUNS
            assert result.autoregressive.runs_at(n) >= MIN_COMPARED_RUNS
