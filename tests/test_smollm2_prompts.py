"""scripts.smollm2_prompts: deterministic, diverse, held-out-free synthetic user turns."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from scripts.smollm2_prompts import SOURCES, diverse_prompts

DATA = Path(__file__).resolve().parents[1] / "redrafter_mlx" / "data"


def _norm(s: str) -> str:
    return " ".join(s.lower().split())


@pytest.fixture(scope="module")
def everything() -> list[dict]:
    return diverse_prompts(10**9, seed=0)


def test_deterministic_for_a_seed():
    assert diverse_prompts(300, seed=7) == diverse_prompts(300, seed=7)


def test_different_seeds_differ():
    a = [d["prompt"] for d in diverse_prompts(300, seed=1)]
    b = [d["prompt"] for d in diverse_prompts(300, seed=2)]
    assert a != b
    assert len(set(a) & set(b)) < len(a) // 2


@pytest.mark.parametrize("n", [0, 1, 7, 250])
def test_n_respected(n):
    out = diverse_prompts(n, seed=0)
    assert len(out) == n
    assert all(set(d) == {"source", "prompt"} for d in out)
    assert all(d["source"] in SOURCES and d["prompt"].strip() for d in out)


def test_prefix_is_stable_and_balanced():
    long, short = diverse_prompts(700, seed=3), diverse_prompts(70, seed=3)
    assert long[:70] == short
    first = Counter(d["source"] for d in diverse_prompts(100, seed=3))
    assert set(first) == set(SOURCES)
    assert max(first.values()) - min(first.values()) <= 1


def test_at_least_12000_available_without_duplicates(everything):
    assert len(everything) >= 12_000
    keys = [_norm(d["prompt"]) for d in everything]
    assert len(set(keys)) == len(keys)
    # the first 12,000 are spread evenly over the sources
    counts = Counter(d["source"] for d in everything[:12_000])
    assert set(counts) == set(SOURCES)
    assert min(counts.values()) >= 12_000 // len(SOURCES) - 1


def test_no_held_out_turns(everything):
    held = set()
    for name in ("mt_bench_questions.jsonl", "vicuna_bench_questions.jsonl"):
        for line in (DATA / name).read_text(encoding="utf-8").splitlines():
            if line.strip():
                held.update(_norm(t) for t in json.loads(line)["turns"])
    assert len(held) > 100
    assert not [d["prompt"] for d in everything if _norm(d["prompt"]) in held]


def test_no_unfilled_template_fields(everything):
    for d in everything:
        p = d["prompt"]
        if d["source"] != "coding":  # code snippets legitimately contain braces
            assert "{" not in p and "}" not in p, p
