"""``tune --draft-length`` without a draft model to draft with is refused, naming the fix."""

from __future__ import annotations

from tests.support.cli import error_line, invoke


def test_tune_draft_length_without_a_draft_model_is_refused(cli_app):
    result = invoke(cli_app, "tune", "--model", "demo", "--draft-length", 3, "--json")
    line = error_line(result, 2)
    assert "--draft-length 3" in line and "add --draft-model" in line
