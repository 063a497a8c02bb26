"""``bench``'s prompt choice and report, without a model: the edit set, ``--spread`` over
categories, turns kept per record, ``--configs`` labels and the lookup column."""

from __future__ import annotations

import json

import pytest

from redrafter_mlx.cli.bench_report import (
    AR_CONFIG,
    BenchError,
    BenchPrompt,
    BenchResult,
    Config,
    parse_configs,
    render_table,
    summarize,
)
from redrafter_mlx.engine.base.prompts import (
    PromptRecord,
    load_prompts,
    load_records,
    parse_records,
    spread,
)
from redrafter_mlx.engine.core.shape import AR, BeamShape
from redrafter_mlx.measure.throughput import Run


def test_edit_set_is_built_in():
    records = load_records("edit")
    assert len(records) == 36 and len(load_prompts("edit")) == 36
    assert all(len(r.turns) == 1 and r.category for r in records)


def test_mt_bench_records_keep_both_turns_and_the_category():
    records = load_records("mt-bench")
    assert len(records) == 80 and all(len(r.turns) == 2 for r in records)
    assert records[0].category == "writing" and records[0].prompt == load_prompts("mt-bench")[0]


def test_spread_takes_two_per_category_of_16_mt_bench_questions():
    records = load_records("mt-bench")
    chosen = load_records("mt-bench", 16, spread_categories=True)
    categories = list(dict.fromkeys(r.category for r in records))
    assert len(categories) == 8
    assert [r.category for r in chosen] == [c for c in categories for _ in range(2)]
    firsts = [r for c in categories for r in [x for x in records if x.category == c][:2]]
    assert chosen == firsts  # the first two of each category, in file order
    assert load_records("mt-bench", 16) == records[:16]  # without --spread: the first 16


def test_spread_round_robin_and_files_without_categories():
    recs = [PromptRecord((str(i),), c) for i, c in enumerate("aaabbc")]
    assert [r.prompt for r in spread(recs, 4)] == ["0", "1", "3", "5"]  # a, b, c, then a
    assert [r.prompt for r in spread(recs, 5)] == ["0", "1", "3", "4", "5"]
    assert spread(recs, 99) == recs
    plain = [PromptRecord((str(i),)) for i in range(5)]
    assert spread(plain, 3) == plain[:3]


def test_records_of_files(tmp_path):
    lines = [
        {"turns": ["q1", "q2"], "category": "x"},
        {"prompt": "p"},
        {"text": "t", "category": 3},
        {"turns": ["only", 5]},
    ]
    records = parse_records("\n".join(json.dumps(x) for x in lines), "f.jsonl")
    assert records == [
        PromptRecord(("q1", "q2"), "x"),
        PromptRecord(("p",)),
        PromptRecord(("t",)),
        PromptRecord(("only",)),
    ]
    f = tmp_path / "p.txt"
    f.write_text("one\ntwo\n")
    assert load_records(str(f), spread_categories=True) == [
        PromptRecord(("one",)),
        PromptRecord(("two",)),
    ]


def test_parse_configs():
    shapes = parse_configs("AR, W1xL3,W1xL4+K1xL8 C8 ,K1×L8, W2xL5/C6")
    assert [s.label for s in shapes] == ["AR", "W1×L3", "W1×L4+K1×L8 C8", "K1×L8", "W2×L5 C6"]
    assert shapes[3] == BeamShape.lookup_only(1, 8)
    for bad, needle in [
        ("W1xL3,nope", "'nope' is not a beam shape"),
        ("W3xL1", "beam length must be >= 2"),
        ("W1xL4+K1xL8 C99", "capacity 99"),
        ("", "comma-separated"),
    ]:
        with pytest.raises(BenchError, match="--configs") as info:
            parse_configs(bad)
        assert needle in str(info.value)


def _run(accepted: int, from_lookup: int) -> Run:
    return Run([1] * 9, 8, 0.1, 4, 2.0, 3.0, 0.01, 0.1, accepted, {"lookup": from_lookup})


def test_lookup_share_column():
    lookup = Config(BeamShape.parse("W1xL4+K1xL8"))
    drafted = Config(BeamShape(1, 4))
    configs = [AR_CONFIG, drafted, lookup]
    items = [BenchPrompt([1], 0, 1), BenchPrompt([2], 0, 2)]
    runs = {
        "AR": [_run(0, 0), _run(0, 0)],
        drafted.name: [_run(4, 0), _run(4, 0)],
        lookup.name: [_run(6, 3), _run(4, 4)],
    }
    rows = summarize(BenchResult(configs, items, runs, greedy=True))
    assert [(r["turn"], r["config"]) for r in rows] == [
        (t, c.name) for t in (1, 2) for c in configs
    ]
    shares = {(r["turn"], r["config"]): r["lookup_share"] for r in rows}
    assert shares[(1, "W1×L4+K1×L8")] == pytest.approx(0.5)
    assert shares[(2, "W1×L4+K1×L8")] == pytest.approx(1.0)
    assert shares[(1, "AR")] is None and shares[(1, "W1×L4")] is None
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_table(rows[:3], "t"))
    text = console.export_text()
    assert "lookup" in text and "50%" in text
    ar_line = next(line for line in text.splitlines() if line.strip().startswith("AR"))
    assert "–" in ar_line
    assert Config(AR).kind == "ar" and lookup.tree_size == 12 and drafted.tree_size == 4
    assert Config(BeamShape.lookup_only(2, 6)).tree_size == 12
    assert Config(BeamShape.lookup_only(2, 6)).drafts is False
