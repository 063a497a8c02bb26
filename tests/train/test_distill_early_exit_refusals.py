"""``distill --kind early-exit``'s flags out of range, a zero ``--budget`` and a ``--resume`` with
changed settings: one clear error naming the problem and the fix, nothing written."""

from __future__ import annotations

import pytest

from tests.support.cli import error_line, invoke
from tests.support.models import SHAREGPT_SAMPLE

DISTILL = ["distill", "--model", "demo", "--data", SHAREGPT_SAMPLE, "--seq-len", 64]
DISTILL += ["--kind", "early-exit", "--quiet"]


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--exit-layer", 0], "--exit-layer: exit layer 0 is outside"),
        (["--exit-layer", 4], "pass --exit-layer between 1 and 3"),
        (["--draft-vocab", 5000], "--draft-vocab: 5000 ids exceed the model's vocabulary (4096"),
    ],
)
def test_distill_early_exit_flags_out_of_range_exit_2(cli_app, tmp_path, flags, says):
    out = tmp_path / "out"
    line = error_line(invoke(cli_app, *DISTILL, "--steps", 1, "--out", out, *flags), 2)
    assert says in line and not out.exists()


def test_a_zero_budget_is_refused_up_front(cli_app, tmp_path):
    out = tmp_path / "out"
    args = ["distill", "--model", "demo", "--kind", "early-exit", "--quiet", "--out", out]
    for budget in ("0", "0k"):
        line = error_line(invoke(cli_app, *args, "--budget", budget), 2)
        assert f"got '{budget}'" in line and "positions > 0" in line
    assert not out.exists()


def test_resume_with_changed_settings_is_refused(cli_app, tmp_path):
    out = tmp_path / "out"
    run = [*DISTILL, "--out", out, "--batch-size", 128]
    assert invoke(cli_app, *run, "--steps", 2).exit_code == 0
    before = (out / "model.safetensors").read_bytes()
    changed = invoke(cli_app, *run, "--steps", 3, "--seed", 7, "--draft-vocab", 50, "--resume")
    line = error_line(changed, 1)
    assert "--seed 0 (now 7)" in line and "--draft-vocab not given (now 50)" in line
    assert "--steps 2 (now 3)" in line and "--overwrite" in line
    assert (out / "model.safetensors").read_bytes() == before
    line = error_line(invoke(cli_app, *run[:-1], 64, "--steps", 2, "--resume"), 1)
    assert "--batch-size 128 (now 64)" in line
