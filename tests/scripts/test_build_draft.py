"""``scripts/build_smollm2_draft.py``: a layer-truncated model folder loads with our loader and
with mlx-lm, and its forward equals the source model's first k layers, final norm and head."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from redrafter_mlx.engine.loop.loading import load_model
from scripts.build_smollm2_draft import main, truncated_config
from tests.support.families import our_logits
from tests.support.models import VICUNA_TOKENIZER, save_model_dir, tiny_model

PROMPT = [1, 5, 9, 2, 7, 3, 3, 8]


@pytest.mark.parametrize("tied", [True, False], ids=["tied-head", "own-head"])
def test_the_truncated_folder_equals_the_first_k_layers(tmp_path, tied):
    from mlx_lm.utils import load_model as mlx_lm_load

    src, out = tmp_path / "src", tmp_path / "draft"
    save_model_dir(tiny_model(3, layers=4, tie_word_embeddings=tied), src, VICUNA_TOKENIZER)
    (src / ".marker.json").write_text("{}")  # a hidden file (the SmolLM2 install marker)
    assert main(["--layers", "2", "--model", str(src), "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.model").is_file() and not (out / ".marker.json").exists()

    tokens = mx.array([PROMPT])
    ref, _ = mlx_lm_load(src)
    ref.model.layers = ref.model.layers[:2]  # the source's first 2 layers, norm and head
    want = np.array(ref(tokens)[0])
    theirs, _ = mlx_lm_load(out)
    np.testing.assert_allclose(np.array(theirs(tokens)[0]), want, atol=1e-5)
    ours, _ = load_model(out, mx.float32)
    assert ours.args.num_hidden_layers == 2
    got = np.stack(our_logits(ours, PROMPT, []))
    np.testing.assert_allclose(got, want, atol=1e-4)
    full = np.array(mlx_lm_load(src)[0](tokens)[0])
    assert not np.allclose(full, want, atol=1e-3)  # the dropped layers did something


def test_bad_layer_counts_and_a_full_out_folder_are_refused(tmp_path, capsys):
    src = tmp_path / "src"
    save_model_dir(tiny_model(3, layers=4), src)
    for k in (0, 4):
        assert main(["--layers", str(k), "--model", str(src), "--out", str(tmp_path / "o")]) == 2
        assert "from 1 to 3" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["--layers", "2", "--model", str(src), "--out", str(src)]) == 2
    assert "overwrite the source" in capsys.readouterr().err
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("x")
    assert main(["--layers", "2", "--model", str(src), "--out", str(taken)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["--layers", "2", "--model", str(src), "--out", str(taken), "--force"]) == 0
    assert not (taken / "x").exists()


def test_per_layer_config_lists_are_cut_too():
    cfg = {"num_hidden_layers": 3, "layer_types": ["a", "b", "c"], "eos_token_id": [1, 2, 3]}
    assert truncated_config(cfg, 2) == {
        "num_hidden_layers": 2,
        "layer_types": ["a", "b"],
        "eos_token_id": [1, 2, 3],
    }
