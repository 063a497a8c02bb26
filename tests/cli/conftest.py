"""Shared by several test modules (moved from ``tests/cli/test_chat.py``)."""

from __future__ import annotations

import pytest

from redrafter_mlx.cli.common import ModelPaths, load_engine


@pytest.fixture(scope="module")
def engine(pair):
    model, drafter, _ = pair
    return load_engine(ModelPaths(model, drafter), None)
