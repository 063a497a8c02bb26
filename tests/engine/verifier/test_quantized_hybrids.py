"""A quantized LFM2 / LFM2-MoE speculates (issue 68, item 2): a folder quantized as ``mlx_lm
convert -q --q-bits 4 --q-group-size 32`` does (mlx-lm's own ``quantize_model``) loads,
and greedy speculation gives plain decoding's tokens, where the compiled step raised
``IndexError: _Map_base::at`` (MLX's compile on one result split twice: the quantized
``in_proj``'s matmul plus bias, split by the verify and again by the recurrent commit).
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.loading import load_model
from tests.support.drafters import ReplayDrafter
from tests.support.mlx_lm_families import RECURRENT
from tests.support.models import _randomize, run_decode

PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 7, 3, 9, 4, 2]


def quantized_folder(tmp_path, name: str):
    """A 4-bit (groups of 32) folder of mlx-lm's class for ``name``, random peaked weights."""
    config = dict(RECURRENT[name])
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    _randomize(lm, 3, 2.0)
    lm, config = quantize_model(lm, config, group_size=32, bits=4)
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.parameters())))
    return path


def test_mlx_compile_still_fails_on_a_result_split_twice():
    """The upstream defect the load check works around: when MLX fixes it, this fails, and
    ``lm_checks``' workaround (``commit_apart``) can go."""

    def f(x, y):
        s = x + y
        a, b = mx.split(s, 2, axis=-1)
        _, d = mx.split(s, 2, axis=-1)
        return a * b, d

    with pytest.raises(IndexError, match="_Map_base::at"):
        mx.compile(f)(mx.ones((1, 4)), mx.ones((4,)))


@pytest.mark.parametrize("name", ["lfm2", "lfm2_moe"])
def test_a_quantized_lfm2_speculates_and_gives_plain_decodings_tokens(tmp_path, name):
    model, _ = load_model(quantized_folder(tmp_path, name), mx.float32)
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=16)
    assert len(set(plain[0])) > 3  # tokens that vary: a wrong state would show
    drafter = ReplayDrafter(model, [PROMPT + plain[0]])
    for label, source in (("K1xL5", None), ("W1xL4", drafter), ("W2xL4+K1xL4", drafter)):
        got, stats = run_decode(
            model, source, [PROMPT], max_tokens=16, shape=BeamShape.parse(label)
        )
        assert got == plain, f"{name} {label}"
    assert stats["accepted_tokens"] > 0  # the drafter's drafts were verified and committed
    assert model.commit_apart  # the load found MLX's compile failure and worked around it
