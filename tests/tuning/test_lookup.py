"""Context lookup in the tuner: the grid's lookup variants, profiles that keep them, and
``tune --lookup / --lookup-length / --no-lookup`` on a fake chip (with and without drafter)."""

from __future__ import annotations

import io
import json

import pytest

import redrafter_mlx.cli.tune
from redrafter_mlx.engine.core.shape import AR, BeamShape
from tests.support.fakes import FakeClock
from tests.support.tuning import LookupChip, invoke
from tuning import ShapeChoice, resolve_beam_shape, tuned_choice
from tuning.defaults import cap_length
from tuning.grid import build_grid, parse_lookup, parse_lookup_lengths, with_lookup
from tuning.profiles import Profile, ProfileKey, ProfileStore
from tuning.search import AUTO_BUDGET_S, successive_halving

K1L8 = BeamShape.lookup_only(1, 8)


@pytest.fixture()
def drafter_dir(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text('{"predict_tokens": 4}')
    return str(drafter)


def fake_engine(monkeypatch, **chip_kwargs) -> LookupChip:
    """Measure with a LookupChip instead of the engine; records the drafter it was given."""
    clock = FakeClock()
    chip = LookupChip(clock, per_token=0.004, **chip_kwargs)
    chip.loaded = []

    def build(model, drafter, *_args, **_kwargs):
        chip.loaded.append(drafter)
        return chip, clock

    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", build)
    return chip


# --------------------------------------------------------------------------- the grid


def test_flags_parse_to_chain_sets():
    assert parse_lookup(None, "1") == [1]
    assert parse_lookup("1-3", "1") == [1, 2, 3]
    assert parse_lookup("0", "1") == [] and parse_lookup("off", "1") == []
    assert parse_lookup_lengths(None, "8") == [8]
    assert parse_lookup_lengths("4,8", "8") == [4, 8]
    with pytest.raises(ValueError, match="--lookup-length.*>= 2"):
        parse_lookup_lengths("1,4", "8")
    with pytest.raises(ValueError, match="--lookup"):
        parse_lookup("x", "1")


def test_default_grid_adds_the_chain_to_every_drafter_shape_and_alone():
    from redrafter_mlx.cli.tune import grid_for, lookup_grid

    chains, lengths = lookup_grid(None, None, False, has_drafter=True)
    assert (chains, lengths) == ([1], [8])
    shapes, _ = grid_for("1-4", "2-6", None, "drafter", False, BeamShape(1, 4), chains, lengths)
    plain = build_grid([1, 2, 3, 4], [2, 3, 4, 5, 6], [None])
    with_chain = [BeamShape(s.width, s.length, None, 1, 8) for s in plain]
    assert len(shapes) == 41 == len(set(shapes))
    assert set(shapes) == {*plain, *with_chain, K1L8}
    # the chip's preset and its lookup variant come first: measured even on a tiny budget
    assert [s.label for s in shapes[:3]] == ["W1×L4", "W1×L4+K1×L8", "K1×L8"]
    for shape in shapes:
        shape.validate()


def test_no_lookup_gives_the_old_grid():
    from redrafter_mlx.cli.tune import grid_for, lookup_grid

    for args in ((None, None, True), ("0", None, False)):
        chains, lengths = lookup_grid(*args, has_drafter=True)
        assert (chains, lengths) == ([], [])
        shapes, _ = grid_for("1-3", "2-4", "5", "drafter", False, None, chains, lengths)
        assert shapes == build_grid([1, 2, 3], [2, 3, 4], [None, 5])


def test_chain_sets_and_capacities():
    shapes = with_lookup(build_grid([3], [4], [None, 6]), [1, 2], [4, 8])
    labels = [s.label for s in shapes]
    assert labels[:4] == ["K1×L4", "K1×L8", "K2×L4", "K2×L8"]
    # a capped drafter shape keeps its C slots and adds the chains' own, as chat does
    assert "W3×L4 C6" in labels and "W3×L4+K2×L8 C20" in labels and "W3×L4+K1×L4 C9" in labels
    assert len(shapes) == 4 + 2 * (1 + 4)
    assert with_lookup(build_grid([2], [3], [None]), [], []) == [BeamShape(2, 3)]


def test_without_a_drafter_the_grid_is_lookup_alone():
    from redrafter_mlx.cli.tune import grid_for, lookup_grid

    chains, lengths = lookup_grid(None, None, False, has_drafter=False)
    shapes, note = grid_for("1-4", "2-6", None, None, False, None, chains, lengths)
    assert [s.label for s in shapes] == ["K1×L4", "K1×L8", "K2×L4", "K2×L8"]
    assert note == ""
    chains, lengths = lookup_grid("3", "6", False, has_drafter=False)
    shapes, _ = grid_for("1-4", "2-6", None, None, False, None, chains, lengths)
    assert shapes == [BeamShape.lookup_only(3, 6)]


def test_automatic_budget_stays_in_bounds_with_the_lookup_grid():
    """41 shapes on a slow CPU model: the budget grows with the grid but stays capped."""
    from redrafter_mlx.cli.tune import grid_for

    grid, _ = grid_for("1-4", "2-6", None, "d", False, BeamShape(1, 4), [1], [8])
    slow = dict(base_step=0.07, per_token=0.015, warmup_overhead=3.0, accept=0.35)
    for kwargs in (slow, dict(per_token=0.004)):
        clock = FakeClock()
        chip = LookupChip(clock, lookup_accept=0.5, **kwargs)
        result = successive_halving(chip, grid, None, clock=clock)
        assert AUTO_BUDGET_S[0] <= result.budget_s <= AUTO_BUDGET_S[1]
        assert result.elapsed_s <= result.budget_s
        assert result.autoregressive.last_round == 2  # the search reached its finals
        assert chip.tokens_per_s(result.recommended) >= 0.95 * chip.tokens_per_s(chip.best(grid))


# --------------------------------------------------------------------------- profiles


def _profile(key: ProfileKey, shape: BeamShape, lookup_searched=True) -> Profile:
    return Profile(key, shape, True, 1.4, 30.0, "2026-11-22T10:00:00+00:00", {}, lookup_searched)


@pytest.mark.parametrize(
    "shape",
    [
        BeamShape(2, 4, None, 1, 8),
        BeamShape(3, 4, 20, 2, 8),
        K1L8,
        BeamShape.lookup_only(2, 4),
        BeamShape(2, 5),
    ],
)
def test_profile_round_trips_lookup_shapes(home, model_dir, drafter_dir, shape):
    store = ProfileStore()
    key = ProfileKey.build("cpu-x", model_dir, drafter_dir, "float32")
    store.put(_profile(key, shape))
    loaded = ProfileStore().get(key)
    assert loaded.shape == shape and loaded.shape.label == shape.label
    assert loaded.lookup_searched


def test_old_profile_without_lookup_loads_as_no_lookup(home, model_dir, drafter_dir):
    key = ProfileKey.build("cpu-x", model_dir, drafter_dir, "float32")
    record = _profile(key, BeamShape(2, 5)).to_json()
    del record["lookup_searched"]
    assert set(record["shape"]) == {"width", "length", "capacity"}
    home.mkdir(parents=True)
    (home / "profiles.json").write_text(json.dumps({"format": 1, "profiles": {key.text: record}}))
    loaded = ProfileStore().get(key)
    assert loaded.shape == BeamShape(2, 5) and loaded.shape.lookup == 0
    assert not loaded.lookup_searched
    choice = resolve_beam_shape(model_dir, drafter_dir, "float32", chip="cpu-x")
    assert choice.shape == BeamShape(2, 5) and not choice.lookup_tuned


def test_profile_without_drafter_is_found(home, model_dir, drafter_dir):
    store = ProfileStore()
    key = ProfileKey.build("cpu-x", model_dir, None, "float32")
    assert key.drafter == "none"
    store.put(_profile(key, BeamShape.lookup_only(2, 4)))
    choice = tuned_choice(model_dir, None, "float32", chip="cpu-x")
    assert choice.shape == BeamShape.lookup_only(2, 4) and choice.lookup_tuned
    assert resolve_beam_shape(model_dir, None, "float32", chip="cpu-x").shape == choice.shape
    assert tuned_choice(model_dir, drafter_dir, "float32", chip="cpu-x") is None  # another key


def test_length_cap_keeps_the_chains():
    choice = ShapeChoice(BeamShape(2, 7, None, 1, 8), "tuned", True)
    capped = cap_length(choice, 4)
    assert capped.shape == BeamShape(2, 5, None, 1, 8) and capped.lookup_tuned
    assert cap_length(ShapeChoice(K1L8, "tuned"), 2).shape == K1L8  # no drafter beam to cap
    too_big = cap_length(ShapeChoice(BeamShape(2, 7, 19, 1, 8), "tuned"), 3)
    assert too_big.shape == BeamShape(2, 4, None, 1, 8)  # C19 > the shorter tree's 14 slots


# --------------------------------------------------------------------------- tune


def test_tune_picks_lookup_where_the_text_repeats(
    cli_app, home, model_dir, drafter_dir, monkeypatch
):
    chip = fake_engine(monkeypatch, accept=0.5, lookup_accept=0.85)
    result = invoke(cli_app, "--model", model_dir, "--drafter", drafter_dir, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["lookup"] == {"chains": [1], "lengths": [8]}
    labels = {row["label"] for row in data["shapes"]}
    assert {"AR", "K1×L8", "W1×L4", "W1×L4+K1×L8", "W4×L5+K1×L8"} <= labels
    grid = [BeamShape.parse(label) for label in labels - {"AR"}]
    best = chip.best(grid)
    assert best.lookup  # the fake chip makes lookup pay
    recommended = BeamShape.parse(data["recommended"]["label"])
    assert recommended.lookup and data["speculation_wins"]
    assert chip.tokens_per_s(recommended) >= 0.97 * chip.tokens_per_s(best)
    choice = resolve_beam_shape(model_dir, drafter_dir, None)
    assert choice.shape == recommended and choice.lookup_tuned


def test_tune_without_lookup_keeps_the_drafter_grid(
    cli_app, home, model_dir, drafter_dir, monkeypatch
):
    fake_engine(monkeypatch, lookup_accept=0.85)
    args = ("--model", model_dir, "--drafter", drafter_dir, "--widths", "1-2", "--lengths", "2-4")
    result = invoke(cli_app, *args, "--no-lookup", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["lookup"] is None
    labels = [row["label"] for row in data["shapes"]]
    assert sorted(labels) == sorted(
        ["AR", *(s.label for s in build_grid([1, 2], [2, 3, 4], [None]))]
    )
    choice = resolve_beam_shape(model_dir, drafter_dir, None)
    assert not choice.shape.lookup and not choice.lookup_tuned
    contradiction = invoke(cli_app, *args, "--no-lookup", "--lookup", "2")
    assert contradiction.exit_code == 2 and "--no-lookup" in contradiction.stderr


def test_tune_chain_sets_from_the_flags(cli_app, home, model_dir, drafter_dir, monkeypatch):
    fake_engine(monkeypatch, lookup_accept=0.5)
    args = ("--model", model_dir, "--drafter", drafter_dir, "--widths", "2", "--lengths", "3")
    result = invoke(cli_app, *args, "--lookup", "1-2", "--lookup-length", "4,6", "--json")
    assert result.exit_code == 0, result.output
    labels = {row["label"] for row in json.loads(result.stdout)["shapes"]}
    chains = {f"K{k}×L{n}" for k in (1, 2) for n in (4, 6)}
    assert labels == {"AR", "W2×L3", *chains, *(f"W2×L3+{c}" for c in chains)}
    bad = invoke(cli_app, *args, "--lookup-length", "1")
    assert bad.exit_code == 1 and "--lookup-length" in bad.stderr


@pytest.mark.parametrize("lookup_accept", [0.85, 0.0])
def test_tune_without_a_drafter_searches_lookup_alone(
    cli_app, home, model_dir, monkeypatch, lookup_accept
):
    """A model without a drafter: the lookup-only shapes against plain decoding; where the
    text never repeats, plain decoding wins and is saved as the profile."""
    chip = fake_engine(monkeypatch, lookup_accept=lookup_accept)
    result = invoke(cli_app, "--model", model_dir, "--json")
    assert result.exit_code == 0, result.output
    assert chip.loaded == [None]
    data = json.loads(result.stdout)
    assert data["drafter"] is None
    labels = [row["label"] for row in data["shapes"]]
    assert labels == ["AR", "K1×L4", "K1×L8", "K2×L4", "K2×L8"]
    grid = [BeamShape.parse(label) for label in labels[1:]]
    choice = tuned_choice(model_dir, None, None)
    assert choice is not None and choice.lookup_tuned
    if lookup_accept:
        best = chip.best(grid)
        assert chip.tokens_per_s(choice.shape) >= 0.97 * chip.tokens_per_s(best)
        assert not choice.shape.drafts and choice.shape.lookup
    else:
        assert choice.shape == AR and data["recommended"]["label"] == "AR"
    text = invoke(cli_app, "--model", model_dir)  # a table, and no W x L heatmap
    assert text.exit_code == 0, text.output
    assert "K1×L8" in text.stdout and "L \\ W" not in text.stdout
    shown = invoke(cli_app, "--show")
    assert "none" in shown.stdout


def test_tune_without_a_drafter_and_no_lookup_is_refused(cli_app, home, model_dir, monkeypatch):
    fake_engine(monkeypatch)
    result = invoke(cli_app, "--model", model_dir, "--no-lookup")
    assert result.exit_code == 1
    assert "no drafter" in result.stderr and "--no-lookup" in result.stderr
    plot = invoke(cli_app, "--model", model_dir, "--plot", "x.png")
    assert plot.exit_code != 0 and ("heatmap" in plot.stderr or "matplotlib" in plot.stderr)


def test_heatmap_shows_the_best_variant_per_cell():
    from rich.console import Console

    from tuning.render import has_heatmap, heatmap_cells, heatmap_table, results_table

    clock = FakeClock()
    chip = LookupChip(clock, per_token=0.004, lookup_accept=0.8)
    grid = with_lookup(build_grid([1, 2], [2, 3], [None]), [1], [8])
    result = successive_halving(chip, grid, 60.0, clock=clock)
    cells = heatmap_cells(result)
    assert set(cells) == {(w, n) for w in (1, 2) for n in (2, 3)}  # no cell for K1×L8
    assert any(r.shape.lookup for r in cells.values())
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(heatmap_table(result))
    console.print(results_table(result))
    text = console.export_text()
    assert "+K1×L8" in text and "K1×L8" in text and "W=0" not in text and "L=1" not in text
    lookup_alone = successive_halving(chip, [K1L8], 10.0, clock=clock)
    assert not has_heatmap(lookup_alone) and has_heatmap(result)


def test_real_engine_measures_lookup_shapes_without_a_drafter():
    """The search drives the real engine (tiny random Llama, no drafter) over lookup-only
    shapes and a drafter shape with chains: real figures, no failure."""
    from types import SimpleNamespace

    from tests.support.models import tiny_drafter, tiny_model
    from tuning.measure import EngineMeasure
    from tuning.search import SearchPlan

    model = tiny_model()
    tokenizer = SimpleNamespace(eos_token_ids=set(), decode=lambda ids: " ".join(map(str, ids)))
    prompts = [[1, 5, 7, 9, 1, 5, 7], [1, 3, 1, 3, 1]]
    plan = SearchPlan(warmup_tokens=4, min_tokens=8, short_tokens=8, long_tokens=16)
    for drafter, shapes in (
        (None, [K1L8, BeamShape.lookup_only(2, 4)]),
        (tiny_drafter(model), [BeamShape(1, 3, None, 1, 4), K1L8]),
    ):
        measure = EngineMeasure(model, drafter, tokenizer, prompts)
        result = successive_halving(measure, shapes, 2.0, plan=plan)
        assert all(r.error is None for r in result.results)
        measured = [r for r in result.results if r.measured]
        assert measured and all(min(r.tokens_per_step) >= 1.0 for r in measured)
        assert result.recommended in {AR, *(r.shape for r in measured)}
