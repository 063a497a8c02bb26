"""The sizes and settings the engine reads of any family's config (``lm_model.LmArgs``)."""

from __future__ import annotations

from redrafter_mlx.engine.verifier.lm_model import LmArgs


def test_a_per_layer_rope_theta_list_reads_as_the_first_layers():
    # step3p5's config lists rope_theta per layer; the load crashed on float(list)
    args = LmArgs({"model_type": "step3p5", "rope_theta": [5e5, 1e4]}, 64, 100, 2, [(2, 16, 16)])
    assert args.rope_theta == 5e5
    assert LmArgs({"rope_theta": 1e6}, 64, 100, 2, []).rope_theta == 1e6
