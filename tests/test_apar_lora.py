"""APAR LoRA helper (train/apar_lora.py) on a tiny tied Llama: the vocabulary grows by the
split tokens, only LoRA and the new rows train, checkpoints resume, the fused export loads
as a branching model with the trained model's logits."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.branches import BranchRules, branch_rules
from redrafter_mlx.train.apar_lora import (
    LoraSettings,
    add_split_tokens,
    done_iters,
    export,
    prepare_model,
    train,
    trainable_weights,
)

TOKENIZER = Path(__file__).parent / "fixtures" / "convert" / "tokenizer"
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


def test_ids_after_the_embedding_are_required():
    model, _, _ = tiny()
    with pytest.raises(ValueError, match="disagree on the vocabulary size"):
        prepare_model(model, SETTINGS, [200, 201])


def test_checkpoints_resume_and_export_is_a_branching_model(tmp_path):
    model, tokenizer, ids = tiny()
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
    export(again, tokenizer, dict(CONFIG), tmp_path / "out")
    import mlx_lm

    loaded, tok = mlx_lm.load(str(tmp_path / "out"))
    np.testing.assert_allclose(np.array(loaded(x)), want, atol=1e-4)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["vocab_size"] == 130
    assert branch_rules(tmp_path / "out") == BranchRules(128, 129)
    assert tok.encode("w5 [SplitMask]", add_special_tokens=False) == [5, 128]


def test_a_stopped_runs_saves_are_adopted_with_their_step_numbers(tmp_path):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "start").write_text("4")  # the run resumed after step 4, then was killed
    mx.save_safetensors(str(run / "0000002_adapters.safetensors"), {"x": mx.zeros(1)})
    mx.save_safetensors(str(run / "adapters.safetensors"), {"x": mx.zeros(1)})
    assert done_iters(tmp_path) == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0000006_adapters.safetensors"]
