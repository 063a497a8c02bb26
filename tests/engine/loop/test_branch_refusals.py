"""APAR branch limits misused: ``--max-branches`` / ``--branch-depth`` on a model that does not
branch, ``--branches`` misspelt, and more branches than memory holds name the flag to change."""

from __future__ import annotations

import pytest

from tests.support.cli import error_line, generate_demo


def test_branch_limits_on_a_model_that_does_not_branch_are_refused(cli_app):
    line = error_line(generate_demo(cli_app, "--max-branches", 3), 2)
    assert "--max-branches 3" in line and "does not branch" in line
    line = error_line(generate_demo(cli_app, "--branch-depth", 2, "--branches", "off"), 2)
    assert "--branch-depth 2" in line and "--branches off" in line
    line = error_line(generate_demo(cli_app, "--branches", "maybe"), 2)
    assert line.count("--branches") == 1 and "auto, on, off" in line


def test_too_many_branches_for_memory_names_max_branches(monkeypatch):
    from redrafter_mlx.engine.base.errors import ParamError
    from redrafter_mlx.engine.core.sampling import SamplerConfig
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop import memory, run

    def check(model, sources, shape, batch, *rest, **kw):
        if batch > 1:
            raise memory.ShapeTooLarge("lookup_length", f"needs 9 GiB for {batch} rows")

    monkeypatch.setattr(run, "check_step_memory", check)
    with pytest.raises(ParamError) as e:
        run.check_branch_memory(None, (), BeamShape(1, 4), 1, 100, 64, SamplerConfig())
    assert e.value.param == "max_branches" and "lower --max-branches" in e.value.message
    assert "100 branches per answer make up to 100 rows" in e.value.message
