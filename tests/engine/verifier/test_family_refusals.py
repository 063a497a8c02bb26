"""Families refused before mlx-lm imports them (``verifier.refusals``): mlx-lm 0.32's olmo.py
ends the process (``sys.exit(1)``, after printing a pip hint) when ``hf_olmo`` is missing, which
killed a whole sweep and would end a server; the load names the package in one line instead."""

from __future__ import annotations

import json

import pytest

from redrafter_mlx.engine.loop.loading import LoadError, load_model
from redrafter_mlx.engine.verifier.config import convert_command
from redrafter_mlx.engine.verifier.refusals import missing_package

OLMO = {"model_type": "olmo", "d_model": 64, "n_layers": 2, "mlp_hidden_size": 128,
        "n_heads": 4, "vocab_size": 100, "embedding_size": 100}  # fmt: skip


@pytest.mark.skipif(missing_package("olmo") is None, reason="hf_olmo is installed here")
def test_olmo_without_its_package_is_refused_in_one_line_not_an_exit(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OLMO))
    with pytest.raises(LoadError) as e:
        load_model(tmp_path)
    line = str(e.value)
    assert "\n" not in line and "'olmo'" in line and "pip install ai2-olmo" in line
    assert convert_command("olmo", "src") == "mlx_lm convert --hf-path src --mlx-path <dir>"
