"""Shared fixtures and the suite's policy on skips.

* ``home``: every test runs with ``REDRAFTER_MLX_HOME`` in its own temporary folder, so no
  test reads or writes the user's tuned profiles or models.
* ``cli_app``: the ``redrafter-mlx`` typer app with every command registered.
* Under ``make test`` (``REDRAFTER_MLX_STRICT_SKIPS=1``) a skipped test fails the run unless its
  reason names an optional extra: a fresh clone must run everything, not skip silently.
"""

from __future__ import annotations

import os

import pytest

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
