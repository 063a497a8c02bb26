"""``tune`` on a model whose steps verify one chain (a hybrid's recurrent state): the beam
widths that all run as that chain are measured once and share the measurement."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import redrafter_mlx.measure.throughput as throughput
from redrafter_mlx.engine.core.shape import BeamShape
from tuning.measure import EngineMeasure


def test_shapes_a_model_runs_as_one_chain_are_measured_once(monkeypatch):
    calls = []

    def fake(model, drafter, tokenizer, prompt, shape, n_tokens, **kw):
        calls.append(shape)
        return SimpleNamespace(tokens_per_s=10.0 + len(calls), tokens_per_step=2.0, mean_packed=4)

    monkeypatch.setattr(throughput, "measure_generation", fake)
    monkeypatch.setattr("tuning.measure.encode_prompt", lambda tokenizer, p: [1, 2, 3])
    hybrid = SimpleNamespace(verifies="chain", narrowing="its recurrent state follows one chain")
    measure = EngineMeasure(hybrid, object(), None, ["a prompt"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = [measure(BeamShape.parse(s), 32) for s in ("W2xL4", "W3xL4", "W4xL4", "W1xL5")]
    assert len(calls) == 2  # W2-W4 x L4 run as W1xL4: once; W1xL5: once
    assert got[0] is got[1] is got[2] and got[3] is not got[0]
    attention = SimpleNamespace(verifies="tree")
    calls.clear()
    measure = EngineMeasure(attention, object(), None, ["a prompt"])
    for s in ("W2xL4", "W3xL4"):
        measure(BeamShape.parse(s), 32)
    assert len(calls) == 2  # a tree model runs each width as it is
