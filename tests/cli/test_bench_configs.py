"""Which configurations ``bench`` runs (``choose_configs``), without a model or a timing: a bare
``bench`` measures what ``chat`` runs (adaptive decoding from the chat shape), pinned shapes
only when asked."""

from __future__ import annotations

import pytest

from redrafter_mlx.cli.bench import choose_configs
from redrafter_mlx.cli.common import BeamFlags, ModelPaths, plan_from_flags

WITH_DRAFTER = ModelPaths("/no/such/model", "/no/such/drafter")
LOOKUP_ONLY = ModelPaths("/no/such/model", None)


def names(paths: ModelPaths, **kw) -> list[str]:
    configs, _ = choose_configs(paths, None, BeamFlags(), **kw)
    return [c.name for c in configs]


@pytest.mark.parametrize("paths", [WITH_DRAFTER, LOOKUP_ONLY], ids=["drafter", "lookup-only"])
def test_bare_bench_runs_what_chat_runs(paths):
    plan = plan_from_flags(paths, None, BeamFlags())  # what chat runs, adaptively
    assert plan.speculative
    configs, source = choose_configs(paths, None, BeamFlags())
    assert [(c.name, c.adapt) for c in configs] == [("AR", False), (f"adaptive {plan.label}", True)]
    assert configs[1].shape == plan.shape and "as chat runs" in source


@pytest.mark.parametrize("paths", [WITH_DRAFTER, LOOKUP_ONLY], ids=["drafter", "lookup-only"])
def test_pinned_shapes_when_asked(paths):
    label = plan_from_flags(paths, None, BeamFlags()).label
    assert names(paths, adapt=False) == ["AR", label]  # --no-adapt
    assert names(paths, adapt=True) == ["AR", label, f"adaptive {label}"]  # --adapt: both
    assert names(paths, shapes="K1xL4") == ["AR", "K1×L4"]  # --configs: those, pinned
    assert names(paths, shapes="K1xL4", adapt=True) == ["AR", "K1×L4", f"adaptive {label}"]
    assert names(paths, with_mlx_lm=True)[-1] == "mlx-lm"


def test_grid_shapes_are_pinned_unless_adapt():
    label = plan_from_flags(WITH_DRAFTER, None, BeamFlags()).label
    assert names(WITH_DRAFTER, grid="1x2,3") == ["AR", "W1×L2+K1×L8", "W1×L3+K1×L8"]
    assert names(WITH_DRAFTER, grid="1x3", adapt=True)[-1] == f"adaptive {label}"
    # --grid without a drafter falls back to the plan, pinned as the grid asked
    assert names(LOOKUP_ONLY, grid="1x3") == ["AR", "K1×L8"]


def test_plain_decoding_plan_runs_ar_only():
    configs, source = choose_configs(WITH_DRAFTER, None, BeamFlags(no_draft=True))
    assert [c.name for c in configs] == ["AR"] and "--no-draft" in source
