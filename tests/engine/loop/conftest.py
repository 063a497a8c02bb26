"""Fixtures of the loop's tests: ``read_order``, both read orders of a loop with branching rows."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.base.platform import READ_FIRST_ENV


@pytest.fixture(params=["1", "0"], ids=["read-first", "queue-ahead"])
def read_order(request, monkeypatch):
    """Both read orders of a loop with branching rows (``platform.read_first``: the CPU
    reads each branching step first, a GPU queues ahead where no fork can change the next)."""
    monkeypatch.setenv(READ_FIRST_ENV, request.param)
    return request.param
