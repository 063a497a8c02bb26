"""A family whose forward reads the engine's slot caches in a way the mask does not reach is
refused at load, never decoded (issue 68, item 3): phi3small's block-sparse layers add the
(boolean) attention mask to the scores as numbers, so they attend to every slot, junk
included; through mlx-lm's own cache they see only the real keys. Its head also writes at
token ids up to 100351: with a smaller vocabulary, out of bounds (the crashes and the "one
run in three" of the issue). It is refused by name before any forward
(``verifier.refusals``), and the general check (``lm_checks.check_parity``) finds it too.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.loop.loading import LoadError, load_model
from redrafter_mlx.engine.verifier.lm_checks import check_parity
from redrafter_mlx.engine.verifier.lm_model import LmModel
from tests.support.models import _randomize, tiny_model

PHI3SMALL = dict(
    model_type="phi3small", hidden_size=32, dense_attention_every_n_layers=2,
    ff_intermediate_size=64, gegelu_limit=20.0, num_hidden_layers=2, num_attention_heads=4,
    layer_norm_epsilon=1e-5, vocab_size=100352, num_key_value_heads=2,
)  # fmt: skip


def built(config: dict):
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    _randomize(lm, 3, 2.0)
    return lm


def test_phi3small_is_refused_in_one_line_before_any_forward(tmp_path):
    config = dict(PHI3SMALL, vocab_size=1000)  # its head would write past this vocabulary
    lm = built(config)
    (tmp_path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(lm.parameters())))
    with pytest.raises(LoadError) as refused:
        load_model(tmp_path, mx.float32)
    line = str(refused.value)
    assert "\n" not in line and "model_type 'phi3small' cannot be" in line
    assert "block-sparse" in line and "mlx_lm.generate runs it" in line


def test_the_parity_check_finds_a_family_that_attends_past_the_mask():
    model = LmModel(built(PHI3SMALL), PHI3SMALL)
    with pytest.raises(ValueError, match="other logits through the engine's slot caches"):
        check_parity(model)
    check_parity(tiny_model())  # a Llama gives mlx-lm's own logits
