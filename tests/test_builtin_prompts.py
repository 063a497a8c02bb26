"""The built-in prompt collection (redrafter_mlx/data/distill_prompts.jsonl, package data):
our own synthetic user turns, diverse, without duplicates or MT-Bench / Vicuna-bench turns."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from redrafter_mlx.train import selfdata

KINDS = ("template", "topic", "roleplay", "math", "reasoning", "coding", "extraction", "knowledge")


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return selfdata.builtin_prompts()


def test_every_line_is_a_source_and_a_prompt(rows):
    lines = selfdata.PROMPTS_FILE.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(rows) > 12_000
    assert all(set(json.loads(line)) == {"source", "prompt"} for line in lines)
    assert all(r["prompt"].strip() for r in rows)


def test_kinds_are_balanced(rows):
    counts = Counter(r["source"] for r in rows)
    assert set(counts) == set(KINDS)
    synthetic = [counts[k] for k in KINDS[1:]]
    assert max(synthetic) - min(synthetic) <= len(synthetic)


def test_no_duplicates(rows):
    keys = [selfdata.normalize(r["prompt"]) for r in rows]
    assert len(set(keys)) == len(keys)


def test_no_held_out_turns(rows):
    held = selfdata.heldout_turns()
    assert len(held) > 100
    assert not [r["prompt"] for r in rows if selfdata.normalize(r["prompt"]) in held]


def test_no_unfilled_template_fields(rows):
    for r in rows:
        if r["source"] != "coding":  # code snippets legitimately contain braces
            assert "{" not in r["prompt"] and "}" not in r["prompt"], r["prompt"]


def test_asks_cover_topics_styles_and_kinds():
    asks = selfdata.ask_texts(50, seed=0)
    assert len(asks) == len(set(asks)) == 50
    assert asks == selfdata.ask_texts(50, seed=0) != selfdata.ask_texts(50, seed=1)
    assert all("{" not in a and a.startswith("Write ") for a in asks)


def test_prompt_list_is_seeded_and_drops_held_out_and_duplicate_turns():
    mt = json.loads(selfdata.HELDOUT_FILES[0].read_text().splitlines()[0])["turns"][0]
    own = ["Tell me about owls, please.", "tell me about  OWLS, please.", mt]
    a = selfdata.prompt_list(own, seed=3)
    assert a == selfdata.prompt_list(own, seed=3)
    assert [r["id"] for r in a] == list(range(len(a)))
    assert [r["prompt"] for r in a if r["source"] == "model"] == ["Tell me about owls, please."]
    assert a != selfdata.prompt_list(own, seed=4)
