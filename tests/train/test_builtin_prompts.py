"""The built-in prompt collection (redrafter_mlx/data/distill_prompts.jsonl, package data):
our own synthetic user turns, diverse, without duplicates or MT-Bench / Vicuna-bench turns."""

from __future__ import annotations

import json
import re
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


def collection(n: int) -> list[dict]:
    return [dict(source="topic", prompt=f"Tell me about subject number {i}.") for i in range(n)]


def test_a_grown_collection_is_answered_next_and_the_answered_rows_stay(monkeypatch):
    """Answered rows (the held-out ones first) stay in place with their ids; the new prompts
    (not duplicates in another case, not MT-Bench turns) get new ids, shuffled, before the
    unanswered rows."""
    monkeypatch.setattr(selfdata, "builtin_prompts", lambda: collection(10))
    rows = selfdata.prompt_list([], seed=0)
    answered = {r["id"] for r in rows[:4]}
    assert selfdata.extend_prompts(rows, answered, seed=0) is rows  # nothing new
    mt = json.loads(selfdata.HELDOUT_FILES[0].read_text().splitlines()[0])["turns"][0]
    grown = collection(14) + [
        dict(source="topic", prompt="TELL me about subject number 3."),
        dict(source="writing", prompt=mt),
    ]
    monkeypatch.setattr(selfdata, "builtin_prompts", lambda: grown)
    out = selfdata.extend_prompts(rows, answered, seed=0)
    assert out == selfdata.extend_prompts(rows, answered, seed=0)  # seeded
    assert out[:4] == rows[:4]
    assert sorted(r["id"] for r in out) == list(range(14))
    new = {r["prompt"] for r in out if r["id"] >= 10}
    assert new == {f"Tell me about subject number {i}." for i in range(10, 14)}
    assert sorted(r["id"] for r in out[4:8]) == list(range(10, 14))
    assert [r["id"] for r in out[4:8]] != list(range(10, 14))  # shuffled
    assert out[8:] == rows[4:]


def test_a_work_folder_extends_its_prompt_list_once_and_records_it(monkeypatch, tmp_path):
    monkeypatch.setattr(selfdata, "builtin_prompts", lambda: collection(6))
    rows = selfdata.prompt_list([], seed=1)
    selfdata.write_jsonl_atomic(tmp_path / "prompts.jsonl", rows)
    answer = dict(id=rows[0]["id"], response_ids=[1, 2], finish="stop")
    selfdata.write_jsonl_atomic(tmp_path / "answers.jsonl", [answer])
    data = selfdata.SelfData(
        tmp_path, None, None, temperature=0.0, answer_tokens=8, batch=2, seed=1
    )
    assert data.prompts(0) == rows
    monkeypatch.setattr(selfdata, "builtin_prompts", lambda: collection(9))
    grown = data.prompts(0)
    assert len(grown) == 9 and grown[0] == rows[0]
    assert data.prompts(0) == grown == selfdata.read_jsonl(tmp_path / "prompts.jsonl")
    meta = json.loads((tmp_path / "prompts_meta.json").read_text())
    assert meta["added"] == [dict(prompts=3, answered_before=1)]


def word_runs(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.sub(r"[^\w\s]", " ", text.lower()).split()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def test_no_prompt_shares_eight_words_in_a_row_with_a_held_out_turn(rows):
    """Stricter than equality: no paraphrase of an MT-Bench or Vicuna-bench turn either."""
    held = set()
    for f in selfdata.HELDOUT_FILES:
        for row in selfdata.read_jsonl(f):
            for turn in row["turns"]:
                held |= word_runs(turn)
    assert not [r["prompt"] for r in rows if word_runs(r["prompt"]) & held]


def test_a_budget_ending_inside_a_pool_keeps_prompts_of_every_length(tmp_path, monkeypatch):
    """Batches are cut from length-sorted prompts (little padding) but run in a seeded random
    order: stopping after half of them keeps prompts of every length, not the shortest half
    (whose mean id would be 7.5 here; the pool's is 15.5)."""
    rows = [dict(id=i, source="topic", prompt="x" * (i + 1)) for i in range(64)]
    means = []
    for seed in range(8):
        work = tmp_path / str(seed)
        data = selfdata.SelfData(
            work, None, None, temperature=0.0, answer_tokens=8, batch=4, seed=seed
        )
        monkeypatch.setattr(data, "prompt_ids", lambda p: list(range(len(p["prompt"]))))
        ran = []

        def answer_batches(batches, ran=ran):
            for chunk in batches:
                ran.append([p["id"] for p in chunk])
                yield [dict(id=p["id"], response_ids=[1], finish="stop") for p in chunk]

        monkeypatch.setattr(data, "answer_batches", answer_batches)
        data.generate(rows[:32], stop=lambda made: made >= 16)  # one pool of 8 batches
        assert len(ran) == 4 and all(b == sorted(b) and b[-1] - b[0] == 3 for b in ran)
        answered = [r["id"] for r in selfdata.read_jsonl(work / "answers.jsonl")]
        assert answered == [i for b in ran for i in b]
        means.append(sum(answered) / len(answered))
    assert len(set(means)) > 1  # the order depends on the seed
    assert 12 < sum(means) / len(means) < 19
