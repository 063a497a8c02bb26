"""A weights file whose name is there but which cannot be opened (a symbolic link in a loop or
to nothing) gets one line naming it, from the loader and the converter alike, never "no
weights found" or an OS error."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.loop.loading import LoadError, load_drafter, load_model
from tests.support.models import tiny_drafter, tiny_model

CONFIG = dict(
    model_type="llama",
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=32,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def model_folder(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    weights = dict(tree_flatten(tiny_model().parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


def loop(file: Path) -> Path:
    """Replace ``file`` with a symbolic link to itself."""
    file.unlink(missing_ok=True)
    os.symlink(file.name, file)
    return file


def test_the_folder_itself_loads(tmp_path):
    load_model(model_folder(tmp_path / "m"))


@pytest.mark.parametrize(
    "make, why",
    [
        (loop, "symbolic link in a loop"),
        (lambda f: (f.unlink(), os.symlink("gone.safetensors", f)), "which does not exist"),
    ],
)
def test_a_model_file_that_is_a_bad_link_is_named(tmp_path, make, why):
    folder = model_folder(tmp_path / "m")
    make(folder / "model.safetensors")
    with pytest.raises(LoadError) as caught:
        load_model(folder)
    message = str(caught.value)
    assert f"{folder / 'model.safetensors'} is a symbolic link" in message and why in message
    assert "re-download" in message and "\n" not in message


def test_a_shard_in_a_loop_is_named_not_called_missing(tmp_path):
    folder = model_folder(tmp_path / "m")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    names = list(mx.load(str(folder / "model-00001-of-00001.safetensors")))
    index = {"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    loop(folder / "model-00001-of-00001.safetensors")
    with pytest.raises(
        LoadError, match="model-00001-of-00001.safetensors is a symbolic link in a loop"
    ):
        load_model(folder)


def test_a_drafter_file_in_a_loop_is_named(tmp_path):
    from redrafter_mlx.engine.drafting.drafter import Drafter

    drafter = tiny_drafter(tiny_model())
    folder = tmp_path / "d"
    folder.mkdir()
    args = drafter.args
    config = {k: getattr(args, k) for k in ("vocab_size", "hidden_size", "exit_dim")}
    config.update(num_draft_layers=args.num_draft_layers, rnn=args.rnn)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(drafter.parameters())))
    assert isinstance(load_drafter(folder), Drafter)
    loop(folder / "model.safetensors")
    with pytest.raises(LoadError, match="model.safetensors is a symbolic link in a loop"):
        load_drafter(folder)


def test_convert_names_a_weights_file_in_a_loop(tmp_path):
    from weights_convert import ConversionError, convert

    folder = model_folder(tmp_path / "m")
    loop(folder / "model.safetensors")
    with pytest.raises(ConversionError, match="model.safetensors is a symbolic link in a loop"):
        convert(str(folder), tmp_path / "out", progress=False)
