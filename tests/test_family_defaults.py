"""A config.json that leaves keys out gets each family's reference defaults
(transformers' config classes), and decodes as mlx-lm's class does on the same weights when
that class is given those defaults written out. Before, a Gemma 3 config without
``query_pre_attn_scalar`` scaled attention by head_dim^-1/2 (0 of 24 tokens agreed)."""

from __future__ import annotations

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.verifier.model import Model, ModelArgs
from tests.helpers import _randomize
from tests.test_families import our_logits

# Only what check_model_config requires. 32 attention heads: Qwen's default of 32 KV heads
# (transformers) must divide them; 6 layers: Gemma 3's default pattern has a global sixth.
REQUIRED = dict(
    hidden_size=64, num_hidden_layers=6, intermediate_size=96, num_attention_heads=32, vocab_size=80
)

# Written out from transformers 5.24's configuration_<family>.py (fields and __post_init__),
# independently of config.FAMILY_DEFAULTS.
REFERENCE = {
    "llama": dict(num_key_value_heads=32, head_dim=2, rope_theta=10000.0, rms_norm_eps=1e-6),
    "mistral": dict(num_key_value_heads=8, head_dim=2, rope_theta=10000.0, rms_norm_eps=1e-6),
    "qwen2": dict(num_key_value_heads=32, head_dim=2, rope_theta=10000.0, rms_norm_eps=1e-6),
    "qwen3": dict(num_key_value_heads=32, head_dim=128, rope_theta=10000.0, rms_norm_eps=1e-6),
    "gemma2": dict(
        num_key_value_heads=4, head_dim=256, rope_theta=10000.0, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        sliding_window=4096,
    ),
    "gemma3_text": dict(
        num_key_value_heads=4, head_dim=256, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
        query_pre_attn_scalar=256, rope_local_base_freq=10000.0, sliding_window=4096,
        sliding_window_pattern=6,
    ),
}  # fmt: skip
MLX_LM_MODULE = {"mistral": "llama"}  # mlx-lm runs Mistral with its Llama class


def minimal(model_type: str) -> dict:
    return dict(REQUIRED, model_type=model_type)


@pytest.mark.parametrize("model_type", list(REFERENCE))
def test_an_absent_key_takes_the_family_reference_default(model_type):
    args = ModelArgs.from_config(minimal(model_type))
    got = {k: getattr(args, k) for k in REFERENCE[model_type]}
    assert got == REFERENCE[model_type]


def test_a_key_written_as_null_is_kept_not_defaulted():
    """Gemma 2 with ``final_logit_softcapping: null`` has no final cap (transformers), where
    the old ``or 30.0`` capped it anyway."""
    args = ModelArgs.from_config(dict(minimal("gemma2"), final_logit_softcapping=None))
    assert args.final_logit_softcapping is None
    assert args.attn_logit_softcapping == 50.0


def test_gemma3_without_the_scalar_scales_attention_by_256():
    args = ModelArgs.from_config(dict(minimal("gemma3_text"), head_dim=16))
    assert args.attention_scale == 256**-0.5  # not head_dim ** -0.5 = 0.25


@pytest.mark.parametrize("model_type", list(REFERENCE))
def test_a_minimal_config_decodes_as_mlx_lm_with_the_reference_defaults(model_type):
    """Ours from the minimal config, mlx-lm's class from it plus the reference defaults: the
    same logits in prefill and in single-token steps."""
    model = Model(ModelArgs.from_config(minimal(model_type)))
    _randomize(model, 0, 2.0)
    if model.args.family.gemma_norm:
        model.load_weights(
            [(k, v - 1.0) for k, v in tree_flatten(model.parameters()) if "norm" in k],
            strict=False,
        )
    mx.eval(model.parameters())
    tied = model.args.tie_word_embeddings  # transformers: False, Gemma True
    written = {**minimal(model_type), **REFERENCE[model_type], "tie_word_embeddings": tied}
    written["max_position_embeddings"] = 32768  # mlx-lm's Qwen3 requires it; unused here
    if model_type == "gemma3_text":  # mlx-lm's Gemma 3 builds its layers from the pattern
        del written["sliding_window"]  # and windows them; 4096 is past this test's tokens
    module = importlib.import_module(f"mlx_lm.models.{MLX_LM_MODULE.get(model_type, model_type)}")
    ref = module.Model(module.ModelArgs.from_dict(written))
    weights = dict(tree_flatten(model.parameters()))
    if hasattr(ref, "sanitize"):
        weights = ref.sanitize(weights)
    ref.load_weights(list(weights.items()), strict=True)
    prompt, steps = [1, 17, 50, 42, 3, 29], [7, 71, 33]
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref)
    want = list(np.array(ref(mx.array([prompt]), cache=cache)[0]))
    for t in steps:
        want.append(np.array(ref(mx.array([[t]]), cache=cache)[0, 0]))
    got = our_logits(model, prompt, steps)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"{model_type} {i}")
