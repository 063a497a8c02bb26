"""``bench --profile``'s engine side: per-phase timings and graph-op counts of one step."""

import mlx.core as mx
import pytest

from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.measure.profile import (
    PHASES,
    MacCost,
    WeightBytes,
    graph_ops,
    kernels,
    launch_bound,
    profile_steps,
)
from tests.support.models import tiny_drafter, tiny_model


def test_graph_ops_counts_what_a_compiled_call_dispatches():
    fn = mx.compile(lambda x: (mx.exp(x) + 1) @ x)
    x = mx.ones((4, 4))
    mx.eval(x)
    ops = graph_ops(fn(x))
    assert ops["Matmul"] == 1 and sum(ops.values()) == 2  # exp + add fused into one kernel
    assert kernels(ops) == 2


def test_profile_rows_per_phase_with_ar_beside():
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    data = profile_steps(
        model,
        held_sources(drafter),
        [(1, 3, 3), (2, 3, 5)],
        [1, 2, 3],
        repeats=2,
        loop_tokens=6,
        loop_rounds=1,
    )
    ar, w1, w2 = data["rows"]
    assert ar["config"] == "AR" and ar["step_kernels"] > 0 and "verify_ms" not in ar
    for row in (w1, w2):
        for phase in PHASES:
            assert row[f"{phase}_ms"] >= 0 and row[f"{phase}_ops"] >= row[f"{phase}_kernels"]
        assert row["step_kernels"] > row["verify_kernels"] > 0
    assert w1["pack_kernels"] == 0 and w1["commit_kernels"] < w2["commit_kernels"]  # W=1 paths


# --------------------------------------------------------------------------- launch-bound estimate

PER_LAYER = 32 * 32 * 2 + 32 * 16 * 2 + 3 * 64 * 32 + 2 * 32  # q, o; k, v; MLP; two norms


def test_weight_bytes_reads_the_output_head_once_and_skips_the_gathered_table():
    from redrafter_mlx.measure.profile import weight_bytes

    read = 2 * PER_LAYER + 32 + 64 * 32  # layers, final norm, the output head (vocab 64)
    for tied in (False, True):  # untied: lm_head read, embed_tokens only gathered
        model = tiny_model(0, vocab=64, tie_word_embeddings=tied)
        assert weight_bytes(model, held_sources(), None).model == 4 * read  # float32 as loaded
        assert weight_bytes(model, held_sources(), "float16").model == 2 * read
    drafter = tiny_drafter(model, 1)  # exit_dim 2H: no input_proj
    step = 2 * (64 * 64 + 64) + 64 * 64 + (32 * 32 + 32) + 32 * 32  # blocks, head, rnn_u, rnn_w
    got = weight_bytes(model, held_sources(drafter), "bfloat16")
    assert (got.drafter_once, got.drafter_step) == (0, 2 * step)
    assert got.per_step(0) == got.model and got.per_step(3) == got.model + 3 * 2 * step
    featured = weight_bytes(
        model, held_sources(tiny_drafter(model, 1, feature_layers=[0, 1])), None
    )
    assert featured.drafter_once == 4 * (64 * 32 + 32)  # feature_proj: once per step
    assert featured.per_step(2) == featured.model + featured.drafter_once + 2 * 4 * step
    with pytest.raises(ValueError, match="--bandwidth-gbs must be > 0"):
        MacCost(bandwidth_gbs=0)
    with pytest.raises(ValueError, match="--launch-us must be >= 0"):
        MacCost(launch_us=-1)


def test_launch_bound_prices_kernels_and_weights_against_ar():
    rows = [
        dict(config="AR", step_kernels=100, step_ms=2.0),
        dict(config="W1×L4 C4", step_kernels=150, step_ms=5.0, draft_steps=3),
        dict(config="K1×L8 C8", step_kernels=120, step_ms=3.0, draft_steps=0),
    ]
    weights = WeightBytes(model=1_000_000, drafter_once=100_000, drafter_step=200_000)
    ar, drafted, lookup = launch_bound(rows, weights, MacCost(launch_us=5, bandwidth_gbs=100))
    assert ar["mac_bytes"] == 1_000_000 and lookup["mac_bytes"] == 1_000_000
    assert drafted["mac_bytes"] == 1_000_000 + 100_000 + 3 * 200_000
    assert ar["mac_launch_ms"] == pytest.approx(0.5) and ar["mac_memory_ms"] == pytest.approx(0.01)
    assert drafted["mac_ms"] == pytest.approx(0.75 + 0.017)
    assert drafted["mac_x_ar"] == pytest.approx(0.767 / 0.51)
    assert lookup["mac_x_ar"] == pytest.approx((0.6 + 0.01) / 0.51)
    assert [r["step_x_ar"] for r in (ar, drafted, lookup)] == [1.0, 2.5, 1.5]
    assert ar["mac_x_ar"] == 1.0 and "mac_ms" not in rows[0]  # the input rows are left as is
    # where launches are free, a step costs its reads alone: the drafter's weights decide
    free = launch_bound(rows, weights, MacCost(launch_us=0, bandwidth_gbs=100))
    assert [r["mac_x_ar"] for r in free] == pytest.approx([1.0, 1.7, 1.0])


def test_profile_times_the_products_own_step(monkeypatch):
    """``bench --profile`` times the compiled batch step every loop runs (kept on
    the model by ``step.batch_step``), not a step builder of its own. Before, it compiled
    ``decode.make_step``, which no product loop ran."""
    from redrafter_mlx.engine.core.sampling import StepMode
    from redrafter_mlx.engine.core.shape import BeamShape
    from redrafter_mlx.measure import profile

    monkeypatch.setattr(profile, "_loop_ms_per_step", lambda *a: 1.0)  # the loop apart
    model = tiny_model(0)
    drafter = tiny_drafter(model, 1)
    shape = BeamShape(1, 3, 3)
    profile.profile_steps(
        model, held_sources(drafter), [shape], [1, 2, 3], repeats=1, loop_rounds=1
    )
    steps = model.__dict__.get("_batch_steps", {})
    timed = {key[1]: run.counter["traces"] for key, run in steps.items() if key[2] == StepMode()}
    assert timed.keys() == {None, shape} and all(timed.values()), steps.keys()
