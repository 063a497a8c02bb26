"""The Metal/CUDA code paths (fused rope with per-row offsets, fused attention) run here on
the CPU backend and agree with the CPU path, so the path Apple users take is tested too."""

from __future__ import annotations

import mlx.core as mx
import pytest

import redrafter_mlx.engine.verifier.slots as model_mod
from redrafter_mlx.engine.core.tree import cache_mask, pack
from redrafter_mlx.engine.decoding.cache import Session
from redrafter_mlx.engine.decoding.decode import prefill_chunk
from tests.support.models import run_decode, tiny_drafter, tiny_model


@pytest.fixture
def fused(monkeypatch):
    """Run a callable once with the fused kernels forced on and once forced off."""

    def both(fn):
        out = {}
        for flag in (True, False):
            monkeypatch.setattr(model_mod, "FUSED_KERNELS", flag)
            out[flag] = fn()
        return out[True], out[False]

    return both


def verify_forward(model, rope_scaling=None):
    """Hidden states of a tree verify pass over a prefilled batch of two rows of different
    lengths: (B, C, H)."""
    session = Session(model, 2)
    zeros = mx.zeros((2,), dtype=mx.int32)
    prompt = mx.array([[1, 5, 7, 9, 2], [3, 4, 0, 0, 0]])
    _, lengths, cache = prefill_chunk(model, prompt, mx.array([5, 2]), zeros, session.cache, 256)
    beams = mx.array([[[4, 8, 9, 3], [4, 8, 2, 6], [4, 1, 1, 1]]] * 2)
    tree = pack(beams, 9)
    mask = cache_mask(lengths, tree.mask, 256)
    hidden, _ = model(
        tree.tokens,
        lengths[:, None] + tree.depth,
        mask,
        cache,
        lengths[:, None] + mx.arange(9)[None, :],
    )
    return hidden


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"rope_traditional": True},
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ],
)
def test_fused_and_cpu_forwards_agree_on_a_tree(fused, extra):
    model = tiny_model(3, **extra)
    on, off = fused(lambda: verify_forward(model))
    assert on.shape == off.shape
    assert mx.allclose(on, off, atol=1e-4, rtol=1e-4).item()


def test_fused_path_keeps_greedy_redrafter_equal_to_autoregressive(fused):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]

    def both_ways():  # a fresh model each time: compiled steps are cached on the model
        model = tiny_model(1)
        drafter = tiny_drafter(model, 2)
        ar, _ = run_decode(model, None, prompts, max_tokens=20)
        rd, _ = run_decode(model, drafter, prompts, max_tokens=20, beam_width=3, beam_length=4)
        return ar, rd

    (ar_on, rd_on), (ar_off, rd_off) = fused(both_ways)
    assert rd_on == ar_on
    assert ar_on == ar_off and rd_off == ar_off
