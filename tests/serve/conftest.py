"""Fixtures of the server's tests: the demo pair loaded (``pair``, overriding the tiny saved
pair of ``tests/conftest.py``), chat prompts from its held-out set (``prompts``), and chat
tokenizers that render tools (``toks``)."""

from __future__ import annotations

import json

import pytest

import redrafter_mlx
from redrafter_mlx.engine.base.bundled import demo_paths
from tests.support.chat_tokenizers import chat_tokenizer


@pytest.fixture(scope="module")
def pair():
    base, drafter = demo_paths()
    return redrafter_mlx.load(base, drafter)


@pytest.fixture(scope="module")
def prompts(pair):
    _, _, tok = pair
    lines = (demo_paths()[0].parent / "heldout_prompts.jsonl").read_text().splitlines()[:6]
    return [
        tok.chat_prompt([{"role": "user", "content": json.loads(line)["turns"][0]}])
        for line in lines
    ]


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_tokenizers")
    kinds = ("qwen3", "qwen3_coder", "mistral", "chatml")
    return {k: chat_tokenizer(k, root / k) for k in kinds}
