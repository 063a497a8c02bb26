"""``bench --profile`` for every draft source (``measure/profile.py``): the early-exit adapter's
and a draft model's steps are profiled, and the launch-bound estimate reads the weights each
source really reads (the early-exit chain runs the target's first layers and its head)."""

from __future__ import annotations

import pytest

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.drafting.early_exit import EarlyExitAdapter, EarlyExitArgs
from redrafter_mlx.engine.drafting.held import held_sources
from redrafter_mlx.measure.profile import MacCost, launch_bound, profile_steps, weight_bytes
from tests.support.models import tiny_model

H, V, F = 32, 64, 64  # hidden, vocabulary, MLP width of tiny_model(hidden=32)
LAYER = H * H * 2 + H * 16 * 2 + 3 * F * H + 2 * H  # q, o; k, v (2 of 4 heads); MLP; norms
ADAPTER = H * H * 2 + H * 16 * 2 + H + H  # one attention layer, its norm, the final norm


@pytest.mark.parametrize("tied", [False, True])
def test_an_early_exit_chain_reads_the_first_layers_the_adapter_and_the_head(tied):
    model = tiny_model(0, vocab=V, layers=3, tie_word_embeddings=tied)
    adapter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 2))
    got = weight_bytes(model, held_sources(adapter), None)  # float32 as loaded
    once = 4 * (2 * LAYER + ADAPTER)  # a forward of layers [:2] and the adapter
    assert got.model == 4 * (3 * LAYER + H + V * H)
    assert (got.drafter_once, got.drafter_step) == (once, once + 4 * V * H)
    assert got.drafter_refresh == once
    # L = 4: four forwards of the first layers and the adapter, three of the head
    assert got.per_step(3) == got.model + 4 * once + 3 * 4 * V * H
    assert got.per_step(3, refreshes=1) == got.per_step(3) + once
    rows = [dict(config="AR", step_kernels=10, step_ms=1.0)]
    rows.append(dict(config="W1×L4", step_kernels=10, step_ms=1.0, draft_steps=3))
    priced = launch_bound(rows, got, MacCost())
    assert priced[1]["mac_bytes"] == got.per_step(3)


@pytest.mark.parametrize("label", ["W1xL4", "W1xL4+K1xL6", "D1xL4"])
def test_profile_runs_for_each_source(label):
    """Each source's step is profiled with AR beside it: its kernels counted, and an
    early-exit chain beside another source counts its refresh."""
    model = tiny_model(0, vocab=V, layers=3)
    shape = BeamShape.parse(label)
    drafter = draft = None
    if shape.model_length:
        draft = tiny_model(1, vocab=V, layers=1)
    else:
        drafter = EarlyExitAdapter(EarlyExitArgs.for_target(model.args, 1))
    data = profile_steps(
        model, held_sources(drafter, draft), [shape], [1, 2, 3, 1, 2], repeats=1, loop_tokens=6,
        loop_rounds=1,
    )  # fmt: skip
    ar, row = data["rows"]
    assert row["step_kernels"] > ar["step_kernels"] > 0 and row["loop_ms"] > 0
    assert row.get("drafter_refreshes", 0) == (1 if shape.lookup else 0)
    if draft is not None:
        assert row["draft_model_forwards"] == 3
