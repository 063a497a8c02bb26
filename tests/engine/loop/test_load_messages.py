"""Messages that sent users in circles now name the problem and a fix that works, in one
line (issue 68, item 5), each from a tiny Llama folder through ``loading.load``:

* tokenizer files removed: the tokenizer is missing, and from which folder;
* NaN or infinity in a weight: found at load, the tensor and its file named (any family:
  the check reads mlx-lm's loaded model), never decoded;
* weights under another file name (``model.bin``, ``weights.safetensors``): what was found,
  and the command that makes it load;
* a ``.gguf`` file given as the model: the convert command;
* ``max_position_embeddings: 0``: the config key, not a ``--lookup-length`` problem.
"""

from __future__ import annotations

import json
import os
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.loop.loading import LoadError, load
from tests.support.models import VICUNA_TOKENIZER, _randomize, tiny_config


def folder(tmp_path, config=None, tokenizer=True, weights="model.safetensors", poison=None):
    """A tiny Llama's folder (mlx-lm's class, random weights; ``poison``: a tensor set to
    NaN), its weights under the file name ``weights``."""
    config = config or tiny_config(vocab=32000)
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    _randomize(lm, 3, 2.0)
    tensors = dict(tree_flatten(lm.parameters()))
    if poison:
        tensors[poison] = tensors[poison] * float("nan")
    path = tmp_path / "model"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), tensors)
    os.rename(path / "model.safetensors", path / weights)
    if tokenizer:
        for f in VICUNA_TOKENIZER.iterdir():
            shutil.copy(f, path / f.name)
    return path


def refusal(path) -> str:
    """``load``'s one-line LoadError for ``path``."""
    with pytest.raises(LoadError) as refused:
        load(path, dtype=mx.float32)
    line = str(refused.value)
    assert "\n" not in line
    return line


def test_a_folder_without_its_tokenizer_says_so_and_where(tmp_path):
    path = folder(tmp_path, tokenizer=False)
    line = refusal(path)
    assert f"{path} has no tokenizer" in line and "tokenizer.json" in line


def test_non_finite_weights_are_named_at_load_with_their_file(tmp_path):
    line = refusal(folder(tmp_path, poison="model.layers.1.mlp.up_proj.weight"))
    assert "NaN or infinity" in line
    assert "model.layers.1.mlp.up_proj.weight in model.safetensors" in line


@pytest.mark.parametrize("name", ["model.bin", "weights.safetensors"])
def test_weights_under_another_name_say_what_was_found_and_the_command(tmp_path, name):
    path = folder(tmp_path, weights=name)
    line = refusal(path)
    assert f"it holds {name}" in line
    if name.endswith(".bin"):
        assert f"{path / 'pytorch_model.bin'}), then convert it: redrafter-mlx convert" in line
        return
    os.rename(path / name, path / "model.safetensors")  # the command the line gives
    assert f"mv {path / name} {path / 'model.safetensors'}" in line
    load(path, dtype=mx.float32)  # ... which makes it load


def test_a_gguf_file_as_the_model_gets_the_convert_command(tmp_path):
    file = tmp_path / "tiny.gguf"
    file.write_bytes(b"GGUF" + bytes(64))
    line = refusal(file)
    assert "GGUF file" in line and f"redrafter-mlx convert --model {file} --out <dir>" in line


def test_a_zero_context_is_reported_as_the_config_key(tmp_path):
    line = refusal(folder(tmp_path, tiny_config(vocab=32000, max_position_embeddings=0)))
    assert "max_position_embeddings 0" in line and "config.json" in line
    assert "lookup" not in line


def test_a_config_transformers_rejects_is_one_line_naming_the_field(tmp_path):
    """transformers' strict validation (read as the tokenizer loads, when its config names
    no tokenizer class) says the field in a second line: the one line keeps it."""
    config = dict(tiny_config(vocab=32000), pad_token_id="x")
    path = folder(tmp_path, config)
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.pop("tokenizer_class")
    settings["chat_template"] = "{{ messages[0]['content'] }}"
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    line = refusal(path)
    assert f"{path}/config.json is rejected by transformers' config validation" in line
    assert "pad_token_id" in line and "expected int" in line
