"""A config.json that transformers' config class cannot read, read while the tokenizer loads
(as in ``mlx_lm.load``), is named as the config's problem in one line, not the tokenizer's
(issue 68, item 5): exaone4 with a text ``sliding_window_pattern`` and no ``layer_types``
(``unsupported operand type(s) for %``), and the fix it names works."""

from __future__ import annotations

import json

import pytest

from redrafter_mlx.engine.loop.folder_checks import read_tokenizer
from redrafter_mlx.engine.verifier.weight_files import LoadError
from tests.support.chat_tokenizers import chat_tokenizer
from tests.support.mlx_lm_sweep import CONFIGS


def test_exaone4_without_layer_types_is_a_one_line_config_problem_and_the_fix_works(tmp_path):
    chat_tokenizer("chatml", tmp_path)
    config = dict(CONFIGS["exaone4"])
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError) as e:
        read_tokenizer(tmp_path)
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"{tmp_path}/config.json cannot be read")
    assert "'exaone4'" in line and "add its layer_types" in line and "tokenizer files" not in line
    pattern, n = config["sliding_window_pattern"], config["num_hidden_layers"]
    config["layer_types"] = [
        "sliding_attention" if pattern[i % len(pattern)] == "L" else "full_attention"
        for i in range(n)
    ]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_tokenizer(tmp_path).encode("hello")
