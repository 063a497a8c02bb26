"""`redrafter-mlx tune` through typer's CliRunner, output rendering, and the engine wiring."""

from __future__ import annotations

import importlib.util
import io
import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import redrafter_mlx.cli.tune
from redrafter_mlx.engine.base.prompts import PromptSetError, load_prompts, parse_prompts
from redrafter_mlx.engine.core.sampling import SamplerConfig
from redrafter_mlx.engine.core.shape import BeamShape
from tests.support.fakes import FakeChip, FakeClock
from tuning import resolve_beam_shape
from tuning.grid import build_grid
from tuning.measure import EngineMeasure, TuneError
from tuning.search import successive_halving


def invoke(app, *args):
    """Run ``redrafter-mlx tune ARGS`` (typer drops the command name when it is the only one)."""
    prefix = ["tune"] if len(app.registered_commands) > 1 else []
    return CliRunner().invoke(app, [*prefix, *args], env={"COLUMNS": "200"})


@pytest.fixture()
def pair(tmp_path):
    model, drafter = tmp_path / "model", tmp_path / "drafter"
    model.mkdir()
    drafter.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (drafter / "config.json").write_text('{"predict_tokens": 4}')
    return str(model), str(drafter)


@pytest.fixture()
def fake_engine(monkeypatch):
    """Replace the engine-backed measure function with the fake cost model."""
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (chip, clock))
    return chip


# --------------------------------------------------------------------------- presets


def test_preset_json(app, home):
    result = invoke(app, "--chip", "m2", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert (data["preset"], data["width"], data["length"], data["capacity"]) == ("m2", 2, 5, None)
    assert data["source"] == "preset for m2"
    assert "paper" in data["note"]


def test_preset_text_and_drafter_cap(app, home, pair):
    result = invoke(app, "--chip", "m1-max", "--drafter", pair[1])
    assert result.exit_code == 0, result.output
    assert "W1×L5" in result.output and "preset for m1-max" in result.output
    capped = json.loads(invoke(app, "--chip", "m2", "--drafter", pair[1], "--json").stdout)
    assert capped["length"] == 5  # predict_tokens 4 -> max length 5: no cap needed
    forced = invoke(app, "--chip", "m2-ultra", "--json", "--force-lengths").stdout
    assert json.loads(forced)["length"] == 4


def test_unknown_chip_is_a_usage_error(app, home):
    result = invoke(app, "--chip", "m9-mega")
    assert result.exit_code == 2
    assert "m9-mega" in result.output and "m2-max" in result.output


# --------------------------------------------------------------------------- show / clear


def test_show_and_clear(app, home, pair, fake_engine):
    empty = invoke(app, "--show")
    assert empty.exit_code == 0 and "No tuned profiles" in empty.output
    tuned = invoke(app, "--model", pair[0], "--drafter", pair[1], "--budget-seconds", "120")
    assert tuned.exit_code == 0, tuned.output
    shown = invoke(app, "--show")
    assert shown.exit_code == 0
    assert "model" in shown.output and "drafter" in shown.output
    listed = json.loads(invoke(app, "--show", "--json").stdout)
    assert len(listed["profiles"]) == 1
    cleared = invoke(app, "--clear")
    assert cleared.exit_code == 0 and "Removed 1" in cleared.output
    assert json.loads(invoke(app, "--show", "--json").stdout)["profiles"] == []


def test_show_with_corrupt_file_warns_and_continues(app, home):
    home.mkdir(parents=True)
    (home / "profiles.json").write_text("{oops")
    result = invoke(app, "--show")
    assert result.exit_code == 0
    assert "corrupt" in result.stderr and "No tuned profiles" in result.stdout


# --------------------------------------------------------------------------- tuning


def test_tune_measures_saves_and_becomes_the_default(app, home, pair, fake_engine):
    result = invoke(
        app,
        "--model",
        pair[0],
        "--drafter",
        pair[1],
        "--budget-seconds",
        "60",
        "--widths",
        "1-4",
        "--lengths",
        "2-6",
    )
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "L \\ W" in out and "W=4" in out and "L=5" in out  # the heatmap
    assert "recommended:" in out and "speedup" in out
    # lengths above predict_tokens + 1 = 5 were skipped, with the reason
    assert "lengths [6] skipped" in out and "L=6" not in out
    best = fake_engine.best(build_grid([1, 2, 3, 4], [2, 3, 4, 5], [None]))
    choice = resolve_beam_shape(pair[0], pair[1], None)
    assert choice.shape == best
    assert choice.source.startswith("tuned profile for ")


def test_tune_json_output(app, home, pair, fake_engine):
    result = invoke(
        app,
        "--model",
        pair[0],
        "--drafter",
        pair[1],
        "--json",
        "--capacities",
        "6",
        "--widths",
        "2-3",
        "--lengths",
        "3-4",
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["mode"] == "tuned" and data["chip"]["chip_id"]
    labels = {row["label"] for row in data["shapes"]}
    assert {"AR", "W2×L4", "W3×L4", "W3×L4 C6", "W2×L4 C6"} <= labels
    assert data["recommended"]["label"] in labels


def test_tune_errors_are_clear(app, home, pair):
    no_drafter = invoke(app, "--model", pair[0], "--no-lookup")  # nothing to speculate with
    assert no_drafter.exit_code == 1 and "--drafter" in no_drafter.stderr
    bad_widths = invoke(app, "--model", pair[0], "--drafter", pair[1], "--widths", "x")
    assert bad_widths.exit_code == 1 and "--widths" in bad_widths.stderr
    too_long = invoke(app, "--model", pair[0], "--drafter", pair[1], "--lengths", "7-9")
    assert too_long.exit_code == 1 and "--force-lengths" in too_long.stderr


def test_tune_engine_failure_points_at_presets(app, home, pair, monkeypatch):
    def broken(*_args, **_kwargs):
        raise TuneError("cannot measure: the engine is not installed")

    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", broken)
    result = invoke(app, "--model", pair[0], "--drafter", pair[1])
    assert result.exit_code == 1
    assert "engine is not installed" in result.stderr and "--chip" in result.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is not None,
    reason="matplotlib (the optional plot extra) is installed",
)
def test_plot_without_matplotlib_says_how_to_install(app, home, pair, fake_engine):
    result = invoke(app, "--model", pair[0], "--drafter", pair[1], "--plot", "out.png")
    assert result.exit_code == 1 and "redrafter-mlx[plot]" in result.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib (the optional plot extra) is not installed",
)
def test_plot_writes_png(app, home, pair, fake_engine, tmp_path):
    png = tmp_path / "heat.png"
    result = invoke(app, "--model", pair[0], "--drafter", pair[1], "--plot", str(png))
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------- rendering


def test_heatmap_rendering_marks_the_best_cell():
    from rich.console import Console

    from tuning.render import heatmap_cells, heatmap_table, results_table

    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    grid = build_grid([1, 2, 3], [2, 3, 4], [None, 5])
    result = successive_halving(chip, grid, 60.0, clock=clock)
    cells = heatmap_cells(result)
    assert set(cells) == {(w, n) for w in (1, 2, 3) for n in (2, 3, 4)}
    console = Console(record=True, width=140, color_system="truecolor", file=io.StringIO())
    console.print(heatmap_table(result))
    console.print(results_table(result))
    text = console.export_text(clear=False)
    assert text.count("★") == 2  # once in the heatmap, once in the table
    assert "×" in text and "W=3" in text and "L=4" in text
    assert "\x1b[" in console.export_text(styles=True)  # cells are colored


# --------------------------------------------------------------------------- prompts and engine


def test_prompt_files(tmp_path):
    jsonl = tmp_path / "q.jsonl"
    jsonl.write_text('{"turns": ["first?", "second?"]}\n{"prompt": "p2"}\n{"text": "p3"}\n')
    assert load_prompts(str(jsonl), 2) == ["first?", "p2"]
    txt = tmp_path / "q.txt"
    txt.write_text("one\n\ntwo\n")
    assert load_prompts(str(txt), 10) == ["one", "two"]
    with pytest.raises(PromptSetError, match="not a file"):
        load_prompts(str(tmp_path / "missing.jsonl"), 1)
    with pytest.raises(PromptSetError, match="no 'turns'"):
        parse_prompts('{"x": 1}', "bad.jsonl")
    with pytest.raises(TuneError, match="at least 1"):  # tune's check, before any loading
        redrafter_mlx.cli.tune.build_measure("model", "drafter", None, str(txt), 0)
    with pytest.raises(TuneError, match="--prompts: .*not a file"):
        redrafter_mlx.cli.tune.build_measure("model", "drafter", None, "missing.jsonl", 1)


def test_engine_measure_passes_shapes_and_reads_stats(monkeypatch):
    """EngineMeasure drives the engine's measurement: greedy, drafter=None for the AR shape."""
    import redrafter_mlx.measure.throughput as throughput

    calls = []

    def fake_measure(model, drafter, tokenizer, prompt, shape, max_tokens, **sampling):
        calls.append((drafter, prompt, max_tokens, shape, sampling))
        return throughput.Run([1] * 11, 10, 0.2, 4, 2.5, 7.0, 0.01, 0.0)

    monkeypatch.setattr(throughput, "measure_generation", fake_measure)
    tokenizer = SimpleNamespace(chat_prompt=lambda messages: [1, len(messages[0]["content"])])
    measure = EngineMeasure("model", "drafter", tokenizer, ["abc", "hello"])
    m = measure(BeamShape(2, 5, 7), 32)
    assert m.tokens_per_s == (50.0, 50.0) and m.tokens_per_step == (2.5, 2.5)
    assert m.mean_packed == 7.0
    drafter, prompt, max_tokens, shape, sampling = calls[0]
    assert (drafter, prompt, max_tokens) == ("drafter", [1, 3], 32)
    greedy = {"sampler": SamplerConfig(temperature=0.0), "draft_model": None}
    assert shape == BeamShape(2, 5, 7) and sampling == greedy
    measure(BeamShape.autoregressive(), 16)
    assert calls[-1][0] is None and calls[-1][4] == greedy
    measure(BeamShape.lookup_only(1, 8), 16)  # no drafter beam: the drafter is not run
    assert calls[-1][0] is None and calls[-1][3] == BeamShape.lookup_only(1, 8)
    measure(BeamShape(1, 4, None, 1, 8), 16)
    assert calls[-1][0] == "drafter"


def test_no_model_and_no_demo_drafter_is_explained(app, home, monkeypatch, tmp_path):
    import redrafter_mlx.engine.base.bundled

    base = tmp_path / "demo_base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    monkeypatch.setattr(redrafter_mlx.engine.base.bundled, "demo_paths", lambda: (base, None))
    result = invoke(app, "--no-lookup")  # without --no-lookup: tuned for lookup alone
    assert result.exit_code == 1
    assert "no drafter" in result.stderr and "--model DIR --drafter DIR" in result.stderr
    monkeypatch.setattr(
        redrafter_mlx.engine.base.bundled, "demo_paths", lambda: (tmp_path / "nothing", None)
    )
    missing = invoke(app)
    assert missing.exit_code == 1 and "make demo-model" in missing.stderr


def test_real_engine_end_to_end_on_a_tiny_random_model():
    """The search drives the real engine (tiny random Llama + drafter, a 2-second budget).

    Nothing about speed is asserted: only that every figure is real and the outcome coherent.
    """
    from tests.support.models import tiny_drafter, tiny_model
    from tuning.search import SearchPlan

    model = tiny_model()
    tokenizer = SimpleNamespace(eos_token_ids=set(), decode=lambda ids: " ".join(map(str, ids)))
    measure = EngineMeasure(model, tiny_drafter(model), tokenizer, [[1, 5, 7, 9], [1, 3]])
    plan = SearchPlan(warmup_tokens=4, min_tokens=8, short_tokens=8, long_tokens=16)
    shapes = [BeamShape(2, 2), BeamShape(1, 3)]
    result = successive_halving(measure, shapes, 2.0, plan=plan)
    assert result.autoregressive.measured
    assert all(sample > 0 for _, _, sample in result.autoregressive.samples)  # real figures
    measured = [r for r in result.results if r.measured]
    assert all(r.error is None for r in result.results)
    assert all(min(r.tokens_per_step) >= 1.0 for r in measured)
    assert result.recommended in {BeamShape.autoregressive(), *(r.shape for r in measured)}
    json.dumps(result.to_dict())
