"""Every dimension of a beam shape is bounded before its step is built: a tree larger than
the model's context is refused at once, by the API, the CLI and ``tune``, with one line that
names the flag that makes it large and the largest shape that fits."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.base.bundled import demo_paths
from redrafter_mlx.engine.core.shape import BeamShape, ShapeError
from redrafter_mlx.engine.drafting.held import held_sources
from tests.support.cli import error_line, invoke

GIB = 2**30


def test_a_tree_larger_than_the_context_is_refused_before_compiling():
    """``--lookup 1000`` on a 512-token model: 7,004 tree slots, which fit in memory but
    never in the context; building that step took minutes. Refused, naming the chains."""
    from redrafter_mlx.engine.loop.memory import ShapeTooLarge, check_step_memory
    from tests.support.models import tiny_drafter, tiny_model

    model = tiny_model(vocab=256, hidden=32, max_position_embeddings=512)
    drafter = tiny_drafter(model)
    plenty = (64 * GIB, "the test's budget")
    shape = BeamShape(1, 4, None, 1000, 8)
    with pytest.raises(ShapeTooLarge) as e:
        check_step_memory(model, held_sources(drafter), shape, available=plenty)
    message = str(e.value)
    assert e.value.param == "lookup" and "\n" not in message
    assert "7,004 tree tokens" in message and "context holds 512 tokens" in message
    best = BeamShape.parse(message.rsplit("the largest that fits is ", 1)[1])
    assert (best.width, best.length, best.chain_length) == (1, 4, 8)
    assert best.tree_tokens < 512 <= BeamShape(1, 4, None, best.lookup + 1, 8).tree_tokens
    check_step_memory(
        model, held_sources(drafter), best, available=plenty
    )  # the suggestion is accepted
    with pytest.raises(ShapeTooLarge, match="--|context"):  # every dimension is bounded
        check_step_memory(model, held_sources(drafter), BeamShape(200, 4), available=plenty)


def test_the_cli_refuses_an_unbounded_lookup_width_at_once(app):
    result = invoke(app, "generate", "--model", "demo", "-p", "def is_even(n):", "-n", 16,
                    "--lookup", 1000)  # fmt: skip
    line = error_line(result, 2)
    assert line.startswith("error: --lookup: beam shape W1×L4+K1000×L8 puts 7,004 tree tokens")
    assert "context holds 512 tokens; the largest that fits is W1×L4+K" in line


def test_tune_refuses_a_grid_shape_larger_than_the_context_before_measuring():
    """``tune --lookup 1000`` measured nothing of those shapes and said only that some
    "failed"; now the grid is checked once the model is loaded."""
    from redrafter_mlx.cli.tune import build_measure
    from redrafter_mlx.engine.loop.memory import ShapeTooLarge

    model, drafter = (str(p) for p in demo_paths())
    huge = BeamShape(1, 2, None, 1000, 8)
    with pytest.raises(ShapeTooLarge, match="context holds 512 tokens") as e:
        build_measure(model, drafter, None, "demo", 1, [BeamShape(1, 2), huge])
    assert e.value.param == "lookup"
    measure, _clock = build_measure(model, drafter, None, "demo", 1, [BeamShape(1, 2)])
    assert measure is not None


def test_a_too_long_lookup_chain_blames_lookup_length(app):
    """The memory guard used to blame --beam-width for ``--lookup-length 100000``."""
    result = invoke(app, "generate", "--model", "demo", "-p", "def f", "--lookup-length", 100000)
    line = error_line(result, 2)
    assert line.startswith("error: --lookup-length: beam shape W1×L4+K1×L100000")
    assert "largest that fits is W1×L4+K1×L" in line


@pytest.mark.parametrize(
    "shape, part",
    [
        (BeamShape(4096, 50), "width"),
        (BeamShape(1, 2000), "length"),
        (BeamShape(1, 4, None, 1000, 8), "lookup"),
        (BeamShape(1, 4, None, 1, 100000), "lookup_length"),
        (BeamShape.lookup_only(50000, 50), "lookup"),
    ],
)
def test_the_largest_part_of_a_shape_names_the_flag_raised(shape, part):
    assert shape.largest_part == part


def test_a_lookup_chain_of_length_zero_is_refused_as_zero():
    """``K1xL0`` said "got 1" (0 meant "the drafter's length"); ``W1xL4+K1xL0`` became
    ``W1xL4+K1xL4`` without a word."""
    for label in ("K1xL0", "W1xL4+K1xL0"):
        with pytest.raises(ShapeError, match="got 0") as e:
            BeamShape.parse(label)
        assert e.value.param == "lookup_length"


@pytest.mark.parametrize(
    "flag, value, expected",
    [
        ("--grid", "0x4", "error: --grid 0x4: beam width must be >= 1, got 0"),
        ("--grid", "1x-3", "error: --grid 1x-3: beam length must be >= 2"),
        ("--configs", "K1xL0", "error: --configs 'K1xL0': lookup chain length must be >= 2"),
    ],
)
def test_bench_shape_errors_name_the_flag_typed(app, flag, value, expected):
    line = error_line(invoke(app, "bench", "--model", "demo", flag, value), 2)
    assert line.startswith(expected)
    assert "--beam-width" not in line and "--beam-length" not in line
    assert "got 1" not in line
