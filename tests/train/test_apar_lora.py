"""APAR LoRA helper (train/apar_lora.py) on a tiny tied Llama: the vocabulary grows by the
split tokens, only LoRA and the new rows train, checkpoints resume, the saved adapter fused
into the base folder (weights_convert.smollm2_apar) loads as a branching model with the
trained model's logits, quantized bases included."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.branches import BranchRules, branch_rules
from redrafter_mlx.train.apar_lora import (
    LoraSettings,
    add_split_tokens,
    done_iters,
    prepare_model,
    save_adapter,
    split_rows_start,
    train,
    trainable_weights,
)
from tests.support.paths import CONVERT
from weights_convert.smollm2_apar import build

TOKENIZER = CONVERT / "tokenizer"
CONFIG = {
    "model_type": "llama",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "vocab_size": 128,
    "tie_word_embeddings": True,
}
SETTINGS = LoraSettings(layers=1, rank=2, batch_size=2, iters=2, save_every=1, lr=1e-2)


def tiny():
    from mlx_lm.models.llama import Model, ModelArgs
    from mlx_lm.utils import load_tokenizer

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(CONFIG))
    mx.eval(model.parameters())
    tokenizer = load_tokenizer(TOKENIZER)
    ids = add_split_tokens(tokenizer)
    return model, tokenizer, ids


def samples():
    return [([1, 5, 6, 7, 128, 129, 9, 10, 2], 6), ([1, 5, 8, 128, 3, 4, 2], 3)] * 2


def test_grown_vocabulary_and_what_trains():
    model, _, ids = tiny()
    assert ids == [128, 129]
    prepare_model(model, SETTINGS, ids)
    assert model(mx.array([[1, 128, 129]])).shape == (1, 3, 130)
    names = set(trainable_weights(model))
    assert "model.embed_tokens.extra" in names
    assert {n for n in names if "lora" not in n} == {"model.embed_tokens.extra"}
    assert all(n.startswith("model.layers.1.") for n in names if "lora" in n)  # last layer only


def test_split_rows_start_where_forks_and_children_stand():
    """The fork row starts at the mean of the tokens after a child token, the child row at
    the mean of the tokens before a fork."""
    table = mx.array(np.random.default_rng(0).standard_normal((128, 32)).astype(np.float32))
    rows = split_rows_start(table, samples(), fork=128, child=129)
    np.testing.assert_allclose(np.array(rows[0]), np.array(table[9]), rtol=1e-6)  # after 129
    want = (np.array(table[7]) + np.array(table[8])) / 2  # before each 128
    np.testing.assert_allclose(np.array(rows[1]), want, rtol=1e-5)
    model, _, ids = tiny()
    prepare_model(model, SETTINGS, ids, rows)
    np.testing.assert_array_equal(np.array(model.model.embed_tokens.extra), np.array(rows))
    with pytest.raises(ValueError, match="no fork followed by a child"):
        split_rows_start(table, [([1, 2, 3], 0)], fork=128, child=129)


def test_ids_after_the_embedding_are_required():
    model, _, _ = tiny()
    with pytest.raises(ValueError, match="disagree on the vocabulary size"):
        prepare_model(model, SETTINGS, [200, 201])


def test_checkpoints_resume_and_the_fused_adapter_is_a_branching_model(tmp_path):
    model, _, ids = tiny()
    prepare_model(model, SETTINGS, ids)
    before = np.array(model.model.embed_tokens.extra)
    result = train(model, samples(), tmp_path / "ck", SETTINGS, report=lambda s: None)
    assert result["iters"] == 2 and result["tokens_per_s"] > 0
    assert done_iters(tmp_path / "ck") == 2
    assert not np.array_equal(before, np.array(model.model.embed_tokens.extra))  # rows trained

    again, _, _ = tiny()  # a new process: resumes from step 2, trains step 3
    prepare_model(again, SETTINGS, ids)
    said = []
    train(
        again,
        samples(),
        tmp_path / "ck",
        LoraSettings(**{**SETTINGS.__dict__, "iters": 3}),
        said.append,
    )
    assert said == ["resumed from 0000002_adapters.safetensors"]
    assert done_iters(tmp_path / "ck") == 3

    x = mx.array([[1, 5, 128, 129, 9]])
    want = np.array(again(x))
    save_adapter(again, SETTINGS, tmp_path / "adapter")
    out = build(base_folder(tmp_path / "base"), tmp_path / "adapter", tmp_path / "out")
    import mlx_lm

    loaded, tok = mlx_lm.load(str(out))
    np.testing.assert_allclose(np.array(loaded(x)), want, atol=1e-4)
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 130
    assert branch_rules(out) == BranchRules(128, 129, max_depth=1)  # one-level trees
    assert branch_rules(out, max_depth=2) == BranchRules(128, 129, max_depth=2)  # a flag wins
    config = json.loads((out / "config.json").read_text())
    config["branches"]["max_depth"] = "one"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ParamError, match="max_depth 'one', not a whole number"):
        branch_rules(out)
    assert tok.encode("w5 [SplitMask]", add_special_tokens=False) == [5, 128]
    assert tok.decode([5, 129]).endswith("[SplitSop]")
    assert not list(tmp_path.glob(".out.*"))  # the temp folder was renamed


def base_folder(folder: Path, bits: int | None = None) -> Path:
    """The untrained tiny model (``tiny``'s seed) as an mlx-lm folder, quantized if asked."""
    import shutil

    from mlx_lm.utils import quantize_model, save_config, save_model

    model, _, _ = tiny()
    config = dict(CONFIG)
    if bits:
        model, config = quantize_model(model, config, group_size=32, bits=bits)
    folder.mkdir(parents=True)
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for f in TOKENIZER.iterdir():
        shutil.copyfile(f, folder / f.name)
    return folder


def test_fusing_into_a_quantized_base_matches_mlx_lms_fuse(tmp_path):
    """A 4-bit base: each adapted weight dequantized, fused and quantized again, as mlx-lm's
    ``LoRALinear.fuse`` does; the grown embedding keeps its quantization."""
    import mlx_lm
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model, _, ids = tiny()
    quantized = base_folder(tmp_path / "base", bits=4)
    reference, _ = mlx_lm.load(str(quantized))
    linear_to_lora_layers(reference, 1, {"rank": 2, "scale": SETTINGS.scale, "dropout": 0.0})
    prepare_model(model, SETTINGS, ids)
    rng = np.random.default_rng(1)
    trained = {
        k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.05)
        for k, v in trainable_weights(model).items()
    }
    model.load_weights(list(trained.items()), strict=False)
    reference.load_weights([(k, v) for k, v in trained.items() if "lora" in k], strict=False)
    save_adapter(model, SETTINGS, tmp_path / "adapter")
    out = build(quantized, tmp_path / "adapter", tmp_path / "out")
    fused, _ = mlx_lm.load(str(out))
    layer = fused.model.layers[1].self_attn.q_proj
    want = reference.model.layers[1].self_attn.q_proj.fuse()
    assert layer.bits == 4 and layer.group_size == 32
    np.testing.assert_array_equal(np.array(layer.weight), np.array(want.weight))
    np.testing.assert_array_equal(np.array(layer.scales), np.array(want.scales))
    rows = mx.dequantize(
        fused.model.embed_tokens.weight[128:],
        fused.model.embed_tokens.scales[128:],
        fused.model.embed_tokens.biases[128:],
        group_size=32,
        bits=4,
    )
    np.testing.assert_allclose(
        np.array(rows), np.array(trained["model.embed_tokens.extra"]), atol=0.02
    )


def test_a_stopped_runs_saves_are_adopted_with_their_step_numbers(tmp_path):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "start").write_text("4")  # the run resumed after step 4, then was killed
    mx.save_safetensors(str(run / "0000002_adapters.safetensors"), {"x": mx.zeros(1)})
    mx.save_safetensors(str(run / "adapters.safetensors"), {"x": mx.zeros(1)})
    assert done_iters(tmp_path) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000006_adapters.safetensors"]


def test_install_fuses_the_packaged_adapter_once_and_again_when_it_changes(tmp_path, monkeypatch):
    """``make smollm2``'s step (``ensure_smollm2_apar``): nothing without a packaged adapter,
    a clear error without SmolLM2, a no-op once fused, a new fuse for a new adapter."""
    from redrafter_mlx.engine.base.bundled import smollm2_apar_path, smollm2_path
    from weights_convert import ConversionError, smollm2_apar

    home, adapter = tmp_path / "home", tmp_path / "adapter"
    monkeypatch.setattr(smollm2_apar, "SMOLLM2_APAR_ADAPTER", adapter)
    assert smollm2_apar.ensure_smollm2_apar(home) is None  # nothing packaged
    model, _, ids = tiny()
    prepare_model(model, SETTINGS, ids)
    save_adapter(model, SETTINGS, adapter)
    with pytest.raises(ConversionError, match="run `make smollm2` first"):
        smollm2_apar.ensure_smollm2_apar(home)
    base_folder(smollm2_path(home))
    out = smollm2_apar.ensure_smollm2_apar(home)
    assert out == smollm2_apar_path(home) and branch_rules(out) is not None
    fused_at = (out / "model.safetensors").stat().st_mtime_ns
    assert smollm2_apar.ensure_smollm2_apar(home) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == fused_at  # nothing redone
    model.model.embed_tokens.extra = model.model.embed_tokens.extra + 1.0  # a new adapter
    save_adapter(model, SETTINGS, adapter)
    smollm2_apar.ensure_smollm2_apar(home)
    import mlx_lm

    fused, _ = mlx_lm.load(str(out))
    np.testing.assert_allclose(
        np.array(fused.model.embed_tokens.weight[128:]),
        np.array(model.model.embed_tokens.extra),
        atol=1e-6,
    )
