"""Bad options that used to cost a run, or contradict their own fix, are refused first and
clearly: ``tune --budget-seconds`` NaN/inf/negative, ``convert --out <source>`` (never
overwritten, so ``--force`` is not offered), ``bench --csv`` to a path that cannot be written
(checked before any model loads), ``serve`` on a busy port (checked before the model loads),
and ``/stats``' packed-slots figure measured against the slots of the shape that packs them."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from tests.support.chat import make_loop

MISSING_MODEL = "/nonexistent/model"  # a check that runs before loading reports first


def run(cli_app, *args):
    return CliRunner().invoke(cli_app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_tune_budget_seconds_must_be_finite_and_positive(cli_app, value):
    result = run(cli_app, "tune", "--model", MISSING_MODEL, "--budget-seconds", value)
    assert result.exit_code == 2, result.output
    assert "--budget-seconds must be a finite number of seconds > 0" in result.output


@pytest.mark.parametrize("force", [False, True])
def test_convert_out_as_the_source_is_refused_without_offering_force(cli_app, tmp_path, force):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    before = sorted(p.name for p in source.iterdir())
    result = run(cli_app, "convert", "--model", source, "--out", source, *(["--force"] * force))
    assert result.exit_code != 0
    assert "would overwrite the source" in result.output
    assert "--force" not in result.output
    assert sorted(p.name for p in source.iterdir()) == before


def test_bench_csv_that_cannot_be_written_fails_before_the_run(cli_app, tmp_path):
    for bad, why in [
        (tmp_path / "no-such-folder" / "out.csv", "cannot be written"),
        (tmp_path, "is a folder"),
    ]:
        result = run(cli_app, "bench", "--model", MISSING_MODEL, "--csv", bad)
        assert result.exit_code == 2, result.output
        assert f"--csv {bad}" in result.output and why in result.output
    good = tmp_path / "fine.csv"
    result = run(cli_app, "bench", "--model", MISSING_MODEL, "--csv", good)
    assert "--csv" not in result.output  # the model is what fails now
    assert not good.exists()  # the probe left nothing behind


def test_serve_on_a_busy_port_fails_before_loading_the_model(cli_app):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run(cli_app, "serve", "--model", MISSING_MODEL, "--port", port)
    assert result.exit_code == 2, result.output
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in result.output
    result = run(cli_app, "serve", "--model", MISSING_MODEL, "--host", "no.such.host.invalid")
    assert result.exit_code == 2 and "--host" in result.output


def test_stats_measures_packed_tokens_against_the_shape_that_packs_them(engine):
    loop = make_loop(engine, max_tokens=12)
    loop.adapt = False
    loop.answer("tell me a story")
    slots = loop.plan.shape.slots
    assert loop.plan.shape.lookup and slots > loop.plan.width * loop.plan.length  # beam + chain
    assert f"of {slots} slots" in loop.stats_text()
    assert loop.last.mean_packed <= slots
    loop.adapt = True
    loop.answer("and another")
    assert f"(adaptive; {loop.plan.label} packs {slots})" in loop.stats_text()
