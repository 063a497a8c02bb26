"""Guards that turn a wrong input into one clear line (issue 22): an unwritable ``convert
--out``, a base model given as ``--drafter``, an unknown ``--model`` name, a beam shape that
cannot fit in memory, and a ``tune`` that measured too little to save a profile."""

from __future__ import annotations

import errno
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
