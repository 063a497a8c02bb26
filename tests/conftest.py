"""Shared fixtures and the suite's policy on skips.

* ``home``: every test runs with ``REDRAFTER_MLX_HOME`` in its own temporary folder, so no
  test reads or writes the user's tuned profiles or models.
* ``cli_app``: the ``redrafter-mlx`` typer app with every command registered.
* ``app``: the same app, by the name the CLI tests use; ``pair``: a tiny random model, its
  drafter and a drafter for another model, saved as folders; ``apar_folder``: the demo model
  marked as an APAR model; ``model_dir``: a folder holding only a Llama ``config.json`` (the
  tuner's fake chip needs no weights). A folder's ``conftest.py`` may override one by name
  (``tests/serve``: ``pair``; ``tests/train``: ``model_dir``).
* Under ``make test`` (``REDRAFTER_MLX_STRICT_SKIPS=1``) a skipped test fails the run unless its
  reason names an optional extra: a fresh clone must run everything, not skip silently.
"""

from __future__ import annotations

import json
import os

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.core.branches import CHILD_TOKEN, FORK_TOKEN
from tests.support.cli import CONTEXT
from tests.support.models import (
    VICUNA_TOKENIZER,
    save_drafter_dir,
    save_model_dir,
    tiny_drafter,
    tiny_model,
)

OPTIONAL_MARK = "optional"  # skip reasons containing this word are allowed under make test


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """An empty, private REDRAFTER_MLX_HOME (profiles, models, caches)."""
    monkeypatch.setenv("REDRAFTER_MLX_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="session")
def cli_app():
    """The typer app with every command registered once."""
    from redrafter_mlx import cli

    cli._register()
    return cli.app


def pytest_sessionfinish(session, exitstatus):
    """Fail a strict run that skipped anything but optional-extra tests."""
    if os.environ.get("REDRAFTER_MLX_STRICT_SKIPS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    bad = [
        report
        for report in reporter.stats.get("skipped", [])
        if OPTIONAL_MARK not in str(report.longrepr)
    ]
    if bad:
        for report in bad:
            reporter.write_line(f"SKIPPED (not allowed under make test): {report.longrepr}")
        session.exitstatus = 1


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(model dir, drafter dir, drafter-for-another-model dir) of tiny random models."""
    root = tmp_path_factory.mktemp("cli")
    model = tiny_model(vocab=32000, hidden=32, max_position_embeddings=CONTEXT)
    save_model_dir(model, root / "model", VICUNA_TOKENIZER)
    save_drafter_dir(tiny_drafter(model), root / "drafter")
    other = tiny_model(seed=5, vocab=32000, hidden=64)
    save_drafter_dir(tiny_drafter(other), root / "other_drafter")
    return str(root / "model"), str(root / "drafter"), str(root / "other_drafter")


@pytest.fixture(scope="session")
def app(cli_app):
    return cli_app


@pytest.fixture(scope="module")
def apar_folder(tmp_path_factory):
    """The demo model marked as an APAR model, two of its ids named as the split tokens."""
    base, _ = demo_paths()
    folder = tmp_path_factory.mktemp("apar-cli")
    for f in base.iterdir():
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    config = json.loads((base / "config.json").read_text())
    config["branches"] = {"fork": FORK_TOKEN, "child": CHILD_TOKEN}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 4094, CHILD_TOKEN: 4095}))
    return folder


@pytest.fixture()
def model_dir(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    return str(model)
