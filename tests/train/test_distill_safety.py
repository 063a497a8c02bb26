"""``distill --out`` never destroys what is there, and a bad ``--data`` says what is wrong.

A folder holding a model, a drafter or other files is refused without ``--overwrite``; with it
the new drafter is built beside ``--out`` and renamed into place at the end, so a failed run
leaves the old one as it was. The command's own run resumes without ``--overwrite``.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.loop.loading import load_drafter
from redrafter_mlx.train import distill as D
from tests.support.models import (
    SHAREGPT_SAMPLE,
    save_drafter_dir,
    tiny_drafter,
)
from tests.support.train import RUN

pytestmark = pytest.mark.slow  # make test-fast leaves these out


@pytest.fixture
def drafter_dir(model_dir, tmp_path):
    """A finished drafter folder, as ``convert`` writes ``OUT/drafter``."""
    from redrafter_mlx.engine.loop.loading import load_model

    path = tmp_path / "drafter"
    save_drafter_dir(tiny_drafter(load_model(model_dir)[0], layers=1), path)
    (path / "model.safetensors.index.json").write_text('{"weight_map": {}}\n')
    return path


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` by relative path, with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if p.is_file()
    }


def cli_distill(model_dir, out, *extra, data=SHAREGPT_SAMPLE):
    from redrafter_mlx.cli import _register, app

    _register()
    args = ["distill", "--model", model_dir, "--data", data, "--out", out, "--quiet"]
    args += ["--predict-tokens", "2", "--steps", "2", "--batch-size", "32", "--seq-len", "128"]
    args += ["--eval-prompts", "1", "--eval-max-tokens", "4", *extra]
    return CliRunner().invoke(app, [str(a) for a in args])


def error_lines(result) -> list[str]:
    return [line for line in result.output.splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------
# a model's folder


def test_out_at_a_model_folder_is_refused_and_the_model_is_untouched(model_dir, tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(model_dir, other)
    before = snapshot(other)
    result = cli_distill(model_dir, other)
    assert result.exit_code == 1, result.output
    assert "holds a model" in result.output and "--overwrite" in result.output
    assert len(error_lines(result)) == 1
    assert snapshot(other) == before


def test_out_at_the_input_model_is_refused_even_with_overwrite(model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    before = snapshot(model)
    result = cli_distill(model, model, "--overwrite")
    assert result.exit_code == 1, result.output
    assert "would overwrite the source" in result.output
    assert snapshot(model) == before


def test_data_inside_out_is_refused_even_with_overwrite(model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    data = out / "train.json"
    shutil.copy(SHAREGPT_SAMPLE, data)
    with pytest.raises(FileExistsError, match="would overwrite the source"):
        D.distill(model_dir, [data], out, overwrite=True, **RUN)
    assert data.read_bytes() == SHAREGPT_SAMPLE.read_bytes()


# ------------------------------------------------------------------------------------------
# a drafter's folder


def test_out_at_a_drafter_folder_is_refused(model_dir, drafter_dir):
    before = snapshot(drafter_dir)
    with pytest.raises(FileExistsError, match="holds a drafter.*--overwrite"):
        D.distill(model_dir, [SHAREGPT_SAMPLE], drafter_dir, **RUN)
    assert snapshot(drafter_dir) == before


def test_overwrite_replaces_a_drafter_only_at_the_end(
    model_dir, drafter_dir, tmp_path, monkeypatch
):
    before = snapshot(drafter_dir)
    seen = []
    real_save = D.save_checkpoint

    def save_and_look(out, *args):
        path = real_save(out, *args)
        seen.append(snapshot(drafter_dir) == before)
        return path

    monkeypatch.setattr(D, "save_checkpoint", save_and_look)
    summary = D.distill(model_dir, [SHAREGPT_SAMPLE], drafter_dir, overwrite=True, **RUN)
    assert seen == [True, True]  # both checkpoints went elsewhere
    assert summary["out_dir"] == str(drafter_dir)
    assert sorted(p.name for p in drafter_dir.iterdir()) == [
        "cache",
        "checkpoints",
        "config.json",
        "model.safetensors",
    ]
    assert Path(summary["cache_dir"]).is_dir()
    assert load_drafter(drafter_dir).args.num_draft_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # no staging left


def test_a_failed_overwrite_leaves_the_old_drafter_loadable_and_identical(
    model_dir, drafter_dir, tmp_path, monkeypatch
):
    before = snapshot(drafter_dir)
    real_save = D.save_checkpoint

    def save_then_crash(out, trainer, step, config, run):
        real_save(out, trainer, step, config, run)
        raise KeyboardInterrupt(f"killed after step {step}")

    monkeypatch.setattr(D, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt, match="after step 2"):
        D.distill(model_dir, [SHAREGPT_SAMPLE], drafter_dir, overwrite=True, **RUN)
    assert snapshot(drafter_dir) == before
    assert load_drafter(drafter_dir).args.num_draft_layers == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]  # staging removed


# ------------------------------------------------------------------------------------------
# other folders and the command's own run


def test_out_at_a_folder_with_other_files_is_refused(model_dir, tmp_path):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me\n")
    result = cli_distill(model_dir, out)
    assert result.exit_code == 1, result.output
    assert "not empty" in result.output and "--overwrite" in result.output
    assert (out / "todo.txt").read_text() == "keep me\n" and len(snapshot(out)) == 1


def test_an_interrupted_run_resumes_in_place_without_overwrite(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    real_save = D.save_checkpoint

    def save_then_crash(out, trainer, step, config, run):
        real_save(out, trainer, step, config, run)
        raise KeyboardInterrupt(f"killed after step {step}")

    monkeypatch.setattr(D, "save_checkpoint", save_then_crash)
    with pytest.raises(KeyboardInterrupt):
        D.distill(model_dir, [SHAREGPT_SAMPLE], out, **RUN)
    monkeypatch.setattr(D, "save_checkpoint", real_save)
    summary = D.distill(model_dir, [SHAREGPT_SAMPLE], out, resume=True, **RUN)
    assert summary["resumed_from"] == 2 and [h["step"] for h in summary["history"]] == [3, 4]
    assert [p.name for p in D.list_checkpoints(out)] == ["step-00000002", "step-00000004"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_run_stopped_before_its_first_checkpoint_continues_with_its_cache(model_dir, tmp_path):
    out = tmp_path / "run"
    first = D.distill(model_dir, [SHAREGPT_SAMPLE], out, **RUN)
    shutil.rmtree(out / "checkpoints")  # as if stopped once the targets were cached
    for name in ("config.json", "model.safetensors"):
        (out / name).unlink()
    (out / ".model.safetensors.tmp-123").write_bytes(b"partial")
    again = D.distill(model_dir, [SHAREGPT_SAMPLE], out, **RUN)
    assert again["cache_dir"] == first["cache_dir"]
    assert [h["loss"] for h in again["history"]] == [h["loss"] for h in first["history"]]


def test_starting_a_finished_run_over_keeps_it_until_the_new_one_is_complete(
    model_dir, tmp_path, monkeypatch
):
    out = tmp_path / "run"
    first = D.distill(model_dir, [SHAREGPT_SAMPLE], out, **RUN)
    before = snapshot(out)
    cache = {k: v for k, v in before.items() if k.startswith("cache/")}

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(D, "final_eval", crash)
    with pytest.raises(OSError, match="disk full"):
        D.distill(model_dir, [SHAREGPT_SAMPLE], out, overwrite=True, **dict(RUN, lr=1e-2))
    assert snapshot(out) == before
    monkeypatch.undo()
    again = D.distill(model_dir, [SHAREGPT_SAMPLE], out, overwrite=True, **dict(RUN, lr=1e-2))
    assert again["cache_dir"] == first["cache_dir"]  # the targets were reused and kept
    assert {k: v for k, v in snapshot(out).items() if k.startswith("cache/")} == cache
    assert snapshot(out)["model.safetensors"] != before["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# ------------------------------------------------------------------------------------------
# --data


def test_a_folder_as_data_says_so_and_what_is_expected(model_dir, tmp_path):
    result = cli_distill(model_dir, tmp_path / "out", data=tmp_path)
    assert result.exit_code == 1, result.output
    [line] = error_lines(result)
    assert "is a folder, not a data file" in line and ".jsonl" in line
    assert "not found" not in line
