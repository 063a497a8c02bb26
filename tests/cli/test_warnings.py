"""Warnings reach a command's user as one ``warning:`` line, without Python's source path,
and transformers' "You are using a model of type X..." log lines not at all (issue 68,
minor: distill, bench and tune printed raw ``UserWarning``s with paths)."""

from __future__ import annotations

import os
import subprocess
import sys

CODE = """
import warnings
from redrafter_mlx.cli.errors import one_line_warnings
one_line_warnings()
warnings.warn("a narrowed beam: K2xL5 runs as K1xL5")
import transformers
transformers.utils.logging.get_logger("transformers").warning("You are using a model of type x")
"""


def test_a_warning_is_one_line_without_a_source_path_and_transformers_is_quiet():
    env = {k: v for k, v in os.environ.items() if k != "TRANSFORMERS_VERBOSITY"}
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", CODE], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    lines = [x for x in out.stderr.splitlines() if "PyTorch was not found" not in x]
    assert lines == ["warning: a narrowed beam: K2xL5 runs as K1xL5"], out.stderr
