"""Chat's ``/stats`` after a turn that failed before any answer: the last answer's details,
not "no answer yet" (the failed turn left the conversation and its stats as they were)."""

from __future__ import annotations

import pytest

from tests.support.chat import make_short_loop


@pytest.fixture(scope="module")
def demo_engine():
    from redrafter_mlx.cli.common import ModelPaths, load_engine
    from redrafter_mlx.engine.base.bundled import demo_paths

    model, drafter = demo_paths()
    return load_engine(ModelPaths(str(model), str(drafter)), None)


def test_stats_keep_the_last_answer_after_a_failed_turn(demo_engine):
    loop = make_short_loop(demo_engine)
    loop.command("/stats")
    assert "no answer yet" in loop.console.file.getvalue()
    assert loop.answer("def f(x):")
    answered = loop.stats_text()
    assert "answer: " in answered and "no answer yet" not in answered

    def broken(*args, **kwargs):
        raise RuntimeError("the backend fell over")

    loop.stream = broken
    assert loop.answer("second") == ""
    assert loop.stats_text() == answered
