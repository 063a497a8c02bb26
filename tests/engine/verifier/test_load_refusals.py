"""Families that crashed at load with an internal error now load and decode plain
decoding's tokens, or are refused in one line naming the family and what is missing
(issue 68, item 4), each a tiny random folder of mlx-lm's own class through ``load_model``:

* gptj (its layers called by keyword), phixtral (an attention class named ``RoPEAttention``,
  no rope), plamo, plamo2, plamo3 (layers run one module below the embedding table) load;
* mamba (it writes only an ``ArraysCache``) is checked, and refused for ignoring mlx-lm's
  right-padding lengths, as other such recurrent families are;
* gemma3n (its layers' module returns logits), dbrx and gpt_bigcode (host reads inside
  the forward, which the compiled step cannot trace) are refused in one line.
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from redrafter_mlx.engine.core.shape import BeamShape
from redrafter_mlx.engine.loop.loading import LoadError, load_model
from tests.support.models import _randomize, run_decode

GEMMA3N_TEXT = {
    "model_type": "gemma3n",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "head_dim": 8,
    "rms_norm_eps": 1e-5,
    "vocab_size": 64,
    "num_key_value_heads": 2,
    "num_kv_shared_layers": 2,
    "vocab_size_per_layer_input": 64,
    "sliding_window": 8,
    "max_position_embeddings": 256,
    "rope_local_base_freq": 1.0,
    "rope_theta": 1000.0,
    "final_logit_softcapping": 30.0,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "activation_sparsity_pattern": [0.0] * 4,
    "hidden_size_per_layer_input": 16,
    "altup_num_inputs": 4,
    "altup_coef_clip": 1.0,
    "altup_correct_scale": True,
    "altup_active_idx": 0,
    "laurel_rank": 8,
}
RUNS = {
    "gptj": dict(n_embd=32, vocab_size=64, n_positions=256, n_head=4, rotary_dim=4, n_layer=2),
    "phixtral": dict(
        num_vocab=64,
        model_dim=32,
        num_heads=4,
        num_layers=2,
        rotary_dim=4,
        num_experts_per_tok=2,
        num_local_experts=4,
    ),
    "plamo": dict(
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=8,
        rms_norm_eps=1e-5,
        vocab_size=64,
    ),
    "plamo2": dict(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        rms_norm_eps=1e-5,
        vocab_size=64,
    ),
    "plamo3": dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        window_size=8,
        sliding_window_pattern=2,
        intermediate_size=64,
        vocab_size=64,
    ),
}
REFUSED = {  # family -> (config, what the line must say)
    "dbrx": (
        dict(
            d_model=32, n_layers=2, n_heads=4, vocab_size=64,
            ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
            attn_config={"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000},
        ),
        "reads an array's value on the host",
    ),
    "gpt_bigcode": (
        dict(
            n_embd=32, n_layer=2, n_inner=64, n_head=4, n_positions=256,
            layer_norm_epsilon=1e-5, vocab_size=64,
        ),
        "reads an array's value on the host",
    ),
    "gemma3n": (
        dict(num_hidden_layers=4, vocab_size=64, text_config=GEMMA3N_TEXT),
        "returns logits, not hidden states",
    ),
    "mamba": (
        dict(
            vocab_size=64, use_bias=False, use_conv_bias=True, conv_kernel=4, hidden_size=32,
            num_hidden_layers=2, state_size=8, intermediate_size=64, time_step_rank=4,
        ),
        "right-padding lengths",
    ),
}  # fmt: skip
PROMPT = [1, 7, 3, 9, 4, 2, 8, 5, 7, 3, 9, 4, 2]


def folder(tmp_path, name: str, config: dict):
    """A folder of mlx-lm's class for ``name`` with random weights (peaked enough to matter)."""
    config = dict(config, model_type=name)
    cls, args = _get_classes(config)
    lm = cls(args.from_dict(config))
    _randomize(lm, 3, 2.0)
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.parameters())))
    return path


@pytest.mark.parametrize("name", list(RUNS))
def test_the_family_loads_and_speculation_decodes_plain_decodings_tokens(tmp_path, name):
    model, _ = load_model(folder(tmp_path, name, RUNS[name]), mx.float32)
    plain, _ = run_decode(model, None, [PROMPT], max_tokens=16)
    assert model.verifies == "tree", model.narrowing  # recurrent layers: paths as rows
    tree, _ = run_decode(
        model, None, [PROMPT], max_tokens=16, shape=BeamShape.parse("K2xL5"), adapt=False
    )
    assert tree == plain, name
    if model.recurrent:  # a recurrent draft model is refused; its trees were checked
        return
    own, stats = run_decode(model, None, [PROMPT], max_tokens=16, draft_model=model)
    assert own == plain, name
    assert stats["accepted_tokens"] > 0  # drafts were verified and kept


@pytest.mark.parametrize("name", list(REFUSED))
def test_the_family_is_refused_in_one_line_naming_it_and_why(tmp_path, name):
    config, why = REFUSED[name]
    with pytest.raises(LoadError) as refused:
        load_model(folder(tmp_path, name, config), mx.float32)
    line = str(refused.value)
    assert "\n" not in line
    assert f"model_type {name!r}" in line and why in line
    assert "cannot be" in line  # says the family does not run, not an internal error
