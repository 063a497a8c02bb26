"""A config.json that leaves keys out gets each family's reference defaults
(transformers' config classes) before mlx-lm builds the class (``config.for_mlx_lm``), and a
folder of it decodes as mlx-lm's class does on the same weights when that class is given
those defaults written out (mlx-lm's own defaults differ: Qwen2's rope_theta 1e6, Gemma 2's
query_pre_attn_scalar 144)."""

from __future__ import annotations

import importlib
import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from redrafter_mlx.engine.loop.loading import load_model
from redrafter_mlx.engine.verifier.config import for_mlx_lm
from tests.support.families import our_logits
from tests.support.models import _randomize

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


def built(config: dict) -> dict:
    """The config mlx-lm is handed for a checkpoint with its own head."""
    return for_mlx_lm(config, {"lm_head.weight", "model.embed_tokens.weight"}, "config.json")


# mlx-lm computes these itself when they are absent, as transformers does
COMPUTED = {
    "llama": ("head_dim", "num_key_value_heads"),
    "mistral": ("head_dim",),
    "qwen2": ("head_dim",),
}


@pytest.mark.parametrize("model_type", list(REFERENCE))
def test_an_absent_key_takes_the_family_reference_default(model_type):
    config = built(minimal(model_type))
    keys = [k for k in REFERENCE[model_type] if k not in COMPUTED.get(model_type, ())]
    assert {k: config[k] for k in keys} == {k: REFERENCE[model_type][k] for k in keys}


def test_a_key_written_as_null_is_kept_not_defaulted():
    """Gemma 2 with ``final_logit_softcapping: null`` has no final cap (transformers), where
    the old ``or 30.0`` capped it anyway."""
    config = built(dict(minimal("gemma2"), final_logit_softcapping=None))
    assert config["final_logit_softcapping"] is None
    assert config["attn_logit_softcapping"] == 50.0


def test_another_family_is_handed_to_mlx_lm_unchanged():
    config = dict(minimal("phi3"), rope_theta=None)
    assert built(config) == config


@pytest.mark.parametrize("model_type", list(REFERENCE))
def test_a_minimal_config_decodes_as_mlx_lm_with_the_reference_defaults(model_type, tmp_path):
    """A folder of the minimal config, loaded, and mlx-lm's class from it plus the reference
    defaults: the same logits in prefill and in single-token steps."""
    tied = model_type.startswith("gemma")  # transformers: untied, Gemma tied
    written = {**minimal(model_type), **REFERENCE[model_type], "tie_word_embeddings": tied}
    written["max_position_embeddings"] = 32768  # mlx-lm's Qwen3 requires it; unused here
    if model_type == "gemma3_text":  # mlx-lm's Gemma 3 builds its layers from the pattern
        del written["sliding_window"]  # and windows them; 4096 is past this test's tokens
    module = importlib.import_module(f"mlx_lm.models.{MLX_LM_MODULE.get(model_type, model_type)}")
    ref = module.Model(module.ModelArgs.from_dict(written))
    _randomize(ref, 0, 2.0)
    if tied:
        ref.load_weights(
            [(k, v - 1.0) for k, v in tree_flatten(ref.parameters()) if "norm" in k],
            strict=False,
        )
    mx.eval(ref.parameters())
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(minimal(model_type)))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(ref.parameters())))
    model, _ = load_model(folder, mx.float32)
    prompt, steps = [1, 17, 50, 42, 3, 29], [7, 71, 33]
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(ref)
    want = list(np.array(ref(mx.array([prompt]), cache=cache)[0]))
    for t in steps:
        want.append(np.array(ref(mx.array([[t]]), cache=cache)[0, 0]))
    got = our_logits(model, prompt, steps)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4, err_msg=f"{model_type} {i}")
