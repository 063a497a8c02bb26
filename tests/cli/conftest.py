"""Fixtures of the CLI's tests: ``engine``, the tiny pair (``pair``) loaded as a chat engine."""

from __future__ import annotations

import pytest

from redrafter_mlx.cli.common import ModelPaths, load_engine


@pytest.fixture(scope="module")
def engine(pair):
    model, drafter, _ = pair
    return load_engine(ModelPaths(model, drafter), None)
