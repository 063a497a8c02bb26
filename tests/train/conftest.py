"""Fixtures of the training tests: ``model_dir``, a tiny random Llama with the Vicuna tokenizer
saved as a model folder (overriding the config-only folder of ``tests/conftest.py``)."""

from __future__ import annotations

import pytest

from tests.support.models import (
    VICUNA_TOKENIZER,
    near_bigram_model,
    save_model_dir,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama with the Vicuna tokenizer saved as a model dir."""
    path = tmp_path_factory.mktemp("model")
    save_model_dir(near_bigram_model(seed=0, vocab=32000, hidden=32), path, VICUNA_TOKENIZER)
    return path
