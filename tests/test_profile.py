"""``bench --profile``'s engine side: per-phase timings and graph-op counts of one step."""

import mlx.core as mx

from redrafter_mlx.measure.profile import PHASES, graph_ops, kernels, profile_steps
from tests.helpers import tiny_drafter, tiny_model


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
        model, drafter, [(1, 3, 3), (2, 3, 5)], [1, 2, 3], repeats=2, loop_tokens=6, loop_rounds=1
    )
    ar, w1, w2 = data["rows"]
    assert ar["config"] == "AR" and ar["step_kernels"] > 0 and "verify_ms" not in ar
    for row in (w1, w2):
        for phase in PHASES:
            assert row[f"{phase}_ms"] >= 0 and row[f"{phase}_ops"] >= row[f"{phase}_kernels"]
        assert row["step_kernels"] > row["verify_kernels"] > 0
    assert w1["pack_kernels"] == 0 and w1["commit_kernels"] < w2["commit_kernels"]  # W=1 paths
