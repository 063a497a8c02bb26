"""Every converter refusal names a command that works (issue 68, item 5): a GGUF of a family
the GGUF converter does not take (qwen3moe, phi3, an MoE llama) and a Hugging Face folder of
a family our converter does not take (qwen3_moe) name ``mlx_lm convert``, which converts
every family mlx-lm implements; a family mlx-lm lacks gets the upgrade instead. The
converter writes ``head_dim`` even where it equals hidden / heads.
"""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.loop.loading import load
from tests.support.gguf_files import write_llama_gguf
from tests.support.mlx_lm_families import ATTENTION
from tests.support.models import VICUNA_TOKENIZER, _randomize
from weights_convert.conversion import convert
from weights_convert.errors import ConversionError
from weights_convert.gguf import llama_config, read_gguf


def refusal(src, tmp_path) -> str:
    with pytest.raises(ConversionError) as refused:
        convert(str(src), tmp_path / "never", progress=False)
    line = str(refused.value)
    assert "\n" not in line
    return line


@pytest.mark.parametrize("arch, family", [("qwen3moe", "qwen3_moe"), ("phi3", "phi3")])
def test_a_gguf_of_another_family_names_mlx_lm_convert(tmp_path, arch, family):
    path = tmp_path / f"{arch}.gguf"
    write_llama_gguf(path, "F16", arch=arch)
    line = refusal(path, tmp_path)
    assert f"architecture {arch!r}" in line
    assert "mlx_lm convert --hf-path <checkpoint> --mlx-path <dir>" in line
    assert "redrafter-mlx convert" not in line  # ours would refuse the checkpoint


def test_a_folder_of_a_family_our_converter_lacks_names_mlx_lm_convert_which_works(tmp_path):
    """The named command, run: mlx-lm's own convert makes a folder the loader reads."""
    from mlx_lm.convert import convert as mlx_lm_convert
    from mlx_lm.utils import _get_classes

    config = dict(ATTENTION["qwen3_moe"], architectures=["Qwen3MoeForCausalLM"])
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    _randomize(lm, 3, 2.0)
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(src / "model.safetensors"), dict(tree_flatten(lm.parameters())))
    for f in VICUNA_TOKENIZER.iterdir():
        shutil.copy(f, src / f.name)
    line = refusal(src, tmp_path)
    assert "our converter does not take" in line
    command = f"mlx_lm convert --hf-path {src} --mlx-path <dir>"
    assert command in line
    mlx_lm_convert(str(src), str(tmp_path / "mlx"))  # what the line says to run
    load(tmp_path / "mlx", dtype=mx.float32)


def test_a_family_mlx_lm_lacks_gets_the_upgrade_not_a_command_that_fails(tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({**ATTENTION["qwen2"], "model_type": "qwen9"}))
    mx.save_safetensors(str(src / "model.safetensors"), {"lm_head.weight": mx.zeros((2, 2))})
    line = refusal(src, tmp_path)
    assert "upgrade mlx-lm" in line and "mlx_lm convert" not in line


def test_the_gguf_converter_writes_head_dim_at_hidden_over_heads(tmp_path):
    gguf = write_llama_gguf(tmp_path / "m.gguf", "F16")
    config = llama_config(read_gguf(gguf.path), [0])
    assert config["head_dim"] == config["hidden_size"] // config["num_attention_heads"]
