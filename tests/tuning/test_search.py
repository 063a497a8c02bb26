"""The grid and the budgeted successive-halving search, on a deterministic fake cost model."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.core.shape import BeamShape
from tests.support.fakes import FakeChip, FakeClock
from tuning.grid import (
    build_grid,
    limit_lengths,
    parse_capacities,
    parse_int_set,
    read_predict_tokens,
)
from tuning.search import AUTO_BUDGET_S, Measurement, SearchPlan, Spread, successive_halving

GRID = build_grid([1, 2, 3, 4], [2, 3, 4, 5, 6], [None])
AR = BeamShape.autoregressive()


# --------------------------------------------------------------------------- grid


def test_parse_int_set_ranges_and_lists():
    assert parse_int_set("1-4", "--widths") == [1, 2, 3, 4]
    assert parse_int_set("2,4, 8", "--widths") == [2, 4, 8]
    assert parse_int_set("1-3,6,2", "--widths") == [1, 2, 3, 6]
    for bad in ("", "a", "4-1", "0-2", "1..3"):
        with pytest.raises(ValueError, match="--widths"):
            parse_int_set(bad, "--widths")


def test_capacities_always_include_no_cap():
    assert parse_capacities(None) == [None]
    assert parse_capacities("none") == [None]
    assert parse_capacities("8,12") == [None, 8, 12]


def test_grid_keeps_only_binding_capacities():
    shapes = build_grid([1, 3], [1, 4], [None, 4, 8, 20])
    labels = [s.label for s in shapes]
    # L=1 never appears; W1×L4 packs at most 4 so no cap binds; W3×L4 packs at most 10.
    assert labels == ["W1×L4", "W3×L4", "W3×L4 C4", "W3×L4 C8"]


def test_lengths_limited_by_trained_predict_tokens(tmp_path):
    (tmp_path / "config.json").write_text('{"predict_tokens": 4, "hidden_size": 8}')
    predict = read_predict_tokens(tmp_path)
    assert predict == 4
    assert limit_lengths([2, 3, 4, 5, 6, 7], predict) == ([2, 3, 4, 5], [6, 7])
    assert limit_lengths([2, 6], predict, force=True) == ([2, 6], [])
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert read_predict_tokens(tmp_path) is None
    assert limit_lengths([2, 9], None) == ([2, 9], [])
    assert read_predict_tokens(tmp_path / "missing") is None


def test_spread_median_quartiles_range():
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.q1, s.q3, s.low, s.high, s.n) == (3.0, 2.0, 4.0, 1.0, 5.0, 5)
    one = Spread.of([7.0])
    assert one.q1 == one.q3 == 7.0
    with pytest.raises(ValueError):
        Spread.of([])


# --------------------------------------------------------------------------- search


def _search(budget=60.0, **chip_kwargs):
    clock = FakeClock()
    chip = FakeChip(clock, **chip_kwargs)
    result = successive_halving(chip, GRID, budget, clock=clock)
    return chip, clock, result


def test_finds_the_optimum():
    chip, _, result = _search(per_token=0.004)
    truth = chip.best(GRID)
    assert result.speculation_wins
    assert result.recommended == truth == result.best.shape
    true_speedup = chip.tokens_per_s(truth) / chip.tokens_per_s(AR)
    assert result.speedup(result.best).median == pytest.approx(true_speedup, rel=0.03)


def test_optimum_moves_with_the_chip():
    """A chip with cheap verification wants wider/longer beams than one with costly tokens."""
    _, _, cheap = _search(per_token=0.0003, knee=10**6)
    _, _, costly = _search(per_token=0.004)
    assert cheap.recommended.width * cheap.recommended.length > (
        costly.recommended.width * costly.recommended.length
    )


def test_prunes_losers():
    chip, _, result = _search(per_token=0.004)
    finalists = {r.shape for r in result.results if r.last_round == 2}
    dropped_first = {r.shape for r in result.results if r.last_round == 0}
    assert 1 <= len(finalists) <= SearchPlan().finalists
    assert len(dropped_first) >= len(GRID) // 2
    most_loser_calls = max(chip.calls[s] for s in dropped_first)
    assert all(chip.calls[s] > most_loser_calls for s in finalists)
    assert max(chip.tokens[s] for s in dropped_first) < min(chip.tokens[s] for s in finalists)
    # the baseline is measured in every round, alongside the shapes
    assert result.autoregressive.last_round == 2


@pytest.mark.parametrize("budget", [3.0, 12.0, 30.0, 60.0, 240.0])
def test_respects_the_budget(budget):
    _, clock, result = _search(budget=budget, per_token=0.004)
    assert result.elapsed_s == clock.now - 1000.0
    assert result.elapsed_s <= budget
    assert result.budget_s == budget


def test_small_budget_measures_fewer_shapes_and_leaves_the_rest():
    chip_small, _, small = _search(budget=12.0, per_token=0.004)
    chip_big, _, big = _search(budget=240.0, per_token=0.004)
    assert sum(chip_small.calls.values()) < sum(chip_big.calls.values())
    assert small.skipped and not big.skipped
    assert all(not r.measured for r in small.results if r.shape in small.skipped)


def test_automatic_budget_fits_all_three_rounds_on_a_slow_model():
    """A real model on a CPU (70 ms AR steps, 3 s compiles, 35% acceptance): 120 s only
    covers one short run per shape; the automatic budget, sized from the baseline, reaches
    the finals."""
    slow = dict(base_step=0.07, per_token=0.015, warmup_overhead=3.0, accept=0.35)
    _, _, fixed = _search(budget=120.0, **slow)
    assert fixed.autoregressive.last_round < 2
    chip, _, auto = _search(budget=None, **slow)
    assert 120.0 < auto.budget_s <= AUTO_BUDGET_S[1]
    assert auto.elapsed_s <= auto.budget_s
    assert not auto.skipped and auto.autoregressive.last_round == 2
    assert auto.recommended == chip.best(GRID)


def test_automatic_budget_stays_at_its_floor_for_a_fast_model():
    _, _, result = _search(budget=None, per_token=0.004)
    assert result.budget_s == AUTO_BUDGET_S[0]
    assert result.autoregressive.last_round == 2


def test_tiny_budget_still_measures_baseline_and_recommends_plain_decoding():
    _, _, result = _search(budget=0.5)
    assert result.autoregressive.measured
    assert not result.speculation_wins
    assert result.recommended == AR
    assert "budget" in result.reason


def test_refuses_shapes_slower_than_autoregressive():
    """A drafter whose guesses are nearly always rejected: speculation only costs time."""
    _, _, result = _search(accept=0.02, per_token=0.004)
    assert result.best is not None
    assert result.speedup(result.best).median < 1.0
    assert not result.speculation_wins
    assert result.recommended == AR and result.recommended.label == "AR"
    assert "does not pay" in result.reason


class WithinNoise:
    """Every shape 2% faster than AR on average, with +-15% noise per sample."""

    def __init__(self, clock):
        import random

        self.clock = clock
        self.rng = random.Random(1)

    def __call__(self, shape, n_tokens):
        true = 100.0 if shape.is_autoregressive else 102.0
        self.clock.advance(n_tokens / true)
        return Measurement(tuple(true * (1 + self.rng.uniform(-0.15, 0.15)) for _ in range(4)))


def test_a_gain_within_the_noise_is_not_recommended():
    clock = FakeClock()
    result = successive_halving(
        WithinNoise(clock), GRID[:6], 30.0, clock=clock, plan=SearchPlan(min_speedup=1.0)
    )
    assert not result.speculation_wins
    assert result.recommended == AR
    assert "noise" in result.reason


def test_a_failing_shape_is_reported_not_fatal():
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    broken = BeamShape(4, 6)

    def measure(shape, n_tokens):
        if shape == broken:
            raise MemoryError("out of memory")
        return chip(shape, n_tokens)

    result = successive_halving(measure, GRID, 60.0, clock=clock)
    failed = [r for r in result.results if r.error]
    assert [r.shape for r in failed] == [broken]
    assert "out of memory" in failed[0].error
    assert result.speculation_wins and result.recommended == chip.best(GRID)


def test_shapes_are_tried_in_the_given_order():
    """The CLI puts the chip's preset first so it is measured even on a tiny budget."""
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    order = [BeamShape(3, 6), *[s for s in GRID if s != BeamShape(3, 6)]]
    result = successive_halving(chip, order, 3.0, clock=clock)
    measured = [r.shape for r in result.results if r.measured]
    assert measured and measured[0] == BeamShape(3, 6)


def test_result_to_dict_has_spreads_for_every_measured_shape():
    _, _, result = _search(per_token=0.004)
    data = result.to_dict()
    assert data["recommended"]["label"] == result.recommended.label
    rows = {row["label"]: row for row in data["shapes"]}
    assert rows["AR"]["speedup"]["median"] == pytest.approx(1.0)
    for row in rows.values():
        assert {"median", "q1", "q3", "min", "max", "n"} <= set(row["tokens_per_s"])


def test_a_failing_baseline_stops_with_a_clear_error():
    from tuning.search import SearchError

    clock = FakeClock()

    def measure(shape, n_tokens):
        raise RuntimeError("model weights missing")

    with pytest.raises(SearchError, match="baseline.*model weights missing"):
        successive_halving(measure, GRID, 10.0, clock=clock)


def _result(shape, per_prompt_tps, calls=3):
    from tuning.search import ShapeResult

    r = ShapeResult(shape)
    for _ in range(calls):
        r.samples.extend((0, 128, t) for t in per_prompt_tps)
    r.prompts = len(per_prompt_tps)
    return r


def test_decision_pairs_prompts_that_differ_in_difficulty():
    """Faster on every prompt wins even when prompts differ more than the shapes do."""
    from redrafter_mlx.engine.core.shape import BeamShape
    from tuning.search import SearchPlan, _decide, paired_ratios

    ar = _result(BeamShape.autoregressive(), [100.0, 200.0, 300.0, 400.0])
    spec = _result(BeamShape(2, 4), [125.0, 250.0, 375.0, 500.0])
    assert paired_ratios(ar, spec, 128) == [1.25] * 4
    wins, reason = _decide(ar, spec, SearchPlan())
    assert wins, reason


def test_decision_refuses_a_shape_slower_on_some_prompts():
    from redrafter_mlx.engine.core.shape import BeamShape
    from tuning.search import SearchPlan, _decide

    ar = _result(BeamShape.autoregressive(), [100.0, 200.0, 300.0, 400.0])
    spec = _result(BeamShape(2, 4), [60.0, 150.0, 420.0, 560.0])
    wins, reason = _decide(ar, spec, SearchPlan())
    assert not wins and "slower on some prompts" in reason
