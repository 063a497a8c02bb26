"""``convert --drafter <Kangaroo adapter> --exit-layer N``: the public Kangaroo checkpoint
layout (``config.json`` a LlamaConfig with one layer, ``pytorch_model.bin`` holding
``norm.weight`` and ``layers.0.{input_layernorm,self_attn.*}``), written here without torch,
converted torch-free into the engine's early-exit folder; its forward equals a NumPy
transcription of the public ``AdapterModel`` forward."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

from redrafter_mlx.engine.core.tree import cache_mask, chain_mask
from redrafter_mlx.engine.drafting.early_exit import check_pair, load_adapter
from redrafter_mlx.engine.drafting.early_exit_chain import draft_chain
from redrafter_mlx.engine.loop.loading import load_model
from tests.support.convert import BASE, HEADS, KV, D, H, adapter_weights, make_adapter
from tests.support.paths import CONVERT as FIXTURES
from weights_convert.conversion import convert
from weights_convert.errors import ConversionError


def kangaroo_forward(w: dict, x: np.ndarray, eps: float) -> np.ndarray:
    """The public AdapterModel forward (HF LlamaAttention, rotate_half rotary, causal), in
    NumPy float64: x (T, H) exit-layer states at positions 0..T-1 -> (T, H)."""
    x = x.astype(np.float64)

    def rms(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    T = x.shape[0]
    h = rms(x, w["layers.0.input_layernorm.weight"])
    q = (h @ w["layers.0.self_attn.q_proj.weight"].T).reshape(T, HEADS, D)
    k = (h @ w["layers.0.self_attn.k_proj.weight"].T).reshape(T, KV, D)
    v = (h @ w["layers.0.self_attn.v_proj.weight"].T).reshape(T, KV, D)
    inv = 1.0 / (10000 ** (np.arange(0, D, 2) / D))
    ang = np.arange(T)[:, None] * inv[None]
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None]

    def rot(t):
        half = np.concatenate([-t[..., D // 2 :], t[..., : D // 2]], -1)
        return t * cos + half * sin

    q, k = rot(q), rot(k)
    k, v = np.repeat(k, HEADS // KV, axis=1), np.repeat(v, HEADS // KV, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(D)
    scores = np.where(np.tril(np.ones((T, T), bool))[None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hts,shd->thd", p, v).reshape(T, HEADS * D)
    out = x + attn @ w["layers.0.self_attn.o_proj.weight"].T
    return rms(out, w["norm.weight"])


def test_converted_adapter_equals_the_public_forward_and_drafts(tmp_path):
    weights = adapter_weights()
    src = make_adapter(tmp_path / "kangaroo", weights)
    out = tmp_path / "out"
    summary = convert(
        str(BASE), out, drafter=str(src), exit_layer=1, dtype="float32", progress=False
    )
    assert sorted(d for d in summary.dropped if d.startswith("drafter")) == [
        "drafter layers.0.post_attention_layernorm.weight",
        "drafter layers.0.self_attn.rotary_emb.inv_freq",
    ]
    cfg = json.loads((out / "drafter" / "config.json").read_text())
    assert cfg["kind"] == "early-exit" and cfg["exit_layer"] == 1 and cfg["num_layers"] == 1
    adapter = load_adapter(out / "drafter")
    flat = dict(tree_flatten(adapter.parameters()))
    assert flat.keys() == weights.keys()
    for name, value in weights.items():
        np.testing.assert_array_equal(np.array(flat[name]), value, err_msg=name)
    x = np.random.default_rng(1).standard_normal((7, H)).astype(np.float32)
    pos = mx.arange(7, dtype=mx.int32)[None]
    mask = cache_mask(mx.array([0]), chain_mask(7), 7)
    got = adapter(mx.array(x)[None], pos, mask, adapter.make_cache(1, 7), pos)[0][0]
    want = kangaroo_forward(weights, x, cfg["rms_norm_eps"])
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)

    model, _ = load_model(out, mx.float32)  # the converted pair drafts in the engine
    check_pair(model, adapter)
    cache = model.make_cache(1, 16)
    own = adapter.make_cache(1, 16)
    chain = draft_chain(model, adapter, mx.array([5]), mx.array([0]), cache, own, 16, 3, 0.0)
    assert chain.tokens.shape == (1, 4) and int(chain.tokens[0, 0]) == 5


def test_the_cli_takes_the_exit_layer(tmp_path):
    from redrafter_mlx.cli import _register, app

    _register()
    src = make_adapter(tmp_path / "kangaroo")
    args = ["convert", "--model", str(BASE), "--drafter", str(src), "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "a"), "--exit-layer", "1"])
    assert result.exit_code == 0, result.output
    assert load_adapter(tmp_path / "a" / "drafter").args.exit_layer == 1
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "b")])
    assert result.exit_code != 0 and "pass --exit-layer" in result.output


def test_bad_adapters_are_refused_with_the_fix(tmp_path):
    src = make_adapter(tmp_path / "k")

    def run(drafter=src, **kw):
        kw = {"exit_layer": 1, **kw}
        return convert(str(BASE), tmp_path / "out", drafter=str(drafter), progress=False, **kw)

    with pytest.raises(ConversionError, match="--exit-layer between 1 and 1"):
        run(exit_layer=2)
    with pytest.raises(ConversionError, match="kept unquantized"):
        run(quantize_drafter=True)
    with pytest.raises(ConversionError, match="--exit-layer needs --drafter"):
        convert(str(BASE), tmp_path / "out", exit_layer=1, progress=False)
    with pytest.raises(ConversionError, match="is not one"):
        run(drafter=FIXTURES / "drafter_bin")
    wide = make_adapter(tmp_path / "wide", hidden_size=32)
    with pytest.raises(ConversionError, match="hidden_size is 32"):
        run(drafter=wide)
    odd = adapter_weights()
    odd["layers.0.mlp.gate_proj.weight"] = np.zeros((8, H), np.float32)  # dropped: unused
    odd["layers.1.self_attn.q_proj.weight"] = np.zeros((HEADS * D, H), np.float32)
    with pytest.raises(ConversionError, match="q_proj.weight in pytorch_model.bin is not part"):
        run(drafter=make_adapter(tmp_path / "odd", odd))
    short = adapter_weights()
    del short["layers.0.self_attn.v_proj.weight"]
    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    with pytest.raises(ConversionError, match="lacks layers.0.self_attn.v_proj"):
        run(drafter=make_adapter(tmp_path / "short", short))
    assert not (tmp_path / "out").exists()
