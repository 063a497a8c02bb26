"""scripts.experiments.smollm2_blocks: GGUF blocks found again bit-exact, and refused when
the weights are not in them."""

import mlx.core as mx
import numpy as np
import pytest

from scripts.experiments import smollm2_blocks as blocks


def gguf_like(rng) -> dict:
    """An embedding in Q8_0 blocks, a layer matrix in Q4_1 blocks, a norm in float32."""
    d8 = rng.uniform(0.001, 0.01, (64 * 64 // 32, 1)).astype(np.float16).astype(np.float32)
    q8 = rng.integers(-127, 128, (64 * 64 // 32, 32))
    q8[:, 0] = 127  # Q8_0's scale is the block's largest magnitude / 127
    emb = (d8 * q8).reshape(64, 64)
    d4 = rng.uniform(0.001, 0.01, (32 * 64 // 32, 1)).astype(np.float16).astype(np.float32)
    m4 = rng.uniform(-0.1, 0.0, (32 * 64 // 32, 1)).astype(np.float16).astype(np.float32)
    q4 = rng.integers(0, 16, (32 * 64 // 32, 32))
    q4[:, 0], q4[:, 1] = 0, 15  # Q4_1 maps each block's minimum to 0 and maximum to 15
    layer = (d4 * q4 + m4).reshape(32, 64)
    norm = rng.normal(size=64)
    named = {
        "model.embed_tokens.weight": emb,
        "model.layers.0.mlp.up_proj.weight": layer,
        "model.norm.weight": norm,
    }
    return {k: mx.array(v.astype(np.float32)) for k, v in named.items()}


def folder(path, weights):
    path.mkdir()
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    for f in blocks.FILES:
        (path / f).write_text("{}")
    return path


def test_round_trip_is_bit_exact(tmp_path):
    weights = gguf_like(np.random.default_rng(0))
    src = folder(tmp_path / "model", weights)
    blocks.pack(src, tmp_path / "packed")
    blocks.unpack(tmp_path / "packed", tmp_path / "back")
    back = mx.load(str(tmp_path / "back" / "model.safetensors"))
    assert set(back) == set(weights)
    for k, v in weights.items():
        assert back[k].dtype == mx.float32 and mx.array_equal(back[k], v).item(), k
    packed = (tmp_path / "packed" / "packed.npz").stat().st_size
    assert packed < (tmp_path / "model" / "model.safetensors").stat().st_size / 2


def test_weights_not_in_blocks_are_refused(tmp_path):
    weights = gguf_like(np.random.default_rng(1))
    weights["model.layers.0.mlp.up_proj.weight"] += 1e-3 * mx.random.normal((32, 64))
    src = folder(tmp_path / "model", weights)
    with pytest.raises(SystemExit, match="up_proj.weight is not in GGUF blocks"):
        blocks.pack(src, tmp_path / "packed")
