"""Guards that turn a wrong input into one clear line (issue 22): an unwritable ``convert
--out``, a base model given as ``--drafter``, an unknown ``--model`` name, a beam shape that
cannot fit in memory, and a ``tune`` that measured too little to save a profile."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.engine.loop.loading import LoadError, load_drafter
from tests.support.paths import CONVERT as FIXTURES


def invoke(app, *args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200"})


# --------------------------------------------------------------------------- convert --out


def test_convert_into_a_read_only_folder_names_it(app, tmp_path, monkeypatch):
    """A read-only file system (EROFS, even for root) is reported with the folder and a fix,
    not as a raw ``[Errno 30]``."""
    import redrafter_mlx.engine.base.output_dir as output_dir

    def read_only(prefix="", dir=None, **_):
        raise OSError(errno.EROFS, "Read-only file system", os.path.join(dir, prefix + "x"))

    monkeypatch.setattr(output_dir.tempfile, "mkdtemp", read_only)
    out = tmp_path / "ro" / "model"
    result = invoke(
        app, "convert", "--model", str(FIXTURES / "llama_bin_sharded"), "--out", str(out)
    )
    assert result.exit_code == 1
    assert "Errno" not in result.output
    assert f"cannot write to {out.parent}" in result.output
    assert "read-only file system" in result.output and "writable --out" in result.output
    assert not (tmp_path / "ro").exists()  # the parent it created is removed again


def test_convert_to_an_unwritable_parent_fails_before_converting(app, tmp_path, monkeypatch):
    import weights_convert.conversion as conversion

    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access
    monkeypatch.setattr(
        conversion.os, "access", lambda p, mode: Path(p) != locked and real_access(p, mode)
    )
    result = invoke(
        app,
        "convert",
        "--model",
        str(FIXTURES / "llama_bin_sharded"),
        "--out",
        str(locked / "a" / "b"),
    )
    assert result.exit_code == 1
    assert f"cannot write to {locked} (not writable)" in result.output
    assert f"chmod u+w {locked}" in result.output
    assert list(locked.iterdir()) == []


# --------------------------------------------------------------------------- --drafter MODEL


def test_a_model_folder_given_as_drafter_is_named_as_such():
    base, _ = demo_paths()
    with pytest.raises(LoadError) as e:
        load_drafter(base)
    message = str(e.value)
    assert "is a model, not a drafter" in message and "\n" not in message
    assert "embed_tokens" not in message  # not the 38 unexpected tensor names


def test_generate_with_a_model_as_drafter(app):
    base, _ = demo_paths()
    result = invoke(app, "generate", "--model", "demo", "--drafter", str(base), "--prompt", "x")
    assert result.exit_code == 1
    assert "is a model, not a drafter" in result.output


# --------------------------------------------------------------------------- --model NAME


def test_an_unknown_model_name_lists_the_bundled_ones(app, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(app, "generate", "--model", "llama99", "--prompt", "x")
    assert result.exit_code == 1
    assert "'llama99'" in result.output
    assert "smollm2" in result.output and "demo" in result.output


def test_a_missing_path_or_repo_id_is_not_called_a_name(tmp_path):
    from redrafter_mlx.engine.base.bundled import unknown_name_error

    assert unknown_name_error(str(tmp_path / "nope")) is None  # a path: "not found" elsewhere
    assert unknown_name_error("owner/model") is None  # a repo id: looked up on the Hub
    assert unknown_name_error("demo") is None
    (tmp_path / "here").mkdir()
    assert unknown_name_error(str(tmp_path / "here")) is None


# --------------------------------------------------------------------------- tune's profile


@pytest.fixture()
def tune_pair(tmp_path, monkeypatch):
    """A model and drafter folder for ``tune``, measured by the fake cost model."""
    import redrafter_mlx.cli.tune
    from tests.support.fakes import FakeChip, FakeClock

    model, drafter = tmp_path / "model", tmp_path / "drafter"
    model.mkdir()
    drafter.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (drafter / "config.json").write_text('{"predict_tokens": 4}')
    clock = FakeClock()
    chip = FakeChip(clock, per_token=0.004)
    monkeypatch.setattr(redrafter_mlx.cli.tune, "build_measure", lambda *a, **k: (chip, clock))
    return str(model), str(drafter)


def _tune(app, pair, budget: str, *more: str):
    return invoke(
        app, "tune", "--model", pair[0], "--drafter", pair[1], "--budget-seconds", budget, *more
    )


def test_a_one_second_tune_keeps_the_old_profile(app, tune_pair):
    from tuning import resolve_beam_shape
    from tuning.profiles import ProfileStore

    saved = _tune(app, tune_pair, "120")
    assert saved.exit_code == 0, saved.output
    assert "saved to" in saved.output
    store = ProfileStore().path
    before = store.read_bytes()
    choice = resolve_beam_shape(tune_pair[0], tune_pair[1], None)

    quick = _tune(app, tune_pair, "3")  # a few shapes once each, none repeated
    assert quick.exit_code == 1
    assert "no profile was saved" in quick.stderr and "too little was measured" in quick.stderr
    assert "ran 1 time(s)" in quick.stderr
    assert "earlier profile is unchanged" in quick.stderr and "--budget-seconds" in quick.stderr
    assert "saved to" not in quick.stdout
    assert store.read_bytes() == before
    assert resolve_beam_shape(tune_pair[0], tune_pair[1], None) == choice


def test_a_one_second_tune_saves_nothing_and_says_so_in_json(app, tune_pair):
    from tuning.profiles import ProfileStore

    quick = _tune(app, tune_pair, "1", "--json")  # not even one shape
    assert quick.exit_code == 1
    data = json.loads(quick.stdout)
    assert data["saved"] is False and data["profile_path"] is None
    assert "no speculative shape was measured" in quick.stderr
    assert not ProfileStore().path.exists()


def test_evidence_needs_repeated_runs_of_the_pick_and_the_baseline():
    from tests.support.fakes import FakeChip, FakeClock
    from tuning.grid import build_grid
    from tuning.search import MIN_COMPARED_RUNS, successive_halving

    grid = build_grid([1, 2, 3, 4], [2, 3, 4, 5], [None])
    for budget, enough in ((1.0, False), (12.0, False), (120.0, True)):
        clock = FakeClock()
        result = successive_halving(FakeChip(clock, per_token=0.004), grid, budget, clock=clock)
        gap = result.evidence_gap()
        assert (gap is None) == enough, (budget, gap)
        if enough:
            n = result.best.final_tokens
            assert result.best.runs_at(n) >= MIN_COMPARED_RUNS
            assert result.autoregressive.runs_at(n) >= MIN_COMPARED_RUNS


# --------------------------------------------------------------------------- beam-shape memory

GIB = 2**30


def _step_peak(model, drafter, shape, batch, sampler, prompt=40):
    """The peak memory one compiled step of ``shape`` adds (compiled and run once first), and
    the attention window it used."""

    import mlx.core as mx

    from redrafter_mlx.engine.decoding.cache import (
        Session,
        ensure_slots,
        prefill_session,
        step_window,
        text_history,
    )
    from redrafter_mlx.engine.decoding.decode import DecodeState
    from redrafter_mlx.engine.decoding.step import uniform_step
    from tests.support.models import step_added_peak

    rows = [[(7 * i + r) % model.vocab_size for i in range(prompt)] for r in range(batch)]
    session = Session(model, batch)
    hidden = prefill_session(session, session.reuse(rows))
    window = step_window(prompt, 1, shape.longest, shape.slots)
    history = text_history(rows, session.slots) if shape.lookup else None
    init = mx.full((batch,), 3, mx.int32)
    state = DecodeState(init, hidden, session.lengths, session.cache, history)
    state = ensure_slots(state, window)
    session.cache = None
    step = uniform_step(model, held_sources(drafter), shape, sampler, batch)
    return step_added_peak(step, state, window), window


@pytest.mark.parametrize(
    "label, batch, temperature",
    [
        ("W16xL8", 1, 0.0),
        ("W8xL6", 2, 0.0),
        ("W4xL4+K1xL8", 2, 0.8),
        ("K2xL8", 2, 0.0),
        ("W60xL3", 1, 0.0),  # past 50 beams: the drafter ranks every candidate
        ("W32xL16", 1, 0.8),
    ],
)
def test_the_estimate_bounds_the_measured_step(label, batch, temperature):
    """The transient estimate is at least the step's measured peak and at most 4x it."""
    from redrafter_mlx.engine.core.sampling import SamplerConfig
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.drafting.held import held_sources
    from redrafter_mlx.engine.loop.memory import run_memory
    from tests.support.models import tiny_drafter, tiny_model

    model = tiny_model(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2)
    drafter = tiny_drafter(model)
    shape = BeamShape.parse(label)
    sampler = SamplerConfig(temperature=temperature, top_p=0.9 if temperature else 1.0)
    peak, window = _step_peak(model, drafter, shape, batch, sampler)
    held = held_sources(drafter, None)
    estimate = run_memory(model, held, shape, batch, window, sampling=temperature > 0)
    assert peak > 0.3e6  # large enough for the bound to mean something
    assert peak <= estimate.step <= 4 * peak, (peak, estimate.step)


def _smollm2_dims():
    """SmolLM2-135M's sizes in float32 (its drafter's 8,192-token shortlist head:
    ``SMOLLM2_HEAD``)."""
    from redrafter_mlx.engine.core.footprint import Dims

    return Dims(576, 30, 9, 3, 64, 1536, 49152, 4, 600 * 2**20)


SMOLLM2_HEAD = 8192


def test_ordinary_shapes_fit_a_small_machine():
    """The defaults, the presets and every shape the tuner tries fit in 4 GiB for a SmolLM2
    chat of 2,048 tokens."""
    from redrafter_mlx.engine.core.footprint import head_bytes, step_memory
    from redrafter_mlx.engine.loop.generation import DEFAULT_SHAPE
    from redrafter_mlx.engine.loop.memory import decode_window
    from tuning.grid import build_grid, with_lookup
    from tuning.presets import get_preset, preset_names

    d = _smollm2_dims()
    shapes = [DEFAULT_SHAPE, *(get_preset(name).shape for name in preset_names())]
    shapes += with_lookup(build_grid([1, 2, 3, 4], [2, 3, 4, 5, 6], [None]), [1, 2], [4, 8])
    for shape in shapes:
        draft = head_bytes(1, shape.width, SMOLLM2_HEAD) if shape.drafts else 0
        need = step_memory(d, shape, 1, decode_window(2048, 8192, shape), draft=draft)
        assert need.total < 4 * GIB, (shape.label, need)


def test_a_huge_shape_is_refused_with_the_figures_and_what_fits():
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.memory import ShapeTooLarge, check_step_memory
    from tests.support.models import tiny_drafter, tiny_model

    model = tiny_model(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2)
    drafter = tiny_drafter(model)
    budget = (2 * GIB, "the test's budget")
    with pytest.raises(ShapeTooLarge) as e:
        check_step_memory(model, held_sources(drafter), BeamShape(4096, 50), available=budget)
    message = str(e.value)
    assert e.value.param == "width" and "\n" not in message
    assert "W4096×L50 needs about" in message and "GiB" in message
    assert "only 2 GiB is available (the test's budget)" in message
    fits = message.rsplit("the largest that fits is ", 1)[1]
    best = BeamShape.parse(fits)
    assert best.length == 50 and 1 <= best.width < 4096
    check_step_memory(model, held_sources(drafter), best, available=budget)  # it does fit
    with pytest.raises(ShapeTooLarge):
        check_step_memory(
            model, held_sources(drafter), BeamShape(best.width + 1, 50), available=budget
        )


def test_lookup_alone_too_large_names_the_chains():
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.memory import ShapeTooLarge, check_step_memory
    from tests.support.models import tiny_model

    model = tiny_model(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2)
    with pytest.raises(ShapeTooLarge) as e:
        check_step_memory(
            model, held_sources(), BeamShape.lookup_only(50000, 50), available=(GIB, "x")
        )
    assert e.value.param == "lookup" and "the largest that fits is K" in str(e.value)


def test_decode_refuses_before_compiling(monkeypatch):
    """The API's one entry (``generate_steps``, under stream_generate/generate/batch_generate)."""
    import redrafter_mlx.engine.loop.memory as memory
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.engine.loop.memory import ShapeTooLarge
    from tests.support.models import run_decode, tiny_drafter, tiny_model

    model = tiny_model(vocab=4096, hidden=64, layers=2, heads=4, kv_heads=2)
    drafter = tiny_drafter(model)
    monkeypatch.setattr(memory, "available_memory", lambda: (GIB // 4, "a quarter GiB"))
    with pytest.raises(ShapeTooLarge, match="a quarter GiB"):
        run_decode(model, drafter, [[1, 2, 3]], shape=BeamShape(512, 20), max_tokens=4)
    assert not model.__dict__.get("_batch_steps")  # nothing was compiled
    tokens, _ = run_decode(model, drafter, [[1, 2, 3]], shape=BeamShape(2, 3), max_tokens=4)
    assert len(tokens[0]) == 4


def test_generate_refuses_a_huge_beam_in_one_line(app):
    result = invoke(
        app,
        "generate",
        "--model",
        "demo",
        "--beam-width",
        "4096",
        "--beam-length",
        "50",
        "--prompt",
        "def f",
    )
    assert result.exit_code == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --beam-width: beam shape W4096×L50")
    assert "needs about" in line and "is available" in line and "largest that fits is W" in line
