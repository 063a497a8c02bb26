"""BLAS thread policy: every core for a weight-bound model, all but one for a small one, and
the user's own setting always wins."""

import mlx.nn as nn
import pytest

from redrafter_mlx.engine.base import platform

OPENBLAS = platform.OPENBLAS_PATHS[0]


@pytest.fixture
def blas(monkeypatch):
    """A fake preloaded OpenBLAS on a 4-core machine; returns the thread counts it was given."""
    calls = []

    class FakeLib:
        def openblas_set_num_threads(self, n):
            calls.append(n)

        def openblas_get_num_threads(self):
            return calls[-1] if calls else 4

    monkeypatch.setattr(platform.ctypes, "CDLL", lambda path: FakeLib())
    monkeypatch.setattr(platform.os, "cpu_count", lambda: 4)
    monkeypatch.setenv("LD_PRELOAD", OPENBLAS)
    for name in ("OPENBLAS_NUM_THREADS", platform.THREADS_ENV, platform._AUTO_ENV):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_threads_follow_the_model_size(blas):
    big = platform.WEIGHT_BOUND_BYTES + 1
    assert platform.blas_threads() == 3
    assert platform.blas_threads(weight_bytes=1024) == 3
    assert platform.blas_threads(weight_bytes=big) == 4


def test_override_wins(blas, monkeypatch):
    monkeypatch.setenv(platform.THREADS_ENV, "2")
    assert platform.blas_threads(weight_bytes=platform.WEIGHT_BOUND_BYTES + 1) == 2
    platform.limit_blas_threads(10**9)
    assert blas == [2]


def test_fit_counts_every_module_weight(blas, monkeypatch):
    monkeypatch.setattr(platform, "WEIGHT_BOUND_BYTES", 4 * 1000)
    small = nn.Linear(10, 10, bias=False)  # 400 bytes in float32
    platform.fit_blas_threads(small, None)
    platform.fit_blas_threads(small, nn.Linear(40, 40, bias=False))  # 400 + 6400 bytes
    assert blas == [3, 4]


def test_our_own_setting_is_refitted_but_the_users_is_not(blas, monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    monkeypatch.setenv(platform._AUTO_ENV, "1")  # set by the CLI's re-exec
    platform.limit_blas_threads(platform.WEIGHT_BOUND_BYTES + 1)
    assert blas == [4]
    monkeypatch.delenv(platform._AUTO_ENV)  # the user's own OPENBLAS_NUM_THREADS
    platform.limit_blas_threads(platform.WEIGHT_BOUND_BYTES + 1)
    assert blas == [4]


def test_nothing_happens_without_preloaded_openblas(blas, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "")
    platform.limit_blas_threads(platform.WEIGHT_BOUND_BYTES + 1)
    assert blas == []


def test_answer_lanes_share_the_blas_threads_and_give_them_back(blas):
    platform.limit_blas_threads(platform.WEIGHT_BOUND_BYTES + 1)  # every core: 4
    with platform.lane_threads(2):
        assert blas[-1] == 2
    assert blas[-1] == 4
    with platform.lane_threads(3):
        assert blas[-1] == 1
    with platform.lane_threads(1):  # one lane: the threads as they are
        assert blas[-1] == 4
    assert blas == [4, 2, 4, 1, 4]


def test_answer_lanes_by_backend_and_override(blas, monkeypatch):
    import mlx.core as mx

    monkeypatch.delenv(platform.LANES_ENV, raising=False)
    assert platform.answer_lanes() == (2 if mx.default_device() == mx.cpu else 1)
    monkeypatch.setattr(platform.os, "cpu_count", lambda: 1)
    assert platform.answer_lanes() == 1
    monkeypatch.setenv(platform.LANES_ENV, "3")
    assert platform.answer_lanes() == 3


@pytest.mark.parametrize(
    "value, used",
    [("0", "ignoring it"), ("-3", "ignoring it"), ("abc", "ignoring it"), ("99999", "using 4")],
)
def test_a_bad_blas_thread_count_is_said_once(monkeypatch, capsys, value, used):
    from redrafter_mlx.engine.base import platform

    monkeypatch.setattr(platform.os, "cpu_count", lambda: 4)
    monkeypatch.setenv(platform._THREADS_WARNED_ENV, "")
    monkeypatch.setenv(platform.THREADS_ENV, value)
    first = platform.blas_threads()
    assert platform.blas_threads() == first == (4 if value == "99999" else 3)
    warnings = capsys.readouterr().err.strip().splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {platform.THREADS_ENV}=")
    assert used in warnings[0]
    monkeypatch.setenv(platform._THREADS_WARNED_ENV, "")
    monkeypatch.setenv(platform.THREADS_ENV, "2")
    assert platform.blas_threads() == 2 and capsys.readouterr().err == ""
