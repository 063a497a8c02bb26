"""Row and call statistics: each step counted once (``RowStats.accept_hist`` and its per-source
split), everything else read from those counts; a call's stats are its rows' summed."""

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.sources import DRAFTER, LOOKUP, SOURCE_NAMES, by_source
from redrafter_mlx.engine.loop.rows import RowStats
from tests.support.models import near_bigram_model, run_decode


def _row(steps: list[tuple[int, int | None]], prompt: int = 5, **times) -> RowStats:
    """A row's stats after ``steps``: (tokens emitted, the accepting source) each."""
    stats = RowStats(prompt, **times)
    shape = BeamShape(2, 4)
    for count, source in steps:
        stats.record(count, by_source(source, count - 1), 3, shape if source is not None else None)
        stats.generated += count
    return stats


def test_a_rows_counts_come_from_its_steps():
    stats = _row([(3, DRAFTER), (1, None), (4, LOOKUP), (1, LOOKUP)])
    assert stats.steps == 4 and stats.accept_hist == [2, 0, 1, 1]
    assert stats.emitted_by_steps == 9 and stats.accepted_drafts == 5
    assert stats.tokens_per_step == 9 / 4
    assert stats.by_source[DRAFTER] == 2 and stats.by_source[LOOKUP] == 3
    assert sum(stats.by_source) == stats.accepted_drafts
    spec = stats.to_dict()
    assert spec["accepted_draft_tokens"] == 5 and spec["steps"] == 4
    assert spec[f"accepted_from_{SOURCE_NAMES[LOOKUP]}"] == 3
    assert spec["acceptance_rate"] == round(5 / (3 * 3), 4)  # three speculative steps of 3


def test_summed_adds_every_counter_and_keeps_the_roots_times():
    root = _row([(3, DRAFTER), (2, LOOKUP)], ttft_s=0.5, decode_s=1.0, queued_s=0.2)
    child = _row([(5, LOOKUP)], prompt=9, ttft_s=0.1, decode_s=2.0)
    total = RowStats.summed([root, child])
    assert total.steps == 3 and total.accept_hist == [0, 1, 1, 0, 1]
    assert total.emitted_by_steps == 10 and total.accepted_drafts == 7
    assert total.by_source[DRAFTER] == 2 and total.by_source[LOOKUP] == 5
    assert total.generated == 10 and total.packed == 9 and total.drafted == 9
    assert (total.prompt_tokens, total.ttft_s, total.queued_s) == (5, 0.5, 0.2)
    assert total.decode_s == 2.0


def test_a_calls_stats_agree_with_its_steps():
    """``DecodeStats``' accepted drafts, their per-source split and the accept histogram are
    one count read three ways."""
    model = near_bigram_model(3, attn_scale=0.005, vocab=16, hidden=32, layers=1)
    prompts = [[1, 4, 5, 6, 7, 4, 5, 6], [2, 3, 2, 3, 2, 3]]
    out, stats = run_decode(
        model, None, prompts, max_tokens=24, shape=BeamShape.lookup_only(1, 6), adapt=False
    )
    hist = stats["accept_hist"]
    row_steps = sum(hist)
    emitted = sum((i + 1) * n for i, n in enumerate(hist))
    assert stats["source_tokens"][SOURCE_NAMES[LOOKUP]] > 0
    assert stats["accepted_tokens"] == emitted - row_steps == sum(stats["source_tokens"].values())
    assert stats["tokens_per_step"] == emitted / row_steps
    assert stats["generation_tokens"] == sum(len(o) for o in out)


def test_a_source_registered_after_a_row_began_is_counted():
    """A row's counters are made with the names registered then; a step of a source
    registered since counts in its own column (record and summed pad by name)."""
    from redrafter_mlx.engine.drafting.sources import register_source

    early = RowStats(4)
    late_id = register_source("late_test_source")
    try:
        early.record(3, by_source(late_id, 2), 3, BeamShape.parse("D1xL4"))
        assert early.by_source[late_id] == 2
        assert early.to_dict()["accepted_from_late_test_source"] == 2
        assert RowStats.summed([early, RowStats(4)]).by_source[late_id] == 2
    finally:
        del SOURCE_NAMES[late_id:]  # the registry is the process's: leave it as it was
